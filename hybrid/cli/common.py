"""Options and helpers shared by the commands that load a model."""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional, Sequence

import typer
from rich.console import Console

from ..errors import HybridError
from ..placement import DEFAULT_PCIE_SHARE
from ..state import DEFAULT_N_CTX

ModelArg = typer.Argument(None, help="GGUF model file (default: the bundled tiny qwen35 model).",
                          show_default=False)
ModelOpt = typer.Option(None, "-m", "--model", help="GGUF model file (same as the MODEL argument).",
                        show_default=False)
ThreadsOpt = typer.Option(None, "-t", "--threads", help="CPU threads (default: all cores available).",
                          show_default=False)
CtxOpt = typer.Option(DEFAULT_N_CTX, "-c", "--ctx-size", help="Context size in tokens (capped at the model's).")
DeviceOpt = typer.Option("auto", "--device", help="cpu, cuda or auto.")

# Sampling and drafting, shared by decode and chat (llama.cpp's spellings and defaults).
TempOpt = typer.Option(0.8, "--temp", help="Temperature; 0 = greedy.")
TopKOpt = typer.Option(40, "--top-k", help="Keep the k most likely tokens (0 = off).")
TopPOpt = typer.Option(0.95, "--top-p", help="Nucleus sampling mass (1.0 = off).")
MinPOpt = typer.Option(0.05, "--min-p", help="Drop tokens below min_p × the top probability (0 = off).")
RepeatPenaltyOpt = typer.Option(1.0, "--repeat-penalty", help="Penalty for recent tokens (1.0 = off).")
SeedOpt = typer.Option(-1, "--seed", min=-1, help="Random seed (-1 = random).")
DraftOpt = typer.Option(
    None, "--draft", "--spec-draft-n-max",
    help="MTP draft depth per step: 0 = off, N, or 'auto' (picked from measured acceptance and step "
         "cost). Default: auto when the model has an MTP head, else 0.")
DraftPMinOpt = typer.Option(0.0, "--spec-draft-p-min", min=0.0, max=1.0,
                            help="Stop a draft when the MTP head's top probability falls below this (0 = never).")
VramOpt = typer.Option(None, "--vram", help="GPU memory budget, e.g. 12GiB, 8G, 500MiB "
                       "(default: the GPU's free memory).", show_default=False)
CpuOnlyOpt = typer.Option(False, "--cpu-only", help="Keep everything on the CPU (no GPU needed).")
CudaGraphsOpt = typer.Option(True, "--cuda-graphs/--no-cuda-graphs",
                             help="Replay each repeated step's GPU work as a CUDA graph (one driver call "
                                  "per CPU hand-off instead of ~15 kernel launches per layer). Off: launch "
                                  "kernels one by one (debugging, timing comparisons).")
ExpertCacheOpt = typer.Option(True, "--expert-cache/--no-expert-cache",
                              help="MoE models: copy as many routed experts of each layer as the VRAM left "
                                   "over holds to the GPU, which runs them when a token picks them (the rest "
                                   "run on the CPU).")
PcieShareOpt = typer.Option(DEFAULT_PCIE_SHARE, "--pcie-share", min=0.0, max=1.0,
                            help="MoE models with a GPU: of the routed experts a token picks that the GPU does "
                                 "not cache, the share the GPU reads itself from host memory over PCIe while "
                                 "the CPU runs the rest (0 = the CPU runs them all). The host's memory serves "
                                 "both readers at once.")
OverrideTensorOpt = typer.Option(
    [], "-ot", "--override-tensor",
    help="Pin tensors whose name matches REGEX to a side: REGEX=CPU or REGEX=GPU (repeatable, "
         "first match wins; like llama.cpp's -ot), e.g. -ot 'blk\\.[0-9]\\.ffn_.*=GPU'.")


def check_sampling(*, temp: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float,
                   seed: int, repeat_last_n: int = 64) -> None:
    """Every sampling option checked before the model loads (a bad --top-p should not cost a
    minute of loading first): SamplerConfig holds the rules."""
    from ..sampling import SamplerConfig
    SamplerConfig(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                  repeat_last_n=repeat_last_n, seed=None if seed < 0 else seed)


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

    --cpu-only is device cpu; a bad --vram or -ot fails here, before the model is opened.
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


class KernelProgress:
    """progress(done, total) for `Model.warmup`: "compiling CPU kernels 12/40" on a terminal while
    they compile ("12/?" while the total is not known yet), then one line with the count and the
    time; off a terminal the first line and the last. Shows nothing when no kernel compiles (all
    came from Numba's disk cache)."""

    def __init__(self, console: Console, enabled: bool = True):
        self.console, self.enabled = console, enabled
        self._status = None
        self._started = None
        self._last = (0, 0)

    def __call__(self, done: int, total: Optional[int]) -> None:
        if not self.enabled or total == 0:
            return
        self._last = (done, total)
        message = f"compiling CPU kernels {done}/{total or '?'} (first run only, then cached)…"
        if self._started is None:
            self._started = time.perf_counter()
            if self.console.is_terminal:
                self._status = self.console.status(message, spinner="dots")
                self._status.start()
            else:
                self.console.print(message, highlight=False)
        elif self._status is not None:
            self._status.update(message)

    def close(self) -> None:
        if self._status is not None:
            self._status.stop()
        if self._started is not None:
            done, total = self._last
            seconds = time.perf_counter() - self._started
            self.console.print(f"compiled CPU kernels {done}/{total or done} in {seconds:.1f} s (cached for later runs)",
                               style="dim", highlight=False)


def load_model(path: Optional[Path], *, device: str, threads: Optional[int], n_ctx: int,
               console: Console, quiet: bool = False, vram: Optional[str] = None, cpu_only: bool = False,
               overrides: Sequence[str] = (), cuda_graphs: bool = True, expert_cache: bool = True,
               pcie_share: float = DEFAULT_PCIE_SHARE, max_rows: Optional[Callable] = None):
    """Load and warm up a model. max_rows(model) → the most token rows one forward call of the
    job takes (its prompt, a draft verify step), when known: the warm-up then compiles only the
    kernels of calls that size (`Model.warmup`)."""
    from ..api import load
    device, extra = placement_options(device, vram, cpu_only, overrides)
    with status(console, "loading model…", not quiet):
        model = load(path, device=device, threads=threads, n_ctx=n_ctx, cuda_graphs=cuda_graphs,
                     expert_cache=expert_cache, pcie_share=pcie_share, **extra)
    rows = max_rows(model) if max_rows is not None else None
    if model.device != "cpu":
        with status(console, "preparing kernels (compiles on the first run, then cached)…", not quiet):
            model.warmup(rows)
        return model
    progress = KernelProgress(console, not quiet)
    try:
        model.warmup(rows, progress=progress)
    finally:
        progress.close()
    return model
