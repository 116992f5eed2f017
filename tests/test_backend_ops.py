"""Every op of the op set × weight type × a few shapes × {cpu, gpu}, against numpy references:
one table, in the manner of llama.cpp's tests/test-backend-ops.cpp.

`cpu/ops.py` and `gpu/ops.py` expose the same names with the same argument order; `OPS` below
has one row per op: a case generator (shapes, and the weight types where the op takes a
quantised weight), the call through a backend, a float64 numpy reference and its tolerance.
pytest runs each (op, case, backend) as one test, with ids like `matvec-Q4_K-5x256-n3-gpu`.
A backend an op does not run on is an explicit entry (`not_on`), reported as a skip with the
reason, never a missing row.

* Weight types come from `cpu.ggml_types.SUPPORTED`, blocks from `tests/cpu/quant_data.py`
  (gguf's quantiser, or random valid blocks), their values from `gguf.quants.dequantize`.
  A new type is a row by itself: `PRODUCT_REL` gives it a tolerance where the default is not
  its, `X_AS_IS` marks a kernel that takes x unrounded, and a backend without a kernel for it
  shows a not-on entry by itself.
* Activations meet a weight as each backend rounds them: the CPU as llama.cpp's CPU backend
  does (the format per type is `cpu.activations.FORMAT_OF`; the numbers come from the numpy
  statement in tests/reference/llama_cpp_rounding.py; Q8_1's sum s is not used there, the CPU's
  decoded kernels take Q8_1 as codes times d), the GPU's int8 kernels per block of 32
  (tests/gpu/test_matvec_q8.py states them; Q4_1/Q5_1's min meets Q8_1's s, Q2_K's the int sums
  of x per 16, as in llama.cpp),
  its float kernel not at all.
* Per-slot bit identity, the property lossless drafting rests on, is checked where an op takes
  several token rows: row i of an n-row call has the bits of a one-row call on row i.
* GPU shapes are tiny: on a box without a GPU the CUDA simulator runs them (tests/conftest.py).

The ops' dedicated tests (tests/cpu/test_*.py, tests/gpu/test_*.py) keep what a table row does
not state: bit patterns pinned, extremes, in-place calls, validation, kernel-internal paths.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from numba import cuda

import cpu.ops
import gpu.ops
from cpu.activations import FORMAT_OF
from cpu.argmax import PICK_COLUMNS, PICK_ID, PICK_MAX, PICK_P
from cpu.ggml_types import SUPPORTED
from cpu.matmul import MIN_SLOTS as MATMUL_MIN_SLOTS
from gpu.matmul.gemm import GEMM_MIN_ROWS
from gpu.matmul.quants import UNITS as GPU_UNITS
from gpu.matmul.quants_q8 import NATURAL
from gpu.matmul.quants_q8 import UNITS as GPU_INT8_UNITS
from hybrid.weights import DenseFFN, Experts, Matrix, MoEFFN
from tests.cpu.quant_data import dequantized, random_rows
from tests.cpu.test_attention import ref_attention
from tests.cpu.test_gdn import ref_conv, ref_delta, ref_l2
from tests.cpu.test_moe import reference_moe
from tests.cpu.test_ffn import silu
from tests.cpu.test_norm import ref_rms
from tests.cpu.test_rope import ref_rope
from tests.cpu.test_top_logits import expected as top_expected
from tests.cpu.test_top_logits import rows_with_ties
from tests.gpu.test_gemm import fp16_bound
from tests.gpu.test_matvec_q8 import BSUM_MIN, quantize_reference, scale_part
from tests.gpu.test_ops import quick_simulator  # noqa: F401 (autouse fixture: a faster simulator)
from tests.reference.llama_cpp_rounding import q8_1, round_activations

EPS = 1e-6


# --- backends ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Backend:
    name: str
    ops: object                      # the module: cpu.ops or gpu.ops
    dev: Callable                    # a host array as the backend's ops take it
    host: Callable                   # a backend array back as a numpy array


CPU = Backend("cpu", cpu.ops, lambda a: np.array(a, order="C"), np.asarray)     # a copy, as an upload is
GPU = Backend("gpu", gpu.ops, lambda a: cuda.to_device(np.ascontiguousarray(a)), lambda a: a.copy_to_host())
BACKENDS = (CPU, GPU)


# --- weight types -------------------------------------------------------------------------------------

TYPES = tuple(t.name for t in SUPPORTED.values())
BY_NAME = {t.name: t for t in SUPPORTED.values()}
# Error of a product relative to Σ|w|·|x̂| once x̂ (x as the kernel rounds it) is in the reference:
# float32 accumulation only. A type whose kernel is looser gets a line here.
PRODUCT_REL: dict[str, float] = {"F32": 1e-5, "F16": 1e-5, "BF16": 1e-5}
PRODUCT_REL_QUANT = 1e-4


def product_rel(name: str) -> float:
    return PRODUCT_REL.get(name, PRODUCT_REL_QUANT)


def type_cases(name: str, backend: str, case_id: str, params: dict) -> tuple[str, dict]:
    """One case of a weight type; where `backend` has no kernel for the type, an explicit
    not-on-this-backend entry (reported as a skip) instead."""
    if backend == "gpu" and BY_NAME[name].id not in GPU_UNITS:
        return case_id, dict(not_on="no GPU kernel for this type (gpu.matmul.quants.UNITS)")
    return case_id, params


# (backend, type) pairs whose kernel takes x unrounded where llama.cpp's CPU rounds it (a
# decode-then-dot kernel, say): one line each.
X_AS_IS: set[tuple[str, str]] = set()


# The weight type whose rounding each activation format is, for llama_cpp_rounding (Q8_1 has
# Q8_0's codes and scales; its fp16 sum only enters through a weight's min, within tolerance).
_ROUNDED_AS = {"Q8_0": T.Q8_0, "Q8_1": T.Q8_0, "Q8_K": T.Q4_K, "F16": T.F16, "BF16": T.BF16, "F32": T.F32}


def cols_for(name: str, backend: str) -> int:
    """Columns of a weight row: on the CPU several blocks (32-element blocks: one 256-column span
    and a tail of 3 blocks); on the simulator the fewest that still give more than one block."""
    elems = BY_NAME[name].block_elems
    if backend == "gpu":
        return {256: 256, 32: 96}.get(elems, 64)
    return {256: 512, 32: 352}.get(elems, 70)


def product_reference(name: str, w: np.ndarray, x: np.ndarray, backend: str):
    """(x·Wᵀ, Σ|x̂|·|W|ᵀ) in float64 with x as `backend`'s kernel rounds it for weight type `name`."""
    t = BY_NAME[name]
    wd = dequantized(name, w, x.shape[1])
    if backend == "gpu" and t.id in GPU_INT8_UNITS and GPU_INT8_UNITS[t.id].x_layout != NATURAL:
        # the GPU's K-quants: x per 32 with a float32 scale; the −dmin·m part takes x as it is
        # (Q2_K's takes x̂: its int sums per 16, as llama.cpp's bsums)
        xq, dx, _, _ = quantize_reference(x, GPU_INT8_UNITS[t.id].x_layout)
        x_hat = xq * np.repeat(dx.astype(np.float64), 32, axis=1)
        a = scale_part(t, w).astype(np.float64).reshape(wd.shape)
        x_min = x_hat if name in BSUM_MIN else x.astype(np.float64)
        return x_hat @ a.T + x_min @ (wd - a).T, np.abs(x_hat) @ np.abs(a).T + np.abs(x_min) @ np.abs(wd - a).T
    if backend == "gpu" and FORMAT_OF[t.id].name == "Q8_1":
        # Q4_1/Q5_1 on the GPU: d·q meets Q8_1's codes, the min m meets its fp16 sum s (per block),
        # as in llama.cpp's vec_dot_q4_1_q8_1
        qs, d, s = q8_1(x)
        x_hat = qs.astype(np.float64) * np.repeat(d.astype(np.float64), 32, axis=1)
        a = scale_part(t, w).astype(np.float64).reshape(wd.shape)
        m = (wd - a)[:, ::32]
        s = s.astype(np.float64)
        return x_hat @ a.T + s @ m.T, np.abs(x_hat) @ np.abs(a).T + np.abs(s) @ np.abs(m).T
    if (backend == "gpu" and t.id not in GPU_INT8_UNITS) or (backend, name) in X_AS_IS:
        xr = x.astype(np.float64)                      # a float kernel: x as it is
    else:
        xr = round_activations(x, _ROUNDED_AS[FORMAT_OF[t.id].name])
    return xr @ wd.T, np.abs(xr) @ np.abs(wd).T


def bits_equal(a, b) -> bool:
    return np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


def within(got, want, bound, what=""):
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), f"{what}: NaN/inf (an unwritten entry?)"
    excess = np.abs(got - want) - bound
    assert np.all(excess <= 0), f"{what}: max excess {excess.max():.3g}"


@contextlib.contextmanager
def float_edges_expected():
    """Quiet numpy's overflow / divide warnings where an op meets them on purpose: the simulator
    runs kernels in numpy scalars, on threads of its own (so np.errstate, per thread, would not)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"(overflow|divide by zero) encountered", RuntimeWarning)
        yield


def f32(a):
    return np.ascontiguousarray(a, dtype=np.float32)


# --- the rows -------------------------------------------------------------------------------------------
# Each op: cases(backend) → [(id, params)], run(backend, params, rng) checks one case.

@dataclass(frozen=True)
class Op:
    name: str
    cases: Callable[[str], list]
    run: Callable[[Backend, dict, np.random.Generator], None]
    not_on: dict = field(default_factory=dict)     # backend name → why the op is not run there


def per_slot(backend: Backend, call, x, got):
    """Row i of an n-row call has the bits of the one-row call on x[i]."""
    for i in range(x.shape[0]):
        assert bits_equal(call(x[i:i + 1]), got[i:i + 1]), f"slot {i}"


# matvec: every type, one and several slots

def matvec_cases(backend):
    """n = 1 and 3: the decode matvec; the last n: the prompt-chunk kernel (cpu.matmul on the
    CPU, the GEMM of gpu.matmul.gemm on the GPU)."""
    rows = 5 if backend == "gpu" else 37                 # never a multiple of a tile's rows
    return [type_cases(name, backend, f"{name}-{rows}x{cols_for(name, backend)}-n{n}", dict(name=name, rows=rows, n=n))
            for name in TYPES for n in ((1, 3, GEMM_MIN_ROWS) if backend == "gpu" else (1, 3, MATMUL_MIN_SLOTS))]


def run_matvec(b: Backend, p, rng):
    name, rows, n = p["name"], p["rows"], p["n"]
    cols = cols_for(name, b.name)
    w = random_rows(name, rows, cols, rng)
    x = f32(rng.standard_normal((n, cols)))
    w_dev, tid = b.dev(w), BY_NAME[name].id

    def call(xs):
        out = b.dev(np.full((xs.shape[0], rows), np.nan, np.float32))      # poisoned
        b.ops.matvec(tid, w_dev, b.dev(xs), out)
        return b.host(out)

    got = call(x)
    if b.name == "gpu" and n >= GEMM_MIN_ROWS:
        # the GPU's GEMM: x unrounded, products in fp16 on tensor cores (float32 for F32 weights);
        # its rows keep their bits whatever the call's other rows (tests/gpu/test_gemm.py), but
        # they are not the matvec's bits, so no per-slot check against one-row calls here
        xr = x.astype(np.float64)
        wd = dequantized(name, w, cols)
        want, mag = xr @ wd.T, np.abs(xr) @ np.abs(wd).T
        within(got, want, fp16_bound(BY_NAME[name], w, x, mag) + 1e-30, name)
        return
    want, mag = product_reference(name, w, x, b.name)
    within(got, want, product_rel(name) * mag + 1e-30, name)
    if n > 1:
        per_slot(b, call, x, got)


# matvecs: one x, several matrices of different types (the GPU quantises x once for them all)

MATVECS_SETS = (("Q4_K", "Q6_K", "Q8_0"), ("Q8_0", "Q4_0", "F16"), ("Q4_1", "IQ4_NL", "Q5_0"),
                ("IQ4_XS", "Q3_K", "Q2_K"), ("IQ2_XS", "IQ2_S", "IQ1_M"), ("IQ3_XXS", "MXFP4", "IQ2_XXS"))


def matvecs_cases(backend):
    return [(f"{'+'.join(s)}-n{n}", dict(names=s, n=n)) for s in MATVECS_SETS for n in (1, 3)]


def run_matvecs(b: Backend, p, rng):
    names, n = p["names"], p["n"]
    cols = 256 if b.name == "gpu" else 512
    rows = (5, 7, 3)
    ws = [random_rows(name, r, cols, rng) for name, r in zip(names, rows)]
    x = f32(rng.standard_normal((n, cols)))
    w_devs = [b.dev(w) for w in ws]

    def call(xs):
        outs = [b.dev(np.full((xs.shape[0], r), np.nan, np.float32)) for r in rows]
        b.ops.matvecs([(BY_NAME[nm].id, w, o) for nm, w, o in zip(names, w_devs, outs)], b.dev(xs))
        return np.concatenate([b.host(o) for o in outs], axis=1)

    got = call(x)
    at = np.cumsum((0,) + rows)
    for k, (name, w) in enumerate(zip(names, ws)):
        want, mag = product_reference(name, w, x, b.name)
        within(got[:, at[k]:at[k + 1]], want, product_rel(name) * mag + 1e-30, name)
    if n > 1:
        per_slot(b, call, x, got)


# swiglu: gate and up of possibly different types

SWIGLU_PAIRS = (("Q4_K", "Q4_K"), ("Q5_K", "Q6_K"), ("Q8_0", "Q4_0"), ("Q6_K", "Q8_0"), ("F16", "BF16"), ("F32", "Q4_K"),
                ("F32", "F32"), ("Q5_1", "Q5_0"))


def swiglu_cases(backend):
    rows = 5 if backend == "gpu" else 19
    return [(f"{g}+{u}-{rows}x{256 if backend == 'gpu' else 512}-n{n}", dict(gate=g, up=u, rows=rows, n=n))
            for g, u in SWIGLU_PAIRS for n in ((1, 3) if backend == "gpu" else (1, 3, 5, 9, 16))]


def run_swiglu(b: Backend, p, rng):
    gate, up, rows, n = p["gate"], p["up"], p["rows"], p["n"]
    cols = 256 if b.name == "gpu" else 512
    wg, wu = random_rows(gate, rows, cols, rng), random_rows(up, rows, cols, rng)
    x = f32(rng.standard_normal((n, cols)))
    wg_dev, wu_dev = b.dev(wg), b.dev(wu)

    def call(xs):
        h = b.dev(np.full((xs.shape[0], rows), np.nan, np.float32))
        with float_edges_expected():        # exp(−g) overflows for g ≪ 0: SiLU → −0, as meant
            b.ops.swiglu(BY_NAME[gate].id, wg_dev, BY_NAME[up].id, wu_dev, b.dev(xs), h)
        return b.host(h)

    got = call(x)
    g, mg = product_reference(gate, wg, x, b.name)
    u, mu = product_reference(up, wu, x, b.name)
    # |Δh| ≤ |silu'|·|Δg|·|u| + |silu(g)|·|Δu|, |silu'| < 1.1
    bound = 1.1 * product_rel(gate) * mg * np.abs(u) + np.abs(silu(g)) * product_rel(up) * mu + 1e-30
    within(got, silu(g) * u, bound)
    if n > 1:
        per_slot(b, call, x, got)


# norms

NORM_TOL = {"cpu": dict(rtol=2e-6, atol=2e-6), "gpu": dict(rtol=2e-5, atol=2e-6)}   # the GPU sums in a tree


def norm_cases(backend):
    return [(f"{n}x{D}", dict(n=n, D=D)) for n, D in ((1, 64), (5, 33), (3, 300 if backend == "gpu" else 512))]


def run_rms_norm(b: Backend, p, rng):
    x = f32(rng.standard_normal((p["n"], p["D"])) * 3)
    w = f32(rng.standard_normal(p["D"]))
    out = b.dev(np.full_like(x, np.nan))
    b.ops.rms_norm(b.dev(x), b.dev(w), EPS, out)
    np.testing.assert_allclose(b.host(out), ref_rms(x, w), **NORM_TOL[b.name])


def run_add_rms_norm(b: Backend, p, rng):
    x = f32(rng.standard_normal((p["n"], p["D"])) * 3)
    y = f32(rng.standard_normal((p["n"], p["D"])))
    w = f32(rng.standard_normal(p["D"]))
    x_dev, out = b.dev(x), b.dev(np.full_like(x, np.nan))
    b.ops.add_rms_norm(x_dev, b.dev(y), b.dev(w), EPS, out)
    np.testing.assert_array_equal(b.host(x_dev), x + y)          # the residual: one float32 add
    np.testing.assert_allclose(b.host(out), ref_rms(x + y, w), **NORM_TOL[b.name])


def run_add_inplace(b: Backend, p, rng):
    x = f32(rng.standard_normal((p["n"], p["D"])))
    y = f32(rng.standard_normal((p["n"], p["D"])))
    x_dev = b.dev(x)
    b.ops.add_inplace(x_dev, b.dev(y))
    np.testing.assert_array_equal(b.host(x_dev), x + y)


def head_cases(backend):
    return [(f"{n}x{H}x{d}", dict(n=n, H=H, d=d)) for n, H, d in ((1, 2, 16), (3, 3, 40))]


def run_head_rms_norm(b: Backend, p, rng):
    """The query half of a packed [q | gate] projection, per head."""
    n, H, d = p["n"], p["H"], p["d"]
    qg = f32(rng.standard_normal((n, H, 2 * d)))
    w = f32(rng.standard_normal(d))
    out = b.dev(np.full((n, H, d), np.nan, np.float32))
    b.ops.head_rms_norm(b.dev(qg), b.dev(w), EPS, out)
    np.testing.assert_allclose(b.host(out), ref_rms(qg[:, :, :d], w), **NORM_TOL[b.name])


def run_gated_rms_norm(b: Backend, p, rng):
    n, H, d = p["n"], p["H"], p["d"]
    o = f32(rng.standard_normal((n, H * d)))
    z = f32(rng.standard_normal((n, H * d)) * 2)
    w = f32(rng.standard_normal(d))
    out = b.dev(np.full_like(o, np.nan))
    b.ops.gated_rms_norm(b.dev(o), b.dev(z), b.dev(w), EPS, out)
    want = ref_rms(o.reshape(n, H, d), w).reshape(n, H * d) * silu(z)
    np.testing.assert_allclose(b.host(out), want, rtol=1e-5, atol=1e-6)


def run_l2_norm_heads(b: Backend, p, rng):
    """The leading H heads normalised, the one after them left alone; a zero head meets eps."""
    n, H, d = p["n"], p["H"], p["d"]
    x = f32(rng.standard_normal((n, (H + 1) * d)))
    x[0, :d] = 0.0
    want = x.astype(np.float64)
    want[:, :H * d] = ref_l2(x[:, :H * d].reshape(n, H, d)).reshape(n, -1)
    x_dev = b.dev(x)
    b.ops.l2_norm_heads(x_dev, H, d, EPS)
    np.testing.assert_allclose(b.host(x_dev), want, **NORM_TOL[b.name])


# rope

def rope_cases(backend):
    return [(f"{n}x{H}x{d}-rot{r}", dict(n=n, H=H, d=d, n_rot=r, theta=th))
            for n, H, d, r, th in ((1, 2, 64, 16, 1e7), (3, 2, 24, 8, 1e4))]


def run_rope(b: Backend, p, rng):
    n, H, d, n_rot, theta = p["n"], p["H"], p["d"], p["n_rot"], p["theta"]
    x = f32(rng.standard_normal((n, H, d)))
    pos = np.array([0, 1_000, 200_000][:n] if n > 1 else [37_000], np.int64)
    x_dev = b.dev(x)
    b.ops.rope_neox(x_dev, b.dev(pos), b.ops.rope_inv_freq(n_rot, theta))
    got = b.host(x_dev)
    np.testing.assert_allclose(got, ref_rope(x, pos, n_rot, theta), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:])


# attention: kv_append then gated_attention (the two ops the forward calls back to back)

def attention_cases(backend):
    return [(f"n{n}-before{nb}-{H}x{Hkv}x{d}", dict(n=n, n_before=nb, H=H, Hkv=Hkv, d=d))
            for n, nb, H, Hkv, d in ((1, 0, 2, 1, 16), (3, 5, 4, 2, 40))]


def run_attention(b: Backend, p, rng):
    n, n_before, H, Hkv, d = p["n"], p["n_before"], p["H"], p["Hkv"], p["d"]
    P, n_ctx = n_before + n, n_before + n + 3
    q = f32(rng.standard_normal((n, H, d)))
    gate = f32(rng.standard_normal((n, H, d)))
    qg = f32(np.concatenate([rng.standard_normal((n, H, d)), gate], -1))     # [junk | gate]
    K = f32(rng.standard_normal((P, Hkv, d)) * 2)
    V = f32(rng.standard_normal((P, Hkv, d)))
    # the caches in the op set's own element type (fp16 on the GPU: K and V are rounded to
    # nearest on the way in, and attention reads the rounded values); past the positions
    # written so far they hold NaN: reading there shows
    kv_type = b.ops.KV_DTYPE
    caches = [np.full((Hkv, n_ctx, d), np.nan, kv_type) for _ in range(2)]
    for c, src in zip(caches, (K, V)):
        c[:, :n_before] = src[:n_before].transpose(1, 0, 2)
    k_cache, v_cache = b.dev(caches[0]), b.dev(caches[1])
    pos = b.dev(np.arange(n_before, P, dtype=np.int64))
    b.ops.kv_append(b.dev(K[n_before:]), b.dev(V[n_before:]), k_cache, v_cache, pos)
    out = b.dev(np.full((n, H * d), np.nan, np.float32))
    b.ops.gated_attention(b.dev(q), b.dev(qg), k_cache, v_cache, pos, out)
    K, V = K.astype(kv_type), V.astype(kv_type)
    np.testing.assert_array_equal(b.host(k_cache)[:, :P], K.transpose(1, 0, 2))
    np.testing.assert_array_equal(b.host(v_cache)[:, :P], V.transpose(1, 0, 2))
    group = H // Hkv
    np.testing.assert_allclose(b.host(out), ref_attention(q, gate, K, V, n_before, lambda h: h // group),
                               rtol=2e-5, atol=2e-6)


# gated delta net: the conv, the delta rule, and the fused mixer made of them and two norms

def conv_cases(backend):
    return [(f"n{n}-K{K}-C{C}", dict(n=n, K=K, C=C)) for n, K, C in ((1, 4, 24), (3, 4, 40))]


def run_conv1d_silu(b: Backend, p, rng):
    """Output, the rolled state, and ring slot i = the window after token i."""
    n, K, C = p["n"], p["K"], p["C"]
    mix = f32(rng.standard_normal((n, C)))
    state = f32(rng.standard_normal((K - 1, C)))
    w_ck = f32(rng.standard_normal((C, K)))
    want, want_state, windows = ref_conv(mix, state, w_ck)
    state_dev, out = b.dev(state), b.dev(np.full((n, C), np.nan, np.float32))
    ring = b.dev(np.full((n, K - 1, C), np.nan, np.float32))
    b.ops.conv1d_silu(b.dev(mix), b.dev(w_ck.T), state_dev, out, ring)
    np.testing.assert_allclose(b.host(out), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(b.host(state_dev), want_state)
    np.testing.assert_array_equal(b.host(ring), np.array(windows))


def gdn_inputs(rng, n, Hk, Hv, dk):
    """Inputs of the delta rule, q and k already unit vectors (as the L2 norm leaves them)."""
    C = 2 * Hk * dk + Hv * dk
    u = f32(rng.standard_normal((n, C)))
    u[:, :2 * Hk * dk] = ref_l2(u[:, :2 * Hk * dk].reshape(n, 2 * Hk, dk)).reshape(n, -1)
    return dict(u=u, b=f32(rng.standard_normal((n, Hv))), alpha=f32(rng.standard_normal((n, Hv))),
                ssm_a=f32(-np.exp(rng.standard_normal(Hv))), dt_bias=f32(rng.standard_normal(Hv)),
                ssm=f32(rng.standard_normal((Hv, dk, dk)) * 0.3))


def delta_cases(backend):
    return [(f"n{n}-{'grouped' if g else 'tiled'}-dk{dk}", dict(n=n, grouped=g, dk=dk, Hk=2, Hv=4))
            for n, g, dk in ((1, False, 8), (3, True, 8), (3, False, 6))]


def run_gated_delta_rule(b: Backend, p, rng):
    n, Hk, Hv, dk, grouped = p["n"], p["Hk"], p["Hv"], p["dk"], p["grouped"]
    g = gdn_inputs(rng, n, Hk, Hv, dk)
    want, states = ref_delta(g["u"], Hk, dk, g["b"], g["alpha"], g["ssm_a"], g["dt_bias"], g["ssm"], grouped)
    ssm, out = b.dev(g["ssm"]), b.dev(np.full((n, Hv * dk), np.nan, np.float32))
    ring = b.dev(np.full((n, Hv, dk, dk), np.nan, np.float32))
    b.ops.gated_delta_rule(b.dev(g["u"]), Hk, grouped, *(b.dev(g[k]) for k in ("b", "alpha", "ssm_a", "dt_bias")),
                           ssm, out, ring)
    tol = dict(rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(b.host(out), want, **tol)
    np.testing.assert_allclose(b.host(ssm), states[-1], **tol)
    np.testing.assert_allclose(b.host(ring), np.array(states), **tol)


def mixer_cases(backend):
    return [(f"n{n}-{'grouped' if g else 'tiled'}", dict(n=n, grouped=g, Hk=2, Hv=4, dk=8, K=4))
            for n, g in ((1, False), (3, True))]


def run_gdn_mixer(b: Backend, p, rng):
    """conv1d_silu → l2_norm_heads (q, k) → gated_delta_rule → gated_rms_norm, in one op."""
    n, Hk, Hv, dk, K, grouped = p["n"], p["Hk"], p["Hv"], p["dk"], p["K"], p["grouped"]
    C = 2 * Hk * dk + Hv * dk
    mix, z = f32(rng.standard_normal((n, C))), f32(rng.standard_normal((n, Hv * dk)))
    conv, conv_w = f32(rng.standard_normal((K - 1, C))), f32(rng.standard_normal((K, C)) * 0.5)
    g = gdn_inputs(rng, n, Hk, Hv, dk)
    norm_w = f32(1 + 0.1 * rng.standard_normal(dk))
    # the reference, op by op in float64
    u, want_conv, _ = ref_conv(mix, conv, conv_w.T)
    u[:, :2 * Hk * dk] = ref_l2(u[:, :2 * Hk * dk].reshape(n, 2 * Hk, dk)).reshape(n, -1)
    o, states = ref_delta(u, Hk, dk, g["b"], g["alpha"], g["ssm_a"], g["dt_bias"], g["ssm"], grouped)
    want = ref_rms(o.reshape(n, Hv, dk), norm_w).reshape(n, -1) * silu(z)
    state = (b.dev(conv), b.dev(g["ssm"]))
    rings = (b.dev(np.zeros((0, K - 1, C), np.float32)), b.dev(np.zeros((0, Hv, dk, dk), np.float32)))
    bufs = [b.dev(np.full(shape, np.nan, np.float32)) for shape in ((n, C), (n, Hv * dk), (n, Hv * dk))]
    weights = tuple(b.dev(a) for a in (conv_w, g["ssm_a"], g["dt_bias"], norm_w))
    b.ops.gdn_mixer(b.dev(mix), b.dev(z), b.dev(g["b"]), b.dev(g["alpha"]), weights, state, rings, Hk, grouped, EPS,
                    *bufs)
    tol = dict(rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(b.host(bufs[2]), want, **tol)
    np.testing.assert_allclose(b.host(state[1]), states[-1], **tol)
    np.testing.assert_array_equal(b.host(state[0]), want_conv)


# greedy picks and the best logits of a row

def argmax_cases(backend):
    return [(f"{n}x{V}", dict(n=n, V=V)) for n, V in ((1, 40), (5, 333))]


def run_argmax_rows(b: Backend, p, rng):
    """First maximum, its float64 softmax probability, and the row's maximum (NaN, -inf kept)."""
    n, V = p["n"], p["V"]
    x = f32(rng.standard_normal((n, V)) * 4)
    if n > 3:
        x[1, [V - 10, 7, 8]] = 50.0                       # a tie: the lowest id
        x[2, :] = -np.inf
        x[2, V - 1] = 1.0                                 # one finite value, at the end
        x[3, 5] = np.nan                                  # refused by the sampler: max is NaN
        x[4, :] = -np.inf                                 # masked: max is -inf
    out = b.dev(np.full((n, PICK_COLUMNS), 7.0, np.float32))
    with float_edges_expected():            # the masked row's probability: 1 / 0
        b.ops.argmax_rows(b.dev(x), out)
    got = b.host(out)
    ok = [i for i in range(n) if np.isfinite(x[i]).any() and not np.isnan(x[i]).any()]
    x64 = x[ok].astype(np.float64)
    np.testing.assert_array_equal(got[ok, PICK_ID], np.argmax(x[ok], axis=1))
    np.testing.assert_allclose(got[ok, PICK_P], 1 / np.exp(x64 - x64.max(axis=1, keepdims=True)).sum(axis=1), rtol=1e-5)
    np.testing.assert_array_equal(got[:, PICK_MAX], x.max(axis=1))             # NaN and -inf kept


def top_cases(backend):
    return [(f"5x{V}-top{c}", dict(V=V, count=c)) for V, c in ((333, 1), (333, 3), (333, 40))]


def run_top_logits(b: Backend, p, rng):
    """The `count` best entries by (NaN first, larger, lower id), ids in any order, values as bits."""
    V, count = p["V"], p["count"]
    x = rows_with_ties(seed=int(rng.integers(1000)), V=V)
    x[0, V // 2] = np.nan
    out = b.dev(np.full((x.shape[0], 2 * count), 0xDEADBEEF, np.uint32))
    b.ops.top_logits(b.dev(x), out)
    got = b.host(out)
    for r, row in enumerate(x):
        ids = got[r, :count].astype(np.int64)
        assert sorted(ids.tolist()) == top_expected(row, count), f"row {r}"
        np.testing.assert_array_equal(got[r, count:], row.view(np.uint32)[ids])


# the MoE FFN: router, k of E experts, the gated shared expert

def moe_cases(backend):
    # Q5_0 on the GPU: a 32-weight type of the dp4a experts kernel (on the CPU each decoded type
    # compiles a MoE kernel variant: tests/cpu/test_moe.py has its pairs). (Q4_1/Q5_1 experts meet
    # x's fp16 block sums in their min term, which the float64 reference does not model:
    # tests/gpu/test_expert_cache.py checks their GPU experts bit for bit instead.)
    names = ("F32", "Q8_0", "Q5_0") if backend == "gpu" else ("F32", "Q8_0")
    return [(f"{t}-E4k2-D32-n{n}", dict(name=t, n=n)) for t in names for n in (1, 3)]


def tiny_moe(name, b: Backend, rng, D=32, F=32, E=4, k=2):
    tid = BY_NAME[name].id

    def matrix(label, rows, cols, scale=0.3, kind=name):
        data = (f32(rng.standard_normal((rows, cols)) * scale).view(np.uint8) if kind == "F32"
                else random_rows(kind, rows, cols, rng))
        return Matrix(label, BY_NAME[kind].id, b.dev(data), rows, cols), data

    def experts(label, rows, cols):
        data = random_rows(name, E * rows, cols, rng).reshape(E, rows, -1)
        return Experts(label, tid, b.dev(data), rows, cols), data

    parts = dict(router=matrix("router", E, D, 1.0, "F32"), gate=experts("g", F, D), up=experts("u", F, D),
                 down=experts("d", D, F), sg=matrix("sg", F, D), su=matrix("su", F, D), sd=matrix("sd", D, F),
                 sgate=matrix("sgate", 1, D, 0.3, "F32"))

    def build(pick):
        m = {key: pick(v) for key, v in parts.items()}
        return MoEFFN(router=m["router"], gate=m["gate"], up=m["up"], down=m["down"], n_used=k,
                      shared=DenseFFN(m["sg"], m["su"], m["sd"]), shared_gate=m["sgate"])

    on_backend = build(lambda v: v[0])
    on_host = build(lambda v: type(v[0])(v[0].name, v[0].wtype, v[1], v[0].rows, v[0].cols))
    return on_backend, on_host


def run_moe_ffn(b: Backend, p, rng):
    n, D = p["n"], 32
    moe, host_moe = tiny_moe(p["name"], b, rng, D=D)
    x = f32(rng.standard_normal((n, D)))
    want, magnitude = reference_moe(host_moe, x)

    def call(xs):
        out = b.dev(np.full((xs.shape[0], D), np.nan, np.float32))
        b.ops.moe_ffn(moe, b.dev(xs), out)
        return b.host(out)

    got = call(x)
    within(got, want, 5e-4 * magnitude + 1e-6)   # float32 sums, and activation rounding flips
    if n > 1:
        per_slot(b, call, x, got)


# embedding rows

def dequantize_cases(backend):
    return [type_cases(name, backend, f"{name}-5x{cols_for(name, backend)}", dict(name=name)) for name in TYPES]


def run_dequantize_rows(b: Backend, p, rng):
    name = p["name"]
    cols = cols_for(name, b.name)
    w = random_rows(name, 5, cols, rng)
    ids = np.array([4, 0, 4], np.int64)
    got = b.host(b.ops.dequantize_rows(BY_NAME[name].id, b.dev(w), ids, cols))
    np.testing.assert_allclose(got, dequantized(name, w, cols)[ids], rtol=1e-6, atol=1e-7)


OPS: tuple[Op, ...] = (
    Op("matvec", matvec_cases, run_matvec),
    Op("matvecs", matvecs_cases, run_matvecs),
    Op("swiglu", swiglu_cases, run_swiglu),
    Op("moe_ffn", moe_cases, run_moe_ffn),
    Op("dequantize_rows", dequantize_cases, run_dequantize_rows),
    Op("add_inplace", norm_cases, run_add_inplace),
    Op("rms_norm", norm_cases, run_rms_norm),
    Op("add_rms_norm", norm_cases, run_add_rms_norm),
    Op("head_rms_norm", head_cases, run_head_rms_norm),
    Op("gated_rms_norm", head_cases, run_gated_rms_norm),
    Op("l2_norm_heads", head_cases, run_l2_norm_heads),
    Op("rope_neox", rope_cases, run_rope),
    Op("kv_append+gated_attention", attention_cases, run_attention),
    Op("conv1d_silu", conv_cases, run_conv1d_silu),
    Op("gated_delta_rule", delta_cases, run_gated_delta_rule),
    Op("gdn_mixer", mixer_cases, run_gdn_mixer),
    Op("argmax_rows", argmax_cases, run_argmax_rows),
    Op("top_logits", top_cases, run_top_logits),
)


def _params():
    for op in OPS:
        for backend in BACKENDS:
            if backend.name in op.not_on:
                yield pytest.param(op, {}, backend, id=f"{op.name}-{backend.name}",
                                   marks=pytest.mark.skip(reason=f"not on {backend.name}: {op.not_on[backend.name]}"))
                continue
            for case_id, params in op.cases(backend.name):
                marks = [pytest.mark.skip(reason=f"not on {backend.name}: {params['not_on']}")] if "not_on" in params else []
                yield pytest.param(op, params, backend, id=f"{op.name}-{case_id}-{backend.name}", marks=marks)


@pytest.mark.parametrize("op, params, backend", list(_params()))
def test_op(op: Op, params: dict, backend: Backend):
    seed = sum(map(ord, f"{op.name}{sorted(params.items())}"))
    op.run(backend, params, np.random.default_rng(seed))


def test_the_table_names_every_op_of_both_op_sets():
    """A new op in cpu/ops.py or gpu/ops.py needs a row here (the tables' names, less the
    non-ops: the module's NAME and KV_DTYPE, which the attention row reads, and rope_inv_freq,
    which rope_neox's row calls)."""
    covered = {part for op in OPS for part in op.name.split("+")} | {"NAME", "KV_DTYPE", "rope_inv_freq"}
    for module in (cpu.ops, gpu.ops):
        assert set(module.__all__) == covered, module.__name__
