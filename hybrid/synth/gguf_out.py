"""The GGUF v3 container, written by hand so tensor data can be streamed in chunks.

`gguf.GGUFWriter` wants each tensor whole in memory; a 27B file has 2.5 GB tensors. The format
(llama.cpp `gguf.h`) is small: magic "GGUF", version, tensor and KV counts; the KV pairs; per
tensor its name, dims (ne, fastest first), ggml type and data offset; zero padding to the
alignment; then the tensor data, each tensor starting at an aligned offset. Little-endian.
"""
from __future__ import annotations

import struct
from typing import BinaryIO, Iterable, Sequence

import numpy as np
from gguf import GGUFValueType as V

from .metadata import KV

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3

_SCALAR = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
           V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d"}


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(t: V, value, item_type: V | None) -> bytes:
    if t == V.STRING:
        return _string(value)
    if t == V.ARRAY:
        if item_type is None or item_type == V.ARRAY:
            raise ValueError("an array needs a scalar or string item type")
        head = struct.pack("<IQ", int(item_type), len(value))
        if item_type == V.STRING:
            return head + b"".join(_string(v) for v in value)
        return head + np.asarray(value, dtype=np.dtype(_SCALAR[item_type])).tobytes()
    return struct.pack(_SCALAR[t], value)


def encode_kv(kv: KV) -> bytes:
    return _string(kv.key) + struct.pack("<I", int(kv.type)) + _value(kv.type, kv.value, kv.item_type)


def aligned(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def encode_header(kvs: Sequence[KV], tensors: Iterable[tuple[str, Sequence[int], int, int]],
                  alignment: int) -> bytes:
    """Everything before the tensor data, padded to `alignment`.

    `tensors`: (name, ne, ggml type id, nbytes) in file order; offsets are laid out here.
    """
    tensors = list(tensors)
    parts = [GGUF_MAGIC, struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(kvs))]
    parts += [encode_kv(kv) for kv in kvs]
    offset = 0
    for name, ne, type_id, nbytes in tensors:
        parts.append(_string(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, type_id, offset))
        offset += aligned(nbytes, alignment)
    head = b"".join(parts)
    return head + bytes(aligned(len(head), alignment) - len(head))


def write_padding(f: BinaryIO, written: int, alignment: int) -> int:
    """Zero-pad a tensor of `written` bytes up to the next aligned offset; returns the pad size."""
    pad = aligned(written, alignment) - written
    if pad:
        f.write(bytes(pad))
    return pad
