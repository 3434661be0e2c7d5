"""Tokenizer: ids, pieces and text must be llama.cpp's, byte for byte.

The fixtures tests/data/tokens_*.json were written by scripts/fixtures/make_token_oracle.py from llama.cpp
(llama-cpp-python) for the two real models; the tokenizers here are built from the same files'
metadata through GGUFFile. Small hand-made vocabularies check the merge rules on their own.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import pytest

from edgellm.errors import TokenizerError
from edgellm.fetch import model_path
from edgellm.gguf_file import GGUFFile
from edgellm.tokenizer import Tokenizer, _clean_spaces

DATA = Path(__file__).parent / "data"
MODELS = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m", "qwen2": "qwen2.5-coder-0.5b"}
FLAGS = {"10": (True, False), "01": (False, True), "11": (True, True)}


def _oracle(name: str) -> dict:
    return json.loads((DATA / f"tokens_{name}.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    """(fixture name, metadata, tokenizer, oracle) for one real model."""
    name = request.param
    md = GGUFFile(model_path(MODELS[name])).metadata
    return name, md, Tokenizer.from_metadata(md), _oracle(name)


# --- against llama.cpp --------------------------------------------------------------------------
@pytest.mark.real
def test_ids_match_llama_cpp(model):
    name, _, tok, oracle = model
    assert oracle["n_vocab"] == tok.n_vocab
    mismatches = []
    for case in oracle["cases"]:
        for key, (add_special, parse_special) in FLAGS.items():
            got = tok.tokenize(case["text"], add_special, parse_special)
            if got != case["ids"][key]:
                mismatches.append((case["text"], key, got, case["ids"][key]))
    assert not mismatches, f"{name}: {len(mismatches)} mismatches, first: {mismatches[0]}"
    assert len(oracle["cases"]) >= 40


@pytest.mark.real
def test_detokenize_matches_llama_cpp(model):
    _, _, tok, oracle = model
    for case in oracle["cases"]:
        ids = case["ids"]["11"]
        assert tok.detokenize_bytes(ids).hex() == case["detok_hex"], case["text"]
        assert tok.detokenize_bytes(ids, special=True).hex() == case["detok_special_hex"], case["text"]


@pytest.mark.real
def test_round_trip_text(model):
    """Plain text (no special-token text) comes back unchanged from its ids."""
    name, _, tok, oracle = model
    for case in oracle["cases"]:
        text = case["text"]
        if "<" in text or "\u2581" in text:
            continue
        assert tok.detokenize(tok.tokenize(text, add_special=True)) == text, (name, text)


@pytest.mark.real
def test_special_ids_match_llama_cpp(model):
    _, md, tok, oracle = model
    assert (tok.bos_id, tok.eos_id) == (oracle["bos"], oracle["eos"])
    assert tok.eot_id == oracle["eot"]
    assert tok.stop_ids == frozenset(oracle["eog"])
    assert all(tok.is_eog(t) for t in oracle["eog"])
    assert not tok.is_eog(tok.tokenize("Hello", add_special=False)[0])


@pytest.mark.real
def test_pieces_match_llama_cpp(model):
    _, _, tok, oracle = model
    for tid, hexed in oracle["pieces_hex"].items():
        assert tok.token_to_bytes(int(tid)).hex() == hexed, tid
    h = hashlib.sha256()
    for tid in range(tok.n_vocab):
        piece = tok.token_to_bytes(tid)
        h.update(len(piece).to_bytes(4, "little"))
        h.update(piece)
    assert h.hexdigest() == oracle["pieces_sha256"]


@pytest.mark.real
@pytest.mark.parametrize("name", list(MODELS))
def test_speed_of_setup_and_tokenize(name):
    """Set-up (262k tokens for Gemma) well under 1 s; 2 kB of text in under 50 ms (best of 3)."""
    md = GGUFFile(model_path(MODELS[name])).metadata
    text = " ".join(case["text"] for case in _oracle(name)["cases"])[:2048]
    assert len(text.encode("utf-8")) >= 2000
    setup, runs = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        tok = Tokenizer.from_metadata(md)      # fresh: nothing cached from an earlier call
        t1 = time.perf_counter()
        ids = tok.tokenize(text, True, True)
        t2 = time.perf_counter()
        setup.append(t1 - t0)
        runs.append(t2 - t1)
    body = ids[1:] if tok.add_bos else ids
    assert tok.detokenize(body, special=True).replace("\u2581", " ") == text.replace("\u2581", " ")
    assert min(setup) < 1.0, f"{name}: vocabulary set up in {min(setup):.3f} s"
    assert min(runs) < 0.05, f"{name}: 2 kB tokenized in {1e3 * min(runs):.1f} ms"


# --- streaming ----------------------------------------------------------------------------------
@pytest.mark.real
def test_stream_decoder_holds_back_split_emoji(model):
    _, _, tok, _ = model
    text = "ok 🤖🪿 done"
    ids = tok.tokenize(text, add_special=False)
    pieces = [tok.token_to_bytes(t) for t in ids]
    split = [p for p in pieces if _is_broken_utf8(p)]
    assert split, "the emoji should span several tokens in this vocabulary"
    dec = tok.stream_decoder()
    outputs = [dec.push(t) for t in ids]
    assert "".join(outputs) + dec.flush() == text
    assert all("\ufffd" not in o for o in outputs)
    assert "" in outputs                       # at least one token had to wait for the next


def test_stream_decoder_byte_fallback_tokens():
    tok = _tiny_spm()
    emoji = "🦜"                               # not in the vocabulary: four <0xXX> tokens
    ids = tok.tokenize(emoji, add_special=False)
    assert ids == [tok._token_to_id[f"<0x{b:02X}>"] for b in emoji.encode("utf-8")]
    dec = tok.stream_decoder()
    assert [dec.push(t) for t in ids] == ["", "", "", emoji]
    assert dec.flush() == ""
    dec.push(ids[0])
    dec.push(ids[1])
    assert dec.flush() == "\ufffd"             # an unfinished sequence at the end
    assert dec.push(tok._token_to_id["<0xFF>"]) == "\ufffd"   # a byte that starts nothing
    assert dec.push(tok._token_to_id["a"]) == "a"


# --- merge rules on hand-made vocabularies --------------------------------------------------------
def _tiny_spm(**extra):
    tokens = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "c", "ab", "bc", "\u2581a", "\u2581ab",
              "<ctrl>", "<user>", "xy", "yzw"] + [f"<0x{b:02X}>" for b in range(256)]
    scores = [0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -2.0, -1.5, -0.5, -1.2, -0.1, 0.0, 0.0, 0.0, 0.0] + [0.0] * 256
    types = [2, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 3, 4, 4, 4] + [6] * 256
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.scores": np.array(scores, np.float32),
          "tokenizer.ggml.token_type": np.array(types, np.int32),
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
          "tokenizer.ggml.add_space_prefix": False, **extra}
    return Tokenizer.from_metadata(md)


def test_spm_merges_best_score_first():
    tok = _tiny_spm()
    ids = tok._token_to_id
    # "abc": "bc" (-0.5) beats "ab" (-1.5), so a + bc
    assert tok.tokenize("abc", add_special=False) == [ids["a"], ids["bc"]]
    # " ab": "▁a" (-1.2) then "▁ab" (-0.1)
    assert tok.tokenize(" ab", add_special=False) == [ids["\u2581ab"]]
    assert tok.tokenize("ab", add_special=True) == [1, ids["ab"]]
    assert tok.detokenize(tok.tokenize(" ab c", add_special=True)) == " ab c"


def test_spm_space_prefix_after_special_tokens():
    tok = _tiny_spm(**{"tokenizer.ggml.add_space_prefix": True})
    ids = tok._token_to_id
    assert tok.tokenize("ab", add_special=False) == [ids["\u2581ab"]]
    assert tok.tokenize("ab<ctrl>ab", add_special=False, parse_special=True) == [
        ids["\u2581ab"], ids["<ctrl>"], ids["\u2581ab"]]
    assert tok.detokenize([ids["\u2581ab"]]) == "ab"      # the added space is taken off again


def test_special_partition_rules():
    tok = _tiny_spm()
    ids = tok._token_to_id
    # CONTROL text is plain text unless parse_special; USER_DEFINED text is always its token
    plain = tok.tokenize("<ctrl>", add_special=False, parse_special=False)
    assert ids["<ctrl>"] not in plain and len(plain) == 6
    assert tok.tokenize("<ctrl>", add_special=False, parse_special=True) == [ids["<ctrl>"]]
    assert tok.tokenize("a<user>b", add_special=False, parse_special=False) == [
        ids["a"], ids["<user>"], ids["b"]]
    # the longest special token is cut out first wherever it is, not the leftmost one
    assert tok.tokenize("xyzw", add_special=False) == [ids["<0x78>"], ids["yzw"]]
    assert tok.tokenize("xyz", add_special=False) == [ids["xy"], ids["<0x7A>"]]
    assert tok.token_to_bytes(ids["<ctrl>"]) == b""
    assert tok.token_to_bytes(ids["<ctrl>"], special=True) == b"<ctrl>"
    assert tok.token_to_bytes(ids["<user>"]) == b"<user>"


def _tiny_bpe(pre="gpt-2"):
    # bytes 'a' 'b' 'c' ' ' in the GPT-2 alphabet; ' ' is 'Ġ'
    tokens = ["<|endoftext|>", "a", "b", "c", "Ġ", "ab", "bc", "Ġa", "Ġab", "abc", "1", "2", "3", "12"]
    merges = ["b c", "a b", "Ġ a", "Ġa b", "ab c", "1 2"]
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": np.array([3] + [1] * (len(tokens) - 1), np.int32),
          "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 0,
          "tokenizer.ggml.eos_token_id": 0}
    return Tokenizer.from_metadata(md)


def test_bpe_merges_lowest_rank_first():
    tok = _tiny_bpe()
    ids = tok._token_to_id
    # "abc": rank 0 "b c" first → a + bc (no "a bc" merge), although "ab c" would give "abc"
    assert tok.tokenize("abc") == [ids["a"], ids["bc"]]
    # " ab": "a b" (rank 1) goes before "Ġ a" (rank 2), and nothing joins "Ġ" + "ab"
    assert tok.tokenize(" ab") == [ids["Ġ"], ids["ab"]]
    assert tok.tokenize("123") == [ids["12"], ids["3"]]
    assert tok.detokenize(tok.tokenize("abc ab")) == "abc ab"
    # smollm splits every digit before merging
    smol = _tiny_bpe("smollm")
    assert smol.tokenize("123") == [ids["1"], ids["2"], ids["3"]]


def test_clean_spaces_as_llama_cpp():
    assert _clean_spaces(b"a , b . c ' d 's 't 're 've 'll") == b"a, b. c'd's 't're've 'll"
    assert _clean_spaces(b"x ' ' y") == b"x'' y"
    assert _clean_spaces(b"") == b""


def test_errors_name_the_problem():
    with pytest.raises(TokenizerError, match="bert"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(TokenizerError, match="no-such-pre"):
        _tiny_bpe("no-such-pre")
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        _tiny_bpe().token_to_bytes(10_000)
    with pytest.raises(TokenizerError, match="duplicate"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "a"]})


def _is_broken_utf8(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_string_index_finds_the_first_index_and_survives_hash_collisions():
    from edgellm.tokenizer import StringIndex

    class Colliding(str):  # every string hashes alike: the index must compare the strings
        def __hash__(self):
            return 7

    words = ["b c", "a b", "Ġ a", "a b", "x"]
    for seq in (words, [Colliding(w) for w in words]):
        idx = StringIndex(seq)
        got = [idx.get(Colliding(w) if seq is not words else w) for w in ("b c", "a b", "Ġ a", "x", "zz")]
        assert got == [0, 1, 2, 4, None]  # "a b" twice: the first (lowest rank) wins
        assert idx.first_duplicate() == (1, 3)
    assert StringIndex(["a", "b"]).first_duplicate() is None
    with pytest.raises(KeyError):
        StringIndex(["a"])["b"]


@pytest.mark.real
def test_vocabulary_and_merges_stay_compact():
    """SmolLM2's 49k tokens and 49k merges, as metadata and tokenizer: ~15 MiB as Python strings
    and dicts, 3.4 MiB as bytes, offsets and sorted hashes (with the scores and token types)."""
    import tracemalloc

    tracemalloc.start()
    try:
        md = GGUFFile(model_path(MODELS["smollm2"])).metadata
        tok = Tokenizer.from_metadata(md)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert tok.n_vocab == 49152 and tok.tokenize("Hello world") == [19556, 905]
    assert held < 5 * 2**20, held


# --- llama.cpp's vocabulary walk (edgellm.vocab_order) ------------------------------------------
def test_string_hash_and_walk_are_libstdcxx():
    """Values printed by a C++ program built with GCC 12's libstdc++: std::hash<std::string> of
    strings across the 8-byte word boundary, and the iteration order of an unordered_map filled
    with 40 keys (through the rehashes at 13 and 29 elements)."""
    from edgellm.gguf_file import StringArray
    from edgellm.vocab_order import string_hashes, walk_order

    words = ["", "a", "abcdefg", "abcdefgh", "abcdefghi", "<|endoftext|>", "déjà vu 東京"]
    blob, off = StringArray(words).utf8()
    assert string_hashes(blob, off).tolist() == [
        6142509188972423790, 4993892634952068459, 16063891478991045295, 8664279048047335611,
        13036955925923793583, 3113324847494305268, 14781396196601614702]
    blob, off = StringArray([f"tok{7 * i}" for i in range(40)]).utf8()
    assert walk_order(blob, off).tolist() == [
        36, 33, 31, 30, 12, 1, 11, 21, 9, 7, 25, 6, 34, 28, 37, 29, 3, 10, 13, 4, 5, 0, 35, 24, 27, 39,
        15, 38, 14, 17, 16, 32, 8, 2, 18, 23, 19, 26, 20, 22]


def test_a_phi3_files_special_tokens_take_the_whitespace_after_them():
    """llama.cpp sets RSTRIP on a Phi-3 file's special tokens by the model's name (not in the file):
    the whitespace after them is not tokenized, except after <unk>, <s> and <|endoftext|>. The ids
    are llama.cpp 0.3.36's for this vocabulary (llama_tokenize, parse_special, no BOS)."""
    tokens = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "c", "ab", "bc", "\u2581a", "\u2581ab",
              "<ctrl>", "<user>", "xy", "yzw", "<|endoftext|>"] + [f"<0x{b:02X}>" for b in range(256)]
    scores = [0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -2.0, -1.5, -0.5, -1.2, -0.1, 0.0, 0.0, 0.0, 0.0, 0.0] + [0.0] * 256
    types = [2, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 3, 4, 4, 4, 3] + [6] * 256
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.scores": np.array(scores, np.float32), "tokenizer.ggml.token_type": np.array(types, np.int32),
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_space_prefix": False}
    texts = ["a<ctrl>\n ab<user>  b</s> c<s> c\t<ctrl>", "<|endoftext|> a <user>\n\nb <ctrl>  ", " <ctrl><ctrl> \n<user>"]
    want = {"Phi-3.5-mini-instruct": [[4, 11, 7, 12, 5, 2, 6, 1, 3, 6, 25, 11], [15, 9, 3, 12, 5, 3, 11],
                                      [3, 11, 11, 12]],
            "tiny": [[4, 11, 26, 10, 12, 3, 3, 5, 2, 3, 6, 1, 3, 6, 25, 11], [15, 9, 3, 12, 26, 26, 5, 3, 11, 3, 3],
                     [3, 11, 11, 3, 26, 12]]}
    for name, ids in want.items():
        tok = Tokenizer.from_metadata({**md, "general.name": name})
        assert [tok.tokenize(t, add_special=False, parse_special=True) for t in texts] == ids, name


def test_pre_tokenizers_split_as_llama_cpp(tmp_path):
    """The synthetic BPE vocabulary under several tokenizer.ggml.pre names: llama.cpp's ids for 20
    texts (ASCII, contractions, digits, accents, CJK, emoji, whitespace runs), recorded by
    scripts/fixtures/make_pre_oracle.py; gpt-4o (Phi-4-mini, Llama 4) splits unlike gpt-2."""
    import sys

    sys.path.insert(0, str(DATA.parents[1] / "scripts" / "fixtures"))
    import make_pre_oracle

    oracle = json.loads((DATA / "pre_tokenizers.json").read_text(encoding="utf-8"))
    for pre, want in oracle["ids"].items():
        tok = Tokenizer.from_metadata(GGUFFile(make_pre_oracle.vocab_file(tmp_path / f"{pre}.gguf", pre)).metadata)
        assert [tok.tokenize(t, add_special=False) for t in oracle["texts"]] == want, pre
    assert oracle["ids"]["gpt-4o"] != oracle["ids"]["gpt-2"]
