"""dequantize_rows on the GPU (the twin of `cpu/quants.py`'s): float32 copies of chosen rows of a
device weight, i.e. embedding rows (get_rows).

Reuses the matvec's per-type lane decoding (`gpu/matmul/quants.py`): one warp per requested row walks
it tile by tile; each lane decodes its unit of the tile into shared memory at the slot the
matvec stages x in (`i·32 + (lane ^ i)` for its weight i), and the warp then writes the tile
out in column order, looking each column's slot up through the type's `owner` map. The values
are the same float32 weights the matvec multiplies with.
"""
from __future__ import annotations


import numpy as np
from numba import cuda, float32, uint32
from numba import types
from numba.np import numpy_support

from cpu import ggml_types as gt
from cpu.errors import HybridError

from .matmul.kernel_source import SOURCE_STAMP, kernel_factory
from .matmul.kernel_source import specialise as _specialise
from .matmul.quants import UNITS, LaneUnit
from .runtime.memory import stream

# Bound per ggml type in each specialised kernel's globals (see gpu.matmul.kernel_source.specialise).
load = prepare = weight = owner = None


def _kernel_template(E, TILE, RAW, FAC, TYPE_ID, STAMP):
    def dequantize_rows_kernel(w, w8, ids, out, cols):
        if TYPE_ID < 0 or STAMP < 0:  # never true: puts both in the cache key
            return
        tile = cuda.shared.array(TILE, float32)
        raw = cuda.local.array((1, RAW), uint32)
        fac = cuda.local.array((1, FAC), float32)
        lane = cuda.threadIdx.x
        t = cuda.blockIdx.x
        row = ids[t]
        for col0 in range(0, cols, TILE):
            load(w, w8, row, col0, cols, lane, raw, 0)
            prepare(raw, fac, 0, col0, cols, lane)
            for i in range(E):
                tile[i * 32 + (lane ^ i)] = weight(raw, fac, 0, i, lane)
            cuda.syncthreads()
            for ct in range(lane, TILE, 32):
                if col0 + ct < cols:
                    ln, i = owner(ct)
                    out[t, col0 + ct] = tile[i * 32 + (ln ^ i)]
            cuda.syncthreads()
    return dequantize_rows_kernel


def _build_kernel(unit: LaneUnit):
    functions = dict(load=unit.load, prepare=unit.prepare, weight=unit.weight, owner=unit.owner)
    constants = dict(E=unit.elems, TILE=unit.tile_cols, RAW=unit.raw_words, FAC=unit.factors,
                     TYPE_ID=unit.type.id, STAMP=SOURCE_STAMP)
    fn = _specialise(_kernel_template, constants, functions)
    fn.__name__ = fn.__qualname__ = f"dequantize_rows_{unit.type.name}"
    return fn


@kernel_factory
def kernel(type_id: int):
    return cuda.jit(cache=True)(_build_kernel(UNITS[type_id]))


def kernel_argtypes(unit: LaneUnit) -> tuple:
    """Numba argument types of a row kernel (w, w8, ids, out, cols), for PTX checks."""

    def matrix(dtype, ndim=2):
        return types.Array(numpy_support.from_dtype(np.dtype(dtype)), ndim, "C")

    return (matrix(unit.word), matrix(np.uint8), matrix(np.int64, 1), matrix(np.float32), types.int64)


def ptx_targets():
    """(name, python function, argument types) of every row kernel, for the sm_90 PTX check."""
    for unit in UNITS.values():
        yield f"dequantize_rows {unit.type.name}", _build_kernel(unit), kernel_argtypes(unit)


def dequantize_rows(wtype: int, w_dev, ids_dev, cols: int, out_dev) -> None:
    """out_dev (n, cols) = rows ids_dev (n,) int64 of the device weight w_dev (rows, row_bytes)."""
    unit = UNITS.get(int(wtype))
    if unit is None:
        raise HybridError(f"GPU embedding rows: unsupported tensor type {gt.type_name(int(wtype))}")
    if unit.type.row_bytes(cols) != w_dev.shape[1]:
        raise HybridError(f"GPU embedding rows: {unit.type.name} rows of {w_dev.shape[1]} bytes "
                          f"do not hold {cols} columns")
    n = ids_dev.shape[0]
    if n:
        kernel(unit.type.id)[n, 32, stream()](w_dev.view(unit.word), w_dev, ids_dev, out_dev, int(cols))
