"""The OpenAI-compatible HTTP API (Starlette, served by uvicorn): /v1/models, /v1/chat/completions,
/v1/completions, /health.

Requests are checked and tokenized here, then queued to the `Engine`'s single worker; events come
back through an asyncio queue and go out as one JSON body or as server-sent events in OpenAI's
chunk format. Every error is OpenAI's error JSON with a fitting status, never a traceback.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
import uuid
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from .. import __version__
from ..errors import HybridError
from ..events import Done, Token
from ..grammar import Constraint, json_schema_grammar
from ..sampling import SamplerConfig
from .engine import Engine, Job, QueueFull
from .parse import OutputParser, prepare_messages, prompt_opens_thinking, template_knows_tools

log = logging.getLogger("hybrid.server")


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_response(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None):
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status)


@dataclass
class Limits:
    max_body: int = 1 << 20          # bytes of one request body
    max_tokens: int = 4096           # the most tokens one request may ask for (and its default)
    api_key: str | None = None


# --- request fields ------------------------------------------------------------------------------
def _number(body: dict, name: str, default, lo=None, hi=None, integer=False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not float(value).is_integer()):
        raise ApiError(400, f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}", param=name)
    if not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be finite", param=name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"between {lo} and {hi}" if lo is not None and hi is not None else \
            f"at least {lo}" if lo is not None else f"at most {hi}"
        raise ApiError(400, f"'{name}' must be {bounds}, got {value}", param=name)
    return int(value) if integer else float(value)


def _logit_bias(body: dict, n_vocab: int) -> dict[int, float] | None:
    """OpenAI's logit_bias: {token id (a string in JSON): bias from -100 to 100}, added to the
    token's logit (-100 all but bans it)."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict) or len(bias) > 1024:
        raise ApiError(400, "'logit_bias' must be an object of at most 1024 {token id: bias} entries",
                       param="logit_bias")
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < n_vocab):
            raise ApiError(400, f"'logit_bias' key {key!r} is not a token id (0 to {n_vocab - 1})", param="logit_bias")
        out[int(key)] = _number({"logit_bias": value}, "logit_bias", 0.0, -100, 100)
    return out


# name: (lowest, highest, integer), checked here; SamplerConfig checks the rest
SAMPLER_NUMBERS = {"typical_p": (0, 1, False), "xtc_probability": (0, 1, False), "xtc_threshold": (0, 1, False),
                   "dry_multiplier": (0, None, False), "dry_base": (1, None, False),
                   "dry_allowed_length": (0, None, True), "dry_penalty_last_n": (-1, None, True)}


def _strings(body: dict, name: str) -> list[str] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise ApiError(400, f"'{name}' must be a list of non-empty strings", param=name)
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise ApiError(400, "'stop' must be a non-empty string or a list of at most 16 of them", param="stop")
    return stop


class Server:
    def __init__(self, model, engine: Engine, limits: Limits, model_id: str):
        self.model, self.engine, self.limits = model, engine, limits
        self.model_id = model_id        # what /v1/models lists and every response carries
        # ChatML's message opener, in every supported model's template: where the last message
        # begins is where a chat prompt's boundary snapshot goes (server.engine)
        self.message_start = model.tokenizer.token_to_id("<|im_start|>")
        self.created = int(time.time())
        self.native_tools = template_knows_tools(model.chat_template.source)

    # --- plumbing ---------------------------------------------------------------------------------
    async def read_json(self, request: Request) -> dict:
        limit = self.limits.max_body
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise ApiError(413, f"the request body has {length} bytes; this server takes at most {limit}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError(413, f"the request body is over {limit} bytes, the most this server takes")
        try:
            data = json.loads(bytes(body) or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return data

    def job(self, body: dict, ids: list[int], logprobs: int | None, boundary: int = 0,
            constraint: Constraint | None = None) -> Job:
        n_ctx = self.model.n_ctx
        if not ids:
            raise ApiError(400, "the prompt is empty")
        if len(ids) >= n_ctx:
            raise ApiError(400, f"the prompt has {len(ids)} tokens, more than the context of {n_ctx} holds "
                                f"(at most {n_ctx - 1} with room for one generated token)", code="context_length_exceeded")
        limit = self.limits.max_tokens
        max_tokens = body.get("max_completion_tokens")
        max_tokens = body.get("max_tokens") if max_tokens is None else max_tokens
        max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", limit, 0, None, integer=True)
        if max_tokens > limit:
            raise ApiError(400, f"max_tokens is {max_tokens}; this server generates at most {limit} per request",
                           param="max_tokens")
        if _number(body, "n", 1, 1, 1, integer=True) != 1:
            raise ApiError(400, "'n' must be 1", param="n")
        seed = _number(body, "seed", -1, -1, 2**63 - 1, integer=True)
        seed = None if seed == -1 else seed          # -1: random, as llama-server takes it
        sampling = dict(temperature=_number(body, "temperature", 0.8, 0, 2),
                        top_p=_number(body, "top_p", 0.95, 0, 1),
                        top_k=_number(body, "top_k", 40, 0, None, integer=True),
                        min_p=_number(body, "min_p", 0.05, 0, 1),
                        presence_penalty=_number(body, "presence_penalty", 0.0, -2, 2),
                        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2, 2),
                        repeat_penalty=_number(body, "repeat_penalty", 1.0, 0.01, 10),
                        repeat_last_n=_number(body, "repeat_last_n", 64, -1, None, integer=True),
                        seed=seed, **self.model.sampler_options(**self.sampler_options(body)))
        try:                 # the sampler's own checks, now: as a 400, not inside a started stream
            SamplerConfig(**sampling)
        except HybridError as e:
            raise ApiError(400, str(e)) from None
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise ApiError(400, "'ignore_eos' must be true or false", param="ignore_eos")
        return Job(ids=ids, sampling=sampling, max_tokens=max_tokens, stop=_stop(body),
                   ignore_eos=ignore_eos, logprobs=logprobs, boundary=boundary, constraint=constraint)

    def response_constraint(self, fmt) -> Constraint | None:
        """The grammar a chat's response_format asks for, compiled: OpenAI's json_schema ({"type":
        "json_schema", "json_schema": {"schema": …}}), json_object (any object, or llama-server's
        {"type": "json_object", "schema": …}); None for text."""
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            schema = fmt.get("schema")
        elif kind == "json_schema" and isinstance(fmt.get("json_schema"), dict) and "schema" in fmt["json_schema"]:
            schema = fmt["json_schema"]["schema"]
        else:
            raise ApiError(400, "response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                                "{\"type\": \"json_schema\", \"json_schema\": {\"schema\": {…}}}",
                           param="response_format")
        if schema is not None and not isinstance(schema, dict):
            raise ApiError(400, "the response_format schema must be a JSON object", param="response_format")
        try:
            return Constraint(self.model.tokenizer, json_schema_grammar(schema))
        except HybridError as e:
            raise ApiError(400, f"response_format's schema: {e}", param="response_format") from None

    def sampler_options(self, body: dict) -> dict:
        """llama-server's other samplers, by its names, and OpenAI's logit_bias: what the body
        gives (the model's `sampler_options` holds the defaults)."""
        options = {name: _number(body, name, None, lo, hi, integer)
                   for name, (lo, hi, integer) in SAMPLER_NUMBERS.items()}
        options["dry_sequence_breakers"] = _strings(body, "dry_sequence_breakers")
        options["logit_bias"] = _logit_bias(body, self.model.config.n_vocab)
        return {k: v for k, v in options.items() if v is not None}

    def last_message_start(self, ids: list[int]) -> int:
        """Where a rendered chat's last message begins: its second-to-last message opener (the
        last one opens the reply); 0 if it has fewer than two."""
        opens = [i for i, t in enumerate(ids) if t == self.message_start] if self.message_start is not None else []
        return opens[-2] if len(opens) >= 2 else 0

    def submit(self, job: Job) -> Job:
        try:
            return self.engine.submit(job)
        except QueueFull as e:
            raise ApiError(503, str(e), type_="server_error", code="queue_full") from None

    async def events(self, job: Job, request: Request | None):
        """The job's events as they come; for a non-streamed request, polls the connection so a
        client that hung up cancels its job."""
        last_check = time.monotonic()
        try:
            while True:
                try:
                    item = await asyncio.wait_for(job.out.get(), 0.25)
                except asyncio.TimeoutError:
                    item = None
                if request is not None and time.monotonic() - last_check > 0.25:
                    last_check = time.monotonic()
                    if await request.is_disconnected():
                        return
                if item is None:
                    continue
                if item[0] == "error":
                    raise ApiError(item[1], item[2], type_="server_error" if item[1] >= 500 else "invalid_request_error")
                yield item[1]
                if item[0] == "done":
                    return
        finally:
            job.cancel()         # no effect once the job is done; stops it when the client went away

    def token_logprob(self, ev: Token, chat: bool):
        tok = self.model.tokenizer

        def piece(i):
            b = tok.token_bytes(i)
            return b.decode("utf-8", errors="replace"), list(b)
        lp, top = ev.logprobs
        text, raw = piece(ev.id)
        alts = []
        for i, v in top:
            t, b = piece(i)
            alts.append({"token": t, "logprob": v, "bytes": b})
        return {"token": text, "logprob": lp, "bytes": raw, "top_logprobs": alts}

    @staticmethod
    def finish_reason(stats, tool_calls: bool) -> str:
        if tool_calls:
            return "tool_calls"
        return "length" if stats.stop_reason in ("length", "context") else "stop"

    @staticmethod
    def usage(stats, job: Job) -> dict:
        return {"prompt_tokens": len(job.ids), "completion_tokens": stats.generated_tokens,
                "total_tokens": len(job.ids) + stats.generated_tokens,
                "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}}

    # --- endpoints ----------------------------------------------------------------------------------
    async def health(self, request: Request):
        return JSONResponse({"status": "ok"})

    async def stats(self, request: Request):
        e = self.engine
        return JSONResponse({"pending": e.pending, "cache_entries": len(e.cache), "cache_bytes": e.cache.bytes,
                             **e.stats})

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "hybrid",
             "meta": {"n_ctx": self.model.n_ctx, "path": str(self.model.path)}}]})

    async def props(self, request: Request):
        """llama-server's /props, the fields front-ends read: the context, slots, template."""
        return JSONResponse({"default_generation_settings": {"n_ctx": self.model.n_ctx}, "total_slots": 1,
                             "model_path": str(self.model.path), "model_alias": self.model_id,
                             "chat_template": self.model.chat_template.source,
                             "modalities": {"vision": False, "audio": False}, "build_info": f"hybrid {__version__}"})

    async def tokenize(self, request: Request):
        """llama-server's /tokenize: {"content", "add_special" (false), "parse_special" (true),
        "with_pieces" (false)} → {"tokens": ids, or [{"id", "piece"}]}."""
        body = await self.read_json(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise ApiError(400, "'content' must be a string", param="content")
        flags = {name: body.get(name, default) for name, default in
                 (("add_special", False), ("parse_special", True), ("with_pieces", False))}
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise ApiError(400, f"'{name}' must be true or false", param=name)
        tok = self.model.tokenizer
        try:
            ids = tok.encode(content, add_special=flags["add_special"], parse_special=flags["parse_special"])
        except HybridError as e:
            raise ApiError(400, str(e), param="content") from None
        if flags["with_pieces"]:
            return JSONResponse({"tokens": [{"id": i, "piece": tok.decode([i])} for i in ids]})
        return JSONResponse({"tokens": ids})

    async def detokenize(self, request: Request):
        """llama-server's /detokenize: {"tokens": ids} → {"content": text}."""
        body = await self.read_json(request)
        ids = body.get("tokens")
        n_vocab = self.model.tokenizer.n_vocab
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_vocab
                                                for i in ids):
            raise ApiError(400, f"'tokens' must be a list of token ids (0 to {n_vocab - 1})", param="tokens")
        return JSONResponse({"content": self.model.tokenizer.decode(ids)})

    async def chat(self, request: Request):
        body = await self.read_json(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list", param="messages")
        constraint = self.response_constraint(body.get("response_format"))
        tools = body.get("tools") or None
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise ApiError(400, "'tools' must be a list of objects", param="tools")
        if body.get("tool_choice") == "none":
            tools = None
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ApiError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs")
        thinking = kwargs.get("enable_thinking")
        if thinking is not None and not isinstance(thinking, bool):
            raise ApiError(400, "'enable_thinking' must be true or false", param="chat_template_kwargs")
        if constraint is not None:      # the grammar holds from the reply's first token: no thinking first
            if thinking:
                raise ApiError(400, "a response_format grammar needs enable_thinking false", param="response_format")
            thinking = False
        try:
            msgs = prepare_messages(messages, tools, self.native_tools)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        extra = {k: v for k, v in kwargs.items() if k != "enable_thinking"}
        if self.native_tools and tools:
            extra["tools"] = tools
        try:
            text = self.model.chat_template.render(msgs, add_generation_prompt=True, enable_thinking=thinking, **extra)
        except HybridError as e:
            raise ApiError(400, str(e), param="messages") from None
        ids = self.model.encode_chat_text(text)
        logprobs = body.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise ApiError(400, "'logprobs' must be true or false", param="logprobs")
        top = _number(body, "top_logprobs", 0, 0, 20, integer=True)
        job = self.submit(self.job(body, ids, top if logprobs else None, self.last_message_start(ids), constraint))
        parser = OutputParser(thinking=prompt_opens_thinking(text), tools=bool(tools))
        cid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
        if body.get("stream"):
            opts = body.get("stream_options") or {}
            include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
            return self.stream(request, job, self.chat_chunks(job, parser, cid, created, include_usage, request))
        reasoning, content, lps, stats = [], [], [], None
        async for ev in self.events(job, request):
            if isinstance(ev, Token) and ev.logprobs is not None:
                lps.append(self.token_logprob(ev, True))
            deltas = parser.push(ev.text) if isinstance(ev, Token) else parser.push(ev.text) + parser.finish()
            for d in deltas:
                reasoning.append(d.reasoning)
                content.append(d.content)
            if isinstance(ev, Done):
                stats = ev.stats
        if stats is None:
            return error_response(499, "the client closed the request")
        message = {"role": "assistant", "content": "".join(content).strip() if parser.calls else "".join(content)}
        if "".join(reasoning).strip():
            message["reasoning_content"] = "".join(reasoning).strip("\n")
        if parser.calls:
            message["tool_calls"] = parser.calls
            message["content"] = message["content"] or None
        return JSONResponse({
            "id": cid, "object": "chat.completion", "created": created, "model": self.model_id,
            "choices": [{"index": 0, "message": message, "finish_reason": self.finish_reason(stats, bool(parser.calls)),
                         "logprobs": {"content": lps} if logprobs else None}],
            "usage": self.usage(stats, job)})

    async def chat_chunks(self, job, parser, cid, created, include_usage, request):
        def chunk(delta, finish=None, logprobs=None):
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_id,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}
        n_calls, first = 0, True
        async for ev in self.events(job, None):
            if first:     # sent with the first token, not before: its arrival is the time to first token
                yield chunk({"role": "assistant", "content": ""})
                first = False
            deltas = parser.push(ev.text) if isinstance(ev, Token) else parser.push(ev.text) + parser.finish()
            lp = {"content": [self.token_logprob(ev, True)]} if isinstance(ev, Token) and ev.logprobs is not None else None
            for d in deltas:
                if d.reasoning:
                    yield chunk({"reasoning_content": d.reasoning}, logprobs=lp)
                elif d.content:
                    yield chunk({"content": d.content}, logprobs=lp)
                else:
                    call = d.tool_call
                    yield chunk({"tool_calls": [{"index": n_calls, "id": call["id"], "type": "function",
                                                 "function": call["function"]}]}, logprobs=lp)
                    n_calls += 1
                lp = None
            if lp is not None:      # a token whose text is held back still has its log-probability
                yield chunk({}, logprobs=lp)
            if isinstance(ev, Done):
                yield chunk({}, self.finish_reason(ev.stats, n_calls > 0))
                if include_usage:
                    yield {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_id,
                           "choices": [], "usage": self.usage(ev.stats, job)}

    def stream(self, request, job, chunks):
        async def sse():
            try:
                async for c in chunks:
                    yield "data: " + json.dumps(c, ensure_ascii=False) + "\n\n"
            except ApiError as e:     # the status line is gone: the error goes in the stream
                yield "data: " + json.dumps({"error": {"message": e.message, "type": e.type, "code": e.code}}) + "\n\n"
            except Exception:
                log.exception("stream failed")
                yield "data: " + json.dumps({"error": {"message": "internal error", "type": "server_error"}}) + "\n\n"
            finally:
                job.cancel()
            yield "data: [DONE]\n\n"
        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def completions(self, request: Request):
        body = await self.read_json(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.model.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = [int(t) for t in prompt]
            n_vocab = self.model.config.n_vocab
            bad = [t for t in ids if not 0 <= t < n_vocab]
            if bad:
                raise ApiError(400, f"token id {bad[0]} is outside the vocabulary of {n_vocab}", param="prompt")
        else:
            raise ApiError(400, "'prompt' must be a string or a non-empty list of token ids (one prompt per request)",
                           param="prompt")
        if body.get("echo"):
            raise ApiError(400, "'echo' is not supported", param="echo")
        if body.get("suffix"):
            raise ApiError(400, "'suffix' is not supported", param="suffix")
        k = body.get("logprobs")
        k = None if k is None else _number(body, "logprobs", 0, 0, 20, integer=True)
        job = self.submit(self.job(body, ids, k))
        cid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())

        def lp_block(evs):
            items = [self.token_logprob(ev, False) for ev in evs]
            return {"tokens": [i["token"] for i in items], "token_logprobs": [i["logprob"] for i in items],
                    "top_logprobs": [{a["token"]: a["logprob"] for a in i["top_logprobs"]} for i in items],
                    "text_offset": []}
        if body.get("stream"):
            opts = body.get("stream_options") or {}
            include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))

            async def chunks():
                def chunk(text, finish=None, lp=None):
                    return {"id": cid, "object": "text_completion", "created": created, "model": self.model_id,
                            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": lp}]}
                async for ev in self.events(job, None):
                    if isinstance(ev, Token):
                        yield chunk(ev.text, lp=lp_block([ev]) if ev.logprobs is not None else None)
                    else:
                        yield chunk(ev.text, self.finish_reason(ev.stats, False))
                        if include_usage:
                            yield {"id": cid, "object": "text_completion", "created": created, "model": self.model_id,
                                   "choices": [], "usage": self.usage(ev.stats, job)}
            return self.stream(request, job, chunks())
        text, toks, stats = [], [], None
        async for ev in self.events(job, request):
            text.append(ev.text)
            if isinstance(ev, Token) and ev.logprobs is not None:
                toks.append(ev)
            if isinstance(ev, Done):
                stats = ev.stats
        if stats is None:
            return error_response(499, "the client closed the request")
        return JSONResponse({
            "id": cid, "object": "text_completion", "created": created, "model": self.model_id,
            "choices": [{"index": 0, "text": "".join(text), "finish_reason": self.finish_reason(stats, False),
                         "logprobs": lp_block(toks) if k is not None else None}],
            "usage": self.usage(stats, job)})


def build_app(model, engine: Engine, limits: Limits, model_id: str) -> Starlette:
    """The API of one loaded model. A request's 'model' is not checked, as llama-server's in its
    single-model mode: clients configured with any name (a tool's default, an old alias) get the
    model there is, and responses say which (model_id)."""
    server = Server(model, engine, limits, model_id)

    async def on_api_error(request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    async def on_http(request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind)

    async def on_any(request, exc: Exception):
        log.exception("request failed")
        return error_response(500, f"internal error: {type(exc).__name__}", "server_error")

    routes = [Route("/health", server.health), Route("/stats", server.stats),
              Route("/v1/models", server.models), Route("/models", server.models),
              Route("/v1/chat/completions", server.chat, methods=["POST"]),
              Route("/chat/completions", server.chat, methods=["POST"]),
              Route("/v1/completions", server.completions, methods=["POST"]),
              Route("/completions", server.completions, methods=["POST"]),
              Route("/props", server.props),
              Route("/tokenize", server.tokenize, methods=["POST"]),
              Route("/detokenize", server.detokenize, methods=["POST"])]
    app = Starlette(routes=routes, exception_handlers={ApiError: on_api_error, HTTPException: on_http,
                                                       Exception: on_any})

    if limits.api_key:
        expected = ("Bearer " + limits.api_key).encode()

        class Auth:
            """Bearer key on everything but /health (a load balancer's probe carries no key)."""

            def __init__(self, app):
                self.app = app

            async def __call__(self, scope, receive, send):
                if scope["type"] == "http" and scope["path"] != "/health":
                    got = dict(scope["headers"]).get(b"authorization", b"")
                    if not secrets.compare_digest(got, expected):
                        resp = error_response(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                                              "authentication_error", code="invalid_api_key")
                        return await resp(scope, receive, send)
                return await self.app(scope, receive, send)
        app.add_middleware(Auth)
    return app
