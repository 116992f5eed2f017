"""Low-level GGUF parsing over a read-only memory map.

Reads the header (magic, version, metadata key/values, tensor infos) and hands back the
whole file as one uint8 numpy view over the map: tensor bytes are never copied or read
until someone touches them. Only little-endian GGUF v2/v3 is accepted (the layout llama.cpp
writes on every platform we run on). Every way a file can be malformed ends in a
`ModelError` whose message names the file and the problem.

Format (ggml's gguf.md): "GGUF" · u32 version · u64 n_tensors · u64 n_kv · n_kv × (string
key, u32 value type, value) · n_tensors × (string name, u32 n_dims, u64 ne[n_dims], u32
ggml type, u64 offset) · padding to `general.alignment` (default 32) · tensor data.
A string is u64 length + UTF-8 bytes; an array is u32 element type + u64 count + elements.
Strings decode with "surrogateescape": a token that is not valid UTF-8 keeps its bytes
(recover them with `s.encode("utf-8", "surrogateescape")`) instead of failing the load.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ModelError
from .metadata import safe_text

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
# Arrays of arrays: llama.cpp writes none, gguf-py reads them recursively. A bound keeps a
# crafted file from nesting deeper than the Python stack.
MAX_ARRAY_NESTING = 8

# GGUF value type id → (struct format, numpy dtype) for fixed-size scalars.
_STRING, _ARRAY, _BOOL = 8, 9, 7
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"),
    4: ("<I", "<u4"), 5: ("<i", "<i4"), 6: ("<f", "<f4"), _BOOL: ("<?", "<u1"),
    10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class RawTensorInfo:
    """One tensor-info record as stored: ggml type id (maybe unsupported), offset from the data start."""
    name: str
    ne: tuple[int, ...]
    type_id: int
    rel_offset: int


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensor_infos: list[RawTensorInfo]
    alignment: int
    header_end: int           # first byte after the tensor-info table (padding follows)
    data_offset: int          # absolute file offset of the (aligned) tensor data section
    file_size: int
    buf: np.ndarray           # uint8 view of the whole file over the memory map
    _mm: mmap.mmap | None

    @property
    def closed(self) -> bool:
        return self._mm is None

    def close(self) -> None:
        """Drop the map. Arrays already taken from `buf` keep it alive until they go away."""
        mm, self._mm = self._mm, None
        self.buf = np.empty(0, np.uint8)
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views still exported: the map is unmapped when the last one is freed


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Map `path` and parse its GGUF header. Raises ModelError for anything malformed."""
    path = Path(path)
    mm = _map(path)
    try:
        return _Parser(path, mm).parse()
    except BaseException:
        try:
            mm.close()
        except BufferError:
            pass  # a view is still referenced (e.g. by a traceback frame); freed with it
        raise


def _map(path: Path) -> mmap.mmap:
    if not path.exists():
        raise ModelError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelError(f"not a model file (it is a directory or device): {path}")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 4:
                raise ModelError(f"{path} is not a GGUF file (only {size} bytes)")
            # The map keeps its own handle on the file, so the Python file object can close now.
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ModelError(f"cannot read {path}: {e.strerror or e}") from None


class _Parser:
    """A cursor over the map with one bounds check per read, so a cut header gives a clear error."""

    def __init__(self, path: Path, mm: mmap.mmap):
        self.path, self.mm, self.size, self.pos = path, mm, len(mm), 0

    # --- primitives -----------------------------------------------------------------------
    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise ModelError(
                f"{self.path} is truncated: its GGUF header needs at least {self.pos + n:,} bytes for {what} "
                f"but the file has {self.size:,}")

    def scalar(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.mm, self.pos)
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        self.need(n, what)
        s = self.mm[self.pos:self.pos + n].decode("utf-8", "surrogateescape")
        self.pos += n
        return s

    # --- structure ------------------------------------------------------------------------
    def parse(self) -> GGUFFile:
        magic = bytes(self.mm[:4])
        if magic != MAGIC:
            raise ModelError(f"{self.path} is not a GGUF file (it starts with {magic!r}, expected b'GGUF')")
        self.pos = 4
        version = self.scalar("<I", "the version")
        if version not in SUPPORTED_VERSIONS:
            if struct.unpack("<I", struct.pack(">I", version))[0] in SUPPORTED_VERSIONS:
                raise ModelError(f"{self.path} is a big-endian GGUF; hybrid reads little-endian GGUF only")
            raise ModelError(
                f"{self.path} has GGUF version {version}; hybrid reads versions "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))}")
        n_tensors = self.scalar("<Q", "the tensor count")
        n_kv = self.scalar("<Q", "the metadata count")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self.string("a metadata key")
            shown = safe_text(key)      # keys are file text: messages carry them escaped and cut
            vtype = self.scalar("<I", f"the type of '{shown}'")
            metadata[key] = self.value(vtype, shown)
        infos = [self.tensor_info() for _ in range(n_tensors)]
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ModelError(f"{self.path}: 'general.alignment' is {safe_text(repr(alignment))}; "
                             "it must be a power of two")
        data_offset = -(-self.pos // alignment) * alignment
        if data_offset > self.size:
            raise ModelError(
                f"{self.path} is truncated: the tensor data should start at byte {data_offset:,} "
                f"but the file has {self.size:,}")
        return GGUFFile(self.path, version, metadata, infos, alignment, self.pos, data_offset, self.size,
                        np.frombuffer(self.mm, dtype=np.uint8), self.mm)

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            v = self.scalar(_SCALARS[vtype][0], f"the value of '{key}'")
            return bool(v) if vtype == _BOOL else v
        if vtype == _STRING:
            return self.string(f"the value of '{key}'")
        if vtype == _ARRAY:
            etype = self.scalar("<I", f"the element type of '{key}'")
            count = self.scalar("<Q", f"the length of '{key}'")
            return self.array(etype, count, key, depth)
        raise ModelError(f"{self.path}: metadata key '{key}' has unknown value type {vtype}")

    def array(self, etype: int, count: int, key: str, depth: int) -> list[Any]:
        what = f"the array '{key}' ({count:,} entries)"
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype][1])
            self.need(count * dtype.itemsize, what)
            a = np.frombuffer(self.mm, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            return a.astype(bool).tolist() if etype == _BOOL else a.tolist()
        if etype == _STRING:
            self.need(count * 8, what)  # every string costs at least its length field
            return self._strings(count, what)
        if etype == _ARRAY:
            if depth >= MAX_ARRAY_NESTING:
                raise ModelError(f"{self.path}: metadata array '{key}' nests arrays more than "
                                 f"{MAX_ARRAY_NESTING} deep")
            self.need(count * 12, what)  # every inner array costs at least its type and length
            return [self.value(_ARRAY, key, depth + 1) for _ in range(count)]
        raise ModelError(f"{self.path}: metadata array '{key}' has unknown element type {etype}")

    def _strings(self, count: int, what: str) -> list[str]:
        # The hot path for 250k-entry vocab and merge arrays: locals only, one bounds check each,
        # bytes slices of the map (measured faster than memoryview slices here).
        mm, size, pos, unpack = self.mm, self.size, self.pos, _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                break
            (n,) = unpack(mm, pos)
            pos += 8
            if pos + n > size:
                break
            append(mm[pos:pos + n].decode("utf-8", "surrogateescape"))
            pos += n
        self.pos = pos
        if len(out) != count:
            self.need(size + 1 - pos, what)  # always fails: reports the cut
        return out

    def tensor_info(self) -> RawTensorInfo:
        name = self.string("a tensor name")
        shown = safe_text(name)
        n_dims = self.scalar("<I", f"the dimension count of {shown}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise ModelError(f"{self.path}: tensor {shown} has {n_dims} dimensions; ggml allows 1..{MAX_DIMS}")
        self.need(8 * n_dims, f"the shape of {shown}")
        ne = struct.unpack_from(f"<{n_dims}Q", self.mm, self.pos)
        self.pos += 8 * n_dims
        type_id = self.scalar("<I", f"the type of {shown}")
        offset = self.scalar("<Q", f"the offset of {shown}")
        return RawTensorInfo(name, tuple(int(n) for n in ne), type_id, offset)
