"""Live terminal display for streamed generation: finished lines scroll above, the line being
written and a status line (prefill progress, then tokens/s) stay at the bottom."""
from __future__ import annotations

import sys

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from ..events import Done, Prefill, Stats, Token
from ..metadata import safe_text


def visible(text: str) -> str:
    """Generated text for a terminal: its tokens come from the model file, so escape sequences
    and other control characters are shown escaped (newlines and tabs stay). Piped output is
    left byte-exact."""
    if text.isprintable():
        return text
    return "\n".join("\t".join(safe_text(part, len(part)) for part in line.split("\t"))
                     for line in text.split("\n"))


def status_text(stats: Stats, prefill: Prefill | None, decoding: bool) -> Text:
    if not decoding and prefill is not None:
        tps = prefill.done / prefill.seconds if prefill.seconds > 0 else 0.0
        return Text(f"prefill {prefill.done}/{prefill.total} tokens · {tps:,.1f} t/s", style="cyan")
    parts = [f"decode {stats.decode_tps:,.2f} t/s", f"{stats.generated_tokens} tokens"]
    if stats.draft:
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
        """Show `prompt` (echoed like llama.cpp does for raw prompts), then the stream."""
        if not self.interactive:
            return self._plain(events, prompt)
        *done, partial = prompt.split("\n")
        for line in done:
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)
        st = {"stats": Stats(), "prefill": None, "decoding": False, "partial": partial}
        with Live(console=self.console, refresh_per_second=8, transient=True) as live:
            def handle(ev):
                if isinstance(ev, Prefill):
                    st["prefill"] = ev
                elif isinstance(ev, Token):
                    st["decoding"], st["stats"] = True, ev.stats
                    lines = (st["partial"] + visible(ev.text)).split("\n")
                    for line in lines[:-1]:
                        live.console.print(line, markup=False, highlight=False, soft_wrap=True)
                    st["partial"] = lines[-1]
                elif isinstance(ev, Done):
                    st["stats"], st["partial"] = ev.stats, st["partial"] + visible(ev.text)
                live.update(Group(Text(st["partial"]), status_text(st["stats"], st["prefill"], st["decoding"])))
            drive(events, handle)
        if st["partial"]:
            self.console.print(st["partial"], markup=False, highlight=False, soft_wrap=True)
        self.console.print(summary_text(st["stats"]), style="dim", highlight=False)
        return st["stats"]

    def _plain(self, events, prompt: str) -> Stats:
        final = [Stats()]
        sys.stdout.write(prompt)

        def handle(ev):
            if isinstance(ev, (Token, Done)):
                sys.stdout.write(ev.text)
                sys.stdout.flush()
            if isinstance(ev, Done):
                final[0] = ev.stats
        drive(events, handle)
        sys.stdout.write("\n")
        Console(stderr=True).print(summary_text(final[0]), style="dim", highlight=False)
        return final[0]
