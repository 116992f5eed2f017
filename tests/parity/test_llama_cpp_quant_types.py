"""Files made by llama.cpp's own quantizer, one per file type people download, against llama.cpp's
logits and greedy streams on the same file (issue 31). The source is the bundled trained model
dequantised to F32 (tests/requantize.py), so each file carries llama.cpp's per-tensor type choices
for that type (`llama_model_quantize`, as `llama-quantize` runs it). A type whose kernels round
activations as llama.cpp does agrees within the trained-model bound; a type the engine cannot
load fails with its one-line error. The types llama.cpp only makes with an importance matrix
(IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M, and IQ3_XXS in this build) and MXFP4 (which it writes for MoE
experts alone) come instead in synthetic files of random codes (hybrid.synth, every matrix of the
type): both engines read the same blocks, so the comparison holds the kernels and their activation
rounding to llama.cpp's, and tests/cpu holds the blocks to gguf-py.

Run with `NUMBA_NUM_THREADS=1 pytest tests/parity -q -rA -s` to see the measured errors."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from tests.conftest import BUNDLED_MODEL
from tests.parity.test_engine_vs_llama_cpp import (CODE_PROMPTS, N_SYNTH_TOKENS, TRAINED_BOUND, Bound,  # noqa: F401
                                                   check_logits, engine, first_counted_divergence, synth)
from tests.reference.llama_cpp_ref import llama_cpp_greedy, llama_cpp_logits, llama_cpp_quantize, llama_cpp_tokenize
from tests.requantize import requantize

FILE_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M",
              "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_M"]
N_GREEDY = 24
# synthetic files of one type throughout; measured max / rms 0.08-0.15 / 0.013-0.029 (16 random tokens)
SYNTH_TYPES = ["IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "MXFP4"]
SYNTH_BOUND = Bound(0.4, 0.08)


@pytest.fixture(scope="module")
def trained_f32(tmp_path_factory):
    return requantize(BUNDLED_MODEL, tmp_path_factory.mktemp("f32") / "tiny-qwen35-mtp-F32.gguf",
                      target=gguf.GGMLQuantizationType.F32)


@pytest.fixture(scope="module")
def quantised(trained_f32, tmp_path_factory):
    folder, made = tmp_path_factory.mktemp("llama-quantize"), {}

    def make(ftype: str):
        if ftype not in made:
            made[ftype] = llama_cpp_quantize(trained_f32, folder / f"tiny-qwen35-mtp-{ftype}.gguf", ftype)
        return made[ftype]
    return make


@pytest.mark.parametrize("ftype", FILE_TYPES)
def test_llama_cpp_quantised_file_matches_llama_cpp(ftype, quantised, engine):
    path = quantised(ftype)
    m = engine(path)
    for k, text in enumerate(CODE_PROMPTS):
        ids = llama_cpp_tokenize(path, text)
        check_logits(f"llama-quantize {ftype} prompt {k}", m.logits(ids), llama_cpp_logits(path, ids), TRAINED_BOUND)
    ids = llama_cpp_tokenize(path, CODE_PROMPTS[0])
    theirs, their_rows = llama_cpp_greedy(path, ids, N_GREEDY)
    ours = [e.id for e in m.generate(ids, max_tokens=N_GREEDY, temperature=0, draft=0, ignore_eos=True)
            if hasattr(e, "id")]
    at, counted = first_counted_divergence(ours, theirs, their_rows, TRAINED_BOUND.max_abs)
    print(f"[parity] llama-quantize {ftype} greedy: {N_GREEDY if at is None else at}/{N_GREEDY} tokens identical"
          + ("" if at is None else f", then a {'COUNTED' if counted else 'near-tie'} divergence"))
    assert len(ours) == N_GREEDY and not counted, (ftype, at, ours, theirs)


@pytest.mark.parametrize("wtype", SYNTH_TYPES)
def test_synthetic_file_of_a_type_llama_cpp_quantises_only_with_an_imatrix(wtype, synth, engine):
    path = synth("qwen35", wtype)
    m = engine(path)
    ids = np.random.default_rng(0).integers(m.config.n_vocab, size=N_SYNTH_TOKENS).tolist()
    check_logits(f"synthetic qwen35 {wtype}", m.logits(ids), llama_cpp_logits(path, ids), SYNTH_BOUND)
