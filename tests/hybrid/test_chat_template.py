"""Chat template rendering: the trained model's own template, the ChatML fallback, the HF-like env."""
from __future__ import annotations

import gguf
import pytest

from hybrid.chat_template import ChatTemplate
from hybrid.errors import HybridError, ModelError

CONVERSATION = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "Sort a list."}]
EXPECTED_CHATML = ("<|im_start|>system\nYou write Python.<|im_end|>\n"
                   "<|im_start|>user\nSort a list.<|im_end|>\n"
                   "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def meta(trained_model_q4km):
    reader = gguf.GGUFReader(trained_model_q4km)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def test_trained_models_template_renders_chatml(meta):
    template = ChatTemplate.from_metadata(meta)
    assert not template.is_fallback
    assert template.render(CONVERSATION) == EXPECTED_CHATML
    assert template.render(CONVERSATION, add_generation_prompt=False) == \
        EXPECTED_CHATML.removesuffix("<|im_start|>assistant\n")


def test_enable_thinking_is_passed_through(meta):
    template = ChatTemplate.from_metadata(meta)
    assert template.render(CONVERSATION, enable_thinking=False) == \
        EXPECTED_CHATML + "<think>\n\n</think>\n\n"
    assert template.render(CONVERSATION, enable_thinking=True) == EXPECTED_CHATML


def test_earlier_reasoning_is_dropped_by_the_models_template(meta):
    history = CONVERSATION + [{"role": "assistant", "content": "<think>\nhmm\n</think>\n\nsorted(xs)"},
                              {"role": "user", "content": "Thanks"}]
    out = ChatTemplate.from_metadata(meta).render(history)
    assert "<|im_start|>assistant\nsorted(xs)<|im_end|>\n" in out and "hmm" not in out


def test_fallback_chatml_when_the_file_has_none(meta):
    no_template = {k: v for k, v in meta.items() if k != "tokenizer.chat_template"}
    template = ChatTemplate.from_metadata(no_template)
    assert template.is_fallback
    assert template.render(CONVERSATION) == EXPECTED_CHATML
    assert template.render(CONVERSATION, enable_thinking=False).endswith("<think>\n\n</think>\n\n")


def test_bos_and_eos_token_texts_reach_the_template(meta):
    meta = {**meta, "tokenizer.chat_template": "{{ bos_token }}|{{ eos_token }}"}
    assert ChatTemplate.from_metadata(meta).render([]) == "|<|im_end|>"  # no BOS in this model


def test_hf_environment_features():
    template = ChatTemplate(
        "  {% for m in messages %}\n"
        "{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m | tojson }}\n"
        "  {% endfor %}\n"
        "{{ strftime_now('%Y') | length }}")
    # trim_blocks/lstrip_blocks remove the block lines; tojson keeps non-ASCII and key order
    assert template.render([{"role": "user", "content": "café"}, {"role": "x", "content": "y"}]) == \
        '{"role": "user", "content": "café"}\n4'


def test_raise_exception_becomes_a_user_error():
    template = ChatTemplate("{{ raise_exception('System role not supported') }}")
    with pytest.raises(HybridError, match="rejected the conversation: System role not supported"):
        template.render(CONVERSATION)


def test_sandbox_refuses_mutation():
    template = ChatTemplate("{{ messages.append(1) }}")
    with pytest.raises(HybridError, match="failed to render"):
        template.render(CONVERSATION)


def test_syntax_error_is_a_model_error(meta):
    with pytest.raises(ModelError, match="does not parse.*chat_template"):
        ChatTemplate.from_metadata({**meta, "tokenizer.chat_template": "{% for m in messages %}"})


def test_bad_messages_are_refused():
    template = ChatTemplate()
    with pytest.raises(HybridError, match="role"):
        template.render([{"content": "no role"}])
    with pytest.raises(HybridError, match="list"):
        template.render("hello")
    with pytest.raises(HybridError, match="text content only"):
        template.render([{"role": "user", "content": None}])
