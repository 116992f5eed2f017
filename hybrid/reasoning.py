"""Telling a thinking model's reasoning from its answer in the token stream.

Qwen3.x chat templates open the assistant turn either plainly (the model then writes
`<think> … </think>` itself), with an open `<think>` (the model starts inside its reasoning), or,
with enable_thinking=false, with an empty `<think>\n\n</think>` block. `ReasoningTagger` follows
the markers through the events and sets `Token.reasoning` / `Done.reasoning`: the markers
themselves and the blank lines right after `</think>` count as reasoning, so the answer is the
text a reader wants and `"".join(t.text for t in tokens if not t.reasoning)` is it.
"""
from __future__ import annotations

from .events import Done, Token

OPEN, CLOSE = "<think>", "</think>"


def starts_inside(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves the model inside an open <think> block."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


class ReasoningTagger:
    """Wraps an event iterator, tagging its Token/Done events; throw() and close() reach the
    wrapped generator, so a Ctrl-C thrown in by `display.drive` still ends it with its Done."""

    def __init__(self, events, inside: bool = False):
        self._it = iter(events)
        self.inside = inside
        self._after_close = False      # just left a block: blank text still belongs to it

    def __iter__(self):
        return self

    def _tag(self, ev):
        if isinstance(ev, (Token, Done)):
            text = ev.text
            if OPEN in text:
                self.inside, self._after_close = True, False
                ev.reasoning = True
            elif CLOSE in text:
                self.inside, self._after_close = False, True
                ev.reasoning = True
            elif self.inside:
                ev.reasoning = True
            elif self._after_close and not text.strip():
                ev.reasoning = True
            else:
                self._after_close = False
        return ev

    def __next__(self):
        return self._tag(next(self._it))

    def send(self, value):
        return self._tag(self._it.send(value))

    def throw(self, *args):
        return self._tag(self._it.throw(*args))

    def close(self):
        close = getattr(self._it, "close", None)
        if close is not None:
            close()
