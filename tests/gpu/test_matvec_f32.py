"""The small-F32 matvec (a MoE router, a shared expert's gate) against a float64 reference,
through `gpu.matvec.matvec`, which sends such matrices to it."""
import numpy as np
import pytest
from numba import cuda

from gpu import matvec_f32
from hybrid import ggml_types as gt
from tests.gpu.test_matvec import assert_close, reference, run


@pytest.mark.parametrize("rows, cols", [(7, 4 * 32 * matvec_f32.UNROLL + 4 * 32 * 3 + 20), (1, 64)])
def test_small_f32_matches_reference_and_every_slot_has_its_own_bits(rows, cols):
    """cols: one full unrolled pass, then a partial one whose last word is past some lanes'
    reach; 9 slots, more than the float kernel takes per launch."""
    rng = np.random.default_rng(rows)
    w_bytes = rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint8)
    w_dev = cuda.to_device(w_bytes)
    assert matvec_f32.takes(w_dev, cols)
    x = rng.standard_normal((9, cols)).astype(np.float32)
    want, magnitude = reference(gt.F32, w_bytes, x)
    got = run(gt.F32, w_dev, x, rows)
    assert_close(got, want, magnitude)
    for s in (0, 8):
        alone = run(gt.F32, w_dev, x[s:s + 1], rows)
        assert np.array_equal(got[s].view(np.uint32), alone[0].view(np.uint32))


def test_only_small_word_aligned_matrices_take_it():
    assert not matvec_f32.takes(cuda.to_device(np.zeros((2, 4 * 66), np.uint8)), 66)      # cols % 4
    big = matvec_f32.SMALL_WORDS // 64 + 1
    assert not matvec_f32.takes(cuda.device_array((big, 256), np.uint8), 64)
