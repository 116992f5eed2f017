"""The HTTP layer's handling of tool calls and reasoning, with a scripted engine in place of the
model (the bundled tiny model does not write tool calls): the openai client must see OpenAI
tool_calls, streamed as deltas and whole, and finish_reason "tool_calls"."""
import json
from types import SimpleNamespace

import openai
import pytest
from starlette.testclient import TestClient

from hybrid.chat_template import ChatTemplate
from hybrid.events import Done, Stats, Token
from hybrid.server.app import Limits, build_app

REPLY = ['<th', 'ink>\nI should', ' call it.\n</thi', 'nk>\n\n', '<tool_', 'call>\n{"name": "get_weather", ',
         '"arguments": {"city": "Paris"}}\n</tool_call>', '\n<tool_call>\n<function=get_time>\n<parameter=tz>\n',
         'UTC\n</parameter>\n</function>\n</tool_call>']
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


class ScriptedEngine:
    """Emits REPLY's pieces as tokens, as the worker would, and records the prompts it got."""

    def __init__(self):
        self.pending, self.stats, self.prompts = 0, {}, []
        self.cache = []

    def submit(self, job):
        import asyncio
        job.loop, job.out = asyncio.get_running_loop(), asyncio.Queue()
        self.prompts.append(job.ids)
        stats = Stats(generated_tokens=len(REPLY), stop_reason="eog", cached_tokens=0)
        for i, piece in enumerate(REPLY):
            job.out.put_nowait(("token", Token(i, piece, stats)))
        job.out.put_nowait(("done", Done(stats)))
        return job


@pytest.fixture(scope="module")
def api():
    tok = SimpleNamespace(encode=lambda text, **kw: list(range(len(text))), token_to_id=lambda text: None)
    model = SimpleNamespace(chat_template=ChatTemplate(None), tokenizer=tok, n_ctx=100_000, path="m.gguf",
                            config=SimpleNamespace(n_vocab=1000), encode_chat_text=tok.encode,
                            sampler_options=lambda **given: {})
    engine = ScriptedEngine()
    app = build_app(model, engine, Limits(), "m.gguf")
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0), engine


def check_calls(calls):
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert json.loads(calls[1].function.arguments) == {"tz": "UTC"}
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)


def test_tool_calls_whole(api):
    client, _ = api
    r = client.chat.completions.create(model="m.gguf", messages=[{"role": "user", "content": "weather?"}], tools=TOOLS)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content is None and msg.reasoning_content == "I should call it."
    check_calls(msg.tool_calls)


def test_tool_calls_streamed_as_deltas(api):
    client, _ = api
    stream = client.chat.completions.create(model="m.gguf", messages=[{"role": "user", "content": "weather?"}],
                                            tools=TOOLS, stream=True)
    calls, reasoning, content, finish = {}, "", "", None
    for chunk in stream:
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                calls[d.index] = d
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and reasoning == "\nI should call it.\n" and content.strip() == ""
    check_calls([calls[i] for i in sorted(calls)])


def test_without_tools_the_call_text_is_content(api):
    client, _ = api
    r = client.chat.completions.create(model="m.gguf", messages=[{"role": "user", "content": "weather?"}])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert "<tool_call>" in r.choices[0].message.content


def test_tools_and_results_reach_the_prompt(api):
    """The fallback template gets the tool list and the fed-back result (its token count here is
    the rendered length: the fake tokenizer gives one id per character)."""
    client, engine = api
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model="m.gguf", messages=messages, tools=TOOLS)
    from hybrid.server.parse import prepare_messages
    text = ChatTemplate(None).render(prepare_messages(messages, TOOLS, False), add_generation_prompt=True)
    assert "<tool_response>\nsunny\n</tool_response>" in text and '"name": "get_time"' in text
    assert r.usage.prompt_tokens == len(text) == len(engine.prompts[-1])
