"""Live terminal display for streamed generation: finished lines scroll above, the line being
written and a status line (prefill progress, then tokens/s) stay at the bottom."""
from __future__ import annotations

import re
import sys

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from ..events import Done, Prefill, Stats, Token


# Control characters a model may write (C0 but newline and tab, DEL, C1) would move the cursor,
# clear the screen or ring the bell on a terminal: they are shown as escapes instead.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def visible(text: str) -> str:
    """`text` with control characters written as escapes (\\x1b, \\r…), newline and tab kept."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def stderr_console() -> Console:
    """Status lines go here: soft_wrap so a line is never broken mid-number when stderr is a file
    or a pipe (rich would wrap at its 80-column default there)."""
    return Console(stderr=True, soft_wrap=True)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def status_text(stats: Stats, prefill: Prefill | None, decoding: bool) -> Text:
    if not decoding and prefill is not None:
        tps = prefill.done / prefill.seconds if prefill.seconds > 0 else 0.0
        return Text(f"prefill {prefill.done}/{prefill.total} tokens · {tps:,.1f} t/s", style="cyan")
    # A rate from one token measures only that token's own step: it is shown from the second on.
    rate = f"{stats.decode_tps:,.2f} t/s" if stats.generated_tokens >= 2 else "… t/s"
    parts = [f"decode {rate}", _plural(stats.generated_tokens, "token")]
    if stats.draft and stats.draft.get("steps"):
        parts.append(f"accept {stats.draft.get('acceptance', 0):.0%} · "
                     f"{stats.draft.get('tokens_per_step', 0):.2f} tok/step")
    return Text(" · ".join(parts), style="cyan")


def summary_text(stats: Stats) -> str:
    s = (f"prompt {stats.prompt_tokens} tokens in {stats.prefill_seconds:.2f} s ({stats.prefill_tps:,.1f} t/s) · "
         f"generated {stats.generated_tokens} tokens in {stats.decode_seconds:.2f} s ({stats.decode_tps:,.2f} t/s) · "
         f"total {stats.prefill_seconds + stats.decode_seconds:.2f} s · stop: {stats.stop_reason}")
    if stats.draft:
        d = stats.draft
        s += (f"\ndraft depth {d.get('depth')} · {d.get('steps')} steps · accepted {d.get('accepted')}/"
              f"{d.get('drafted')} ({d.get('acceptance', 0):.1%}) · {d.get('tokens_per_step', 0):.2f} tokens/step")
    return s


def drive(events, handle) -> None:
    """Feed each event to `handle`. A Ctrl-C that lands in `handle` (not inside the generator,
    which handles its own) is thrown into the generator, so it still closes with its `Done`."""
    it = iter(events)
    while True:
        try:
            ev = next(it)
        except StopIteration:
            return
        try:
            handle(ev)
        except KeyboardInterrupt:
            try:
                handle(it.throw(KeyboardInterrupt()))
            except StopIteration:
                return


class LiveStream:
    """Consumes generation events and shows them; returns the final stats."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console()
        self.interactive = self.console.is_terminal

    def run(self, events, prompt: str = "") -> Stats:
        """Show `prompt` (echoed like llama.cpp does for raw prompts) once generation has started
        (so a prompt that fails its checks is never printed), then the stream: reasoning dim on a
        terminal, on stderr otherwise, so stdout carries the answer alone."""
        if not self.interactive:
            return self._plain(events, prompt)
        st = {"stats": Stats(), "prefill": None, "decoding": False, "partial": Text(), "echoed": False}

        def add(text: str, style: str = "") -> None:
            lines = visible(text).split("\n")
            for line in lines[:-1]:
                st["partial"].append(line, style)
                self.console.print(st["partial"], highlight=False, soft_wrap=True)
                st["partial"] = Text()
            st["partial"].append(lines[-1], style)

        with Live(console=self.console, refresh_per_second=8, transient=True) as live:
            def handle(ev):
                if not st["echoed"]:
                    st["echoed"] = True
                    add(prompt)
                if isinstance(ev, Prefill):
                    st["prefill"] = ev
                elif isinstance(ev, Token):
                    st["decoding"], st["stats"] = True, ev.stats
                    add(ev.text, "dim" if ev.reasoning else "")
                elif isinstance(ev, Done):
                    st["stats"] = ev.stats
                    add(ev.text, "dim" if ev.reasoning else "")
                live.update(Group(st["partial"], status_text(st["stats"], st["prefill"], st["decoding"])))
            drive(events, handle)
        if st["partial"]:
            self.console.print(st["partial"], highlight=False, soft_wrap=True)
        self.console.print(summary_text(st["stats"]), style="dim", highlight=False, soft_wrap=True)
        return st["stats"]

    def _plain(self, events, prompt: str) -> Stats:
        final = [Stats()]
        echoed = [False]
        err = stderr_console()
        open_line = [False]       # reasoning left on stderr without its newline yet

        def handle(ev):
            if not echoed[0]:
                echoed[0] = True
                sys.stdout.write(visible(prompt))
            if isinstance(ev, (Token, Done)) and ev.text:
                if ev.reasoning:
                    sys.stderr.write(visible(ev.text))
                    sys.stderr.flush()
                    open_line[0] = not ev.text.endswith("\n")
                else:
                    sys.stdout.write(visible(ev.text))
                    sys.stdout.flush()
            if isinstance(ev, Done):
                final[0] = ev.stats
        drive(events, handle)
        sys.stdout.write("\n")
        sys.stdout.flush()
        if open_line[0]:
            sys.stderr.write("\n")
        err.print(summary_text(final[0]), style="dim", highlight=False)
        return final[0]
