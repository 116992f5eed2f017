"""Typed reads of GGUF metadata values, and the one way file-derived text reaches a message.

A GGUF file is input we do not control: any key may hold any type (a string where a count
belongs, NaN for a token id, a 400-deep nested array for a flag list). `Meta` is the single
layer every reader goes through: each read names the key, checks the type and the range, and
fails with one `ModelError` that says what was found and what was expected.

`shown`/`safe_text` make file-derived text safe for a terminal: control bytes (escape
sequences, NULs, bytes that were not UTF-8) are written as escapes and long values are cut,
so a hostile name can neither drive the terminal nor flood it.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from .errors import ModelError

MAX_SHOWN = 120          # characters of one file-derived value in a message
_MISSING = object()


def safe_text(text: str, limit: int = MAX_SHOWN) -> str:
    """`text` with every non-printable character escaped (\\x1b, \\x00, \\udcff for a byte that
    was not UTF-8) and cut to about `limit` characters, saying how long it was."""
    cut = len(text) > limit
    head = text[:limit] if cut else text
    if not head.isprintable():
        head = "".join(c if c.isprintable() else _escape(c) for c in head)
    return f"{head}…({len(text):,} characters)" if cut else head


def _escape(c: str) -> str:
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def shown(value: Any, limit: int = MAX_SHOWN) -> str:
    """A file-derived value for a message: strings quoted, lists summarised, all of it safe."""
    if isinstance(value, str):
        return "'" + safe_text(value, limit) + "'"
    if isinstance(value, list):
        inner = ", ".join(shown(v, limit // 4) for v in value[:4])
        more = f", … {len(value):,} entries" if len(value) > 4 else ""
        return f"[{inner}{more}]"
    return safe_text(repr(value), limit)


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return type(value).__name__


class Meta:
    """Checked access to a GGUF key/value dict; `prefix` is prepended to every key."""

    def __init__(self, kv: Mapping[str, Any], prefix: str = ""):
        self.kv, self.prefix = kv, prefix

    def key(self, key: str) -> str:
        return self.prefix + key

    def has(self, key: str) -> bool:
        return self.key(key) in self.kv

    def _raw(self, key: str, default: Any) -> tuple[bool, Any]:
        """(present, value): the default when absent, an error when absent and required."""
        full = self.key(key)
        if full not in self.kv:
            if default is _MISSING:
                raise ModelError(f"GGUF metadata key '{safe_text(full)}' is missing")
            return False, default
        return True, self.kv[full]

    def bad(self, key: str, value: Any, expected: str, entry: int | None = None) -> ModelError:
        """The error for a value (or, with `entry`, one entry of an array value) of the wrong kind."""
        where = "" if entry is None else f" entry {entry}"
        return ModelError(f"GGUF metadata key '{safe_text(self.key(key))}'{where} is {_type_name(value)} "
                          f"{shown(value)}; expected {expected}")

    def int(self, key: str, default: Any = _MISSING, *, lo: int = 0, hi: int = 2**31 - 1) -> Any:
        """An integer in [lo, hi] (an integral float is accepted, as int() would; bools are not)."""
        present, value = self._raw(key, default)
        if not present:
            return value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.bad(key, value, f"an integer in {lo:,}..{hi:,}")
        if not lo <= value <= hi:
            raise self.bad(key, value, f"an integer in {lo:,}..{hi:,}")
        return value

    def float(self, key: str, default: Any = _MISSING, *, positive: bool = False) -> Any:
        """A finite number (> 0 with positive=True)."""
        present, value = self._raw(key, default)
        if not present:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or (positive and value <= 0):
            raise self.bad(key, value, "a finite number" + (" > 0" if positive else ""))
        return float(value)

    def str(self, key: str, default: Any = _MISSING) -> Any:
        present, value = self._raw(key, default)
        if not present:
            return value
        if not isinstance(value, str):
            raise self.bad(key, value, "a string")
        return value

    def bool(self, key: str, default: Any = _MISSING) -> Any:
        present, value = self._raw(key, default)
        if not present:
            return value
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise self.bad(key, value, "a boolean")

    def ints(self, key: str, default: Any = _MISSING, *, lo: int = 0, hi: int = 2**31 - 1,
             max_len: int | None = None) -> Any:
        """A flat array of integers (or booleans, as 0/1) in [lo, hi]."""
        present, value = self._raw(key, default)
        if not present:
            return value
        if not isinstance(value, list):
            raise self.bad(key, value, "an array of integers")
        if max_len is not None and len(value) > max_len:
            raise self.bad(key, value, f"an array of at most {max_len:,} integers")
        for i, v in enumerate(value):
            if isinstance(v, bool):
                v = int(v)
            if not isinstance(v, int) or not lo <= v <= hi:
                raise self.bad(key, v, f"an integer in {lo:,}..{hi:,}", entry=i)
        return [int(v) for v in value]

    def strs(self, key: str, default: Any = _MISSING) -> Any:
        """A flat array of strings."""
        present, value = self._raw(key, default)
        if not present:
            return value
        if not isinstance(value, list):
            raise self.bad(key, value, "an array of strings")
        for i, v in enumerate(value):
            if not isinstance(v, str):
                raise self.bad(key, v, "a string", entry=i)
        return value
