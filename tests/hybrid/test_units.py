"""Sizes and bandwidths as typed on the command line, and their display."""
from __future__ import annotations

import pytest

from hybrid.errors import HybridError
from hybrid.units import format_bandwidth, format_size, parse_bandwidth, parse_size


@pytest.mark.parametrize("text, expected", [
    ("12GiB", 12 * 2**30), ("8G", 8 * 2**30), ("8g", 8 * 2**30), ("500MiB", 500 * 2**20),
    ("500M", 500 * 2**20), ("1.5GiB", 3 * 2**29), ("16GB", 16 * 10**9), ("100 MB", 10**8),
    ("64KiB", 65536), ("2k", 2048), ("1T", 2**40), ("1048576", 1048576), ("512B", 512),
    (" 3 GiB ", 3 * 2**30), (".5G", 2**29), (4096, 4096),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "12x", "12 GiBs", "-1G", "1.2.3G", "twelve", "12Gb/s"])
def test_parse_size_rejects_with_a_clear_message(text):
    with pytest.raises(HybridError, match="cannot read .* as a VRAM budget; write it like 12GiB"):
        parse_size(text, "VRAM budget")


def test_negative_int_size_is_refused():
    with pytest.raises(HybridError, match="≥ 0"):
        parse_size(-5)


@pytest.mark.parametrize("text, expected", [
    ("100GB/s", 100e9), ("100 GB/s", 100e9), ("80GiB/s", 80 * 2**30), ("100GB", 100e9), (2.5e10, 2.5e10),
])
def test_parse_bandwidth(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["0GB/s", "fast", 0.0])
def test_parse_bandwidth_rejects(text):
    with pytest.raises(HybridError):
        parse_bandwidth(text)


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (3 * 2**29, "1.50 GiB"), (12 * 2**30, "12.00 GiB"),
    (500 * 2**20, "500.00 MiB"), (2**41, "2.00 TiB"), (-(2**20), "-1.00 MiB"),
])
def test_format_size(n, text):
    assert format_size(n) == text


def test_format_parse_round_trip():
    for n in (2**20, 7 * 2**30, 123 * 2**20):
        assert parse_size(format_size(n).replace(" ", "")) == n


def test_format_bandwidth():
    assert format_bandwidth(104.24e9) == "104.2 GB/s"
