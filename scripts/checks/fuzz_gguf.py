"""Fuzz edgellm's GGUF loading with mutated copies of one file (developer tool, never imported).

    python scripts/checks/fuzz_gguf.py MODEL.gguf [--cases 10000] [--seed 0] [--run-share 0.05]
                                [--timeout 20] [--mem-gib 3] [--keep DIR] [--json]

Each case mutates the file one way — random header bytes, an odd byte (ESC, newline, broken
UTF-8) in a key, value or token string, a header integer or float field set to a boundary value (0, 1, 2^31-1, 2^32-1, 2^64-1, NaN, inf, ...), a truncation, or two dimensions of a
tensor swapped (same bytes, wrong shape) — and a worker process opens it as `edgellm info` does
(reader, config and tensor checks, tokenizer, `describe`); on `--run-share` of the cases that open
cleanly it also loads the model and generates 4 greedy tokens. The worker runs under a memory cap
(RLIMIT_AS) and each case under a timeout; a worker that dies or stops answering is replaced.
Outcomes: clean (an EdgeLLMError), success, traceback (any other exception), signal (the worker
died), hang (no answer in time), blowup (MemoryError or the memory cap). Anything but clean and
success is a bug; `--keep DIR` saves the first 20 such cases' files.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter

OUTCOMES = ("clean", "success", "traceback", "signal", "hang", "blowup")
BAD = ("traceback", "signal", "hang", "blowup")
BOUNDARY = (0, 1, 2, 3, 0x7F, 0x80, 0xFF, 0x100, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF,
            2**32, 2**40, 2**63 - 1, 2**63, 2**64 - 1)
FLOATS = (float("nan"), float("inf"), float("-inf"), -1.0, 0.0, 1e-45, 1e38)
SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF type -> bytes
FLOAT_TYPES = {6: "<f", 12: "<d"}


# --- the header's fields, with their offsets ----------------------------------------------------
def header_fields(data: bytes):
    """([(offset, size, kind)] of every fixed-size header field, [(offset of ne, n_dims)] per
    tensor, [(offset, length)] of every non-empty string's bytes); kind is "int" or "float".
    Stops quietly where the header stops making sense."""
    fields, tensors, strings, pos = [], [], [], 8

    def u(fmt: str, size: int, kind: str = "int") -> int:
        nonlocal pos
        fields.append((pos, size, kind))
        (v,) = struct.unpack_from(fmt, data, pos)
        pos += size
        return v

    def string() -> None:
        nonlocal pos
        n = u("<Q", 8)
        if n:
            strings.append((pos, n))
        pos += n

    def value(vtype: int, depth: int = 0) -> None:
        nonlocal pos
        if vtype == 8:
            string()
        elif vtype == 9:
            etype, count = u("<I", 4), u("<Q", 8)
            if depth > 3 or count > 1 << 20:
                raise ValueError
            if etype in SCALARS and etype not in (8, 9):
                size = SCALARS[etype]
                for i in range(min(count, 64)):  # the first elements as fields, the rest skipped
                    fields.append((pos + i * size, size, "float" if etype in FLOAT_TYPES else "int"))
                pos += count * size
            else:
                for _ in range(count):
                    value(etype, depth + 1)
        elif vtype in SCALARS:
            u("<" + {1: "B", 2: "H", 4: "I", 8: "Q"}[SCALARS[vtype]], SCALARS[vtype],
              "float" if vtype in FLOAT_TYPES else "int")
        else:
            raise ValueError

    try:
        n_tensors, n_kv = u("<Q", 8), u("<Q", 8)
        for _ in range(n_kv):
            string()
            value(u("<I", 4))
        for _ in range(n_tensors):
            string()
            n_dims = u("<I", 4)
            tensors.append((pos, n_dims))
            for _ in range(n_dims):
                u("<Q", 8)
            u("<I", 4)
            u("<Q", 8)
    except (ValueError, struct.error):
        pass
    return fields, tensors, strings


def mutate(data: bytes, fields, tensors, strings, header_end: int, rng: random.Random):
    """(patches [(offset, bytes)]; the length to keep; description)."""
    kind = rng.choice(("flip", "flip", "text", "text", "field", "field", "float", "truncate", "swap"))
    if kind == "text" and strings:  # a key, value or token string gets an odd byte: ESC, newline,
        off, n = rng.choice(strings)  # a stray UTF-8 continuation or lead byte, NUL, anything
        off += rng.randrange(n)
        b = rng.choice((0x1B, 0x0A, 0x80, 0xC0, 0xFF, 0x00, rng.randrange(256)))
        return [(off, bytes([b]))], len(data), f"text byte {b:#x} at {off}"
    if kind == "flip":
        offs = [rng.randrange(header_end) for _ in range(rng.randint(1, 4))]
        return [(o, bytes([rng.randrange(256)])) for o in offs], len(data), f"flip {offs}"
    if kind == "truncate":
        cut = rng.randrange(len(data)) if rng.random() < 0.3 else rng.randrange(header_end)
        return [], cut, f"truncate at {cut}"
    if kind == "swap" and any(n >= 2 for _, n in tensors):
        off, _ = rng.choice([t for t in tensors if t[1] >= 2])
        return [(off, data[off + 8:off + 16] + data[off:off + 8])], len(data), f"swap ne at {off}"
    floats = [f for f in fields if f[2] == "float"]
    if kind == "float" and floats:
        off, size, _ = rng.choice(floats)
        v = rng.choice(FLOATS)
        return [(off, struct.pack("<f" if size == 4 else "<d", v))], len(data), f"float {v} at {off}"
    off, size, _ = rng.choice(fields)
    v = rng.choice(BOUNDARY) & ((1 << (8 * size)) - 1)
    return [(off, v.to_bytes(size, "little"))], len(data), f"int {v} at {off}"


def apply(path: str, data: bytes, patches, keep: int) -> None:
    """Make the file at `path` (a copy of `data`) the mutated case, touching only what changes."""
    with open(path, "r+b") as f:
        for off, b in patches:
            f.seek(off)
            f.write(b)
        if keep < len(data):
            f.truncate(keep)


def restore(path: str, data: bytes, patches, keep: int) -> None:
    with open(path, "r+b") as f:
        for off, b in patches:
            f.seek(off)
            f.write(data[off:off + len(b)])
        if keep < len(data):
            f.seek(keep)
            f.write(data[keep:])


# --- the worker: one case per line on stdin, one JSON answer per line on stdout -----------------
def worker(mem_gib: float) -> None:
    import resource
    import traceback

    limit = int(mem_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from edgellm.commands.info import describe
    from edgellm.errors import EdgeLLMError
    from edgellm.gguf_file import GGUFFile
    from edgellm.tokenizer import Tokenizer

    print(json.dumps({"ready": True}), flush=True)  # imports done: case timeouts start now
    for line in sys.stdin:
        path, run = line.split("\t")
        gf = m = None
        try:
            gf = GGUFFile(path)
            json.dumps(describe(gf))
            Tokenizer.from_metadata(gf.metadata)
            if run.strip() == "1":
                import edgellm

                m = edgellm.load(path, n_ctx=64)
                [c.token for c in m.generate("Hello", max_tokens=4, temperature=0)]
            answer = {"outcome": "success"}
        except EdgeLLMError as exc:
            msg = str(exc)
            ok = msg.isprintable() and len(msg) <= 1100
            answer = {"outcome": "clean" if ok else "traceback", "detail": msg[:200]}
        except MemoryError:
            answer = {"outcome": "blowup", "detail": "MemoryError"}
        except Exception as exc:  # noqa: BLE001 - the point is to see every kind
            tb = traceback.extract_tb(exc.__traceback__)[-1]
            answer = {"outcome": "traceback", "detail": f"{type(exc).__name__}: {str(exc)[:150]} "
                                                        f"({os.path.basename(tb.filename)}:{tb.lineno})"}
        # Each case's map of the file goes now, not whenever the collector runs (a traceback's
        # frames may still hold the file): the memory cap would otherwise be reached
        if m is not None:
            m.gf.close()
        if gf is not None:
            gf.close()
        del gf, m
        gc.collect()
        print(json.dumps(answer), flush=True)


class Worker:
    START_S = 300  # imports on a loaded machine can take long; that is not a case hanging

    def __init__(self, mem_gib: float):
        self.p = subprocess.Popen([sys.executable, __file__, "--worker", "--mem-gib", str(mem_gib)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        ready, _, _ = select.select([self.p.stdout], [], [], self.START_S)
        if not ready or not self.p.stdout.readline():
            self.p.kill()
            raise SystemExit(f"fuzz_gguf: the worker did not start in {self.START_S} s")

    def ask(self, path: str, run: bool, timeout: float) -> dict:
        self.p.stdin.write(f"{path}\t{int(run)}\n")
        self.p.stdin.flush()
        ready, _, _ = select.select([self.p.stdout], [], [], timeout)
        if not ready:
            self.p.kill()
            self.p.wait()
            return {"outcome": "hang", "detail": f"no answer in {timeout:g} s"}
        line = self.p.stdout.readline()
        if not line:
            rc = self.p.wait()
            return {"outcome": "signal" if rc < 0 else "blowup", "detail": f"worker exit {rc}"}
        return json.loads(line)

    def alive(self) -> bool:
        return self.p.poll() is None

    def close(self) -> None:
        if self.alive():
            self.p.stdin.close()
            self.p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-share", type=float, default=0.0, help="share of cases also loaded and run")
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds per case")
    ap.add_argument("--mem-gib", type=float, default=3.0, help="the worker's address-space cap")
    ap.add_argument("--keep", help="save the files of the first 20 bad cases here")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.mem_gib)
        return 0
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from edgellm.gguf_file import GGUFFile

    data = open(args.model, "rb").read()
    gf = GGUFFile(args.model)
    header_end = gf.data_offset
    gf.close()
    fields, tensors, strings = header_fields(data)
    rng = random.Random(args.seed)
    counts, examples = Counter(), []
    tmp = tempfile.mkdtemp(prefix="fuzz_gguf_")
    path = os.path.join(tmp, "case.gguf")
    shutil.copy(args.model, path)  # mutated in place and restored after each case
    w = Worker(args.mem_gib)
    t0 = time.perf_counter()
    try:
        for case in range(args.cases):
            patches, keep, how = mutate(data, fields, tensors, strings, header_end, rng)
            apply(path, data, patches, keep)
            run = rng.random() < args.run_share
            if not w.alive():
                w = Worker(args.mem_gib)
            answer = w.ask(path, run, args.timeout * (4 if run else 1))
            counts[answer["outcome"]] += 1
            if answer["outcome"] in BAD:
                examples.append({"case": case, "mutation": how, "run": run, **answer})
                if args.keep and len(examples) <= 20:  # a few: a case is a full copy of the model
                    os.makedirs(args.keep, exist_ok=True)
                    shutil.copy(path, os.path.join(args.keep, f"case{case}.gguf"))
            restore(path, data, patches, keep)
    finally:
        w.close()
        shutil.rmtree(tmp, ignore_errors=True)
    result = {"cases": args.cases, "seed": args.seed, "seconds": round(time.perf_counter() - t0, 1),
              "outcomes": {k: counts[k] for k in OUTCOMES}, "bad": examples[:50]}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{args.cases} cases, seed {args.seed}, {result['seconds']} s")
        print("| outcome | cases |\n|---|---|")
        for k in OUTCOMES:
            print(f"| {k} | {counts[k]} |")
        for e in examples[:20]:
            print(e)
    return 1 if any(counts[k] for k in BAD) else 0


if __name__ == "__main__":
    sys.exit(main())
