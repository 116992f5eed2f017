"""Options and helpers shared by the commands that load a model."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Sequence

import typer
from rich.console import Console

from ..errors import HybridError
from ..placement import DEFAULT_PCIE_SHARE

ModelArg = typer.Argument(None, help="GGUF model file (default: the bundled tiny qwen35 model).",
                          show_default=False)
ModelOpt = typer.Option(None, "-m", "--model", help="GGUF model file (same as the MODEL argument).",
                        show_default=False)
ThreadsOpt = typer.Option(None, "-t", "--threads", help="CPU threads (default: all cores available).",
                          show_default=False)
CtxOpt = typer.Option(4096, "-c", "--ctx-size", help="Context size in tokens (capped at the model's).")
DeviceOpt = typer.Option("auto", "--device", help="cpu, cuda or auto.")

# Sampling and drafting, shared by decode and chat (llama.cpp's spellings and defaults).
TempOpt = typer.Option(0.8, "--temp", help="Temperature; 0 = greedy.")
TopKOpt = typer.Option(40, "--top-k", help="Keep the k most likely tokens (0 = off).")
TopPOpt = typer.Option(0.95, "--top-p", help="Nucleus sampling mass (1.0 = off).")
MinPOpt = typer.Option(0.05, "--min-p", help="Drop tokens below min_p × the top probability (0 = off).")
RepeatPenaltyOpt = typer.Option(1.0, "--repeat-penalty", help="Penalty for recent tokens (1.0 = off).")
SeedOpt = typer.Option(-1, "--seed", help="Random seed (-1 = random).")
DraftOpt = typer.Option(
    None, "--draft", "--spec-draft-n-max",
    help="MTP draft depth per step: 0 = off, N, or 'auto' (picked from measured acceptance and step "
         "cost). Default: auto when the model has an MTP head, else 0.")
DraftPMinOpt = typer.Option(0.0, "--spec-draft-p-min",
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


def load_model(path: Optional[Path], *, device: str, threads: Optional[int], n_ctx: int,
               console: Console, quiet: bool = False, vram: Optional[str] = None, cpu_only: bool = False,
               overrides: Sequence[str] = (), cuda_graphs: bool = True, expert_cache: bool = True,
               pcie_share: float = DEFAULT_PCIE_SHARE):
    from ..api import load
    device, extra = placement_options(device, vram, cpu_only, overrides)
    with status(console, "loading model…", not quiet):
        model = load(path, device=device, threads=threads, n_ctx=n_ctx, cuda_graphs=cuda_graphs,
                     expert_cache=expert_cache, pcie_share=pcie_share, **extra)
    with status(console, "preparing kernels (compiles on the first run, then cached)…", not quiet):
        model.warmup()
    return model
