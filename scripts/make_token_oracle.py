"""Write the tokenizer fixtures tests/data/tokens_<model>.json from llama.cpp (dev only).

llama.cpp is reached through llama-cpp-python (never an edgellm dependency); each model is
loaded with vocab_only=True, so only its vocabulary is read. For every string of CORPUS the
fixture holds the ids of llama_tokenize(text, add_special, parse_special) for three flag pairs,
and the bytes of llama_detokenize of the (True, True) ids. It also holds the special ids, the
end-of-generation set, the pieces (llama_token_to_piece, special=False) of a sample of tokens,
and a SHA-256 over the pieces of the whole vocabulary.

    python scripts/make_token_oracle.py                # both real models, via edgellm.fetch
    python scripts/make_token_oracle.py NAME=PATH ...  # e.g. smollm2=/path/to/file.gguf
    python scripts/make_token_oracle.py --only qwen2   # one fixture
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import random
import sys
from pathlib import Path

import llama_cpp

# fixture name -> fetch name (the two Qwen2.5-Coder files share one vocabulary)
MODELS = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m", "qwen2": "qwen2.5-coder-0.5b"}
FLAGS = ((True, False), (False, True), (True, True))           # (add_special, parse_special)
DATA = Path(__file__).resolve().parent.parent / "tests" / "data"

LOREM = ("Tokenizers split text into pieces; a model only ever sees the ids. Numbers like 2025, "
         "3.14159 and 1,000,000 are split by rules of their own, and so are CJK (東京は晴れ), "
         "emoji (🙂🚀) and words with accents (déjà vu, Übermaß). ") * 4

CORPUS = [
    "",
    " ",
    "Hello world",
    " Hello world",
    "Hello world ",
    "   multiple   spaces   here   ",
    " " * 32,
    "\t\ttabs\tand\ttabs\t",
    "line1\nline2\r\nline3\n\n\nline4\n",
    "\n\n\n\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "1234567890 3.14159 1,000,000 0x1F2E -42",
    "In 2024, 12345678901234567890 people",
    "日本語のテキストです。中文测试。한국어 텍스트",
    "🤖🎉👍🏽 👨‍👩‍👧‍👦 ❤️ 🇫🇷 🪿🧌",
    "café naïve résumé Ångström façade",
    "Привет мир! Γειά σου Κόσμε! مرحبا بالعالم שלום",
    "I'm sure you'll see they've done it, haven't they? 'quoted' It's we'd",
    "ALL CAPS: I'M DON'T WE'LL",
    "Mr. O'Neil ... wait?! Yes . , ! ? ' s",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_start|>x<|im_end|>",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos> <pad> <unk> <mask>",
    "</s> and <s> tokens",
    "<|endoftext|>after",
    "<unused0><unused12> [multimodal] <start_of_image>",
    "<reponame>foo<file_sep>bar<filename>",
    "<0x0A> looks like a byte token",
    "a\u00a0b\u2003c\u3000d\u2028e",
    "https://example.com/path?q=1&b=2#frag",
    "email@example.com $100 50% #hashtag @user ~tilde ^caret |pipe `tick`",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "\u2581 a literal lower one eighth block \u2581\u2581",
    "combining: e\u0301 a\u0308 n\u0303",
    "zero\u200bwidth\u200djoiner",
    "control \x00\x01\x7f bell\x07",
    "∑∫√∞≠≤≥ ½ ² ³ ① Ⅻ",
    "# Title\n\n- item 1\n- item 2\n\n```python\nprint('hi')\n```\n",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null}}',
    "The quick brown fox jumps over the lazy dog.",
    "'s 're 've leading contractions",
    LOREM,
]


def model_path(name: str, overrides: dict[str, str]) -> Path:
    if name in overrides:
        return Path(overrides[name])
    from edgellm.fetch import model_path as fetch_model_path
    return Path(fetch_model_path(MODELS[name]))


def tokenize(vocab, text: str, add_special: bool, parse_special: bool) -> list[int]:
    raw = text.encode("utf-8")
    n_max = len(raw) + 16
    buf = (llama_cpp.llama_token * n_max)()
    n = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, n_max, add_special, parse_special)
    if n < 0:
        raise RuntimeError(f"token buffer too small for {text!r}")
    return list(buf[:n])


def detokenize(vocab, ids: list[int], remove_special: bool, unparse_special: bool) -> bytes:
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 64 + 64 * len(ids)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, remove_special, unparse_special)
    if n < 0:
        raise RuntimeError("text buffer too small")
    return buf.raw[:n]


def piece(vocab, tok: int, special: bool = False) -> bytes:
    buf = ctypes.create_string_buffer(512)
    n = llama_cpp.llama_token_to_piece(vocab, tok, buf, 512, 0, special)
    if n < 0:
        raise RuntimeError(f"piece of {tok} longer than 512 bytes")
    return buf.raw[:n]


def pieces_sha256(pieces: list[bytes]) -> str:
    """SHA-256 over all pieces, each preceded by its length (4 bytes, little endian)."""
    h = hashlib.sha256()
    for p in pieces:
        h.update(len(p).to_bytes(4, "little"))
        h.update(p)
    return h.hexdigest()


def oracle(name: str, path: Path) -> dict:
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)

    def opt(tok: int) -> int | None:
        return None if tok < 0 else int(tok)

    all_pieces = [piece(vocab, t) for t in range(n_vocab)]
    rng = random.Random(1234)
    sample = sorted(set(range(min(n_vocab, 600))) | set(rng.sample(range(n_vocab), 2000)))
    cases = []
    for text in CORPUS:
        ids = {f"{int(a)}{int(p)}": tokenize(vocab, text, a, p) for a, p in FLAGS}
        both = ids["11"]
        cases.append({
            "text": text,
            "ids": ids,
            "detok_hex": detokenize(vocab, both, False, False).hex(),
            "detok_special_hex": detokenize(vocab, both, False, True).hex(),
        })
    result = {
        "model": name,
        "file": path.name,
        "llama_cpp_python": llama_cpp.__version__,
        "n_vocab": n_vocab,
        "bos": opt(llama_cpp.llama_vocab_bos(vocab)),
        "eos": opt(llama_cpp.llama_vocab_eos(vocab)),
        "eot": opt(llama_cpp.llama_vocab_eot(vocab)),
        "eog": [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)],
        "pieces_sha256": pieces_sha256(all_pieces),
        "pieces_hex": {str(t): all_pieces[t].hex() for t in sample},
        "cases": cases,
    }
    llama_cpp.llama_model_free(model)
    return result


def to_json(data: dict) -> str:
    """One line per top-level key and per case: readable diffs, small files."""
    def dump(v: object) -> str:
        return json.dumps(v, ensure_ascii=False, separators=(",", ":"))
    lines = [f" {dump(k)}: {dump(v)}," for k, v in data.items() if k != "cases"]
    cases = ",\n".join(f"  {dump(c)}" for c in data["cases"])
    return "{\n" + "\n".join(lines) + '\n "cases": [\n' + cases + "\n ]\n}\n"


@llama_cpp.llama_log_callback
def _quiet(level, text, user_data):  # llama.cpp's load log is long; keep the script's output short
    pass


def main(argv: list[str]) -> None:
    only = None
    if argv[:1] == ["--only"]:
        only, argv = set(argv[1].split(",")), argv[2:]
    overrides = dict(a.split("=", 1) for a in argv)
    llama_cpp.llama_log_set(_quiet, None)
    llama_cpp.llama_backend_init()
    DATA.mkdir(parents=True, exist_ok=True)
    for name in MODELS:
        if only and name not in only:
            continue
        out = DATA / f"tokens_{name}.json"
        data = oracle(name, model_path(name, overrides))
        out.write_text(to_json(data), encoding="utf-8")
        print(f"{out}: {len(data['cases'])} strings, n_vocab {data['n_vocab']}")


if __name__ == "__main__":
    main(sys.argv[1:])
