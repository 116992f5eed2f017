"""Constrained decoding: a grammar limits which tokens each step may emit, so that a reply is, for
example, JSON that a schema accepts (the server's `response_format`).

The grammar engine is llguidance, the library llama.cpp's LLGUIDANCE build uses: it compiles a
JSON schema (or a Lark grammar) against the model's vocabulary and, per step, gives the bitmask of
the tokens that keep the output inside the grammar. The vocabulary goes to it as bytes per token,
control tokens marked with a leading 0xFF byte (llguidance's convention: the grammar cannot spell
them out of text), and our tokenizer as its encoder, so the two never disagree on a token.
"""
from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np

from .errors import HybridError


class _Vocabulary:
    """llguidance's TokenizerWrapper protocol over our tokenizer."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.special_token_ids = [i for i in range(tokenizer.n_vocab) if tokenizer.is_control(i)]
        control = set(self.special_token_ids)
        self.tokens = [(b"\xff" if i in control else b"") + tokenizer.token_bytes(i) for i in range(tokenizer.n_vocab)]
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eog_ids)
        self.bos_token_id = tokenizer.bos_id
        self.is_tokenizer_wrapper = True

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special=False)


def vocabulary(tokenizer):
    """The llguidance tokenizer of `tokenizer`, built once per tokenizer (a pass over the whole
    vocabulary) and kept on it."""
    built = getattr(tokenizer, "_llguidance", None)
    if built is None:
        built = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer)),
                                       eos_token=sorted(tokenizer.eog_ids))
        tokenizer._llguidance = built
    return built


def json_schema_grammar(schema: dict[str, Any] | None) -> str:
    """The grammar of JSON text that `schema` accepts (None: any JSON object), compact: no
    whitespace between tokens unless the schema's "x-guidance" options ask for it (a free
    choice of whitespace lets a model wander in it)."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema if schema is not None else {"type": "object"}),
            defaults={"whitespace_flexible": False})
    except ValueError as e:
        raise HybridError(f"the JSON schema is not valid: {e}") from None


def gbnf_grammar(text: str) -> str:
    """The grammar of a GBNF text (llama.cpp's grammars/*.gbnf, its --grammar), or of a Lark one."""
    try:
        return llguidance.grammar_from("gbnf", text)
    except ValueError as e:
        raise HybridError(f"the grammar is not valid GBNF or Lark: {e}") from None


class Constraint:
    """One reply's grammar state: `mask` a logit row before sampling, `accept` the token sampled.
    Made where the request is checked (a grammar that does not compile is a HybridError there),
    then handed to the generation that uses it."""

    def __init__(self, tokenizer, grammar: str):
        vocab = vocabulary(tokenizer)
        self._matcher = llguidance.LLMatcher(vocab, grammar, log_level=0)
        if self._matcher.is_error():
            raise HybridError(f"the grammar does not compile: {self._matcher.get_error()}")
        self._bits = llguidance.numpy.allocate_token_bitmask(1, vocab.vocab_size)
        self._n_vocab = tokenizer.n_vocab

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of the row with every token the grammar does not allow next at -inf."""
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bits)
        out = np.array(logits, dtype=np.float32, copy=True)
        k = min(out.size, self._n_vocab)      # rows past the tokenizer's vocabulary: never allowed
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:k].astype(bool)
        out[:k][~allowed] = -np.inf
        out[k:] = -np.inf
        return out

    def sample(self, sampler, logits: np.ndarray, history) -> int:
        """`sampler`'s token from the row masked by the grammar, and the grammar told of it."""
        token = sampler.sample(self.mask(logits), history)
        self.accept(token)
        return token

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise HybridError(f"the grammar refused token {token}: {self._matcher.get_error()}")

    @property
    def stopped(self) -> bool:
        """The grammar is complete and its end-of-generation token taken: nothing may follow."""
        return self._matcher.is_stopped()

    def allowed_prefix(self, tokens) -> list[int]:
        """The longest prefix of `tokens` the grammar would take one after another from here
        (nothing consumed): the drafts worth verifying."""
        return list(tokens[:self._matcher.validate_tokens(list(tokens))])
