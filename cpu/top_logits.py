"""The best logits of each row, the rest left out: what a sampler with top-k needs of a row.

Why an op: a sampled step (temperature > 0, llama.cpp's default chain) needs only the top_k
largest logits of a row (plus the few a repetition penalty may lower, see
`SamplerConfig.candidates`), yet a vocabulary-wide row is ~1 MB at 248k tokens: on the GPU its
copy to the host and the host's float64 pass over it cost milliseconds per row. The GPU op
(gpu/top_logits.py) selects on the device and sends back 8 bytes per candidate.

Layout: out (n, 2C) uint32, C the count: out[i, :C] the ids, out[i, C:] the float32 bits of
those logits, in no particular order (the caller sorts). The order that decides which C enter
is a total one: larger logit first, the lower id first among equal logits (-0.0 equals 0.0),
and NaN above everything, so a row holding NaN returns it and the sampler reports it.
"""
from __future__ import annotations

import numpy as np

MAX_CANDIDATES = 1024           # the most a sampler asks for; beyond, it takes whole rows
_SIGN = np.uint32(0x80000000)


def order_keys(logits: np.ndarray) -> np.ndarray:
    """uint32 keys whose unsigned order is the float order of `logits` (float32): sign bit
    flipped for positives, all bits for negatives; -0.0 keyed as 0.0, NaN as the largest key."""
    bits = np.ascontiguousarray(logits, np.float32).view(np.uint32)
    keys = np.where(bits & _SIGN, ~bits, bits | _SIGN)
    keys[bits == _SIGN] = _SIGN
    keys[np.isnan(logits)] = np.uint32(0xFFFFFFFF)
    return keys


def top_logits(logits: np.ndarray, out: np.ndarray) -> None:
    """out[i] = the C = out.shape[1] // 2 best entries of logits[i] (ids, then float32 bits)."""
    n, V = logits.shape
    C = out.shape[1] // 2
    if not 0 < C <= V:
        raise ValueError(f"top_logits keeps 1..{V} entries of a row, not {C}")
    # one uint64 per entry, larger = earlier in the order: key high, inverted id low
    rank = (order_keys(logits).astype(np.uint64) << np.uint64(32)) | (
        np.uint64(0xFFFFFFFF) - np.arange(V, dtype=np.uint64))
    best = np.argpartition(rank, V - C, axis=1)[:, V - C:]
    out[:, :C] = best
    out[:, C:] = np.ascontiguousarray(logits, np.float32).view(np.uint32)[np.arange(n)[:, None], best]
