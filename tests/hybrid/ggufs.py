"""Craft small GGUF files for reader tests: valid tiny models of each arch, and broken ones.

Valid files are written with gguf-py's own `GGUFWriter` (an independent writer, so a reader bug
can not hide behind a matching writer bug). Broken files are valid files with a few bytes patched
or cut off. Weights are random bytes: the reader never interprets them.
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType as Q, GGUFValueType as V, GGUFWriter

from cpu import ggml_types as gt
from hybrid.config import config_from_metadata
from cpu.ggml_types import GGMLType
from hybrid.layout import LayoutOptions, expected_tensors


# --- metadata ---------------------------------------------------------------------------------

def tiny_metadata(arch: str, *, n_layer: int = 4, n_nextn: int = 1, **over: Any) -> dict[str, Any]:
    """A small self-consistent config for `arch`, as GGUF key → python value.

    Every row length is a multiple of 32 so all matrices can be Q8_0. `over` replaces keys by
    their short name (`feed_forward_length=96`); a value of None removes the key.
    """
    kv: dict[str, Any] = {
        "block_count": n_layer + n_nextn,
        "context_length": 2048,
        "embedding_length": 64,
        "feed_forward_length": 96,
        "attention.head_count": 2,
        "attention.head_count_kv": 1,
        "attention.key_length": 32,
        "attention.value_length": 32,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.dimension_count": 16,
        "rope.freq_base": 1e7,
        "ssm.conv_kernel": 4,
        "ssm.state_size": 16,
        "ssm.group_count": 2,
        "ssm.time_step_rank": 4,
        "ssm.inner_size": 64,
        "full_attention_interval": 4,
    }
    if n_nextn:
        kv["nextn_predict_layers"] = n_nextn
    if arch in ("qwen35", "qwen35moe"):
        kv["rope.dimension_sections"] = [3, 3, 2, 0]
    if arch in ("qwen35moe", "qwen3next"):
        kv.update({"expert_count": 4, "expert_used_count": 2,
                   "expert_feed_forward_length": 32, "expert_shared_feed_forward_length": 32})
    kv.update(over)
    out = {"general.architecture": arch}
    out.update({f"{arch}.{k}": v for k, v in kv.items() if v is not None})
    return out


# --- writing ----------------------------------------------------------------------------------

def default_type(name: str, ne: tuple[int, ...], f32_only: bool) -> GGMLType:
    """F32 where llama.cpp keeps F32, F16 embeddings (array() has a non-F32 case), Q8_0 elsewhere."""
    if f32_only or len(ne) == 1:
        return gt.F32
    if name == "token_embd.weight":
        return gt.F16
    return gt.Q8_0


def write_tiny_model(
    path: Path,
    arch: str = "qwen35",
    *,
    metadata: dict[str, Any] | None = None,
    n_vocab: int = 128,
    tied_output: bool = False,
    options: LayoutOptions = LayoutOptions(),
    types: dict[str, GGMLType] | None = None,
    drop: tuple[str, ...] = (),
    reshape: dict[str, tuple[int, ...]] | None = None,
    extra: dict[str, tuple[tuple[int, ...], GGMLType]] | None = None,
    alignment: int | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Write a tiny model of llama.cpp's layout; return name → the uint8 bytes written (numpy order).

    `types` overrides tensor types, `drop` leaves tensors out, `reshape` writes a different ne,
    `extra` adds tensors the layout does not name.
    """
    kv = metadata if metadata is not None else tiny_metadata(arch)
    cfg = config_from_metadata(kv, n_vocab=n_vocab, tied_output=tied_output)
    tensors: dict[str, tuple[tuple[int, ...], GGMLType]] = {}
    for s in expected_tensors(cfg, options):
        if s.required and s.name not in drop:
            tensors[s.name] = (s.ne, default_type(s.name, s.ne, s.f32_only))
    for name, ne in (reshape or {}).items():
        tensors[name] = (ne, tensors[name][1])
    for name, t in (types or {}).items():
        tensors[name] = (tensors[name][0], t)
    tensors.update(extra or {})
    return write_gguf(path, kv, tensors, alignment=alignment, seed=seed)


def write_gguf(path: Path, kv: dict[str, Any], tensors: dict[str, tuple[tuple[int, ...], GGMLType]],
               *, alignment: int | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, kv.get("general.architecture", "none"))
    if "general.architecture" not in kv:
        del w.kv_data[0]["general.architecture"]
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, value in kv.items():
        if key != "general.architecture":
            add_value(w, key, value)
    written = {}
    for name, (ne, t) in tensors.items():
        rows = ne[::-1][:-1]
        raw = rng.integers(0, 256, size=(*rows, t.row_bytes(ne[0])), dtype=np.uint8)
        if t in (gt.F32, gt.F16, gt.BF16):   # real floats, so array() results are finite and checkable
            raw = _floats(rng.standard_normal(ne[::-1]), t)
        w.add_tensor(name, raw, raw_dtype=Q(t.id))
        written[name] = raw
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def _floats(x: np.ndarray, t: GGMLType) -> np.ndarray:
    """float64 values stored as t, returned as the uint8 bytes (numpy order, last axis = row bytes)."""
    if t is gt.BF16:
        halves = (x.astype("<f4").view("<u4") >> 16).astype("<u2")   # truncation is a valid BF16 encoding
        return halves.view(np.uint8)
    return x.astype("<f4" if t is gt.F32 else "<f2").view(np.uint8)


def add_value(w: GGUFWriter, key: str, value: Any) -> None:
    """Store python values with the GGUF types llama.cpp's converter uses."""
    if isinstance(value, list):
        w.add_key_value(key, value, V.ARRAY, sub_type=_value_type(value[0], array_elem=True))
    else:
        w.add_key_value(key, value, _value_type(value))


def _value_type(v: Any, array_elem: bool = False) -> V:
    if isinstance(v, bool):
        return V.BOOL
    if isinstance(v, int):
        return V.INT32 if array_elem or v < 0 else V.UINT32   # rope sections are i32[], counts u32
    if isinstance(v, float):
        return V.FLOAT32
    if isinstance(v, str):
        return V.STRING
    if isinstance(v, list):
        return V.ARRAY
    raise TypeError(f"no GGUF type for {v!r}")


# --- breaking ---------------------------------------------------------------------------------

def patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def copy_prefix(src: Path, dst: Path, n_bytes: int) -> Path:
    """Copy the first n_bytes of src: a truncated file."""
    with open(src, "rb") as f:
        dst.write_bytes(f.read(n_bytes))
    return dst


def tensor_info_offset(path: Path, name: str) -> int:
    """File offset of tensor `name`'s n_dims field (just after its name in the tensor-info table)."""
    blob = path.read_bytes()
    encoded = name.encode()
    at = blob.find(struct.pack("<Q", len(encoded)) + encoded)
    assert at >= 0, f"{name} not in {path}"
    return at + 8 + len(encoded)


def patch_tensor_type(path: Path, name: str, type_id: int) -> None:
    """Overwrite the ggml type id of `name` in place (its bytes stay as they were)."""
    at = tensor_info_offset(path, name)
    (n_dims,) = struct.unpack_from("<I", path.read_bytes(), at)
    patch(path, at + 4 + 8 * n_dims, struct.pack("<I", type_id))


def write_broken(path: Path, breaker: Callable[[Path], None], **model: Any) -> Path:
    """A valid tiny model, then `breaker(path)` applied to it."""
    write_tiny_model(path, **model)
    breaker(path)
    return path
