"""`hybrid serve` end to end: real servers on 127.0.0.1 (free ports) with the bundled model, driven
by the official openai client and raw HTTP (httpx).

Two servers: `srv` keeps conversation states (the default); `ref` keeps none (--cache-mem 0), needs
an API key and lets one request wait at most, so it serves as the full-prefill reference and the
auth / queue-full cases. A pair more serves a tiny synthetic qwen35moe file (the MoE FFN and its
state) for the state-reuse and concurrency checks.
"""
import json
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

import hybrid

KEY = "test-key-34"
START_TIMEOUT = 600          # a cold Numba cache compiles the kernels first


class Server:
    def __init__(self, *args):
        self.proc = subprocess.Popen([sys.executable, "-c", "from hybrid.cli import main; main()", "serve",
                                      "--port", "0", "--threads", "1", *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        lines = queue.Queue()
        self.log = []

        def read():
            for line in self.proc.stderr:
                self.log.append(line)
                lines.put(line)
        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT
        self.url = None
        while self.url is None:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError("hybrid serve did not start:\n" + "".join(self.log))
            try:
                line = lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if "listening on http://" in line:
                self.url = line.split("listening on ")[1].split()[0]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


@pytest.fixture(scope="module")
def servers():
    started = []
    try:
        started.append(Server("--max-tokens", "3000", "--max-body", "256KiB", "--max-queue", "8"))
        started.append(Server("--cache-mem", "0", "--api-key", KEY, "--max-queue", "1", "--max-tokens", "512",
                              "--alias", "qwen"))
        yield started
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def srv(servers):
    return servers[0]


@pytest.fixture(scope="module")
def ref(servers):
    return servers[1]


def client(server, key="none"):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def model_id(server):
    # a server without --api-key ignores the header
    return httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer " + KEY},
                     timeout=30).json()["data"][0]["id"]


GREEDY = dict(temperature=0)


def chat(server, messages, key="none", **kw):
    return client(server, key).chat.completions.create(model=model_id(server), messages=messages, **kw)


def user(text):
    return [{"role": "user", "content": text}]


# --- basics ----------------------------------------------------------------------------------------
def test_health_and_models(srv, ref):
    assert httpx.get(srv.url + "/health", timeout=30).json() == {"status": "ok"}
    models = client(srv).models.list()
    assert [m.id for m in models.data] == ["tiny-qwen35-mtp-Q4_K_M.gguf"]
    assert [m.id for m in client(ref, KEY).models.list().data] == ["qwen"]          # --alias


def test_any_model_name_gets_the_one_model(srv, ref):
    """As llama-server with one model: a tool's configured name (here gpt-4o) is not refused;
    the response names the model that answered."""
    for server, key, name in ((srv, "none", "tiny-qwen35-mtp-Q4_K_M.gguf"), (ref, KEY, "qwen")):
        r = client(server, key).chat.completions.create(model="gpt-4o", messages=user("Hi"), max_tokens=2, **GREEDY)
        assert r.model == name and r.usage.completion_tokens == 2
        r = client(server, key).completions.create(model="gpt-4o", prompt="def", max_tokens=2, **GREEDY)
        assert r.model == name and r.usage.completion_tokens == 2


def test_chat_streamed_equals_not_streamed_with_usage(srv):
    whole = chat(srv, user("Write a Python function"), max_tokens=24, **GREEDY)
    msg = whole.choices[0].message
    assert whole.usage.completion_tokens <= 24 and whole.usage.prompt_tokens > 0
    assert whole.choices[0].finish_reason in ("stop", "length")
    stream = chat(srv, user("Write a Python function"), max_tokens=24, stream=True,
                  stream_options={"include_usage": True}, **GREEDY)
    content, reasoning, finish, usage = "", "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            content += c.delta.content or ""
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            finish = c.finish_reason or finish
    assert content == msg.content
    assert reasoning.strip("\n") == (getattr(msg, "reasoning_content", None) or "")
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_reasoning_is_split_from_content(srv):
    """The tiny model opens its replies with a think block: never in `content`."""
    r = chat(srv, user("Hi"), max_tokens=12, **GREEDY)
    raw = client(srv).completions.create(model=model_id(srv), max_tokens=12, temperature=0,
                                         prompt="<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert "<think>" in raw.choices[0].text            # the model does write one here
    assert "<think>" not in r.choices[0].message.content and "</think>" not in r.choices[0].message.content
    # enable_thinking=false: the template closes an empty think block itself, the prompt is longer
    off = chat(srv, user("Hi"), max_tokens=12, extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **GREEDY)
    assert off.usage.prompt_tokens > r.usage.prompt_tokens
    assert "<think>" not in off.choices[0].message.content


def test_max_tokens_and_finish_reason_length(srv):
    r = chat(srv, user("Count"), max_tokens=7, extra_body={"ignore_eos": True}, **GREEDY)
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"
    r = chat(srv, user("Count"), max_completion_tokens=5, extra_body={"ignore_eos": True}, **GREEDY)
    assert r.usage.completion_tokens == 5


def test_stop_strings(srv):
    c = client(srv)
    base = c.completions.create(model=model_id(srv), prompt="def fibonacci(n):", max_tokens=40, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    stop = base[12:16]
    assert stop.strip(), base
    cut = c.completions.create(model=model_id(srv), prompt="def fibonacci(n):", max_tokens=40, temperature=0,
                               stop=[stop, "never-appears"], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == base[:base.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_seeds_repeat_and_differ(srv):
    c = client(srv)

    def sample(seed):
        return c.completions.create(model=model_id(srv), prompt="def fibonacci(n):", max_tokens=32, temperature=1.5,
                                    top_p=1.0, seed=seed,
                                    extra_body={"ignore_eos": True, "top_k": 0, "min_p": 0.0}).choices[0].text
    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3, 4)}) > 1


def test_logprobs(srv):
    r = chat(srv, user("Hello"), max_tokens=6, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True}, **GREEDY)
    items = r.choices[0].logprobs.content
    assert len(items) == 6
    for it in items:
        assert len(it.top_logprobs) == 3
        assert it.logprob <= 0
        # greedy: the chosen token is the most likely one
        assert it.token == it.top_logprobs[0].token and it.logprob == pytest.approx(it.top_logprobs[0].logprob)
        assert it.top_logprobs[0].logprob >= it.top_logprobs[1].logprob >= it.top_logprobs[2].logprob
    # the same request without logprobs (drafting on) gives the same text
    plain = chat(srv, user("Hello"), max_tokens=6, extra_body={"ignore_eos": True}, **GREEDY)
    assert plain.choices[0].message.content == r.choices[0].message.content
    comp = client(srv).completions.create(model=model_id(srv), prompt="def add(a, b):", max_tokens=4, temperature=0,
                                          logprobs=2, extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == 4 == len(lp.token_logprobs) and all(len(t) == 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == comp.choices[0].text


def test_tool_messages_round_trip_through_the_template(srv):
    """A tool call and its result fed back render (usage counts exactly the rendered prompt) and
    generate; the reply parses (tool calls or text) without error."""
    from hybrid.chat_template import ChatTemplate
    from hybrid.model_file import default_model_path, open_model
    from hybrid.server.parse import prepare_messages
    from hybrid.tokenizer import Tokenizer
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                              "required": ["city"]}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = chat(srv, messages, tools=tools, max_tokens=16, **GREEDY)
    meta = open_model(default_model_path()).metadata
    text = ChatTemplate.from_metadata(meta).render(prepare_messages(messages, tools, False), add_generation_prompt=True)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text and "<tool_call>" in text
    assert r.usage.prompt_tokens == len(Tokenizer.from_metadata(meta).encode(text, add_special=False, parse_special=True))
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


# --- errors ------------------------------------------------------------------------------------------
def post(server, path, body, key=None, raw=None):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = "Bearer " + key
    return httpx.post(server.url + path, content=raw if raw is not None else json.dumps(body), headers=headers, timeout=60)


def check_error(r, status, *words):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and "Traceback" not in r.text
    for w in words:
        assert w in err["message"], err["message"]
    return err


def test_error_cases(srv):
    msgs = user("Hi")
    check_error(post(srv, "/v1/chat/completions", None, raw=b"{not json"), 400, "JSON")
    check_error(post(srv, "/v1/chat/completions", [1, 2]), 400, "object")
    check_error(post(srv, "/v1/chat/completions", {"messages": []}), 400, "messages")
    check_error(post(srv, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}), 400, "role")
    check_error(post(srv, "/v1/chat/completions", {"messages": msgs, "temperature": "hot"}), 400, "temperature")
    check_error(post(srv, "/v1/chat/completions", {"messages": msgs, "top_p": 3}), 400, "top_p")
    check_error(post(srv, "/v1/chat/completions", {"messages": msgs, "n": 2}), 400, "n")
    for fmt in ({"type": "xml"}, {"type": "json_schema"}, "json"):
        check_error(post(srv, "/v1/chat/completions", {"messages": msgs, "response_format": fmt}), 400, "json_schema")
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": 5}}}
    check_error(post(srv, "/v1/chat/completions", {"messages": msgs, "response_format": bad}), 400, "schema")
    assert post(srv, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1,
                                              "response_format": {"type": "text"}}).status_code == 200
    check_error(post(srv, "/v1/chat/completions", {"messages": msgs, "max_tokens": 5000}), 400, "5000", "3000")
    check_error(post(srv, "/v1/completions", {"prompt": [10**9]}), 400, "vocabulary")
    check_error(post(srv, "/v1/completions", {}), 400, "prompt")
    check_error(httpx.get(srv.url + "/v1/nothing", timeout=30), 404)
    # a prompt longer than the context: the message says both numbers
    long = "hello " * 5000
    err = check_error(post(srv, "/v1/completions", {"prompt": long, "max_tokens": 1}), 400, "4096", "tokens")
    assert err["code"] == "context_length_exceeded"
    # bodies over --max-body (256 KiB), announced or not
    check_error(post(srv, "/v1/completions", {"prompt": "x" * 300_000}), 413, "262144")
    with pytest.raises(openai.BadRequestError):
        client(srv).chat.completions.create(model=model_id(srv), messages=msgs, temperature=-1)


def test_logit_bias_and_llama_servers_samplers(srv):
    """OpenAI's logit_bias reaches the sampler (-100 bans the greedy first token, +100 forces
    another), llama-server's typical/XTC/DRY fields are taken, and bad values are a 400."""
    tok = hybrid.load(threads=1).tokenizer
    c = client(srv)

    def first(**extra):
        r = c.chat.completions.create(model=model_id(srv), messages=user("Write a Python function"), max_tokens=2,
                                      logprobs=True, **GREEDY, **extra)
        return r.choices[0].logprobs.content[0].token
    greedy = first()
    greedy_id = tok.encode(greedy, add_special=False, parse_special=True)
    assert len(greedy_id) == 1
    assert first(logit_bias={str(greedy_id[0]): -100}) != greedy
    forced = tok.encode(" banana", add_special=False)[-1]
    assert first(logit_bias={str(forced): 100}) == tok.decode([forced])
    assert first(extra_body={"typical_p": 0.9, "xtc_probability": 0.5, "dry_multiplier": 0.8,
                             "dry_sequence_breakers": ["\n"]}) == greedy   # greedy: XTC and typical-p never cut the top
    check_error(post(srv, "/v1/chat/completions", {"messages": user("Hi"), "dry_base": 0.5}), 400, "dry_base", "at least 1")
    check_error(post(srv, "/v1/chat/completions", {"messages": user("Hi"), "logit_bias": {"x": 1}}), 400, "token id")
    check_error(post(srv, "/v1/chat/completions", {"messages": user("Hi"), "logit_bias": {"5": 500}}), 400, "-100")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_response_format_json_schema(srv, stream):
    """A json_schema response_format constrains the reply (llguidance): the text parses and the
    schema's own checker (here by hand: types, enum, bounds, no extra keys) accepts it, from a
    model that would not write it unasked; json_object gives a JSON object."""
    schema = {"type": "object", "additionalProperties": False, "required": ["verdict", "score"],
              "properties": {"verdict": {"enum": ["approve", "reject"]},
                             "score": {"type": "integer", "minimum": 0, "maximum": 10}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "review", "schema": schema, "strict": True}}
    c = client(srv)
    msgs = user("Review this function: def add(a, b): return a - b")
    if stream:
        chunks = c.chat.completions.create(model=model_id(srv), messages=msgs, max_tokens=48, response_format=fmt,
                                           stream=True, **GREEDY)
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    else:
        r = c.chat.completions.create(model=model_id(srv), messages=msgs, max_tokens=48, response_format=fmt, **GREEDY)
        assert r.choices[0].finish_reason == "stop"
        text = r.choices[0].message.content
    reply = json.loads(text)
    assert set(reply) == {"verdict", "score"} and reply["verdict"] in ("approve", "reject")
    assert isinstance(reply["score"], int) and 0 <= reply["score"] <= 10
    plain = c.chat.completions.create(model=model_id(srv), messages=msgs, max_tokens=16, **GREEDY)
    assert not plain.choices[0].message.content.lstrip().startswith("{")       # it did not come unasked
    any_object = c.chat.completions.create(model=model_id(srv), messages=msgs, max_tokens=64, temperature=0.7, seed=3,
                                           response_format={"type": "json_object"})
    if any_object.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(any_object.choices[0].message.content), dict)
    else:                                                # cut by max_tokens: a JSON object's start
        assert any_object.choices[0].message.content.startswith("{")


def test_llama_servers_props_tokenize_detokenize(srv, ref):
    """llama-server's utility endpoints: /tokenize counts what a completion's prompt counts and
    /detokenize gives the text back; /props reports the context and the template; both need the
    key where the server has one."""
    text = "def add(a, b):\n    return a + b  # <|im_end|>"
    ids = post(srv, "/tokenize", {"content": text}).json()["tokens"]
    usage = client(srv).completions.create(model=model_id(srv), prompt=text, max_tokens=1, **GREEDY).usage
    assert len(ids) == usage.prompt_tokens
    assert post(srv, "/detokenize", {"tokens": ids}).json() == {"content": text}
    pieces = post(srv, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids and "".join(p["piece"] for p in pieces) == text
    plain = post(srv, "/tokenize", {"content": text, "parse_special": False}).json()["tokens"]
    assert len(plain) > len(ids)                     # <|im_end|> spelled out, not one control token
    props = httpx.get(srv.url + "/props", timeout=30).json()
    assert props["default_generation_settings"]["n_ctx"] == 4096 and props["total_slots"] == 1
    assert "im_start" in props["chat_template"]
    check_error(post(srv, "/tokenize", {"content": 5}), 400, "content")
    check_error(post(srv, "/detokenize", {"tokens": [10**9]}), 400, "token ids")
    check_error(post(ref, "/tokenize", {"content": "x"}), 401)


def test_api_key(ref):
    check_error(post(ref, "/v1/completions", {"prompt": "x", "max_tokens": 1}), 401, "API key")
    check_error(post(ref, "/v1/completions", {"prompt": "x", "max_tokens": 1}, key="wrong"), 401)
    assert post(ref, "/v1/completions", {"prompt": "x", "max_tokens": 1}, key=KEY).status_code == 200
    assert httpx.get(ref.url + "/health", timeout=30).status_code == 200      # probes need no key
    with pytest.raises(openai.AuthenticationError):
        client(ref, "wrong").models.list()


def test_queue_full_is_503(ref):
    """`ref` runs one request and lets one wait: of six at once, some are turned away at once."""
    def one(_):
        return post(ref, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 512, "ignore_eos": True,
                                             "temperature": 0}, key=KEY)
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(6)))
    codes = sorted(r.status_code for r in results)
    assert codes.count(200) >= 2 and 503 in codes, codes
    for r in results:
        if r.status_code == 503:
            check_error(r, 503, "busy")


# --- disconnects and concurrency ------------------------------------------------------------------
def stats(server):
    return httpx.get(server.url + "/stats", timeout=30).json()


def wait_idle(server, seconds=60):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        s = stats(server)
        if s["pending"] == 0:
            return s
        time.sleep(0.05)
    raise AssertionError(f"server still busy after {seconds} s: {s}")


def test_a_client_that_disconnects_cancels_its_generation(srv):
    wait_idle(srv)
    body = {"model": model_id(srv), "messages": user("Tell a long story"), "max_tokens": 3000,
            "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            n = 0
            for line in r.iter_lines():
                n += line.startswith("data: ")
                if n >= 4:
                    break
    s = wait_idle(srv)
    assert s["last"]["finish"] == "cancelled", s
    assert s["last"]["generated_tokens"] < 3000
    # not streamed: a client that gives up waiting cancels too
    body["stream"] = False
    with pytest.raises(httpx.TimeoutException):
        httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    s = wait_idle(srv)
    assert s["last"]["finish"] == "cancelled", s
    assert s["last"]["generated_tokens"] < 3000
    # the server goes on serving
    assert chat(srv, user("Hi"), max_tokens=3, **GREEDY).choices[0].finish_reason in ("stop", "length")


def test_concurrent_clients_get_their_sequential_outputs(srv):
    prompts = ["def fibonacci(n):", "class Stack:", "import os\n", "for i in range(10):", "# sort a list\n"]

    def run(p):
        return client(srv).completions.create(model=model_id(srv), prompt=p, max_tokens=24, temperature=0,
                                              extra_body={"ignore_eos": True}).choices[0].text
    sequential = [run(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        concurrent = list(pool.map(run, prompts))
    assert concurrent == sequential
    # streamed concurrently too
    def run_stream(p):
        s = client(srv).chat.completions.create(model=model_id(srv), messages=user(p), max_tokens=16, stream=True,
                                                **GREEDY)
        return "".join(c.choices[0].delta.content or "" for c in s if c.choices)
    alone = [chat(srv, user(p), max_tokens=16, **GREEDY).choices[0].message.content for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(run_stream, prompts)) == alone


# --- state reuse ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_servers(tmp_path_factory):
    """(cache on, cache off) servers of a tiny synthetic qwen35moe model with an MTP head."""
    from hybrid.synth import preset, write_model
    path = tmp_path_factory.mktemp("serve-moe") / "tiny-moe.gguf"
    write_model(path, preset("tiny", arch="qwen35moe", mtp=True), types="Q4_K_M", seed=3)
    started = []
    try:
        started.append(Server(str(path), "--max-tokens", "64"))
        started.append(Server(str(path), "--cache-mem", "0", "--api-key", KEY, "--max-tokens", "64"))
        yield started
    finally:
        for s in started:
            s.stop()


@pytest.mark.parametrize("model", ["bundled", "synthetic qwen35moe"])
def test_multi_turn_from_cached_states_equals_full_prefills(model, request):
    """Each turn on `srv` starts from the state kept after the previous one (cached_tokens > 0);
    `ref` keeps nothing and prefills every turn whole: greedy replies are identical."""
    srv, ref = (request.getfixturevalue("srv"), request.getfixturevalue("ref")) if model == "bundled" \
        else request.getfixturevalue("moe_servers")
    turns = ["Write a function that adds two numbers", "Now make it subtract", "Add a docstring", "Thanks!"]
    history_srv, history_ref = [], []
    cached = []
    for text in turns:
        history_srv.append({"role": "user", "content": text})
        history_ref.append({"role": "user", "content": text})
        a = chat(srv, history_srv, max_tokens=40, **GREEDY)
        b = chat(ref, history_ref, key=KEY, max_tokens=40, **GREEDY)
        assert a.choices[0].message.content == b.choices[0].message.content
        assert a.usage.prompt_tokens == b.usage.prompt_tokens
        assert b.usage.prompt_tokens_details.cached_tokens == 0
        cached.append(a.usage.prompt_tokens_details.cached_tokens)
        history_srv.append({"role": "assistant", "content": a.choices[0].message.content})
        history_ref.append({"role": "assistant", "content": b.choices[0].message.content})
    assert all(c > 0 for c in cached[1:]), cached


@pytest.mark.parametrize("logprobs", [False, True], ids=["drafting", "plain"])
def test_same_prompt_again_and_a_new_conversation_start_at_the_last_message(srv, ref, logprobs):
    """A chat prompt is snapshotted where its last message begins: the same request again (a
    regenerated reply) and a new conversation under the same system prompt prefill only their
    last message, and their greedy replies equal full prefills'. Log-probabilities make the
    server decode plainly (the MTP head's rows are then not filled)."""
    about = "pull requests" if logprobs else "bug reports"
    system = {"role": "system", "content": f"You review {about} for a small numerical library. " * 8}
    first = [system, {"role": "user", "content": "Write a function that reverses a list"}]
    other = [system, {"role": "user", "content": "Explain recursion briefly"}]
    kw = dict(max_tokens=16, logprobs=logprobs, **GREEDY)
    a = chat(srv, first, **kw)
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    again = chat(srv, first, **kw)
    assert stats(srv)["last"]["cached_from"] == "snapshot"
    b = chat(srv, other, **kw)
    kept = again.usage.prompt_tokens_details.cached_tokens
    assert 64 <= kept < again.usage.prompt_tokens - 5, kept      # the system block, not the user's message
    assert b.usage.prompt_tokens_details.cached_tokens == kept
    for mine, msgs in ((a, first), (again, first), (b, other)):
        full = chat(ref, msgs, key=KEY, **kw)
        assert full.usage.prompt_tokens_details.cached_tokens == 0
        assert mine.choices[0].message.content == full.choices[0].message.content


def test_completions_continue_from_the_previous_reply(srv, ref):
    """Raw completions: a prompt that extends the last prompt + reply starts from the state that
    ended the reply (more cached tokens than the prompt alone)."""
    c = client(srv)
    p1 = "def fibonacci(n):"
    r1 = c.completions.create(model=model_id(srv), prompt=p1, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    p2 = p1 + r1.choices[0].text + "\n\ndef main():"
    r2 = c.completions.create(model=model_id(srv), prompt=p2, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    assert r2.usage.prompt_tokens_details.cached_tokens > r1.usage.prompt_tokens
    assert stats(srv)["last"]["cached_from"] == "live"      # the state the reply left, not a copy
    # the same prompt again: the live state now holds more than it, a snapshot serves
    r3 = c.completions.create(model=model_id(srv), prompt=p2, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    last = stats(srv)["last"]
    assert last["cached_from"] == "snapshot" and r3.choices[0].text == r2.choices[0].text
    # where the request's time went: restoring the snapshot is counted before the first token
    assert 0 < last["restore_s"] and 0 <= last["queued_s"] and 0 < last["ttft_s"]
    full = client(ref, KEY).completions.create(model=model_id(ref), prompt=p2, max_tokens=20, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.choices[0].text == full.choices[0].text
