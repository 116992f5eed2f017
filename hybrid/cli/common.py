"""Options and helpers shared by the commands that load a model."""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Sequence

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
VramOpt = typer.Option(None, "--vram", help="GPU memory budget, e.g. 12GiB, 8G, 500MiB "
                       "(default: the GPU's free memory).", show_default=False)
CpuOnlyOpt = typer.Option(False, "--cpu-only", help="Keep everything on the CPU (no GPU needed).")
OverrideTensorOpt = typer.Option(
    [], "-ot", "--override-tensor",
    help="Pin tensors whose name matches REGEX to a side: REGEX=CPU or REGEX=GPU (repeatable, "
         "first match wins; like llama.cpp's -ot), e.g. -ot 'blk\\.[0-9]\\.ffn_.*=GPU'.")


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


def placement_options(device: str, vram: Optional[str], cpu_only: bool,
                      overrides: Sequence[str]) -> tuple[str, dict]:
    """Check --vram / --cpu-only / -ot before anything loads; returns (device, extra load() kwargs).

    --cpu-only is device cpu. --vram and -ot go to load() only when given, so commands keep
    working with a load() that does not take them yet (then they are refused, clearly).
    """
    from ..placement import parse_overrides
    from ..units import parse_size
    if cpu_only:
        if device == "cuda":
            raise HybridError("--cpu-only and --device cuda contradict each other; pick one")
        device = "cpu"
    extra: dict = {}
    if vram is not None:
        parse_size(vram, "VRAM budget (--vram)")
        extra["vram"] = vram
    if overrides:
        parse_overrides(overrides)
        extra["overrides"] = tuple(overrides)
    return device, extra


def load_model(path: Optional[Path], *, device: str, threads: Optional[int], n_ctx: int,
               console: Console, quiet: bool = False, vram: Optional[str] = None, cpu_only: bool = False,
               overrides: Sequence[str] = ()):
    from ..api import load
    device, extra = placement_options(device, vram, cpu_only, overrides)
    unknown = [k for k in extra if k not in inspect.signature(load).parameters]
    if unknown:
        flags = {"vram": "--vram", "overrides": "-ot"}
        raise HybridError(f"{', '.join(flags[k] for k in unknown)}: this build has no GPU placement yet; "
                          "see `hybrid info MODEL --plan` for the plan it would use")
    with status(console, "loading model…", not quiet):
        model = load(path, device=device, threads=threads, n_ctx=n_ctx, **extra)
    with status(console, "preparing kernels (compiles on the first run, then cached)…", not quiet):
        model.warmup()
    return model
