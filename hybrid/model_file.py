"""A GGUF model opened for hybrid: typed config, a tensor table over the memory map, validation.

`open_model(path)` maps the file, parses the header and checks everything a run would trip
over later — architecture, tensor types, the full llama.cpp tensor layout for the config
(names, shapes, F32-only tensors), block-size divisibility and that every tensor's bytes lie
inside the file — so a bad file fails at once with one clear `ModelError`, never halfway
through a forward. Tensor bytes are not read here: `TensorInfo.data` is a zero-copy view.
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cpu import ggml_types as gt
from .config import ARCHITECTURES, ModelConfig, config_from_metadata
from .errors import ModelError
from cpu.ggml_types import GGMLType
from .gguf_file import GGUFFile, RawTensorInfo, read_gguf
from .metadata import Meta, safe_text, shown
from .layout import ROLES, LayoutOptions, TensorSpec, expected_tensors, options_from_names

OTHER_ROLE = "other"   # tensors a file may carry that the layout does not name (ignored by the engine)
IDENTITY_SAMPLES, IDENTITY_SAMPLE_BYTES = 64, 4096
DEFAULT_MODEL_NAME = "tiny-qwen35-mtp-Q4_K_M.gguf"


def default_model_path() -> Path:
    """The small trained qwen35 model (with MTP head) bundled with the package."""
    return Path(__file__).resolve().parent / "data" / DEFAULT_MODEL_NAME


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: GGMLType
    ne: tuple[int, ...]      # ggml order, fastest-varying first
    offset: int              # absolute file offset of the first byte
    nbytes: int
    role: str                # a layout role (embeddings, lm_head, trunk, ffn, mtp) or "other"
    _file: GGUFFile = field(repr=False, compare=False)

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order (ne reversed): (rows, row elements), experts first for 3-D tensors."""
        return self.ne[::-1]

    @property
    def n_elements(self) -> int:
        return math.prod(self.ne)

    @property
    def row_bytes(self) -> int:
        return self.type.row_bytes(self.ne[0])

    @property
    def data(self) -> np.ndarray:
        """Zero-copy uint8 view of the stored bytes, shape (*shape[:-1], row_bytes)."""
        if self._file.closed:
            raise ModelError(f"{self._file.path} is closed; cannot read tensor {self.name}")
        flat = self._file.buf[self.offset:self.offset + self.nbytes]
        return flat.reshape(*self.shape[:-1], self.row_bytes)

    def array(self) -> np.ndarray:
        """The values as float32 in numpy shape: a view for F32, a converted copy for F16/BF16."""
        raw = self.data
        if self.type is gt.F32:
            values = raw.view("<f4")
        elif self.type is gt.F16:
            values = raw.view("<f2").astype(np.float32)
        elif self.type is gt.BF16:
            # BF16 is the top half of an f32 bit pattern.
            values = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise TypeError(f"{self.name} is {self.type.name}; array() reads F32/F16/BF16 only "
                            "(quantised tensors need a dequantisation kernel)")
        return values.reshape(self.shape)


class ModelFile:
    """An opened, validated GDN-hybrid GGUF. Use as a context manager or call close()."""

    def __init__(self, g: GGUFFile, config: ModelConfig, tensors: dict[str, TensorInfo],
                 layout_options: LayoutOptions):
        self._file = g
        self.path: Path = g.path
        self.version: int = g.version
        self.metadata: dict[str, Any] = g.metadata
        self.config = config
        self.tensors = tensors
        self.layout_options = layout_options
        self.file_bytes: int = g.file_size
        self.data_offset: int = g.data_offset
        self.alignment: int = g.alignment
        self._identity: str | None = None

    @property
    def identity(self) -> str:
        """Which file this is, for tying saved states to it: the size and a hash of the header
        (metadata and tensor table) plus samples spread over the tensor data. Two files of the
        same architecture and shape (same header, other weights) differ in the samples; reading
        a few pages keeps it cheap for a file of any size."""
        if self._identity is None:
            buf = self._file.buf
            h = hashlib.sha256(memoryview(buf[:self._file.header_end]))
            start, end = self.data_offset, self.file_bytes
            for k in range(IDENTITY_SAMPLES):
                at = start + (end - start) * k // IDENTITY_SAMPLES
                h.update(memoryview(buf[at:at + IDENTITY_SAMPLE_BYTES]))
            self._identity = f"{self.file_bytes}:{h.hexdigest()[:32]}"
        return self._identity

    def bytes_by_type(self) -> dict[str, int]:
        """Tensor bytes per ggml type name, largest first."""
        return _sorted_desc(_sum_by(self.tensors.values(), lambda t: t.type.name, lambda t: t.nbytes))

    def count_by_type(self) -> dict[str, int]:
        """Number of tensors per ggml type name, most first."""
        return _sorted_desc(_sum_by(self.tensors.values(), lambda t: t.type.name, lambda t: 1))

    def bytes_by_role(self) -> dict[str, int]:
        """Tensor bytes per layout role, every role listed (in layout order); 'other' only if present."""
        sums = _sum_by(self.tensors.values(), lambda t: t.role, lambda t: t.nbytes)
        out = {role: sums.get(role, 0) for role in ROLES}
        if sums.get(OTHER_ROLE):
            out[OTHER_ROLE] = sums[OTHER_ROLE]
        return out

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "ModelFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return f"ModelFile({str(self.path)!r}, arch={c.arch}, n_layer={c.n_layer}, tensors={len(self.tensors)})"


def open_model(path: str | os.PathLike[str]) -> ModelFile:
    """Map and validate a llama.cpp GGUF of a supported architecture. Raises ModelError."""
    g = read_gguf(path)
    try:
        return _build(g)
    except BaseException:
        g.close()
        raise


# --- building and validation ------------------------------------------------------------------

def _build(g: GGUFFile) -> ModelFile:
    where = str(g.path)
    raw = _unique_by_name(g.tensor_infos, where)
    config = _config(g.metadata, raw, where)
    types = _types(raw, where)
    options = options_from_names(set(raw))
    specs = {s.name: s for s in expected_tensors(config, options)}
    _check_layout(raw, types, specs, where)
    tensors = {name: _tensor_info(g, r, types[name], specs) for name, r in raw.items()}
    _check_in_file(g, tensors, where)
    return ModelFile(g, config, tensors, options)


def _unique_by_name(infos: list[RawTensorInfo], where: str) -> dict[str, RawTensorInfo]:
    out: dict[str, RawTensorInfo] = {}
    for r in infos:
        if r.name in out:
            raise ModelError(f"{where}: tensor {safe_text(r.name)} appears twice in the file")
        out[r.name] = r
    return out


def _config(kv: dict[str, Any], raw: dict[str, RawTensorInfo], where: str) -> ModelConfig:
    try:
        arch = Meta(kv).str("general.architecture", None)
    except ModelError as e:
        raise ModelError(f"{where}: {e}") from None
    if arch is not None and arch not in ARCHITECTURES:   # say this before any tensor complaint
        raise ModelError(f"{where}: unsupported architecture {shown(arch)}; hybrid runs: {', '.join(ARCHITECTURES)}")
    embd = raw.get("token_embd.weight")
    if embd is not None and len(embd.ne) != 2:
        raise ModelError(f"{where}: token_embd.weight has ne={embd.ne}; expected 2 dims (n_embd, n_vocab)")
    # A missing token_embd is reported by the layout check below; n_vocab=0 only gets us there.
    n_vocab = embd.ne[1] if embd is not None else 0
    try:
        config = config_from_metadata(kv, n_vocab=n_vocab, tied_output="output.weight" not in raw)
    except ModelError as e:
        raise ModelError(f"{where}: {e}") from None
    # Every block has tensors of its own, so a block_count above the file's tensor count is
    # wrong: refusing it here keeps a crafted count from building per-layer tensor lists first.
    if config.n_layer_all > len(raw):
        raise ModelError(f"{where}: '{config.arch}.block_count' is {config.n_layer_all} but the file holds "
                         f"only {len(raw)} tensors (every block needs its own): missing required tensors")
    return config


def _types(raw: dict[str, RawTensorInfo], where: str) -> dict[str, GGMLType]:
    out: dict[str, GGMLType] = {}
    for name, r in raw.items():
        t = gt.SUPPORTED.get(r.type_id)
        if t is None:
            raise ModelError(f"{where}: {safe_text(name)} has type {gt.type_name(r.type_id)}; "
                             f"supported: {', '.join(gt.BY_NAME)}")
        out[name] = t
    return out


def _check_layout(raw: dict[str, RawTensorInfo], types: dict[str, GGMLType],
                  specs: dict[str, TensorSpec], where: str) -> None:
    for name, spec in specs.items():
        r = raw.get(name)
        if r is None:
            if spec.required:
                raise ModelError(f"{where}: missing required tensor {name}")
            continue
        if canonical_ne(r.ne) != canonical_ne(spec.ne):
            raise ModelError(f"{where}: {name} has ne={r.ne}, expected ne={spec.ne} from the model's config")
        if spec.f32_only and types[name] is not gt.F32:
            raise ModelError(f"{where}: {name} has type {types[name].name}; this tensor must be F32")
    for name, r in raw.items():
        t = types[name]
        if r.ne[0] % t.block_elems:
            raise ModelError(f"{where}: {safe_text(name)} has rows of {r.ne[0]} elements, not a multiple of the "
                             f"{t.name} block size {t.block_elems}")


def canonical_ne(ne) -> tuple[int, ...]:
    """The shape without its trailing unit dimensions (at least one dimension kept): the same
    tensor however many trailing 1s a writer stored, as llama.cpp compares them. The HF→GGUF
    converter writes the shared-expert gate (a Linear D→1) as (D, 1), llama-quantize as (D,)."""
    ne = tuple(ne)
    while len(ne) > 1 and ne[-1] == 1:
        ne = ne[:-1]
    return ne


def _tensor_info(g: GGUFFile, r: RawTensorInfo, t: GGMLType, specs: dict[str, TensorSpec]) -> TensorInfo:
    spec = specs.get(r.name)
    nbytes = t.row_bytes(r.ne[0]) * math.prod(r.ne[1:])
    return TensorInfo(r.name, t, canonical_ne(r.ne), g.data_offset + r.rel_offset, nbytes,
                      spec.role if spec else OTHER_ROLE, g)


def _check_in_file(g: GGUFFile, tensors: dict[str, TensorInfo], where: str) -> None:
    for t in sorted(tensors.values(), key=lambda t: t.offset):
        if (t.offset - g.data_offset) % g.alignment:
            raise ModelError(f"{where}: tensor {safe_text(t.name)} starts at data offset {t.offset - g.data_offset:,}, "
                             f"not a multiple of the alignment {g.alignment}")
        if t.offset + t.nbytes > g.file_size:
            raise ModelError(f"{where} is truncated: tensor {safe_text(t.name)} needs bytes up to "
                             f"{t.offset + t.nbytes:,} but the file has {g.file_size:,}")


def _sum_by(items, key, value) -> dict[str, int]:
    out: dict[str, int] = {}
    for it in items:
        k = key(it)
        out[k] = out.get(k, 0) + value(it)
    return out


def _sorted_desc(d: dict[str, int]) -> dict[str, int]:
    return dict(sorted(d.items(), key=lambda kv: (-kv[1], kv[0])))
