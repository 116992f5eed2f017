"""`hybrid decode`: stream a continuation of a prompt with a live tokens/s display."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from ..draft_policy import DraftPolicy
from ..errors import HybridError
from ..events import Done, Token
from . import app
from .common import (CpuOnlyOpt, CtxOpt, CudaGraphsOpt, DeviceOpt, DraftOpt, DraftPMinOpt, ExpertCacheOpt, PcieShareOpt, MinPOpt,
                     ModelArg, ModelOpt, OverrideTensorOpt, RepeatPenaltyOpt, SeedOpt, TempOpt, ThreadsOpt, TopKOpt, TopPOpt, VramOpt,
                     check_sampling, load_model, pick_model)
from .display import LiveStream, drive

DEMO_PROMPT = "def fibonacci(n):"


def read_prompt(prompt: Optional[str], file: Optional[Path], have_model: bool) -> str:
    if prompt is not None and file is not None:
        raise HybridError("give the prompt with -p or -f, not both")
    if file is not None:
        try:
            return file.read_text(encoding="utf-8")
        except OSError as e:
            raise HybridError(f"cannot read prompt file {file}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise HybridError(f"prompt file {file} is not UTF-8 text") from None
    if prompt is None:
        if have_model:
            raise HybridError("no prompt: give one with -p TEXT or -f FILE")
        return DEMO_PROMPT        # the bundled demo: `hybrid decode` alone shows the engine working
    return prompt


def pick_draft(draft: Optional[str], has_mtp: bool) -> int:
    """The --draft value as a depth (its default: auto with an MTP head, else 0)."""
    return DraftPolicy.parse(draft, has_mtp).depth


@app.command("decode")
def decode(
    model: Optional[Path] = ModelArg,
    model_opt: Optional[Path] = ModelOpt,
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="Prompt text, used raw (no BOS unless the GGUF asks for one)."),
    file: Optional[Path] = typer.Option(None, "-f", "--file", help="Read the prompt from a UTF-8 file."),
    n_predict: int = typer.Option(128, "-n", "--n-predict", help="Tokens to generate at most."),
    temp: float = TempOpt,
    top_k: int = TopKOpt,
    top_p: float = TopPOpt,
    min_p: float = MinPOpt,
    repeat_penalty: float = RepeatPenaltyOpt,
    repeat_last_n: int = typer.Option(64, "--repeat-last-n", help="How many recent tokens the penalty looks at."),
    seed: int = SeedOpt,
    threads: Optional[int] = ThreadsOpt,
    ctx_size: int = CtxOpt,
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the GGUF's chat template as a user turn."),
    system: Optional[str] = typer.Option(None, "--system", help="System message for --chat."),
    stop: List[str] = typer.Option([], "--stop", help="Stop when this text appears (repeatable)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep going past end-of-generation tokens."),
    draft: Optional[str] = DraftOpt,
    draft_p_min: float = DraftPMinOpt,
    device: str = DeviceOpt,
    vram: Optional[str] = VramOpt,
    cpu_only: bool = CpuOnlyOpt,
    overrides: List[str] = OverrideTensorOpt,
    cuda_graphs: bool = CudaGraphsOpt,
    expert_cache: bool = ExpertCacheOpt,
    pcie_share: float = PcieShareOpt,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object at the end and nothing else on stdout."),
) -> None:
    """Generate text from a prompt, streaming it with live prefill and decode speed.

    With no model and no prompt it runs the bundled tiny model on a demo prompt.
    """
    path = pick_model(model, model_opt)
    text = read_prompt(prompt, file, path is not None)
    if n_predict < 0:
        raise HybridError(f"-n must be ≥ 0, got {n_predict}")
    check_sampling(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                   seed=seed, repeat_last_n=repeat_last_n)
    DraftPolicy.parse(draft, True)          # a bad --draft fails before loading too
    err = Console(stderr=True)
    m = load_model(path, device=device, threads=threads, n_ctx=ctx_size, console=err, quiet=as_json,
                   vram=vram, cpu_only=cpu_only, overrides=overrides, cuda_graphs=cuda_graphs,
                   expert_cache=expert_cache, pcie_share=pcie_share,
                   max_rows=lambda m: max(len(m.encode_prompt(text, chat=chat, system=system)),
                                          DraftPolicy.parse(draft, m.has_mtp).ring))
    events = m.generate(text, max_tokens=n_predict, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                        repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                        seed=None if seed < 0 else seed, stop=stop, chat=chat, system=system,
                        ignore_eos=ignore_eos, draft=pick_draft(draft, m.has_mtp), draft_p_min=draft_p_min)
    if as_json:
        tokens, pieces, final = [], [], {}

        def collect(ev):
            if isinstance(ev, Token):
                tokens.append(ev.id)
            if isinstance(ev, (Token, Done)):
                pieces.append(ev.text)
            if isinstance(ev, Done):
                final["stats"] = ev.stats
        drive(events, collect)
        out = {"model": str(m.path), "tokens": tokens, "text": "".join(pieces), **final["stats"].to_dict()}
        sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n")
        return
    LiveStream(Console()).run(events, prompt="" if chat else text)
