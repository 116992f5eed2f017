"""Chat prompt rendering from the GGUF's Jinja template (`tokenizer.chat_template`).

The environment copies what Hugging Face transformers gives templates (they are written against
it): a sandbox that cannot mutate its inputs, trim_blocks/lstrip_blocks, the loopcontrols
extension, `raise_exception`, `strftime_now` and a `tojson` filter that keeps non-ASCII text.

A template comes from the model file, so it is untrusted code. Jinja's sandbox stops it reaching
Python internals and caps each `range()`, but not the total: two nested ranges are 10^10 steps.
Rendering therefore runs on a budget (`_Budget`): every range element, call, filter and
intercepted operator costs a step; strings and lists a template builds or outputs are capped in
size; and a wall-clock deadline (checked at every step, and enforced by SIGALRM when rendering
on the main thread, which also stops loops that make no calls) ends the rest.
"""
from __future__ import annotations

import json
import signal
import threading
import time
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

from .errors import HybridError, ModelError
from .metadata import Meta, safe_text

# Far above what any real chat template needs for a long conversation (a few thousand steps
# per message), far below what a hostile one would need to hang or exhaust memory.
MAX_RENDER_STEPS = 5_000_000
MAX_RENDER_CHARS = 16 << 20        # characters of prompt text, or of one built string or list
MAX_RENDER_SECONDS = 5.0

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


class _TooMuchWork(Exception):
    """The template went over its rendering budget."""


class _Budget:
    """Steps and a deadline for one render; `charge` raises _TooMuchWork once either is spent."""

    def __init__(self) -> None:
        self.steps = MAX_RENDER_STEPS
        self.deadline = time.monotonic() + MAX_RENDER_SECONDS

    def charge(self, n: int = 1) -> None:
        self.steps -= n
        if self.steps < 0:
            raise _TooMuchWork(f"more than {MAX_RENDER_STEPS:,} steps")
        if time.monotonic() > self.deadline:
            raise _TooMuchWork(f"more than {MAX_RENDER_SECONDS:g} s")


_active = threading.local()     # the budget of the render running on this thread


def _charge(n: int = 1) -> None:
    budget = getattr(_active, "budget", None)
    if budget is not None:
        budget.charge(n)


def _check_size(value: Any) -> Any:
    if isinstance(value, (str, list, tuple)) and len(value) > MAX_RENDER_CHARS:
        raise _TooMuchWork(f"a value of more than {MAX_RENDER_CHARS:,} entries")
    return value


def _check_args(args: tuple, kwargs: dict) -> None:
    # A huge width or count argument ('x'.center(10**9), 'x'|indent(10**9)) would allocate
    # before any result could be checked.
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and abs(a) > MAX_RENDER_CHARS:
            raise _TooMuchWork(f"an argument of {a:,}")


class _CountedRange:
    """`range()` for templates: jinja's safe_range (each range capped), iterated at a cost of
    one step per element; length, indexing and membership as a range."""

    def __init__(self, *args: int):
        self._range = safe_range(*args)

    def __iter__(self):
        for i in self._range:
            _charge()
            yield i

    def __reversed__(self):
        for i in reversed(self._range):
            _charge()
            yield i

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index):
        item = self._range[index]
        return _CountedRange(item.start, item.stop, item.step) if isinstance(item, range) else item

    def __contains__(self, value) -> bool:
        return value in self._range

    def __repr__(self) -> str:
        return repr(self._range)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` whose attributes cannot grow without bound (`ns.s = ns.s ~ ns.s` in a loop)."""

    def __setitem__(self, name: str, value: Any) -> None:
        _charge()
        super().__setitem__(name, _check_size(value))


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        _charge()
        _check_args(args, kwargs)
        return _check_size(super().call(__context, __obj, *args, **kwargs))

    def call_filter(self, name, value, args=None, kwargs=None, context=None, eval_ctx=None):
        _charge()
        _check_args(tuple(args or ()), dict(kwargs or {}))
        return _check_size(super().call_filter(name, value, args, kwargs, context, eval_ctx))

    def call_binop(self, context, operator, left, right):
        _charge()
        if operator == "*" and isinstance(left, int) and isinstance(right, (str, list, tuple)):
            left, right = right, left
        if operator == "*" and isinstance(left, (str, list, tuple)) and isinstance(right, int) \
                and len(left) * right > MAX_RENDER_CHARS:
            raise _TooMuchWork(f"a repetition of more than {MAX_RENDER_CHARS:,} entries")
        if operator == "**" and isinstance(left, int) and isinstance(right, int) \
                and max(abs(left), 2).bit_length() * right > 1 << 16:
            raise _TooMuchWork(f"a power of {right:,}")
        return _check_size(super().call_binop(context, operator, left, right))


def _environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = _CountedRange
    env.globals["namespace"] = _Namespace
    return env


def _alarm(signum, frame):
    raise _TooMuchWork(f"more than {MAX_RENDER_SECONDS:g} s")


class ChatTemplate:
    """A compiled chat template. `source=None` selects the built-in ChatML template."""

    def __init__(self, source: str | None = None, *, bos_token: str = "", eos_token: str = ""):
        self.is_fallback = source is None
        self.source = CHATML_TEMPLATE if source is None else source
        self.bos_token, self.eos_token = bos_token, eos_token
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise HybridError(f"the chat template does not parse: {safe_text(str(e.message))} "
                              f"(line {e.lineno})") from None
        except RecursionError:      # a template nested thousands deep
            raise HybridError("the chat template does not parse: it nests too deep") from None
        except Exception as e:      # compiling is code too: Python refuses e.g. 100 nested blocks
            raise HybridError(f"the chat template does not compile: {type(e).__name__}: "
                              f"{safe_text(str(e))}") from None

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> "ChatTemplate":
        """The model's own template (ChatML if it has none), with its BOS/EOS token texts."""
        m = Meta(meta)      # every value type-checked, the key named in any error
        tokens = m.strs("tokenizer.ggml.tokens", [])

        def token_text(key: str) -> str:
            tid = m.int(key, None, lo=0, hi=max(len(tokens) - 1, 0))
            return tokens[tid] if tid is not None and tid < len(tokens) else ""

        source = m.str("tokenizer.chat_template", "") or None
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
        _active.budget = _Budget()
        # SIGALRM also stops loops that make no call we could count; used only on the main
        # thread and only when no one else's timer is running (e.g. a test harness's).
        on_main = (threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
                   and signal.getitimer(signal.ITIMER_REAL)[0] == 0
                   and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None))
        old_handler = signal.signal(signal.SIGALRM, _alarm) if on_main else None
        try:
            if on_main:
                signal.setitimer(signal.ITIMER_REAL, MAX_RENDER_SECONDS + 0.5)
            pieces, size = [], 0
            for piece in self._template.generate(**context):
                size += len(piece)
                if size > MAX_RENDER_CHARS:
                    raise _TooMuchWork(f"more than {MAX_RENDER_CHARS:,} characters of output")
                pieces.append(piece)
            return "".join(pieces)
        except _TooMuchWork as e:
            raise HybridError(f"the chat template went over its rendering budget ({e}); "
                              "it is looping or building text without bound") from None
        except _TemplateRaised as e:
            raise HybridError(f"the chat template rejected the conversation: {safe_text(str(e.message))}") from None
        except RecursionError:
            raise HybridError("the chat template failed to render: it recurses without end") from None
        except Exception as e:  # a template is code: any failure in it is a user-facing error
            raise HybridError(f"the chat template failed to render: {type(e).__name__}: "
                              f"{safe_text(str(e))}") from None
        finally:
            if on_main:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, old_handler)
            _active.budget = None


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
