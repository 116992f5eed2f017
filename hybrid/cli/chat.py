"""`hybrid chat`: a multi-turn conversation in the terminal, each turn prefilling only new tokens."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from ..errors import HybridError
from ..metadata import safe_text
from . import app
from .common import (CpuOnlyOpt, CtxOpt, CudaGraphsOpt, DeviceOpt, DraftOpt, DraftPMinOpt, ExpertCacheOpt, PcieShareOpt, MinPOpt,
                     ModelArg, ModelOpt, OverrideTensorOpt, RepeatPenaltyOpt, SeedOpt, TempOpt, ThreadsOpt, TopKOpt, TopPOpt, VramOpt,
                     check_sampling, load_model, pick_model)
from .decode import pick_draft
from .display import LiveStream

COMMANDS = {"/reset": "forget the conversation", "/exit": "quit (or Ctrl-D)"}


def read_messages(console: Console, interactive: bool):
    """User messages: a prompt per turn on a terminal (Ctrl-C clears the line), else one per line."""
    if not interactive:
        for line in sys.stdin:
            line = line.rstrip("\n")
            if line.strip():
                yield line
        return
    while True:
        try:
            line = console.input("[bold green]> [/]")
        except EOFError:
            console.print()
            return
        except KeyboardInterrupt:
            console.print("\n[dim](Ctrl-D or /exit to quit)[/]")
            continue
        if line.strip():
            yield line


def turn_line(stats) -> Text:
    return Text(f"cached {stats.cached_tokens} tokens, prefilled {stats.prompt_tokens}", style="dim")


@app.command("chat")
def chat(
    model: Optional[Path] = ModelArg,
    model_opt: Optional[Path] = ModelOpt,
    system: Optional[str] = typer.Option(None, "--system", "-s", help="System message."),
    n_predict: int = typer.Option(512, "-n", "--n-predict", help="Tokens per reply at most."),
    temp: float = TempOpt,
    top_k: int = TopKOpt,
    top_p: float = TopPOpt,
    min_p: float = MinPOpt,
    repeat_penalty: float = RepeatPenaltyOpt,
    seed: int = SeedOpt,
    threads: Optional[int] = ThreadsOpt,
    ctx_size: int = CtxOpt,
    draft: Optional[str] = DraftOpt,
    draft_p_min: float = DraftPMinOpt,
    device: str = DeviceOpt,
    vram: Optional[str] = VramOpt,
    cpu_only: bool = CpuOnlyOpt,
    overrides: List[str] = OverrideTensorOpt,
    cuda_graphs: bool = CudaGraphsOpt,
    expert_cache: bool = ExpertCacheOpt,
    pcie_share: float = PcieShareOpt,
) -> None:
    """Chat with a model. The conversation stays in the model's state between turns, so each turn
    only prefills what is new. /reset forgets it, /exit or Ctrl-D quits, Ctrl-C stops a reply.

    With stdin not a terminal, every line is one user message (replies go to stdout).
    """
    if n_predict < 0:
        raise HybridError(f"-n must be ≥ 0, got {n_predict}")
    check_sampling(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty, seed=seed)
    pick_draft(draft, True)                 # a bad --draft fails before loading too
    err = Console(stderr=True)
    interactive = sys.stdin.isatty()
    m = load_model(pick_model(model, model_opt), device=device, threads=threads, n_ctx=ctx_size, console=err,
                   vram=vram, cpu_only=cpu_only, overrides=overrides, cuda_graphs=cuda_graphs,
                   expert_cache=expert_cache, pcie_share=pcie_share)
    session = m.session(system=system, n_ctx=ctx_size, draft=pick_draft(draft, m.has_mtp), draft_p_min=draft_p_min)
    sampling = dict(max_tokens=n_predict, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                    repeat_penalty=repeat_penalty, seed=None if seed < 0 else seed)
    out = Console()
    if interactive:
        err.print(f"[dim]{escape(safe_text(m.path.name))} · "
                  + " · ".join(f"{c} {h}" for c, h in COMMANDS.items()) + "[/]")
    failed = 0
    for message in read_messages(err, interactive):
        command = message.strip().lower()
        if command in ("/exit", "/quit"):
            break
        if command == "/reset":
            session.reset()
            err.print("[dim](conversation cleared)[/]")
            continue
        try:
            stats = LiveStream(out).run(session.send(message, **sampling))
        except HybridError as e:
            # one bad turn (a line too long for the context) is reported and the conversation
            # goes on with the next line; a script still sees the failure in the exit status
            err.print(Text.assemble(("error: ", "bold red"), safe_text(str(e), 2000)), soft_wrap=True)
            failed += 1
            continue
        except KeyboardInterrupt:     # landed outside the generation loop: the turn is dropped
            err.print("[dim](interrupted)[/]")
            continue
        (out if out.is_terminal else err).print(turn_line(stats))    # under that turn's summary
    if failed and not interactive:
        raise typer.Exit(1)
