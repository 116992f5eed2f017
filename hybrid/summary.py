"""What `hybrid info` reports about a model, as plain JSON-ready data (rendering lives in the CLI)."""
from __future__ import annotations

from typing import Any

from .config import ATTN, GDN, ModelConfig
from .metadata import Meta
from .model_file import ModelFile
from .placement import CPU, GPU, Plan


def describe_layers(c: ModelConfig) -> str:
    """e.g. '8 trunk: 6 GDN + 2 attention; MTP block at blk.8'."""
    n_gdn = sum(k == GDN for k in c.layer_kinds)
    n_attn = sum(k == ATTN for k in c.layer_kinds)
    text = f"{c.n_layer} trunk: {n_gdn} GDN + {n_attn} attention"
    if c.n_nextn:
        text += f"; MTP block at blk.{c.n_layer}"
    return text


def summarize(m: ModelFile) -> dict[str, Any]:
    """Everything `info` shows. Keys are stable: scripts read `hybrid info --json`."""
    c = m.config
    bytes_by_role = m.bytes_by_role()
    return {
        "path": str(m.path),
        "name": Meta(m.metadata).str("general.name", None),
        "architecture": c.arch,
        "gguf_version": m.version,
        "file_type": Meta(m.metadata).int("general.file_type", None),
        "n_layer": c.n_layer,
        "n_nextn": c.n_nextn,
        "mtp_block": f"blk.{c.n_layer}" if c.n_nextn else None,
        "layers": describe_layers(c),
        "n_embd": c.n_embd,
        "n_vocab": c.n_vocab,
        "tied_output": c.tied_output,
        "layer_kinds": list(c.layer_kinds),
        "n_tensors": len(m.tensors),
        "n_params": sum(t.n_elements for t in m.tensors.values()),
        "tensor_types": m.count_by_type(),
        "bytes_by_type": m.bytes_by_type(),
        "bytes_by_role": bytes_by_role,
        "tensor_bytes": sum(bytes_by_role.values()),
        "file_bytes": m.file_bytes,
        "config": c.to_dict(),
    }


def describe_plan(plan: Plan, cpu_bandwidth: float) -> dict[str, Any]:
    """The `plan` object of `hybrid info --plan --json`: Plan.to_dict plus the CPU roofline.

    cpu_seconds_per_token is the CPU side's per-token bytes at `cpu_bandwidth` (bytes/s): with
    the GPU part overlapped, plain decode can not beat it (DESIGN.md §4).
    """
    d = plan.to_dict(cpu_bandwidth)
    d["gpu_weight_share"] = plan.weight_bytes(GPU) / max(plan.weight_bytes(GPU) + plan.weight_bytes(CPU), 1)
    return d
