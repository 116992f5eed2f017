"""`hybrid info MODEL [--json]`: open and validate a GGUF, then describe it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from . import app
from ..model_file import default_model_path, open_model
from ..summary import summarize


@app.command("info")
def info(
    model: Annotated[Optional[Path], typer.Argument(
        help="GGUF model file (qwen35, qwen35moe or qwen3next). Default: the bundled tiny qwen35 model.",
        show_default=False)] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print one JSON object instead of tables (stable keys, for scripts).")] = False,
) -> None:
    """Check a model file and show its architecture, dimensions, tensor types and bytes per role."""
    with open_model(model or default_model_path()) as m:
        summary = summarize(m)
    if as_json:
        # plain print: rich would wrap long lines and break the JSON
        print(json.dumps(summary))
    else:
        render(summary, Console(highlight=False))


def render(s: dict[str, Any], out: Console) -> None:
    c = s["config"]
    out.print(f"[bold]{s['name'] or Path(s['path']).name}[/]  ({s['path']}, GGUF v{s['gguf_version']})",
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


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
