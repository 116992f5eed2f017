"""A small byte-level BPE vocabulary and a ChatML template for synthetic models.

Shaped like Qwen's (docs/MODEL_FORMAT.md §7): ids 0..255 are the 256 GPT-2 byte symbols
(in GPT-2's order), then merges learnt from a short built-in text, then the special tokens
(`<|endoftext|>`, `<|im_start|>`, `<|im_end|>` as control tokens, `<think>`, `</think>` as
user-defined ones), then `[PAD{id}]` fillers (type UNUSED) up to the requested size, which is what
llama.cpp's converter writes when a model's vocab_size exceeds its tokenizer. Deterministic:
the same size gives the same vocabulary.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from gguf import TokenType

from ..errors import HybridError

SPECIALS = (("<|endoftext|>", TokenType.CONTROL), ("<|im_start|>", TokenType.CONTROL),
            ("<|im_end|>", TokenType.CONTROL), ("<think>", TokenType.USER_DEFINED),
            ("</think>", TokenType.USER_DEFINED))
MIN_VOCAB = 256 + len(SPECIALS)
MAX_MERGES = 1500            # the built-in text runs out of useful merges well before this

# ChatML; earlier assistant turns lose their reasoning; `enable_thinking=false` pre-fills an empty
# think block, as Qwen3.5's template does.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

_TEXT = '''
The model reads a prompt, one token at a time, and writes the next token. Each layer either
mixes the past through attention or carries it forward in a small recurrent state. The state
is updated with the delta rule: the memory forgets a little, then stores the difference
between what it predicted and what it saw. When the answer is known, the model stops.

def forward(self, tokens, positions):
    """Run every layer on the tokens and return the logits of the last one."""
    hidden = self.embed(tokens)
    for layer in self.layers:
        hidden = layer(hidden, positions)
    return self.output(self.norm(hidden))

class Cache:
    def __init__(self, n_layers, n_ctx):
        self.keys = [None] * n_layers
        self.values = [None] * n_layers
        self.length = 0

    def append(self, layer, key, value):
        if self.keys[layer] is None:
            self.keys[layer] = key
        else:
            self.keys[layer] = concat(self.keys[layer], key)
        return self.length

for i in range(10):
    print(f"step {i}: loss = {loss:.4f}", flush=True)

import numpy as np
x = np.zeros((4, 8), dtype=np.float32)
assert x.shape == (4, 8), "unexpected shape"
if not values:
    raise ValueError("the list of values is empty")
# Read the file, count the words, and print the ten most common ones.
with open(path, encoding="utf-8") as f:
    words = f.read().split()
print(sorted(count.items(), key=lambda kv: kv[1], reverse=True)[:10])
It is not the size of the model that matters most, but the data it was trained on and the
care taken in measuring what it does. Tests should fail when the code is wrong.
'''

# Close to Qwen's pre-tokenizer with Python's `re`: letters after an optional non-letter,
# single digits, punctuation runs (underscore counts as punctuation), whitespace.
_PRETOKEN = re.compile(
    r"'(?:[sS]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD])"
    r"|(?:[^\r\n\w]|_)?[^\W\d_]+|\d| ?(?:[^\s\w]|_)+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class Vocab:
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]        # "left right", in rank order

    def id_of(self, token: str) -> int:
        return self.tokens.index(token)

    @property
    def eos_id(self) -> int:
        return self.id_of("<|im_end|>")

    @property
    def padding_id(self) -> int:
        return self.id_of("<|endoftext|>")


def _gpt2_byte_order() -> list[int]:
    """Printable Latin-1 bytes first (they stand for themselves), then the rest in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    return printable + [b for b in range(256) if b not in printable]


@lru_cache(maxsize=1)
def byte_encoder() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte: itself if printable, else chr(256 + k) in order."""
    order, n_printable = _gpt2_byte_order(), 188
    return {b: chr(b) if k < n_printable else chr(256 + k - n_printable) for k, b in enumerate(order)}


def byte_symbols() -> tuple[str, ...]:
    """The 256 byte tokens in GPT-2's vocabulary order (ids 0..255)."""
    enc = byte_encoder()
    return tuple(enc[b] for b in _gpt2_byte_order())


def _train_merges(text: str, max_new_tokens: int) -> tuple[list[str], list[str]]:
    """Plain BPE on `text`: the most frequent adjacent pair (ties: the smaller pair) merges next."""
    enc = byte_encoder()
    words = Counter(tuple(enc[b] for b in piece.encode("utf-8")) for piece in _PRETOKEN.findall(text))
    known = set(enc.values())
    merges, new_tokens = [], []
    while len(new_tokens) < max_new_tokens and len(merges) < MAX_MERGES:
        pairs: Counter = Counter()
        for word, freq in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += freq
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < 2:
            break
        merged = best[0] + best[1]
        merges.append(f"{best[0]} {best[1]}")
        if merged not in known:
            known.add(merged)
            new_tokens.append(merged)
        words = Counter({_merge_word(w, best, merged): f for w, f in words.items()})
    return merges, new_tokens


def _merge_word(word: tuple[str, ...], pair: tuple[str, str], merged: str) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(merged)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


@lru_cache(maxsize=8)
def build_vocab(n_vocab: int) -> Vocab:
    if n_vocab < MIN_VOCAB:
        raise HybridError(f"vocab size {n_vocab} is too small: the byte tokens and specials need {MIN_VOCAB}")
    merges, learnt = _train_merges(_TEXT, n_vocab - MIN_VOCAB)
    tokens = [*byte_symbols(), *learnt, *(s for s, _ in SPECIALS)]
    types = [int(TokenType.NORMAL)] * (256 + len(learnt)) + [int(t) for _, t in SPECIALS]
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]")
        types.append(int(TokenType.UNUSED))
    return Vocab(tuple(tokens), tuple(types), tuple(merges))
