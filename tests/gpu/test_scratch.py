"""`gpu.runtime.memory.scratch`: one allocation per power-of-two bucket of the first dimension,
so a server whose prompt tails bring a new row count each request stops allocating."""
import numpy as np

from gpu.runtime import memory


def test_row_counts_share_one_allocation_per_bucket():
    a, b, c = (memory.scratch("test.bucket", (n, 8)) for n in (33, 60, 65))
    assert a.shape == (33, 8) and b.shape == (60, 8) and c.shape == (65, 8)
    assert memory.address(a) == memory.address(b) != memory.address(c)
    assert memory.scratch("test.bucket", (33, 8)) is a            # the same shape: the same buffer
    assert memory.address(memory.scratch("test.bucket", (33, 4))) != memory.address(a)   # other trailing shape
    assert memory.address(memory.scratch("test.other", (33, 8))) != memory.address(a)    # other key


def test_every_prompt_tail_fits_in_a_few_allocations():
    before = len(memory._buckets)
    for n in range(32, 513):
        buf = memory.scratch("test.tails", (n, 4), np.int32)
        assert buf.shape == (n, 4) and buf.is_c_contiguous()
    assert len(memory._buckets) - before == 5                     # 32, 64, 128, 256, 512


def test_empty_and_scalar_shapes_are_their_own_allocations():
    """Not bucket views: on a GPU, Numba slices an array of no elements to its own shape, so the
    leading 0 rows of a (1, 0) bucket came back as (1, 0), and a kernel that reads "no rows" as
    "no fused norm" (the GDN delta rule) or "no PCIe rows" (the expert router) took a row that
    is not there. The simulator slices as numpy does, hence the check on the buckets."""
    before = len(memory._buckets)
    assert memory.scratch("test.empty", (0, 0)).shape == (0, 0)
    assert memory.scratch("test.empty_rows", (0, 16)).shape == (0, 16)
    assert memory.scratch("test.scalar", ()).shape == ()
    assert len(memory._buckets) == before


def test_a_full_bucket_is_the_allocation_itself():
    a = memory.scratch("test.full", (64, 2))
    assert a is memory._buckets[("test.full", 64, (2,), np.dtype(np.float32).str)]
