"""ggml block bytes → float32: the writer's own expectation of what each tensor holds.

Written from the layouts in docs/MODEL_FORMAT.md §6, with the float32 operation order of
ggml's reference decoders (`(d·sc)·q − dmin·m`), so the result is bit-identical to
`gguf.quants.dequantize`; the tests hold the two against each other.
"""
from __future__ import annotations

import numpy as np

from cpu.ggml_types import DECODED, GGMLType
from cpu.quants import dequantize as _engine_dequantize


def dequantize(data: np.ndarray, t: GGMLType, n: int) -> np.ndarray:
    """Rows of `t` blocks (rows, t.row_bytes(n)) uint8 → (rows, n) float32."""
    data = np.ascontiguousarray(data, dtype=np.uint8)
    rows = data.size // t.row_bytes(n)
    if t in DECODED:      # the engine's decoders (cpu.blocks), held against gguf-py by tests/cpu
        return _engine_dequantize(t.id, data.reshape(rows, t.row_bytes(n)), n)
    blocks = data.reshape(-1, t.block_bytes)
    return _DECODERS[t.name](blocks).reshape(rows, n)


def _half(b: np.ndarray) -> np.ndarray:
    """Two bytes per row → float32 column (nb, 1)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _f32(b):
    return b.view(np.float32)


def _f16(b):
    return b.view(np.float16).astype(np.float32)


def _bf16(b):
    return (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _q8_0(b):
    return _half(b[:, :2]) * b[:, 2:].view(np.int8).astype(np.float32)


def _q4_0(b):
    q = np.concatenate([b[:, 2:] & 0x0F, b[:, 2:] >> 4], axis=1).astype(np.float32) - np.float32(8)
    return _half(b[:, :2]) * q


def unpack_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12-byte K-quant field → eight 6-bit scales and mins, (nb, 8) each (`get_scale_min_k4`)."""
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return sc, m


def _low_nibbles_k(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K qs (nb, 128) → 4-bit codes (nb, 8, 32) by 32-element sub-block."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8)[None, None, :, None]
    return (q & 0x0F).reshape(-1, 8, 32)


def _affine_k(b: np.ndarray, q: np.ndarray) -> np.ndarray:
    d, dmin = _half(b[:, 0:2]), _half(b[:, 2:4])
    sc, m = unpack_scale_min(b[:, 4:16])
    scale = (d * sc.astype(np.float32))[..., None]
    offset = (dmin * m.astype(np.float32))[..., None]
    return (scale * q.astype(np.float32) - offset).reshape(-1, 256)


def _q4_k(b):
    return _affine_k(b, _low_nibbles_k(b[:, 16:144]))


def _q5_k(b):
    qh = b[:, 16:48]
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1   # bit j → sub-block j
    return _affine_k(b, _low_nibbles_k(b[:, 48:176]) | (high << 4))


def _q6_k(b):
    ql, qh = b[:, 0:128].reshape(-1, 2, 2, 32), b[:, 128:192].reshape(-1, 2, 1, 32)
    sc, d = b[:, 192:208].view(np.int8).astype(np.float32), _half(b[:, 208:210])
    lo = np.concatenate([ql & 0x0F, ql >> 4], axis=2)           # quarters k = 0..3 of each half
    hi = (qh >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]) & 3
    q = (lo | (hi << 4)).astype(np.float32) - np.float32(32)    # (nb, half, quarter, 32)
    scale = (d * sc).reshape(-1, 16, 1)
    return (scale * q.reshape(-1, 16, 16)).reshape(-1, 256)


_DECODERS = {
    "F32": _f32, "F16": _f16, "BF16": _bf16, "Q8_0": _q8_0, "Q4_0": _q4_0,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}
