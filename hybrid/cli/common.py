"""Options and helpers shared by the commands that load a model."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from ..errors import HybridError

ModelArg = typer.Argument(None, help="GGUF model file (default: the bundled tiny qwen35 model).",
                          show_default=False)
ModelOpt = typer.Option(None, "-m", "--model", help="GGUF model file (same as the MODEL argument).",
                        show_default=False)
ThreadsOpt = typer.Option(None, "-t", "--threads", help="CPU threads (default: all cores available).",
                          show_default=False)
CtxOpt = typer.Option(4096, "-c", "--ctx-size", help="Context size in tokens (capped at the model's).")
DeviceOpt = typer.Option("auto", "--device", help="cpu, cuda or auto.")


def pick_model(arg: Optional[Path], opt: Optional[Path]) -> Optional[Path]:
    if arg is not None and opt is not None and arg != opt:
        raise HybridError(f"two models given ({arg} and {opt}): use either MODEL or -m")
    return opt or arg


@contextmanager
def status(console: Console, message: str, enabled: bool = True):
    """A spinner for slow steps (loading, first-run kernel compilation) instead of a silent pause."""
    if enabled and console.is_terminal:
        with console.status(message, spinner="dots"):
            yield
    else:
        yield


def load_model(path: Optional[Path], *, device: str, threads: Optional[int], n_ctx: int,
               console: Console, quiet: bool = False):
    from ..api import load
    with status(console, "loading model…", not quiet):
        model = load(path, device=device, threads=threads, n_ctx=n_ctx)
    with status(console, "preparing kernels (compiles on the first run, then cached)…", not quiet):
        model.warmup()
    return model
