"""Chat prompt rendering from the GGUF's Jinja template (`tokenizer.chat_template`).

The environment copies what Hugging Face transformers gives templates (they are written against
it): a sandbox that cannot mutate its inputs, trim_blocks/lstrip_blocks, the loopcontrols
extension, `raise_exception`, `strftime_now` and a `tojson` filter that keeps non-ASCII text.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import HybridError, ModelError

# Used when the model file carries no template. All supported models are Qwen ChatML models; the
# empty think block for enable_thinking=false is what Qwen3.x's own templates emit.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['content'] is not string %}"
    "{{- raise_exception('the built-in ChatML template takes text content only') }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


class _TemplateRaised(jinja2.TemplateError):
    """The template called raise_exception(): its message is meant for the user."""


def _raise_exception(message: str):
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's built-in tojson escapes HTML characters and sorts keys; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template. `source=None` selects the built-in ChatML template."""

    def __init__(self, source: str | None = None, *, bos_token: str = "", eos_token: str = ""):
        self.is_fallback = source is None
        self.source = CHATML_TEMPLATE if source is None else source
        self.bos_token, self.eos_token = bos_token, eos_token
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise HybridError(f"the chat template does not parse: {e.message} (line {e.lineno})") from None

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> "ChatTemplate":
        """The model's own template (ChatML if it has none), with its BOS/EOS token texts."""
        tokens = meta.get("tokenizer.ggml.tokens")
        tokens = [] if tokens is None else tokens

        def token_text(key: str) -> str:
            tid = meta.get(key)
            return str(tokens[int(tid)]) if tid is not None and 0 <= int(tid) < len(tokens) else ""

        source = meta.get("tokenizer.chat_template") or None
        try:
            return cls(source, bos_token=token_text("tokenizer.ggml.bos_token_id"),
                       eos_token=token_text("tokenizer.ggml.eos_token_id"))
        except HybridError as e:
            raise ModelError(f"{e} (tokenizer.chat_template in the model file)") from None

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               enable_thinking: bool | None = None, **extra: Any) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]).

        enable_thinking=None leaves the variable undefined, so the template's own default holds.
        `extra` goes to the template as further variables (e.g. tools=[...]).
        """
        context = dict(extra)
        context.update(messages=_checked_messages(messages), add_generation_prompt=add_generation_prompt,
                       bos_token=self.bos_token, eos_token=self.eos_token)
        context.setdefault("tools", None)
        if enable_thinking is not None:
            context["enable_thinking"] = bool(enable_thinking)
        try:
            return self._template.render(**context)
        except _TemplateRaised as e:
            raise HybridError(f"the chat template rejected the conversation: {e.message}") from None
        except Exception as e:  # a template is code: any failure in it is a user-facing error
            raise HybridError(f"the chat template failed to render: {type(e).__name__}: {e}") from None


def _checked_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise HybridError("messages must be a list of {'role': ..., 'content': ...} objects")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise HybridError(f"message {i} must be an object with a string 'role'")
        if "content" not in message:
            raise HybridError(f"message {i} ({message['role']}) has no 'content'")
        checked.append(dict(message))
    return checked
