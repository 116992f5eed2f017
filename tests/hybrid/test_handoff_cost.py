"""tools/device/handoff_cost.py's arithmetic (the measurement itself needs a GPU)."""
from __future__ import annotations

import pytest

from tools.device import handoff_cost as hc


def test_fit_line_recovers_a_fixed_cost_and_a_rate():
    # 120 µs a call plus bytes at 100 GB/s
    points = [(b, 120e-6 + b / 100e9) for b in (40e6, 80e6, 160e6)]
    a, b = hc.fit_line(points)
    assert a == pytest.approx(120e-6) and 1 / b == pytest.approx(100e9)
    with pytest.raises(ValueError, match="two points"):
        hc.fit_line(points[:1])
    with pytest.raises(ValueError, match="one x"):
        hc.fit_line([(1.0, 2.0), (1.0, 3.0)])


def test_report_states_the_fit_and_each_budget():
    rows = [{"vram": v, "split_rows": [r], "tokens_per_s": 15.0, "calls_per_token": 64.0,
             "bytes_per_call": b, "seconds_per_call": 250e-6 + b / 120e9}
            for v, r, b in (("8GiB", 4096, 120e6), ("16GiB", 10240, 60e6))]
    text = hc.report("defaults", rows)
    assert "fixed cost a call 250 µs; its bytes stream at 120.0 GB/s" in text
    assert "| 8GiB | [4096] | 15.00 | 64 | 120.0 | 1250 | 96.0 |" in text
    flat = [dict(rows[0], seconds_per_call=1e-3), dict(rows[1], seconds_per_call=1e-3)]
    assert "no rate" in hc.report("flat", flat)
