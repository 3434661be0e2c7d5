"""Constrained decoding: JSON schemas, regexes, Lark and GBNF grammars as token masks (llguidance).

`Vocabulary` hands llguidance the model's own tokens (built from the GGUF tokenizer once per model:
every token's bytes, control tokens marked as special so a grammar can name them, as
`<tool_call>`). `grammar_text` turns what a caller asks for into one llguidance grammar, checked,
with a clear error naming the field. A `Constraint` follows one sequence: the sampler asks it
whether the token it drew is allowed, and only when it is not, for the mask (llama.cpp's order:
sample, check, mask and sample again), so a grammar that admits the free answer changes nothing.
A lazy constraint (tool calls with tool_choice "auto") lets every token through until one of its
trigger tokens is drawn, and constrains from that token on.
"""
from __future__ import annotations

import json
import threading

import numpy as np

from edgellm.errors import InvalidArgumentError

GRAMMAR_FIELDS = ("json_schema", "grammar", "regex", "lark")


def _llguidance():
    import llguidance

    return llguidance


class Vocabulary:
    """llguidance's view of a Tokenizer: every token's bytes (special ones behind a 0xFF byte, as
    llguidance expects) and the end-of-generation tokens."""

    def __init__(self, tokenizer):
        from edgellm.tokenizer import ATTR_CONTROL, ATTR_USER_DEFINED

        llg = _llguidance()
        self.tokenizer = tokenizer
        tokens = []
        for i in range(tokenizer.n_vocab):
            piece = tokenizer.token_to_bytes(i, special=True)
            attr = int(tokenizer._attrs[i])
            if attr & ATTR_CONTROL or (attr & ATTR_USER_DEFINED and piece[:1] == b"<" and piece[-1:] == b">"):
                piece = b"\xff" + piece
            tokens.append(piece)
        self.special = {t[1:].decode("utf-8", "replace"): i for i, t in enumerate(tokens) if t[:1] == b"\xff"}
        eog = sorted(tokenizer.stop_ids)
        self.eog = eog

        class _Wrapped:  # the shape llguidance's TokenizerWrapper reads
            eos_token_id = eog[0] if eog else 0
            bos_token_id = tokenizer.bos_id
            special_token_ids: list = []

            def __call__(self, s):
                text = s.decode("utf-8", "replace") if isinstance(s, bytes) else s
                return tokenizer.tokenize(text, add_special=False, parse_special=False)

        _Wrapped.tokens = tokens
        self.ll = llg.LLTokenizer(llg.TokenizerWrapper(_Wrapped()), eos_token=eog or None)
        self.n_vocab = tokenizer.n_vocab

    def literal(self, text: str) -> str:
        """`text` as a Lark item: the special token by name if the vocabulary has it as one token,
        else a quoted string."""
        if text in self.special:
            return text
        return json.dumps(text)


class VocabularyCache:
    """One Vocabulary per model, built on first use (about a second for a 150k vocabulary)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._vocab: Vocabulary | None = None
        self._lock = threading.Lock()

    def get(self) -> Vocabulary:
        with self._lock:
            if self._vocab is None:
                self._vocab = Vocabulary(self._tokenizer)
            return self._vocab


def closed_objects(schema):
    """A copy of a JSON schema where an object with listed properties and no
    additionalProperties takes no others (llama.cpp's default for schemas it turns into grammars:
    a small model otherwise invents keys without end)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) if k not in ("const", "enum", "default", "examples") else v
           for k, v in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema and "patternProperties" not in schema:
        out["additionalProperties"] = False
    return out


# Whitespace inside JSON as llama.cpp's schema grammars bound it (a space, or one or two newlines
# and up to 20 indents): an unbounded run lets a small model pad until max_tokens.
JSON_SPACE = r"(?: |\n{1,2}[ \t]{0,20})?"


def bounded_space(schema):
    """`schema` with llguidance's JSON whitespace bounded, unless it sets its own `x-guidance`."""
    if isinstance(schema, dict) and "x-guidance" not in schema:
        return {**schema, "x-guidance": {"whitespace_pattern": JSON_SPACE}}
    return schema


def grammar_text(vocab: Vocabulary, *, json_schema=None, grammar: str | None = None, regex: str | None = None,
                 lark: str | None = None) -> str | None:
    """One llguidance grammar from at most one of the fields (None when none is given); an
    InvalidArgumentError naming the field and the library's reason when it does not compile."""
    llg = _llguidance()
    given = [(k, v) for k, v in (("json_schema", json_schema), ("grammar", grammar), ("regex", regex),
                                 ("lark", lark)) if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidArgumentError(f"give one of {', '.join(k for k, _ in given)}, not several: a request takes "
                                   "one grammar")
    field, value = given[0]
    try:
        if field == "json_schema":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise InvalidArgumentError(f"json_schema is not JSON: {exc}") from None
            if isinstance(value, (bool, dict)):
                value = json.dumps(bounded_space(closed_objects(value)))
            if not isinstance(value, str):
                raise InvalidArgumentError(f"json_schema must be a JSON object (a dict or its text), not "
                                           f"{type(value).__name__}")
            text = llg.LLMatcher.grammar_from_json_schema(value)
        elif not isinstance(value, str) or not value.strip():
            raise InvalidArgumentError(f"{field} must be a non-empty string")
        elif field == "grammar":
            text = llg.grammar_from("gbnf", value)
        elif field == "regex":
            text = llg.LLMatcher.grammar_from_regex(value)
        else:
            text = llg.LLMatcher.grammar_from_lark(value)
    except InvalidArgumentError:
        raise
    except Exception as exc:  # llguidance's ValueError / conversion errors carry the reason
        raise InvalidArgumentError(f"{field} does not compile: {exc}") from None
    check_grammar(vocab, text, field)
    return text


def check_grammar(vocab: Vocabulary, text: str, field: str = "grammar") -> None:
    error = _llguidance().LLMatcher.validate_grammar(text, vocab.ll)
    if error and not error.startswith("WARNING"):
        raise InvalidArgumentError(f"{field} does not compile: {error.strip()}")


class Constraint:
    """One sequence's grammar state. triggers: token ids that start a lazy grammar (which then
    must begin with that token); empty for a grammar that holds from the first token."""

    def __init__(self, vocab: Vocabulary, text: str, triggers=()):
        llg = _llguidance()
        self.vocab = vocab
        self.matcher = llg.LLMatcher(vocab.ll, text, log_level=0)
        if self.matcher.is_error():
            raise InvalidArgumentError(f"the grammar does not compile: {self.matcher.get_error()}")
        self.triggers = frozenset(triggers)
        self.active = not self.triggers
        self.masked = 0  # draws the grammar refused (each cost a mask and a second draw)

    def allows(self, tok: int) -> bool:
        if not self.active:
            return True
        return self.matcher.validate_tokens([int(tok)]) == 1

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of logits with every token the grammar refuses at -inf."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: len(logits)].astype(bool)
        if not allowed.any():  # the grammar is in an error state: end the answer
            allowed[self.vocab.eog[:1]] = True
        out = np.array(logits, dtype=np.float32, copy=True)
        out[~allowed] = -np.inf
        return out

    def accept(self, tok: int) -> None:
        if not self.active:
            if int(tok) not in self.triggers:
                return
            self.active = True
        self.matcher.consume_token(int(tok))

    @property
    def finished(self) -> bool:
        """The grammar is complete and takes nothing but the end of the answer."""
        return self.active and self.matcher.is_stopped()
