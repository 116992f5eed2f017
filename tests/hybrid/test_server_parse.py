"""Qwen reasoning / tool-call text in and out of the server (hybrid/server/parse.py), without a model
run: the tiny bundled model does not write tool calls reliably, so its text format is fed directly."""
import json

import pytest

from hybrid.chat_template import ChatTemplate
from hybrid.server.parse import (OutputParser, parse_output, parse_tool_call, prepare_messages,
                                 prompt_opens_thinking, template_knows_tools)

QWEN3_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
QWEN35_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
               "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def streamed(text, **kw):
    """Feed text one character at a time: every tag is split across pushes."""
    p = OutputParser(**kw)
    deltas = [d for ch in text for d in p.push(ch)] + p.finish()
    return ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas),
            [d.tool_call for d in deltas if d.tool_call])


@pytest.mark.parametrize("call", [QWEN3_CALL, QWEN35_CALL])
def test_both_qwen_call_forms_parse_into_openai_tool_calls(call):
    reasoning, content, calls = parse_output("<think>\nneed weather\n</think>\n\n" + call)
    assert reasoning == "need weather" and content == ""
    assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}


@pytest.mark.parametrize("text", [
    "<think>\nplan\n</think>\n\nHello world",
    "Sure. " + QWEN3_CALL + "\n" + QWEN35_CALL,
    "no tags at all, a < b and c > d, <tool and <thin",
    "x <tool_call> {broken json</tool_call> y",
])
def test_streamed_character_by_character_equals_whole(text):
    whole = parse_output(text)
    r, c, calls = streamed(text)
    assert r.strip("\n") == whole[0]
    assert (c.strip() if calls else c) == whole[1]
    assert [x["function"] for x in calls] == [x["function"] for x in whole[2]]


def test_no_tag_text_passes_through_and_bad_calls_stay_content():
    assert parse_output("a < b and <tool") == ("", "a < b and <tool", [])
    assert parse_output("x <tool_call> {bad") == ("", "x <tool_call> {bad", [])
    assert parse_output("x <tool_call>{bad}</tool_call>")[1] == "x <tool_call>{bad}</tool_call>"
    assert parse_tool_call('{"arguments": {}}') is None
    # without tools in the request a call-shaped text is just content
    assert parse_output(QWEN3_CALL, tools=False) == ("", QWEN3_CALL, [])


def test_reasoning_when_the_prompt_opened_the_think_block():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert parse_output("step 1\nstep 2\n</think>\n\nAnswer", thinking=True) == ("step 1\nstep 2", "Answer", [])
    assert streamed("step 1\n</think>\n\nAnswer", thinking=True)[:2] == ("step 1\n", "Answer")
    # a second <think> after the first block closed is content
    assert parse_output("<think>a</think>b <think>c")[1] == "b <think>c"


def test_tool_round_trip_through_a_template_without_tools(trained_model_q4km):
    """The bundled template knows no tools: they go in as Qwen3's system block, past calls as
    <tool_call> text, results as <tool_response> in a user turn; the rendered call parses back."""
    import gguf
    reader = gguf.GGUFReader(trained_model_q4km)
    template = ChatTemplate.from_metadata({k: f.contents() for k, f in reader.fields.items()
                                           if k.startswith("tokenizer.")})
    assert not template_knows_tools(template.source)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
                {"role": "tool", "tool_call_id": "call_2", "content": "second result"}]
    text = template.render(prepare_messages(messages, TOOLS, native_tools=False), add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>\n<tool_response>\nsecond result\n" in text
    assistant = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    _, _, calls = parse_output(assistant)
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_that_renders_tools_gets_them_natively():
    source = ("{%- if tools %}TOOLS:{% for t in tools %}{{ t.function.name }}{% endfor %}\n{% endif %}"
              "{%- for m in messages %}<{{ m.role }}>{{ m.content }}"
              "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}"
              "{% for k, v in c.function.arguments|items %}[{{ k }}={{ v }}]{% endfor %}</tool_call>{% endfor %}"
              "{% endfor %}")
    assert template_knows_tools(source)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    msgs = prepare_messages([{"role": "developer", "content": "sys"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "c", "content": "ok"}], TOOLS, native_tools=True)
    out = ChatTemplate(source).render(msgs, add_generation_prompt=False, tools=TOOLS)
    assert out == "TOOLS:get_weather<system>sys<assistant><tool_call>f[x=1]</tool_call><tool>ok"


def test_malformed_messages_are_value_errors():
    for bad in ([{"content": "x"}], [{"role": "wizard", "content": "x"}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                [{"role": "user", "content": 5}]):
        with pytest.raises(ValueError):
            prepare_messages(bad, None, native_tools=False)
    assert prepare_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                            None, False) == [{"role": "user", "content": "ab"}]
