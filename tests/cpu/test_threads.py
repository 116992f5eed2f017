"""cpu/threads.py: thread counts checked; steps use the threads their weights keep busy."""
import numba
import pytest

from cpu.threads import SMALL_STEP_BYTES, STEP_ROWS, ThreadPolicy, available_cores, set_threads


def test_thread_counts():
    assert set_threads(None) == min(available_cores(), numba.config.NUMBA_NUM_THREADS)
    assert set_threads(1) == 1 and numba.get_num_threads() == 1
    for bad in (0, -3):
        with pytest.raises(ValueError, match="threads must be ≥ 1"):
            set_threads(bad)


def test_small_models_step_on_one_thread():
    assert ThreadPolicy.for_step_bytes(16, 16 << 20) == ThreadPolicy(step=1, batch=16)     # the bundled model
    assert ThreadPolicy.for_step_bytes(16, SMALL_STEP_BYTES) == ThreadPolicy(step=16, batch=16)
    assert ThreadPolicy.for_step_bytes(16, 300 << 20) == ThreadPolicy(step=16, batch=16)   # a 35B-A3B token
    n = min(2, numba.config.NUMBA_NUM_THREADS)
    policy = ThreadPolicy(step=1, batch=n)
    policy.use(STEP_ROWS)
    assert numba.get_num_threads() == 1
    policy.use(STEP_ROWS + 1)
    assert numba.get_num_threads() == n
