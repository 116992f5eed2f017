"""cpu.atomics: counters shared by the threads of a parallel region."""
import numpy as np
import pytest
from numba import njit, prange

from cpu.atomics import fetch_add, load_acquire


@njit(parallel=True)
def _take_tickets(counter, tickets, n_workers):
    """Workers take tickets from one counter until there are none left; each ticket's taker
    writes its worker number there (a ticket handed out twice would be written twice)."""
    for worker in prange(n_workers):
        t = fetch_add(counter, 0, 1)
        while t < tickets.size:
            tickets[t] += worker + 1
            t = fetch_add(counter, 0, 1)


@pytest.mark.parametrize("n_workers", [1, 2, 8])
def test_every_ticket_is_handed_out_once(n_workers):
    counter = np.zeros(1, np.int64)
    tickets = np.zeros(200_000, np.int64)
    _take_tickets(counter, tickets, n_workers)
    assert ((tickets >= 1) & (tickets <= n_workers)).all()
    # each worker asked once more than it got, when the tickets had run out
    assert counter[0] == tickets.size + n_workers


@njit
def _add_and_read(a, i, v):
    before = fetch_add(a, i, v)
    return before, load_acquire(a, i)


def test_fetch_add_returns_the_value_before_and_load_acquire_reads_the_element():
    a = np.array([5, 7, 9], np.int64)
    assert _add_and_read(a, 1, -3) == (7, 4)
    assert a.tolist() == [5, 4, 9]


def test_a_counter_must_be_a_writable_int64_array():
    with pytest.raises(Exception, match="int64"):
        _add_and_read(np.zeros(2, np.int32), 0, 1)
