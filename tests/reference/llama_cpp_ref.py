"""llama.cpp as a whole-model oracle, through llama-cpp-python (`pip install .[parity]`).

Also holds the logit-margin rule used by every greedy/argmax comparison (DESIGN.md §5): a
differing argmax only counts when the reference's own top-1/top-2 gap is larger than the numeric
tolerance — otherwise the reference itself could not tell the two tokens apart.
"""

from __future__ import annotations

import ctypes
import logging
import pathlib
from dataclasses import dataclass

import numpy as np
import pytest

# One thread: on the shared 2-core dev machine ggml's spinning thread barrier made 2 threads up to
# 50x slower than 1 under load, and the tiny test model gains nothing from a second thread.
_N_THREADS = 1


def require_llama_cpp():
    """Import and return `llama_cpp`, or skip the calling test with the install hint."""
    try:
        import llama_cpp
    except ImportError:
        pytest.skip("llama-cpp-python not installed: pip install .[parity]")
    return llama_cpp


def _open(model_path, n_ctx: int):
    llama_cpp = require_llama_cpp()
    return llama_cpp.Llama(
        model_path=str(pathlib.Path(model_path)),
        n_ctx=max(n_ctx, 64),
        n_batch=max(n_ctx, 64),  # one batch: prefill logits do not depend on batch splits
        logits_all=True,
        n_threads=_N_THREADS,
        verbose=False,
    )


def llama_cpp_tokenize(model_path, text: str) -> list[int]:
    """llama.cpp's own tokenisation (no BOS, special tokens parsed)."""
    llm = _open(model_path, 64)
    return list(llm.tokenize(text.encode("utf-8"), add_bos=False, special=True))


def llama_cpp_logits(model_path, token_ids) -> np.ndarray:
    """llama.cpp logits for every position of one sequence, float32 (n, n_vocab).

    A fresh context per call, so no state (KV cache, recurrent state) leaks between calls.
    """
    ids = [int(t) for t in token_ids]
    llm = _open(model_path, len(ids))
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def llama_cpp_greedy(model_path, prompt_ids, n_new: int) -> tuple[list[int], np.ndarray]:
    """Greedy continuation by llama.cpp: (n_new new token ids, float32 (n_new, n_vocab) logits).

    Logits row i is what llama.cpp picked new token i from (prompt prefill, then one token per
    decode), i.e. the numbers its argmax was taken over.
    """
    ids = [int(t) for t in prompt_ids]
    llm = _open(model_path, len(ids) + n_new)
    llm.eval(ids)
    new_ids, rows = [], []
    for _ in range(n_new):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        rows.append(row)
        new_ids.append(int(row.argmax()))
        llm.eval([new_ids[-1]])
    return new_ids, np.stack(rows)


# ----------------------------------------------------------------------------------------------
# MTP head through llama.cpp's low-level API
#
# The high-level `Llama` class never loads the MTP block (`llama_model_params.load_mtp` is false)
# and has no MTP context, so this drives the C API the way llama.cpp's draft-mtp speculative
# decoder does (common/speculative.cpp): a target context exporting the post-norm hidden
# (`t_h_nextn`), then a context of type LLAMA_CONTEXT_TYPE_MTP fed rows (token x_p, h_{p-1}).
# The hidden-state getters live in llama.cpp's C++ staging header (src/llama-ext.h), so they
# are only reachable through their mangled symbol names; they may vanish in other versions.

_SET_EMBEDDINGS_NEXTN = "_Z26llama_set_embeddings_nextnP13llama_contextbb"  # (ctx, bool value, bool masked)
_GET_EMBEDDINGS_NEXTN = "_Z26llama_get_embeddings_nextnP13llama_context"  # (ctx) -> float* (n_out, n_embd)


@dataclass(frozen=True)
class LlamaCppMtpRun:
    logits: np.ndarray  # float32 (n, n_vocab): main head
    hidden: np.ndarray  # float32 (n, D): post-final-norm trunk hidden (t_h_nextn)
    mtp_logits: np.ndarray  # float32 (n, n_vocab): MTP row p on (x_p, hidden[p-1]), zeros for p = 0


def _nextn_functions(lib):
    try:
        set_fn, get_fn = getattr(lib, _SET_EMBEDDINGS_NEXTN), getattr(lib, _GET_EMBEDDINGS_NEXTN)
    except AttributeError:
        pytest.skip("this llama.cpp build does not export the nextn hidden-state API (llama-ext.h)")
    set_fn.argtypes, set_fn.restype = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None
    get_fn.argtypes, get_fn.restype = [ctypes.c_void_p], ctypes.POINTER(ctypes.c_float)
    return set_fn, get_fn


def _decode_all_rows(capi, ctx, ids, n_vocab: int, hidden_in: np.ndarray | None) -> np.ndarray:
    """One llama_process over the whole sequence, logits on every row; hidden_in rows ride along."""
    batch = capi.llama_batch_ext_init(ctx)
    try:
        for p, token in enumerate(ids):
            i = capi.llama_batch_ext_add_token(batch, 0, token)
            # qwen35 uses IMROPE: 4 position components; text tokens have t = h = w = p
            ok = capi.llama_batch_ext_set_pos(batch, i, (capi.llama_pos * 4)(p, p, p, 0))
            if hidden_in is not None:
                row = hidden_in[p].ctypes.data_as(ctypes.POINTER(ctypes.c_float))
                ok &= capi.llama_batch_ext_set_embd_token(batch, i, capi.llama_embd(row, 1, hidden_in.shape[1]))
            ok &= capi.llama_batch_ext_set_output_logits(batch, i, True)
            if i != p or not ok:
                raise RuntimeError(f"llama_batch_ext rejected row {p}")
        rc = capi.llama_process(ctx, capi.LLAMA_PROCESS_TYPE_DECODE, batch)
        if rc != 0:
            raise RuntimeError(f"llama_process failed with {rc}")
        return np.stack(
            [np.ctypeslib.as_array(capi.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy() for i in range(len(ids))]
        )
    finally:
        capi.llama_batch_ext_free(batch)


def llama_cpp_mtp_run(model_path, token_ids) -> LlamaCppMtpRun:
    """Main logits, post-norm hidden and MTP-head logits of one sequence, all from llama.cpp."""
    require_llama_cpp()
    from llama_cpp import llama_cpp as capi

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # silence the C-side log
    set_nextn, get_nextn = _nextn_functions(capi._lib)
    ids = [int(t) for t in token_ids]
    n_ctx = max(len(ids), 64)

    model_params = capi.llama_model_default_params()
    model_params.load_mtp = True
    model_params.n_gpu_layers = 0
    model = capi.llama_model_load_from_file(str(pathlib.Path(model_path)).encode(), model_params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {model_path}")
    contexts = []
    try:
        if capi.llama_model_n_layer_nextn(model) < 1:
            pytest.skip(f"{model_path} has no MTP layer")
        n_embd = capi.llama_model_n_embd(model)
        n_vocab = capi.llama_vocab_n_tokens(capi.llama_model_get_vocab(model))

        def new_context(ctx_type):
            params = capi.llama_context_default_params()
            params.ctx_type = ctx_type
            params.n_ctx = params.n_batch = params.n_ubatch = n_ctx
            params.n_threads = params.n_threads_batch = _N_THREADS
            ctx = capi.llama_init_from_model(model, params)
            if not ctx:
                raise RuntimeError("llama.cpp could not create a context")
            contexts.append(ctx)
            return ctx

        target = new_context(capi.LLAMA_CONTEXT_TYPE_DEFAULT)
        set_nextn(target, True, False)  # export t_h_nextn for every row, as the draft-mtp driver does
        logits = _decode_all_rows(capi, target, ids, n_vocab, None)
        hidden = np.ctypeslib.as_array(get_nextn(target), shape=(len(ids), n_embd)).copy()

        h_prev = np.ascontiguousarray(np.concatenate([np.zeros((1, n_embd), np.float32), hidden[:-1]]))
        mtp_logits = _decode_all_rows(capi, new_context(capi.LLAMA_CONTEXT_TYPE_MTP), ids, n_vocab, h_prev)
        return LlamaCppMtpRun(logits, hidden, mtp_logits)
    finally:
        for ctx in reversed(contexts):
            capi.llama_free(ctx)
        capi.llama_model_free(model)


# ----------------------------------------------------------------------------------------------
# the logit-margin rule


def top2_gap(logits: np.ndarray) -> np.ndarray:
    """Per row: top-1 logit minus top-2 logit."""
    top2 = np.sort(np.asarray(logits, dtype=np.float64), axis=-1)[..., -2:]
    return top2[..., 1] - top2[..., 0]


def margin_mismatches(ref_logits, our_logits, tol: float) -> int:
    """Positions where the argmax differs AND the reference's top-1/top-2 gap exceeds tol."""
    ref = np.asarray(ref_logits)
    ours = np.asarray(our_logits)
    if ref.shape != ours.shape:
        raise ValueError(f"logit shapes differ: {ref.shape} vs {ours.shape}")
    differs = ref.argmax(axis=-1) != ours.argmax(axis=-1)
    return int(np.count_nonzero(differs & (top2_gap(ref) > tol)))


def llama_cpp_quantize(src, dst, ftype_name: str):
    """Write `dst`: the GGUF at `src` quantised by llama.cpp's own quantizer (`llama_model_quantize`,
    what `llama-quantize` runs) to the file type LLAMA_FTYPE_MOSTLY_<ftype_name>, with its
    per-tensor type choices. Raises RuntimeError when llama.cpp refuses."""
    require_llama_cpp()
    import llama_cpp        # optional (the parity extra builds it): imported where it is needed, as above
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    params.nthread = 1
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantise {src} to {ftype_name}")
    return dst
