"""Qwen's reasoning and tool-call text, both ways.

Out of the model: `<think>…</think>` is reasoning, `<tool_call>…</tool_call>` a tool call, the
rest is content. Qwen3 writes a call as JSON ({"name": …, "arguments": {…}}); Qwen3.5 and
Qwen3-Coder as XML (<function=NAME><parameter=P>value</parameter></function>). Both parse into
OpenAI tool calls. `OutputParser` works on streamed text: it holds back a piece that could be
the start of a tag, so a tag split over tokens is never shown as content.

Into the model: OpenAI messages become what the chat templates expect (tool-call arguments as
objects, content never None). A template that knows nothing about tools (the bundled tiny
model's) gets them the way Qwen3's own template writes them: a system block listing the tools,
past calls as <tool_call> text, tool results as <tool_response> in a user turn.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class Delta:
    """A piece of parsed output: reasoning text, content text, or one finished tool call."""
    reasoning: str = ""
    content: str = ""
    tool_call: dict | None = None


def _new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_tool_call(body: str) -> dict | None:
    """One tool call's inner text (between <tool_call> and </tool_call>) as an OpenAI tool call,
    or None when it is neither Qwen form."""
    body = body.strip()
    if body.startswith("{"):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return {"id": _new_id(), "type": "function", "function": {"name": obj["name"], "arguments": args}}
    m = re.match(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", body, re.S)
    if not m:
        return None
    args = {}
    for p in re.finditer(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", m.group(2), re.S):
        value = p.group(2)
        try:         # the XML form writes numbers, booleans, arrays and objects as JSON
            args[p.group(1)] = json.loads(value)
        except json.JSONDecodeError:
            args[p.group(1)] = value
    return {"id": _new_id(), "type": "function",
            "function": {"name": m.group(1), "arguments": json.dumps(args, ensure_ascii=False)}}


def _partial_tag(text: str, tags) -> int:
    """Length of the longest tail of text that is a proper prefix of one of tags."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:n]):
                best = max(best, n)
                break
    return best


@dataclass
class OutputParser:
    """Splits streamed model text into reasoning, content and tool calls.

    thinking=True: the prompt already opened a <think> block (Qwen3.5's template does), so the
    text is reasoning until </think>. Otherwise a <think> at the very start opens one.
    tools=False leaves <tool_call> text as content (a request without tools).
    """
    thinking: bool = False
    tools: bool = True
    _buf: str = ""
    _mode: str = field(default="", init=False)          # "reasoning", "content", "call"
    _started: bool = field(default=False, init=False)   # any non-blank content seen
    _thought: bool = field(default=False, init=False)   # a think block was closed
    calls: list = field(default_factory=list, init=False)

    def __post_init__(self):
        self._mode = "reasoning" if self.thinking else "content"

    def push(self, text: str, final: bool = False) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        while self._buf:
            if self._mode == "reasoning":
                i = self._buf.find(THINK_CLOSE)
                if i >= 0:
                    out.append(Delta(reasoning=self._buf[:i]))
                    self._buf = self._buf[i + len(THINK_CLOSE):]
                    self._mode = "content"
                    self._thought = True      # content starts afresh: its leading blank lines go
                    self._started = False
                    continue
                keep = 0 if final else _partial_tag(self._buf, [THINK_CLOSE])
                out.append(Delta(reasoning=self._buf[:len(self._buf) - keep]))
                self._buf = self._buf[len(self._buf) - keep:]
                break
            if self._mode == "call":
                i = self._buf.find(CALL_CLOSE)
                if i < 0:
                    if final:      # an unfinished call is not a call: give the text back as content
                        out.append(Delta(content=CALL_OPEN + self._buf))
                        self._buf = ""
                    break
                body, self._buf = self._buf[:i], self._buf[i + len(CALL_CLOSE):]
                call = parse_tool_call(body)
                if call is None:
                    out.append(Delta(content=CALL_OPEN + body + CALL_CLOSE))
                else:
                    self.calls.append(call)
                    out.append(Delta(tool_call=call))
                self._mode = "content"
                continue
            # content
            if not self._started:
                stripped = self._buf.lstrip()
                if not self._thought and stripped.startswith(THINK_OPEN):
                    self._buf = stripped[len(THINK_OPEN):]
                    self._mode = "reasoning"
                    self._started = True
                    continue
                if not final and (not stripped or (not self._thought and THINK_OPEN.startswith(stripped))):
                    break     # blank so far, or could still become <think>
                self._buf = stripped
            tags = [CALL_OPEN] if self.tools else []
            i = self._buf.find(CALL_OPEN) if self.tools else -1
            if i >= 0:
                out.append(Delta(content=self._buf[:i]))
                self._buf = self._buf[i + len(CALL_OPEN):]
                self._mode = "call"
                self._started = True
                continue
            keep = 0 if final else _partial_tag(self._buf, tags)
            piece = self._buf[:len(self._buf) - keep]
            if piece:
                out.append(Delta(content=piece))
                self._started = self._started or bool(piece.strip())
            self._buf = self._buf[len(self._buf) - keep:]
            break
        return [d for d in out if d.reasoning or d.content or d.tool_call]

    def finish(self) -> list[Delta]:
        return self.push("", final=True)


def parse_output(text: str, thinking: bool = False, tools: bool = True) -> tuple[str, str, list[dict]]:
    """Whole-reply form: (reasoning, content, tool calls)."""
    p = OutputParser(thinking=thinking, tools=tools)
    deltas = p.push(text) + p.finish()
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    if p.calls:                  # text around calls is usually blank lines between them
        content = content.strip()
    return reasoning.strip("\n") if reasoning else "", content, p.calls


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether the rendered prompt ends inside an open <think> block."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


# --- into the template ------------------------------------------------------------------------
def template_knows_tools(source: str) -> bool:
    return "tools" in source and "tool_call" in source


def _arguments(args):
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args
    return args


def _text(content) -> str:
    """OpenAI content: a string, None, or a list of parts, of which text parts are kept."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise ValueError("only text content parts are supported")
        return "".join(parts)
    raise ValueError("message content must be a string, a list of text parts, or null")


def tools_system_block(tools: list) -> str:
    """Qwen3's own description of the tools (its template's text), for templates without one."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{lines}\n</tools>\n\nFor each function call, return a json object with function name and "
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _call_text(call: dict) -> str:
    fn = call.get("function", call)
    return CALL_OPEN + "\n" + json.dumps({"name": fn.get("name"), "arguments": _arguments(fn.get("arguments", {}))},
                                         ensure_ascii=False) + "\n" + CALL_CLOSE


def prepare_messages(messages: list, tools: list | None, native_tools: bool) -> list[dict]:
    """OpenAI chat messages as the template wants them (ValueError on a malformed one).

    native_tools: the template renders `tools`, `tool_calls` and `tool` messages itself; they
    only need arguments as objects (Qwen templates iterate them) and content never None.
    Otherwise tools and calls are written into the text as Qwen3's template would."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        role = m["role"]
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"messages[{i}] has an unknown role {role!r}")
        try:
            content = _text(m.get("content"))
        except ValueError as e:
            raise ValueError(f"messages[{i}]: {e}") from None
        calls = m.get("tool_calls") or []
        if not isinstance(calls, list):
            raise ValueError(f"messages[{i}].tool_calls must be a list")
        msg = {"role": role, "content": content}
        if role == "assistant" and isinstance(m.get("reasoning_content"), str) and m["reasoning_content"]:
            msg["reasoning_content"] = m["reasoning_content"]
        if native_tools:
            if calls:
                msg["tool_calls"] = [{**c, "function": {**c.get("function", {}),
                                                        "arguments": _arguments(c.get("function", {}).get("arguments", {}))}}
                                     for c in calls]
            if role == "tool" and m.get("tool_call_id") is not None:
                msg["tool_call_id"] = m["tool_call_id"]
            out.append(msg)
            continue
        if calls:
            msg["content"] = "\n".join(([content] if content else []) + [_call_text(c) for c in calls])
        if role == "tool":    # results of consecutive calls share one user turn, as in Qwen3's template
            block = "<tool_response>\n" + content + "\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
            continue
        out.append(msg)
    for msg in out:
        msg.pop("_tool", None)
    if tools and not native_tools:
        block = tools_system_block(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
