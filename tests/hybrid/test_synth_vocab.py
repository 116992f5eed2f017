"""The synthetic BPE vocabulary is valid, usable by an independent BPE (HF tokenizers), and ChatML renders."""
import jinja2
import pytest
from gguf import TokenType
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from hybrid.errors import HybridError
from hybrid.synth.vocab import CHATML_TEMPLATE, MIN_VOCAB, build_vocab

TEXT = "def forward(self, x):\n    return self.layer(x)  # the model's output, 42\n"


@pytest.mark.parametrize("n_vocab", [MIN_VOCAB, 384, 2048, 151936])
def test_vocab_is_consistent(n_vocab):
    v = build_vocab(n_vocab)
    assert len(v.tokens) == len(v.token_types) == n_vocab
    assert len(set(v.tokens)) == n_vocab                      # unique: one id per text
    ids = {t: i for i, t in enumerate(v.tokens)}
    for m in v.merges:
        left, right = m.split(" ")
        assert left in ids and right in ids and left + right in ids, m
        # a merge only uses tokens that exist before its result does (rank order)
        assert max(ids[left], ids[right]) < ids[left + right] or left + right in v.tokens[:256]
    assert v.tokens[v.eos_id] == "<|im_end|>" and v.tokens[v.padding_id] == "<|endoftext|>"
    assert v.token_types[v.id_of("<|im_start|>")] == TokenType.CONTROL
    assert v.token_types[v.id_of("<think>")] == TokenType.USER_DEFINED
    assert all(t == TokenType.NORMAL for t in v.token_types[:256])
    assert all(t == TokenType.UNUSED for tok, t in zip(v.tokens, v.token_types) if tok.startswith("[PAD"))


def test_vocab_is_deterministic_and_learns_merges():
    a, b = build_vocab(384), build_vocab.__wrapped__(384)
    assert a == b
    assert len(a.merges) >= 100 and "Ġ t" in a.merges


def test_too_small_vocab_is_refused():
    with pytest.raises(HybridError, match="too small"):
        build_vocab(MIN_VOCAB - 1)


def test_an_independent_bpe_round_trips_text_and_uses_the_merges():
    v = build_vocab(384)
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(v.tokens)},
                               [tuple(m.split(" ")) for m in v.merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    ids = tok.encode(TEXT).ids
    assert tok.decode(ids) == TEXT
    assert len(ids) < 0.6 * len(TEXT.encode())              # merges compress real text
    assert max(ids) < 384


def test_chatml_template_renders():
    t = jinja2.Environment().from_string(CHATML_TEMPLATE)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "<think>\nhm\n</think>\n\nhello"}, {"role": "user", "content": "bye"}]
    out = t.render(messages=msgs, add_generation_prompt=True)
    assert out == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                   "<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nbye<|im_end|>\n"
                   "<|im_start|>assistant\n")
    no_think = t.render(messages=msgs[:2], add_generation_prompt=True, enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
