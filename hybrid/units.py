"""Sizes and rates as people type them: `12GiB`, `8G`, `500MiB`, `100GB/s`.

Binary units (KiB, MiB, GiB, TiB) and the bare letters K, M, G, T count in powers of 1024,
the way `--vram 8G` is meant and the way GPU memory is sold; decimal units (kB, MB, GB, TB)
count in powers of 1000, the way bandwidths are quoted. Plain numbers are bytes.
"""
from __future__ import annotations

import re

from .errors import HybridError

KiB, MiB, GiB, TiB = (1 << 10), (1 << 20), (1 << 30), (1 << 40)

_SCALE = {
    "": 1, "b": 1,
    "k": KiB, "m": MiB, "g": GiB, "t": TiB,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
    "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, what: str = "size") -> int:
    """Bytes from '12GiB', '8G', '500MiB', '1.5 GB' or '1048576'. HybridError on anything else."""
    if isinstance(text, int):
        if text < 0:
            raise HybridError(f"{what} must be ≥ 0, got {text}")
        return text
    m = _SIZE.match(str(text))
    scale = _SCALE.get(m.group(2).lower()) if m else None
    if scale is None:
        raise HybridError(f"cannot read {text!r} as a {what}; write it like 12GiB, 8G, 500MiB or 16GB")
    return int(round(float(m.group(1)) * scale))


def parse_bandwidth(text: str | float, what: str = "bandwidth") -> float:
    """Bytes per second from '100GB/s', '80 GiB/s' or '100G' (the '/s' is optional)."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        value = float(parse_size(re.sub(r"/s\s*$", "", str(text).strip()), what))
    if value <= 0:
        raise HybridError(f"{what} must be > 0, got {text!r}")
    return value


def format_size(n: int | float) -> str:
    """'12.00 GiB', '500.00 MiB', '3.50 KiB', '12 B' (binary units, two decimals)."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{int(n)} B"


def format_bandwidth(bytes_per_s: float) -> str:
    """'104.2 GB/s' (decimal, as bandwidths are quoted)."""
    return f"{bytes_per_s / 1e9:.1f} GB/s"
