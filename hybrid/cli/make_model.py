"""`hybrid make-model OUT.gguf`: write a synthetic model (llama.cpp layout, random weights)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)

from . import app
from ..errors import HybridError
from ..synth import plan_model, preset, write_model
from ..synth.spec import PRESET_NAMES
from ..synth.types import MIXES, RECIPES

def _dim(flag: str, help: str):
    return typer.Option(flag, help=help, show_default=False)


@app.command("make-model")
def make_model(
    out: Annotated[Path, typer.Argument(help="Where to write the GGUF file.", show_default=False)],
    arch: Annotated[Optional[str], typer.Option(
        help="qwen35, qwen35moe or qwen3next (default: the preset's).", show_default=False)] = None,
    preset_name: Annotated[str, typer.Option(
        "--preset", help=f"Shape: {', '.join(PRESET_NAMES)}.")] = "tiny",
    types: Annotated[str, typer.Option(
        "--type", help=f"a llama.cpp mix (Q4_K_M, {', '.join(MIXES)}) or one type for all matrices: "
                       f"{', '.join(r for r in RECIPES if r != 'Q4_K_M' and r not in MIXES)}.")]
        = "Q4_K_M",
    mtp: Annotated[Optional[bool], typer.Option(
        "--mtp/--no-mtp", help="Include the MTP (nextn) block (default: the preset's).", show_default=False)]
        = None,
    seed: Annotated[int, typer.Option(help="Random seed: the same seed writes the same file.")] = 0,
    method: Annotated[str, typer.Option(
        help="How quantised tensors are filled: quantize (random floats, quantised), codes (random "
             "codes: fast, for big files) or auto (quantize for small models).")] = "auto",
    force: Annotated[bool, typer.Option("--force", help="Replace OUT if it exists.")] = False,
    plan_only: Annotated[bool, typer.Option(
        "--plan", help="Print the tensor plan (names, shapes, types, bytes) and write nothing.")] = False,
    layers: Annotated[Optional[int], _dim("--layers", "Trunk layers (the MTP block comes on top).")] = None,
    embd: Annotated[Optional[int], _dim("--embd", "Hidden size D.")] = None,
    vocab: Annotated[Optional[int], _dim("--vocab", "Vocabulary size.")] = None,
    ff: Annotated[Optional[int], _dim("--ff", "Dense FFN width (qwen35).")] = None,
    heads: Annotated[Optional[int], _dim("--heads", "Attention query heads.")] = None,
    kv_heads: Annotated[Optional[int], _dim("--kv-heads", "Attention KV heads.")] = None,
    head_dim: Annotated[Optional[int], _dim("--head-dim", "Attention head dim.")] = None,
    rot: Annotated[Optional[int], _dim("--rot", "Rotated dims per head.")] = None,
    k_heads: Annotated[Optional[int], _dim("--k-heads", "GDN key heads H_k.")] = None,
    v_heads: Annotated[Optional[int], _dim("--v-heads", "GDN value heads H_v.")] = None,
    state: Annotated[Optional[int], _dim("--state", "GDN head dim d_k = d_v.")] = None,
    experts: Annotated[Optional[int], _dim("--experts", "MoE experts.")] = None,
    experts_used: Annotated[Optional[int], _dim("--experts-used", "MoE experts per token.")] = None,
    ff_exp: Annotated[Optional[int], _dim("--ff-exp", "Expert FFN width.")] = None,
    ff_shexp: Annotated[Optional[int], _dim("--ff-shexp", "Shared-expert FFN width (0: none).")] = None,
    interval: Annotated[Optional[int], _dim("--interval", "Every n-th layer is full attention.")] = None,
    ctx: Annotated[Optional[int], _dim("--ctx", "Context length written to the metadata.")] = None,
    tied: Annotated[Optional[bool], typer.Option(
        "--tied/--untied", help="lm_head tied to the token embedding (no output.weight).", show_default=False)] = None,
    fused_gate_up: Annotated[bool, typer.Option(
        "--fused-gate-up", help="MoE: one ffn_gate_up_exps tensor.")] = False,
    legacy_ssm_in: Annotated[bool, typer.Option(
        "--legacy-ssm-in", help="qwen3next: the raw ssm_in tensor.")] = False,
    recurrent_flags: Annotated[bool, typer.Option(
        "--recurrent-layers", help="Also write the per-block attention.recurrent_layers array.")] = False,
) -> None:
    """Write a synthetic model for tests and benchmarks.

    llama.cpp's exact tensor layout and metadata, random well-scaled weights, a small BPE tokenizer
    and a ChatML template. The flags from --layers on override the preset's shape.
    """
    overrides = {k: v for k, v in dict(
        n_layer=layers, n_embd=embd, n_vocab=vocab, n_ff=ff, n_head=heads, n_head_kv=kv_heads,
        head_dim=head_dim, n_rot=rot, ssm_n_k_heads=k_heads, ssm_n_v_heads=v_heads, ssm_d_state=state,
        n_expert=experts, n_expert_used=experts_used, n_ff_exp=ff_exp, n_ff_shexp=ff_shexp,
        full_attention_interval=interval, context_length=ctx, mtp=mtp, tied_output=tied,
    ).items() if v is not None}
    overrides.update({k: True for k, v in dict(
        fused_gate_up_exps=fused_gate_up, legacy_ssm_in=legacy_ssm_in,
        write_recurrent_layers=recurrent_flags).items() if v})
    spec = preset(preset_name, arch, **overrides)
    console = Console(highlight=False)
    plan = plan_model(spec, types)
    if plan_only:
        for t in plan:      # plain print: one unwrapped line per tensor, for scripts
            print(f"{t.name:<40} {str(list(t.ne)):<24} {t.type.name:<5} {t.nbytes:>14,}")
        console.print(_summary(spec, plan))
        return
    if out.exists() and not force:
        raise HybridError(f"{out} exists; pass --force to replace it")
    started = time.perf_counter()
    columns = (TextColumn("{task.description:<36}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("header", total=None)

        def progress(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total, description=name)

        write_model(out, spec, types, seed, progress, method=method)
    seconds = time.perf_counter() - started
    size = out.stat().st_size
    console.print(f"wrote {out}: {_summary(spec, plan)}; {seconds:.1f} s, {size / seconds / 1e6:,.0f} MB/s")


def _summary(spec, plan) -> str:
    n_attn = sum(k == "attn" for k in spec.layer_kinds)
    types = ", ".join(f"{n} {name}" for name, n in sorted(plan.type_counts().items()))
    return (f"{spec.arch} {spec.name}, {spec.n_layer - n_attn} GDN + {n_attn} attention layers"
            f"{' + MTP' if spec.mtp else ''}, "
            f"D={spec.n_embd}, vocab {spec.n_vocab}; {len(plan)} tensors ({types}), "
            f"{plan.total_bytes / 2**30:.3f} GiB of tensor data")
