"""Greedy picks of logit rows: the first maximum of each row, its softmax probability and the
maximum itself, in one (n, 3) float32 array (`PICK_ID`, `PICK_P`, `PICK_MAX` columns).

Why an op: greedy decoding and MTP drafts need one id per row, not the row. On the GPU the
vocabulary-wide row (~1 MB at 248k tokens) then stays on the device and 12 bytes come back
(gpu/argmax.py); here it saves the sampler's float64 copy of the row. The id is stored as a
float32, exact below 2**24 (the forward refuses picks for a larger vocabulary).

A row holding NaN gets a NaN maximum (the caller reports it, as the sampler does for NaN
logits); a row of -inf gets -inf. The probability is 1 / Σ exp(x − max), for a draft's
confidence test only: its last bits differ between the CPU and the GPU, the id never does.
"""
from __future__ import annotations

import numpy as np

PICK_ID, PICK_P, PICK_MAX = 0, 1, 2
PICK_COLUMNS = 3
MAX_EXACT_ID = 1 << 24          # float32 holds every integer below this exactly


def argmax_rows(logits: np.ndarray, picks: np.ndarray) -> None:
    """picks[i] = (id of the first maximum of logits[i], its softmax probability, the maximum)."""
    ids = np.argmax(logits, axis=1)                  # the first NaN where there is one: masked below
    best = logits[np.arange(logits.shape[0]), ids]
    with np.errstate(invalid="ignore", over="ignore"):
        total = np.exp(logits - best[:, None], dtype=np.float64).sum(axis=1)
    has_nan = np.isnan(logits).any(axis=1)
    picks[:, PICK_ID] = ids
    picks[:, PICK_P] = 1.0 / total
    picks[:, PICK_MAX] = np.where(has_nan, np.nan, best)
