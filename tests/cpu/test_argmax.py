"""cpu.argmax.argmax_rows against plain numpy: first maximum, float64 softmax of it, and the
rows the sampler refuses (NaN, all -inf) marked in the maximum column."""
import numpy as np
import pytest

from cpu.argmax import PICK_COLUMNS, PICK_ID, PICK_MAX, PICK_P, argmax_rows
from hybrid.errors import HybridError
from hybrid.sampling import Picks


def picks_of(logits):
    out = np.full((logits.shape[0], PICK_COLUMNS), 7.0, np.float32)
    argmax_rows(np.ascontiguousarray(logits, np.float32), out)
    return out


def test_first_maximum_and_its_probability():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, 1000)) * 4).astype(np.float32)
    x[1, [17, 400, 999]] = 50.0                       # a tie: the lowest id wins
    x[2, :] = -np.inf
    x[2, 5] = 1.0                                     # -inf elsewhere adds nothing
    got = picks_of(x)
    want_ids = [int(np.argmax(r)) for r in x]
    assert got[:, PICK_ID].astype(int).tolist() == want_ids
    assert got[1, PICK_ID] == 17
    x64 = x.astype(np.float64)
    want_p = 1.0 / np.exp(x64 - x64.max(axis=1, keepdims=True)).sum(axis=1)
    np.testing.assert_allclose(got[:, PICK_P], want_p, rtol=1e-6)
    assert got[2, PICK_P] == 1.0
    np.testing.assert_array_equal(got[:, PICK_MAX], x.max(axis=1))


def test_nan_and_masked_rows_are_refused_like_the_sampler_does():
    x = np.zeros((2, 10), np.float32)
    x[0, 3] = np.nan
    x[1, :] = -np.inf
    got = picks_of(x)
    assert np.isnan(got[0, PICK_MAX]) and got[1, PICK_MAX] == -np.inf
    with pytest.raises(HybridError, match="NaN"):
        Picks.of(got[:1])
    with pytest.raises(HybridError, match="masked"):
        Picks.of(got[1:])
    ok = Picks.of(picks_of(np.eye(3, 5, 2, dtype=np.float32)))
    assert ok.ids.tolist() == [2, 3, 4] and ok.ids.dtype == np.int64
