"""Tokenizer built from GGUF metadata alone, returning exactly the ids llama.cpp returns.

Data flow of `Tokenizer.tokenize(text, add_special, parse_special)` (llama.cpp's `llama_tokenize`):

    text ──► special-token partition ──► fragments: raw text | token id
                                          │
                 BPE ("gpt2"):  pre-tokenizer regex split → GPT-2 byte↔unicode → merges by rank
                 SPM ("llama"): spaces → "▁" → bigram merges by score → byte fallback <0xXX>
                                          │
             BOS / EOS added per add_bos_token / add_eos_token when add_special ──► ids

The vocabulary's token types (tokenizer.ggml.token_type) decide which tokens are "special":
CONTROL and UNKNOWN tokens are matched in the text only with parse_special=True; USER_DEFINED
tokens are matched always (llama.cpp follows Hugging Face here). Decoding is the reverse:
`token_to_bytes` gives a token's piece as llama.cpp's `llama_token_to_piece(special=False)`,
`detokenize` joins them as `llama_detokenize(remove_special=False, unparse_special=False)`,
and `StreamDecoder` turns a stream of ids into text that never ends inside a UTF-8 sequence.
"""
from __future__ import annotations

import codecs
import functools
import heapq
import numbers
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import regex

from edgellm.errors import ContextFullError, InvalidArgumentError, TokenizerError
from edgellm.gguf_file import StringArray

# ---------------------------------------------------------------------------------------------
# Token types and attributes
# ---------------------------------------------------------------------------------------------
# Attribute bits, as llama.cpp derives them from the token type (and, for a few tokens, their text).
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7  # whitespace left of the token's text goes with it (set by model name)
ATTR_RSTRIP = 1 << 8  # ... and right of it
_C_SPACE = " \t\n\v\f\r"  # C's isspace, what the strips take

# tokenizer.ggml.token_type (gguf-py's TokenType) -> attribute: UNDEFINED=0, NORMAL=1, UNKNOWN=2,
# CONTROL=3, USER_DEFINED=4, UNUSED=5, BYTE=6; anything else counts as UNDEFINED
_TYPE_TO_ATTR = np.array([0, ATTR_NORMAL, ATTR_UNKNOWN, ATTR_CONTROL, ATTR_USER_DEFINED,
                          ATTR_UNUSED, ATTR_BYTE], dtype=np.int32)
_SPECIAL_ATTRS = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN   # matched in the text
_HIDDEN_ATTRS = ATTR_CONTROL | ATTR_UNKNOWN                        # parse/print only if special

# Token texts llama.cpp recognises when the file names no id for the role. Each is forced to
# CONTROL (that changes how the token is matched and printed). Where several texts of a role are
# in the vocabulary llama.cpp takes whichever its hash map yields first (edgellm.vocab_order).
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
              "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {  # role -> texts; pad, rep and sep also end generation
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
            "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
            "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
            "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
              "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
              "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
              "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[")
_ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
_ROLE_TEXTS = frozenset((*_EOT_TEXTS, *_EOM_TEXTS, *_EOG_TEXTS, *_ALWAYS_USER_DEFINED,
                         *(t for texts in _FIM_TEXTS.values() for t in texts)))

_NO_LIMIT = sys.maxsize  # tokenize(limit=None)
SPM_PIECE = 2048  # characters merged at a time when SPM tokenizes a long text towards a limit

SPACE_ESCAPE = "\u2581"   # "▁": how SentencePiece vocabularies spell a space


def token_ids(tokens, n_vocab: int, what: str = "tokens") -> list[int]:
    """A list of token ids (ints in 0..n_vocab-1, NumPy integers included), or an InvalidArgumentError."""
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__iter__"):
        raise InvalidArgumentError(f"{what} must be a list of token ids (integers), got {type(tokens).__name__}")
    out = []
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise InvalidArgumentError(f"{what} must be integers; got {t!r}")
        if not 0 <= t < n_vocab:
            raise InvalidArgumentError(f"token id {t} is outside the vocabulary (0..{n_vocab - 1})")
        out.append(int(t))
    return out


# ---------------------------------------------------------------------------------------------
# GPT-2 byte-level alphabet: every byte is one printable code point, so merges work on text
# ---------------------------------------------------------------------------------------------
def _gpt2_byte_alphabet() -> list[str]:
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = [""] * 256
    for b in printable:
        alphabet[b] = chr(b)
    extra = 256
    for b in range(256):
        if not alphabet[b]:
            alphabet[b] = chr(extra)
            extra += 1
    return alphabet


_BYTE_TO_CHAR = _gpt2_byte_alphabet()                               # byte -> str of 1 code point
_CHAR_TO_BYTE = {c: b for b, c in enumerate(_BYTE_TO_CHAR)}
_LATIN1_TO_ALPHABET = {b: c for b, c in enumerate(_BYTE_TO_CHAR)}   # str.translate table


def _byte_encode(word: str) -> str:
    """UTF-8 bytes of `word`, each written as its GPT-2 alphabet character."""
    return word.encode("utf-8").decode("latin-1").translate(_LATIN1_TO_ALPHABET)


# ---------------------------------------------------------------------------------------------
# Pre-tokenizers (tokenizer.ggml.pre): regexes applied in turn, each splitting the pieces the
# previous one produced. Text between matches is kept as its own piece, as llama.cpp does.
# The patterns are llama.cpp's. Where llama.cpp runs a hand-written splitter instead (GPT-2 and
# Llama-3 patterns) its result is the regex's; `regex`'s \s is Unicode White_Space, the same
# set as llama.cpp's whitespace table. \p{L}/\p{N} come from `regex`'s Unicode tables, which may
# differ from llama.cpp's generated ones on characters assigned in the newest Unicode versions.
# ---------------------------------------------------------------------------------------------
_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_RE_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
              r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
             r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# GPT-4o's split as llama.cpp writes it (its regex engine has no \p{Lu}: letters that are not a-z /
# not A-Z stand for the upper / lower case classes, which only changes the split of non-ASCII letters)
_RE_GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
             r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
             r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
             r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    clean_spaces: bool = True      # detokenize drops the space in " ?", " 's", ... (llama.cpp)
    ignore_merges: bool = False    # a word that is a whole token skips the merges
    add_bos: bool = False          # default when the file has no tokenizer.ggml.add_bos_token
    compiled: tuple[regex.Pattern, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "compiled", tuple(regex.compile(r) for r in self.regexes))

    def split(self, text: str) -> list[str]:
        """The words of `text`, in order; joined they give `text` back."""
        pieces = [text]
        for pattern in self.compiled:
            out: list[str] = []
            for piece in pieces:
                pos = 0
                for m in pattern.finditer(piece):
                    if m.start() > pos:
                        out.append(piece[pos:m.start()])
                    if m.end() > m.start():
                        out.append(m.group())
                    pos = m.end()
                if pos < len(piece):
                    out.append(piece[pos:])
            pieces = out
        return pieces


_PRE_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_PRE_LLAMA3 = PreTokenizer((_RE_LLAMA3,), ignore_merges=True, add_bos=True)
_PRE_GPT2 = PreTokenizer((_RE_GPT2,))
_PRE_SMOLLM = PreTokenizer((r"\p{N}", _RE_GPT2), clean_spaces=False)
_PRE_QWEN2 = PreTokenizer((_RE_QWEN2,), clean_spaces=False)

# tokenizer.ggml.pre name -> pre-tokenizer (names as llama.cpp's converter writes them)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _PRE_DEFAULT,
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), _PRE_LLAMA3),
    "dbrx": PreTokenizer((_RE_LLAMA3,)),
    "smaug-bpe": PreTokenizer((_RE_LLAMA3,)),
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
                     "mpt", "olmo", "jais", "exaone4"), _PRE_GPT2),
    **dict.fromkeys(("smollm", "command-r"), _PRE_SMOLLM),
    **dict.fromkeys(("starcoder", "refact", "codeshell", "exaone", "minerva-7b"),
                    PreTokenizer((r"\p{N}", _RE_GPT2))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _PRE_QWEN2),
    **dict.fromkeys(("stablelm2", "megrez"), PreTokenizer((_RE_QWEN2,))),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie"), PreTokenizer((_RE_GPT4O,), clean_spaces=False)),
}

# tokenizer.ggml.model -> (kind, default bos, default eos)
_MODELS = {"llama": ("spm", 1, 2), "gpt2": ("bpe", 11, 11)}


# ---------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------
class StringIndex:
    """str -> the first index holding it in a sequence of strings (a vocabulary, a merge list),
    in 12 bytes a string: their hashes sorted (int64) and the matching indices (int32); a hit is
    confirmed against the string itself. A dict would keep every string as a Python object plus
    its slot: ~15 MiB for SmolLM2's 49k tokens and 49k merges, ~35 MiB for Gemma-3's 262k tokens.
    A look-up is slower than a dict's, a few ms over a 512-token prompt."""

    __slots__ = ("_strings", "_hashes", "_ids")

    def __init__(self, strings: Sequence[str]) -> None:
        hashes = np.fromiter(map(hash, strings), dtype=np.int64, count=len(strings))
        order = np.argsort(hashes, kind="stable")  # equal hashes keep index order: the first wins
        self._strings = strings
        self._hashes = hashes[order]
        self._ids = order.astype(np.int32)

    def get(self, s: str, default: int | None = None) -> int | None:
        h = hash(s)
        hashes, ids, strings = self._hashes, self._ids, self._strings
        i = int(hashes.searchsorted(h))
        while i < len(hashes) and hashes[i] == h:
            j = int(ids[i])
            if strings[j] == s:
                return j
            i += 1
        return default

    def __contains__(self, s: str) -> bool:
        return self.get(s) is not None

    def __getitem__(self, s: str) -> int:
        j = self.get(s)
        if j is None:
            raise KeyError(s)
        return j

    def first_duplicate(self) -> tuple[int, int] | None:
        """(i, j), i < j, of the first string (by j) held twice, or None."""
        hashes = self._hashes
        found = None
        starts = np.flatnonzero(hashes[1:] != hashes[:-1]) + 1
        bounds = np.concatenate(([0], starts, [len(hashes)])).tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):  # runs of equal hashes: rare and short
            if b - a < 2:
                continue
            seen: dict[str, int] = {}
            for j in sorted(self._ids[a:b].tolist()):
                s = self._strings[j]
                if s in seen and (found is None or j < found[1]):
                    found = (seen[s], j)
                seen.setdefault(s, j)
        return found


class Tokenizer:
    """A GGUF vocabulary (SPM or byte-level BPE) that tokenizes like llama.cpp."""

    def __init__(self, *, kind: str, tokens: Sequence[str], token_to_id: StringIndex,
                 scores: np.ndarray, attrs: np.ndarray,
                 merges: list[str] | None, pre: PreTokenizer | None, bos_id: int | None,
                 eos_id: int | None, eot_id: int | None, stop_ids: frozenset[int],
                 add_bos: bool, add_eos: bool, add_space_prefix: bool) -> None:
        self.kind = kind                       # "spm" | "bpe"
        self.n_vocab = len(tokens)
        self.bos_id, self.eos_id, self.eot_id = bos_id, eos_id, eot_id
        self.stop_ids = stop_ids               # every end-of-generation token (llama.cpp's EOG set)
        self.add_bos, self.add_eos, self.add_space_prefix = add_bos, add_eos, add_space_prefix
        self._tokens = tokens
        self._scores = scores
        self._attrs = attrs                    # int32 (n_vocab,), ATTR_* bits
        self._token_to_id = token_to_id
        # "left right" -> rank (the first one wins), the file's own merge strings; a pair is looked
        # up as left + " " + right, cut at the first space past the first character, which is
        # where llama.cpp cuts it (a merge with no such space can never apply)
        self._bpe_ranks = StringIndex(merges) if merges is not None else {}
        self._merges = merges if merges is not None else ()
        self._pre = pre
        self._clean_spaces = pre.clean_spaces if pre else False
        self._word_cache: dict[str, list[int]] = {}
        self._special_by_prefix = {parse: _special_buckets(tokens, attrs, parse) for parse in (True, False)}

    # --- construction from metadata ---------------------------------------------------------
    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> "Tokenizer":
        from edgellm.validate import check_tokenizer

        check_tokenizer(md)  # types of every tokenizer key, token types and role ids in range
        model = md.get("tokenizer.ggml.model")
        if model not in _MODELS:
            raise TokenizerError(
                f"tokenizer.ggml.model is {model!r}; edgellm reads SentencePiece ('llama') and "
                "byte-level BPE ('gpt2') vocabularies. Use a GGUF file with one of those.")
        kind, default_bos, default_eos = _MODELS[model]
        tokens = md.get("tokenizer.ggml.tokens") or []
        n = len(tokens)
        if n == 0:
            raise TokenizerError("the file has no tokenizer.ggml.tokens; it cannot be tokenized. "
                                 "Re-convert the model with its tokenizer.")
        token_to_id = StringIndex(tokens)
        if "" in token_to_id:                  # llama.cpp names empty entries "[EMPTY_<id>]"
            tokens = StringArray(t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens))
            token_to_id = StringIndex(tokens)
        duplicate = token_to_id.first_duplicate()
        if duplicate is not None:
            i, j = duplicate
            raise TokenizerError(f"duplicate token {tokens[i]!r} in the vocabulary (ids {i} "
                                 f"and {j}); the file is damaged. Re-convert the model.")
        raw_scores = md.get("tokenizer.ggml.scores")
        # float32, as stored (a Python float per token would take 24 bytes more each: 6 MiB for a
        # 262k vocabulary)
        scores = (np.asarray(raw_scores, dtype=np.float32)[:n] if raw_scores is not None
                  else np.zeros(n, np.float32))
        if len(scores) < n:
            raise TokenizerError(f"tokenizer.ggml.scores has {len(scores)} entries for {n} tokens.")
        types = md.get("tokenizer.ggml.token_type")
        if types is None:
            attrs = np.full(n, ATTR_NORMAL, dtype=np.int32)
        else:
            types = np.asarray(types, dtype=np.int64)[:n]
            if len(types) < n:
                raise TokenizerError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens.")
            attrs = np.where((types >= 0) & (types < len(_TYPE_TO_ATTR)),
                             _TYPE_TO_ATTR[np.clip(types, 0, len(_TYPE_TO_ATTR) - 1)], 0).astype(np.int32)

        pre = None
        merges = None
        add_bos, add_eos, add_space_prefix = (True, False, True) if kind == "spm" else (False, False, False)
        if kind == "bpe":
            pre_name = md.get("tokenizer.ggml.pre") or "default"
            if pre_name not in PRE_TOKENIZERS:
                raise TokenizerError(
                    f"pre-tokenizer {pre_name!r} (tokenizer.ggml.pre) is not supported; known: "
                    f"{', '.join(sorted(PRE_TOKENIZERS))}.")
            pre = PRE_TOKENIZERS[pre_name]
            add_bos = pre.add_bos
            merges = md.get("tokenizer.ggml.merges")
            if merges is None:
                raise TokenizerError("a BPE vocabulary needs tokenizer.ggml.merges, and the file has none.")
        add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", add_space_prefix))

        bos_id = _token_id(md, "tokenizer.ggml.bos_token_id", default_bos, n)
        eos_id = _token_id(md, "tokenizer.ggml.eos_token_id", default_eos, n)
        add_bos = bool(md.get("tokenizer.ggml.add_bos_token", add_bos))
        add_eos = bool(md.get("tokenizer.ggml.add_eos_token", add_eos))
        if add_bos and bos_id is None:
            raise TokenizerError("tokenizer.ggml.add_bos_token is true but the file names no BOS token.")
        if add_eos and eos_id is None:
            raise TokenizerError("tokenizer.ggml.add_eos_token is true but the file names no EOS token.")

        eot_id, stop_ids = _special_roles(md, tokens, token_to_id, attrs, eos_id)
        _named_attrs(md, token_to_id, attrs)
        return cls(kind=kind, tokens=tokens, token_to_id=token_to_id, scores=scores, attrs=attrs,
                   merges=merges, pre=pre, bos_id=bos_id, eos_id=eos_id, eot_id=eot_id, stop_ids=stop_ids,
                   add_bos=add_bos, add_eos=add_eos, add_space_prefix=add_space_prefix)

    # --- tokenize ------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False,
                 limit: int | None = None, stop_after: int | None = None) -> list[int]:
        """Token ids of `text`, as llama.cpp's llama_tokenize(text, add_special, parse_special).

        limit: raise ContextFullError as soon as the text is certain to give more than `limit`
        ids, so that a huge text costs little (see _surely_longer: most are not tokenized at
        all); the others stop at the first 1024 words (BPE) or piece of ~SPM_PIECE characters
        (SPM, cut where no token can span the cut) past the limit. The ids of a text within the
        limit are the same as without one.
        stop_after: return as soon as at least that many ids are made, at the same cuts: the
        ids returned are the first ids of the whole text (no EOS then; perplexity's chunks of a
        long text need only its beginning)."""
        text = _valid_unicode(text)
        stop = _NO_LIMIT if limit is None else limit
        enough = _NO_LIMIT if stop_after is None else stop_after
        if len(text) > stop and self._surely_longer(text, stop):
            raise ContextFullError(f"the text is more than {limit} tokens ({len(text)} characters)")
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)
        fragments = self._partition(text, parse_special) if text else []
        if self.kind == "spm":
            prev_special = True            # a space prefix goes at the start and after a special
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                frag = frag.replace(" ", SPACE_ESCAPE)
                pieces = self._spm_pieces(frag) if limit is not None or stop_after is not None else (frag,)
                for piece in pieces:
                    self._spm(piece, out)
                    if len(out) > stop:
                        raise ContextFullError(f"the text is more than {limit} tokens")
                    if len(out) >= enough:
                        return out
                prev_special = False
        else:
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    continue
                words = self._pre.split(frag)
                for w0 in range(0, len(words), 1024):  # the limit looked at every 1024 words
                    for word in words[w0:w0 + 1024]:
                        ids = self._word_cache.get(word)
                        if ids is None:
                            ids = self._bpe_word(word)
                            if len(self._word_cache) > 65536:
                                self._word_cache.clear()
                            self._word_cache[word] = ids
                        out.extend(ids)
                    if len(out) > stop:
                        raise ContextFullError(f"the text is more than {limit} tokens")
                    if len(out) >= enough:
                        return out
        if add_special and self.add_eos:
            out.append(self.eos_id)
        if len(out) > stop:
            raise ContextFullError(f"the text is more than {limit} tokens")
        return out

    # --- how long a text can be before it must give more ids than a limit --------------------
    def _surely_longer(self, text: str, limit: int) -> bool:
        """True when `text` is certain to give more than `limit` ids, found without tokenizing
        it: no id stands for more characters than the longest token has (a special token its
        text; BPE one byte, so at least one character, per alphabet character; SPM one character
        per character, "▁" for a space), so a text of more than limit x that many characters needs
        more than `limit` ids -- provided every character ends up in some id (see _may_drop)."""
        return len(text) > limit * self.max_token_chars and not self._may_drop(text)

    @functools.cached_property
    def max_token_chars(self) -> int:
        return max(1, max(map(len, self._tokens)))

    def _may_drop(self, text: str) -> bool:
        """Whether some character of `text` may end up in no id. SPM: never (a merge makes a token;
        the rest falls back to byte tokens, or raises). Byte-level BPE drops a piece that is no
        token: with every merge's result a token, the only such pieces are the bytes whose
        alphabet character is not a token (SmolLM2 lacks 21: control bytes, bytes no UTF-8 text
        holds) -- so it may drop when the text's UTF-8 holds one of those."""
        if self.kind == "spm":
            return False
        missing = self._missing_bytes
        if missing is None:
            return True
        data = text.encode("utf-8")
        return any(bytes((b,)) in data for b in missing)

    @functools.cached_property
    def _missing_bytes(self) -> bytes | None:
        """The bytes whose GPT-2 alphabet character is not a token; None when some merge's result
        is not a token either (a crafted vocabulary: then any text may lose characters)."""
        to_id = self._token_to_id
        for merge in self._merges:
            cut = merge.find(" ", 1)  # where llama.cpp cuts a merge (see _bpe_ranks)
            if cut > 0 and merge[:cut] + merge[cut + 1:] not in to_id:
                return None
        return bytes(b for b, c in enumerate(_BYTE_TO_CHAR) if c not in to_id)

    def _spm_pieces(self, text: str):
        """`text` ("▁" for spaces) in pieces of about SPM_PIECE characters or more, each cut
        before a "▁" that no token joins to the character before it. No merge can then make a
        symbol across a cut (it would be a token holding that pair), so each piece merges as it
        does within the whole text, and the pieces' ids end to end are the whole text's ids."""
        if len(text) <= 2 * SPM_PIECE:
            yield text
            return
        joined = self._joined_before_space
        start, pos = 0, SPM_PIECE
        while True:
            p = text.find(SPACE_ESCAPE, pos)
            if p < 0 or len(text) - p < SPM_PIECE:
                break
            if text[p - 1] in joined:
                pos = p + 1
                continue
            yield text[start:p]
            start, pos = p, p + SPM_PIECE
        yield text[start:]

    @functools.cached_property
    def _joined_before_space(self) -> frozenset[str]:
        """The characters some token holds right before a "▁" (Gemma-3: only '>')."""
        joined = set()
        for t in self._tokens:
            i = t.find(SPACE_ESCAPE, 1)
            while i > 0:
                joined.add(t[i - 1])
                i = t.find(SPACE_ESCAPE, i + 1)
        return frozenset(joined)

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split `text` at special-token texts, longest token first, as llama.cpp does."""
        by_prefix = self._special_by_prefix[parse_special]
        prefixes = set(text).union(text[i:i + 2] for i in range(len(text) - 1))  # 1- and 2-char substrings
        candidates = sorted(c for p in prefixes if p in by_prefix for c in by_prefix[p])
        fragments: list[str | int] = [text]
        for _, tok_text, tid in candidates:
            if tok_text not in text:
                continue
            split: list[str | int] = []
            strip = self._attrs[tid] & (ATTR_LSTRIP | ATTR_RSTRIP)
            for frag in fragments:
                if isinstance(frag, int) or tok_text not in frag:
                    split.append(frag)
                    continue
                parts = frag.split(tok_text)
                for j, part in enumerate(parts):
                    if j:
                        split.append(tid)
                    if strip:
                        if j and strip & ATTR_RSTRIP:
                            part = part.lstrip(_C_SPACE)
                        if j < len(parts) - 1 and strip & ATTR_LSTRIP:
                            part = part.rstrip(_C_SPACE)
                    if part:
                        split.append(part)
            fragments = split
        return fragments

    # --- SentencePiece (bigram merges by score) -------------------------------------------------
    def _spm(self, text: str, out: list[int]) -> None:
        to_id, scores = self._token_to_id, self._scores

        def priority(left: str, right: str) -> float | None:    # best score first
            tid = to_id.get(left + right)
            return None if tid is None else -scores[tid]

        for piece in _merge(list(text), priority):
            tid = to_id.get(piece)
            if tid is not None:
                out.append(tid)
            else:                              # not in the vocabulary: one token per UTF-8 byte
                out.extend(self._byte_token(b) for b in piece.encode("utf-8"))

    def _byte_token(self, byte: int) -> int:
        tid = self._token_to_id.get(f"<0x{byte:02X}>")
        if tid is None and byte < 0x80:
            tid = self._token_to_id.get(chr(byte))
        if tid is None:
            raise TokenizerError(f"the vocabulary has no byte-fallback token <0x{byte:02X}>; this "
                                 "text cannot be tokenized with it.")
        return tid

    # --- byte-level BPE (merges by rank) --------------------------------------------------------
    def _bpe_word(self, word: str) -> list[int]:
        to_id = self._token_to_id
        encoded = _byte_encode(word)
        if self._pre.ignore_merges and encoded in to_id:
            return [to_id[encoded]]
        ids: list[int] = []
        ranks = self._bpe_ranks

        def rank(left: str, right: str) -> int | None:
            # a merge's left part has no space past its first character (that is where it is cut)
            return None if " " in left[1:] else ranks.get(left + " " + right)

        for piece in _merge(list(encoded), rank):
            tid = to_id.get(piece)
            if tid is not None:
                ids.append(tid)
                continue
            # not a token: llama.cpp looks each UTF-8 byte up as a one-byte token (only ASCII can hit)
            for b in piece.encode("utf-8"):
                tid = to_id.get(chr(b)) if b < 0x80 else None
                if tid is not None:
                    ids.append(tid)
        return ids

    # --- decode ----------------------------------------------------------------------------------
    def token_to_bytes(self, tok: int, special: bool = False) -> bytes:
        """The piece of token `tok`, as llama.cpp's llama_token_to_piece(lstrip=0, special)."""
        if not 0 <= tok < self.n_vocab:
            raise TokenizerError(f"token id {tok} is outside the vocabulary (0..{self.n_vocab - 1}).")
        attr = int(self._attrs[tok])
        text = self._tokens[tok]
        if attr & _HIDDEN_ATTRS and not special:
            return b""
        if attr & (_HIDDEN_ATTRS | ATTR_USER_DEFINED):
            return text.encode("utf-8")
        if attr & ATTR_NORMAL:
            if self.kind == "spm":
                return text.replace(SPACE_ESCAPE, " ").encode("utf-8")
            return _byte_decode(text)
        if attr & ATTR_BYTE:
            return bytes([int(text[3:5], 16)])
        return b""

    def detokenize_bytes(self, tokens: Iterable[int], special: bool = False) -> bytes:
        """llama.cpp's llama_detokenize(tokens, remove_special=False, unparse_special=special)."""
        out = bytearray()
        for i, tok in enumerate(tokens):
            piece = self.token_to_bytes(int(tok), special)
            if i == 0 and self.add_space_prefix and piece.startswith(b" "):
                piece = piece[1:]
            out += piece
        return _clean_spaces(bytes(out)) if self._clean_spaces else bytes(out)

    def detokenize(self, tokens: Iterable[int], special: bool = False) -> str:
        """Text of `tokens`; control tokens are left out unless special=True."""
        return self.detokenize_bytes(tokens, special).decode("utf-8", errors="replace")

    def is_eog(self, tok: int) -> bool:
        return tok in self.stop_ids

    def token_text(self, tok: int) -> str:
        """The vocabulary entry of `tok` as stored in the file (e.g. "▁the", "Ġthe", "<0x0A>")."""
        return self._tokens[tok]

    def stream_decoder(self, special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, special)


class StreamDecoder:
    """Turns token ids into text one at a time, holding back an unfinished UTF-8 sequence.

    An emoji split over several byte tokens comes out whole with the token that completes it;
    bytes that can never form a character come out as U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, tok: int) -> str:
        return self._utf8.decode(self._tokenizer.token_to_bytes(tok, self._special), final=False)

    def flush(self) -> str:
        """Whatever is held back (an incomplete sequence becomes U+FFFD); the decoder is reset."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


Tokenizer.StreamDecoder = StreamDecoder


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _merge(sym: list[str], priority: Callable[[str, str], float | None]) -> list[str]:
    """Merge adjacent symbols until no pair has a priority, best pair (lowest value, then
    leftmost) first; the merge loop of llama.cpp's SPM (priority -score) and BPE (rank)."""
    n = len(sym)                               # sym[i]: text of symbol i, "" once merged away
    nxt = [*range(1, n), -1] if n else []
    prev = list(range(-1, n - 1))
    queue: list[tuple[float, int, int, str]] = []    # (priority, left, right, merged text)

    def push(left: int, right: int) -> None:
        if left >= 0 and right >= 0:
            p = priority(sym[left], sym[right])
            if p is not None:
                heapq.heappush(queue, (p, left, right, sym[left] + sym[right]))

    for i in range(1, n):
        push(i - 1, i)
    while queue:
        _, left, right, merged = heapq.heappop(queue)
        if not sym[left] or not sym[right] or sym[left] + sym[right] != merged:
            continue                               # a side has changed since it was queued
        sym[left], sym[right] = merged, ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        push(prev[left], left)
        push(left, nxt[left])
    return [piece for piece in sym if piece]


def _special_buckets(tokens: list[str], attrs: np.ndarray,
                     parse_special: bool) -> dict[str, list[tuple[int, str, int]]]:
    """The special tokens matched in text, as {first two characters: [(rank, text, id), ...]}.
    Rank orders them longest text first (ties by id), the order llama.cpp cuts them out in; the
    buckets let a text be searched only for the tokens that can occur in it."""
    matched = (attrs & _SPECIAL_ATTRS) != 0
    if not parse_special:                      # then only USER_DEFINED tokens are
        matched &= (attrs & _HIDDEN_ATTRS) == 0
    ids = np.flatnonzero(matched).tolist()
    ordered = sorted(ids, key=lambda i: (-len(tokens[i].encode("utf-8", "surrogateescape")), i))
    buckets: dict[str, list[tuple[int, str, int]]] = {}
    for rank, tid in enumerate(ordered):
        buckets.setdefault(tokens[tid][:2], []).append((rank, tokens[tid], tid))
    return buckets


def _named_attrs(md: Mapping[str, Any], token_to_id, attrs: np.ndarray) -> None:
    """Token attributes llama.cpp sets by model name (the file does not carry them; updates attrs
    in place): a Phi-3 file's special tokens, and its </s>, take the whitespace after them."""
    name = md.get("general.name")
    name = name.lower() if isinstance(name, str) else ""
    if "phi-3" in name or "phi3" in name:
        attrs[(attrs & _SPECIAL_ATTRS) != 0] |= ATTR_RSTRIP
        for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
            tid = token_to_id.get(text)
            if tid is not None:
                attrs[tid] = attrs[tid] | ATTR_RSTRIP if on else attrs[tid] & ~ATTR_RSTRIP


def _token_id(md: Mapping[str, Any], key: str, default: int | None, n_vocab: int) -> int | None:
    """The id the file gives for `key`, else `default`; ids outside the vocabulary are ignored."""
    tid = default if default is not None and default < n_vocab else None
    value = md.get(key)
    if value is not None and 0 <= int(value) < n_vocab:
        tid = int(value)
    return tid


def _special_roles(md: Mapping[str, Any], tokens: list[str], token_to_id: dict[str, int],
                   attrs: np.ndarray, eos_id: int | None) -> tuple[int | None, frozenset[int]]:
    """(EOT id, end-of-generation ids). Roles the file does not name are found by token text,
    as llama.cpp does, and those tokens become CONTROL (updates `attrs` in place)."""
    n = len(tokens)
    index = {t: token_to_id[t] for t in _ROLE_TEXTS if t in token_to_id}
    walk_rank: list[np.ndarray | None] = []

    def first_in_walk(found: list[int]) -> int:
        if not walk_rank:                      # computed once, only for a vocabulary that needs it
            from edgellm.vocab_order import walk_order

            blob, offsets = (tokens if isinstance(tokens, StringArray) else StringArray(tokens)).utf8()
            order = walk_order(blob, offsets)
            rank = None
            if order is not None:
                rank = np.empty(n, dtype=np.int64)
                rank[order] = np.arange(n)
            walk_rank.append(rank)
        rank = walk_rank[0]
        return min(found) if rank is None else min(found, key=lambda t: rank[t])

    def by_text(key: str, texts: Iterable[str]) -> int | None:
        tid = _token_id(md, key, None, n)
        if tid is not None:
            return tid
        found = [index[t] for t in texts if t in index]
        if not found:
            return None
        tid = found[0] if len(found) == 1 else first_in_walk(found)
        attrs[tid] |= ATTR_CONTROL
        return tid

    eot_id = by_text("tokenizer.ggml.eot_token_id", _EOT_TEXTS)
    eom_id = by_text("tokenizer.ggml.eom_token_id", _EOM_TEXTS)
    fim = {role: by_text(f"tokenizer.ggml.fim_{role}_token_id", texts)
           for role, texts in _FIM_TEXTS.items()}
    stop = {fim[r] for r in ("pad", "rep", "sep") if fim[r] is not None}
    for t in _EOG_TEXTS:
        if t in index:
            stop.add(index[t])
            attrs[index[t]] |= ATTR_CONTROL
    for t in _ALWAYS_USER_DEFINED:
        if t in index:
            attrs[index[t]] = ATTR_USER_DEFINED
    stop |= {i for i in (eos_id, eot_id, eom_id) if i is not None}
    names = {tokens[i] for i in stop}
    if ({"<|return|>", "<|call|>", "<|end|>"} <= names
            or {"<|calls|>", "<|flush|>", "<|end|>"} <= names):   # harmony / solar-open
        stop.discard(index["<|end|>"])
        attrs[index["<|end|>"]] = ATTR_USER_DEFINED
    if {"<|tool_response>", "</s>"} <= names:                     # gemma4 / paddleocr
        stop.discard(index["</s>"])
        attrs[index["</s>"]] = ATTR_NORMAL
    return eot_id, frozenset(stop)


def _valid_unicode(text: str) -> str:
    """`text` with lone surrogates (not encodable as UTF-8) replaced by U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def _byte_decode(text: str) -> bytes:
    """GPT-2 alphabet text back to its bytes (llama.cpp marks characters outside the alphabet)."""
    try:
        return bytes(_CHAR_TO_BYTE[c] for c in text)
    except KeyError:
        out = bytearray()
        for c in text:
            b = _CHAR_TO_BYTE.get(c)
            if b is not None:
                out.append(b)
            else:
                out += b"[UNK_BYTE_0x" + c.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
        return bytes(out)


def _clean_spaces(text: bytes) -> bytes:
    """llama.cpp's clean-up of tokenizer spaces, its three passes in order:
    " ?" " !" " ." " ," lose the space; " ' " becomes "'"; " 's" " 'm" " 're" " 've" lose the space."""
    buf = bytearray(text)
    n = len(buf)
    if n == 0:
        return b""
    # pass 1
    k = 1
    for i in range(1, n):
        x = buf[i]
        if buf[i - 1] == 0x20 and x in b"?!.,":
            k -= 1
        buf[k] = x
        k += 1
    n, k, i = k, 1, 1
    # pass 2: the space after the apostrophe is blanked out (NUL) and skipped, as in llama.cpp
    while i < n:
        x = buf[i]
        if x == 0x27 and i + 1 < n and buf[i - 1] == 0x20 and buf[i + 1] == 0x20:
            k -= 1
            i += 1
            buf[i] = 0
        buf[k] = x
        k += 1
        i += 1
    n, k = k, 1
    # pass 3
    for i in range(1, n):
        x = buf[i]
        if buf[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = buf[i + 1]
            if x1 in b"sm" or (i + 2 < n and x1 in b"rv" and buf[i + 2] == 0x65):   # 's 'm 're 've
                k -= 1
        buf[k] = x
        k += 1
    return bytes(buf[:k])
