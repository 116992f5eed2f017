"""How a MoE row's uncached experts split between the GPU (fetching over PCIe) and the CPU: the
expert cache's routing rule (gpu/expert_cache.py), which the planner sizes staging by. Plain
numpy, so the planner uses it without starting CUDA."""
from __future__ import annotations

import numpy as np

# Calls of up to this many rows fetch their share: a verify step at the deepest draft (16) has 17,
# so every decode and verify step splits a row alike (lossless drafting); a prompt chunk fetches
# nothing (each pair fetches its expert alone, where the CPU reads an expert once for all rows).
PCIE_MAX_ROWS = 17


def pcie_counts(share: float, k: int) -> np.ndarray:
    """For u = 0..k uncached experts in a row, how many of them the GPU fetches over PCIe:
    share · u, rounded half up."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"the PCIe share is a fraction of a row's uncached experts, 0..1; got {share}")
    return np.floor(share * np.arange(k + 1) + 0.5).astype(np.int32)
