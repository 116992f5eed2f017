"""cpu.top_logits against a plain Python sort: which C entries of a row come back, through
ties at the C-th place (lower id first), -0.0 == 0.0, masked (-inf) rows and NaN."""
import numpy as np
import pytest

from cpu.top_logits import top_logits


def run(logits, count):
    out = np.full((logits.shape[0], 2 * count), 0xDEADBEEF, np.uint32)
    top_logits(np.ascontiguousarray(logits, np.float32), out)
    return out


def expected(row, count):
    """ids of the `count` first entries by (NaN first, larger value, lower id): Python's sort."""
    order = sorted(range(len(row)), key=lambda i: (0 if np.isnan(row[i]) else 1,
                                                   0.0 if np.isnan(row[i]) else -float(row[i]), i))
    return sorted(order[:count])


def check(logits, count, out):
    """out's ids are expected()'s (as a set: the op leaves their order free) and its values are
    the row's at those ids, bit for bit."""
    for r, row in enumerate(logits):
        ids = out[r, :count].astype(np.int64)
        assert sorted(ids.tolist()) == expected(row, count), f"row {r}"
        np.testing.assert_array_equal(out[r, count:], row.view(np.uint32)[ids])


def rows_with_ties(seed=0, n=5, V=700):
    """Random rows, some coarsely rounded (many equal values, so the C-th place is tied), one
    mostly masked, one with ±0.0 at the top and one flat."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, V)) * 3).astype(np.float32)
    x[1] = np.round(x[1])                   # ~10 distinct values: every cut is a tie
    x[2, :] = -np.inf
    x[2, [5, 90, V - 30]] = [1.0, -2.0, 1.0]
    x[3] = -np.abs(x[3]) - 1
    x[3, [10, 11, V - 1]] = [0.0, -0.0, 0.0]  # -0.0 ties with 0.0: ids 10, 11, V - 1 in id order
    x[4] = 2.5                              # flat: the lowest ids
    return x


@pytest.mark.parametrize("count", [1, 2, 3, 40, 256, 700])
def test_the_best_entries_in_the_order_lower_id_first_on_ties(count):
    x = rows_with_ties()
    check(x, count, run(x, count))


def test_a_row_holding_nan_returns_it_first():
    x = rows_with_ties()[:2].copy()
    x[0, 123] = np.nan
    out = run(x, 5)
    check(x, 5, out)
    assert 123 in out[0, :5].tolist()


def test_a_count_the_row_cannot_fill_is_refused():
    with pytest.raises(ValueError):
        run(np.zeros((1, 4), np.float32), 5)
