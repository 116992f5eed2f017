"""`hybrid info MODEL [--json] [--plan …]`: open and validate a GGUF, describe it, and with
--plan show where each part would live (GPU or CPU) and what a token reads on each side."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, List, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpu import available

from . import app
from .common import CpuOnlyOpt, OverrideTensorOpt, PcieShareOpt, SplitFfnOpt, VramOpt
from ..metadata import safe_text
from ..model_file import default_model_path, open_model
from ..state import DEFAULT_N_CTX
from ..draft_policy import DraftPolicy
from ..placement import CPU, GPU, GROUPS, plan_for, plan_placement, parse_overrides
from ..summary import describe_plan, summarize
from ..units import format_bandwidth, parse_bandwidth, parse_size


@app.command("info")
def info(
    model: Annotated[Optional[Path], typer.Argument(
        help="GGUF model file (qwen35, qwen35moe or qwen3next). Default: the bundled tiny qwen35 model.",
        show_default=False)] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print one JSON object instead of tables (stable keys, for scripts).")] = False,
    plan: Annotated[bool, typer.Option(
        "--plan", help="Show the GPU/CPU placement plan: what lives where, the VRAM budget, the bytes "
                       "a token reads on each side. Implied by --vram, -ot and --cpu-only.")] = False,
    vram: Optional[str] = VramOpt,
    ctx_size: Annotated[int, typer.Option(
        "-c", "--ctx-size", help="Context size the KV cache is planned for (capped at the model's).")] = DEFAULT_N_CTX,
    draft: Annotated[Optional[str], typer.Option(
        "--draft", help="Draft depth the GDN snapshot ring is planned for: 0, N or auto "
                        "(default: auto when the model has an MTP head, else 0).", show_default=False)] = None,
    overrides: List[str] = OverrideTensorOpt,
    cpu_only: bool = CpuOnlyOpt,
    expert_cache: Annotated[bool, typer.Option(
        "--expert-cache/--no-expert-cache",
        help="MoE: plan the GPU cache of routed experts in the leftover VRAM, as decoding uses by default "
             "(--no-expert-cache: the plan of a run with --no-expert-cache).")] = True,
    pcie_share: float = PcieShareOpt,
    split_ffn: bool = SplitFfnOpt,
    cpu_bandwidth: Annotated[str, typer.Option(
        "--cpu-bandwidth", help="CPU read bandwidth for the per-token roofline in the plan.")] = "100GB/s",
) -> None:
    """Check a model file and show what it holds.

    Its architecture, dimensions, tensor types and bytes per role; with --plan, where each weight
    would live.
    """
    plan = plan or vram is not None or bool(overrides) or cpu_only
    bandwidth = parse_bandwidth(cpu_bandwidth, "--cpu-bandwidth")
    rules = parse_overrides(overrides)        # bad -ot rules fail before the model is opened
    with open_model(model or default_model_path()) as m:
        summary = summarize(m)
        if plan:
            summary["plan"] = describe_plan(
                _plan(m, vram, cpu_only, rules, ctx_size, draft, expert_cache, pcie_share, split_ffn), bandwidth)
            # A --vram plan is computed on any machine: say when no GPU here would run it.
            summary["plan"]["hypothetical"] = _hypothetical(summary["plan"])
    if as_json:
        # plain print: rich would wrap long lines and break the JSON
        print(json.dumps(summary))
    else:
        out = Console(highlight=False)
        render(summary, out)
        if plan:
            render_plan(summary["plan"], out)


def _hypothetical(plan: dict) -> bool:
    """A GPU plan on a machine without a CUDA GPU: what would fit such a card, not what runs here."""
    if plan.get("budget") is None:
        return False
    return not available()


def _plan(m, vram, cpu_only, rules, ctx_size, draft, expert_cache, pcie_share, split_ffn):
    """An explicit --vram plans for that budget on any machine (no GPU needed: 'what would fit
    on a 12 GiB card?'); without it, the plan a run here would use (free VRAM, or the CPU)."""
    n_ring = DraftPolicy.parse(draft, m.config.n_nextn > 0).ring
    if vram is not None and not cpu_only:
        return plan_placement(m, parse_size(vram, "VRAM budget (--vram)"), n_ctx=ctx_size, n_ring=n_ring,
                              overrides=rules, expert_cache=expert_cache, pcie_share=pcie_share, split_ffn=split_ffn)
    return plan_for(m, "auto", None, cpu_only, rules, ctx_size, n_ring, expert_cache=expert_cache,
                    pcie_share=pcie_share, split_ffn=split_ffn)


def render(s: dict[str, Any], out: Console) -> None:
    c = s["config"]
    # The name is file text: a rich Text (never markup) of the escaped, cut value.
    name = s["name"] if isinstance(s["name"], str) and s["name"] else Path(s["path"]).name
    out.print(Text.assemble((safe_text(name), "bold"), f"  ({safe_text(s['path'], 1000)}, GGUF v{s['gguf_version']})"),
              soft_wrap=True)
    out.print(_model_table(s, c))
    out.print(_bytes_table("bytes by tensor type", s["bytes_by_type"], s["tensor_bytes"], s["tensor_types"]))
    out.print(_bytes_table("bytes by role", s["bytes_by_role"], s["tensor_bytes"]))
    out.print(f"total: {s['n_tensors']} tensors, {s['n_params'] / 1e6:,.1f}M parameters, "
              f"{_size(s['tensor_bytes'])} of tensor data in a {_size(s['file_bytes'])} file", soft_wrap=True)


def _model_table(s: dict[str, Any], c: dict[str, Any]) -> Table:
    t = Table(title="model", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("architecture", s["architecture"])
    t.add_row("layers", s["layers"])
    t.add_row("layer kinds", " ".join("G" if k == "gdn" else "A" for k in s["layer_kinds"]) + "  (G=GDN, A=attention)")
    t.add_row("dims", f"n_embd {c['n_embd']}, vocab {c['n_vocab']}, context {c['context_length']}, "
                      f"rms eps {c['rms_eps']:.3g}")
    t.add_row("attention", f"{c['n_head']} heads, {c['n_head_kv']} KV heads, head dim {c['head_dim']}")
    sections = f", sections {list(c['rope_sections'])}" if c["rope_sections"] else ""
    t.add_row("rope", f"{c['n_rot']} rotated dims, θ {c['rope_theta']:g}{sections}")
    pairing = "grouped" if c["arch"] == "qwen3next" else "tiled"
    t.add_row("gated deltanet", f"{c['ssm_n_k_heads']} key heads, {c['ssm_n_v_heads']} value heads, "
                                f"d_k = d_v = {c['ssm_d_state']}, inner {c['ssm_d_inner']}, "
                                f"conv kernel {c['ssm_conv_kernel']}, {pairing} head pairing")
    if c["n_expert"]:
        shared = f", shared expert {c['n_ff_shexp']}" if c["n_ff_shexp"] else ", no shared expert"
        t.add_row("ffn (MoE)", f"{c['n_expert_used']} of {c['n_expert']} experts, expert width "
                               f"{c['n_ff_exp']}{shared}")
    else:
        t.add_row("ffn (dense)", f"width {c['n_ff']}")
    t.add_row("output", "tied to token_embd" if s["tied_output"] else "separate output.weight")
    t.add_row("MTP head", f"yes ({s['mtp_block']})" if s["n_nextn"] else "no")
    return t


def _bytes_table(title: str, sizes: dict[str, int], total: int, counts: dict[str, int] | None = None) -> Table:
    t = Table(title=title, title_justify="left")
    t.add_column("")
    if counts is not None:
        t.add_column("tensors", justify="right")
    t.add_column("bytes", justify="right")
    t.add_column("size", justify="right")
    t.add_column("share", justify="right")
    for name, n in sizes.items():
        cells = [name] + ([str(counts[name])] if counts is not None else [])
        t.add_row(*cells, f"{n:,}", _size(n), f"{100 * n / max(total, 1):.1f}%")
    return t


def render_plan(p: dict[str, Any], out: Console) -> None:
    budget = f"a VRAM budget of {_size(p['budget'])}" if p["budget"] is not None else "the CPU only"
    what = "[bold]hypothetical placement plan[/] (no CUDA GPU here; a run here uses the CPU)" \
        if p.get("hypothetical") else "[bold]placement plan[/]"
    out.print(f"{what} for {budget}, context {p['n_ctx']}, "
              f"snapshot ring {p['n_ring']}", soft_wrap=True)
    out.print(_placement_table(p))
    if p["budget"] is not None:
        out.print(_vram_table(p))
    out.print(_per_token_table(p))
    seconds = p["cpu_seconds_per_token"]
    bound = f", at most {1 / seconds:,.1f} tokens/s plain decode" if seconds else ""
    out.print(f"CPU roofline at {format_bandwidth(p['cpu_bandwidth'])}: {_duration(seconds)} per token{bound}; "
              "a k-token verify step reads the same bytes once for all k tokens", soft_wrap=True)
    for note in p["notes"]:
        out.print(f"note: {note}", soft_wrap=True)


def _placement_table(p: dict[str, Any]) -> Table:
    t = Table(title="what lives where", title_justify="left")
    for col, justify in (("part", "left"), ("side", "left"), ("tensors", "right"), ("size", "right"),
                         ("read per token", "right"), ("per draft", "right")):
        t.add_column(col, justify=justify)
    layers = {GPU: p["ffn_layers_on_gpu"], CPU: p["ffn_layers_on_cpu"]}
    for group in GROUPS:
        cells = p["groups"].get(group, {})
        for side in (s for s in (GPU, CPU) if s in cells):
            cell, label = cells[side], group
            if group in ("ffn", "router+shared") and layers[side]:
                label += f" ({_layer_ranges(layers[side])})"
            t.add_row(label, side.upper(), str(cell["tensors"]), _size(cell["bytes"]),
                      _size(cell["token_bytes"]), _size(cell["draft_bytes"]))
    if p["expert_cache"]:
        k = next(iter(p["expert_cache"].values()))
        t.add_row(f"expert cache ({k} per layer)", "GPU", "", _size(p["vram"].get("expert_cache", 0)),
                  f"{_size(p['expert_cache_token_bytes'])} of the experts'", "")
    if p["ffn_split"]:
        rows = sorted(set(p["ffn_split"].values()))
        t.add_row(f"ffn split (rows 0–{'/'.join(str(r - 1) for r in rows)})",
                  "GPU", "", _size(p["vram"].get("ffn_split", 0)), _size(p["ffn_split_token_bytes"]), "")
    return t


def _vram_table(p: dict[str, Any]) -> Table:
    t = Table(title="VRAM budget", title_justify="left")
    t.add_column("")
    t.add_column("size", justify="right")
    names = {"weights": "weights on the GPU", "kv_cache": f"KV cache (n_ctx {p['n_ctx']})",
             "gdn_state": f"GDN + conv state (live + {p['n_ring']} ring slots)", "scratch": "activation scratch",
             "margin": "safety margin", "expert_cache": "expert cache", "pcie_staging": "PCIe share staging",
             "weight_streaming": "prompt FFN weight streaming (2 layer slots)",
             "expert_streaming": "prompt expert streaming (2 layer slots)", "ffn_split": "split FFNs' device halves"}
    for key, n in p["vram"].items():
        t.add_row(names.get(key, key), _size(n))
    t.add_row("[bold]total[/]", f"[bold]{_size(p['vram_used'])}[/]")
    t.add_row("budget", _size(p["budget"]))
    t.add_row("left", _size(p["vram_left"]))
    return t


def _per_token_table(p: dict[str, Any]) -> Table:
    t = Table(title="bytes read per decoded token", title_justify="left")
    for col in ("side", "weights", "per token", "of which FFN", "per MTP draft"):
        t.add_column(col, justify="left" if col == "side" else "right")
    for side in (GPU, CPU):
        t.add_row(side.upper(), _size(p["weights"][side]), _size(p["per_token"][side]),
                  _size(p["ffn_per_token"][side]), _size(p["per_draft"][side]))
    return t


def _duration(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] → 'blk 0–2, 5, 7–8'."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return "blk " + ", ".join(f"{a}" if a == b else f"{a}–{b}" for a, b in runs)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
