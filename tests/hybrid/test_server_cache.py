"""The server's state cache: longest proper prefix wins, the budget holds, least recently used goes first,
snapshots of one conversation share their KV rows."""
from types import SimpleNamespace

import numpy as np

from hybrid.server.cache import StateCache


def state(n_past, fill):
    """A stand-in for SessionState with numpy arrays (no backend): one GDN layer, one KV layer."""
    kv = np.full((1, 64, 2), fill, np.float32)
    return SimpleNamespace(reset=lambda: None, n_past=n_past, mtp_n_past=0, ssm={0: np.full((2, 2), fill, np.float32)},
                           conv={0: np.full((1, 2), fill, np.float32)}, kv={1: (kv, kv.copy())}, mtp_kv={})


def size(n_past):
    return (4 + 2 + 2 * n_past * 2) * 4


def test_longest_proper_prefix_wins():
    c = StateCache(1 << 20)
    c.put(state(2, 1.0), [1, 2])
    c.put(state(4, 2.0), [1, 2, 3, 4])
    c.put(state(3, 3.0), [9, 9, 9])
    assert c.longest_prefix([1, 2, 3, 4, 5]).ids == [1, 2, 3, 4]
    assert c.longest_prefix([1, 2, 3, 4]).ids == [1, 2]      # an equal one leaves nothing to prefill
    assert c.longest_prefix([1, 2, 7]).ids == [1, 2]
    assert c.longest_prefix([5]) is None
    ck = c.longest_prefix([1, 2, 3, 4, 5])
    assert ck.n_past == 4 and float(ck.ssm[0][0, 0]) == 2.0 and ck.kv[1][0][0].shape == (1, 4, 2)   # used rows only


def test_budget_evicts_least_recently_used():
    c = StateCache(2 * size(4))
    c.put(state(4, 1.0), [1, 1, 1, 1])
    c.put(state(4, 2.0), [2, 2, 2, 2])
    assert c.bytes == 2 * size(4) and len(c) == 2
    c.longest_prefix([1, 1, 1, 1, 0])           # touches the first
    c.put(state(4, 3.0), [3, 3, 3, 3])
    assert c.longest_prefix([2, 2, 2, 2, 0]) is None and c.longest_prefix([1, 1, 1, 1, 0]) is not None
    assert c.bytes <= c.budget
    big = StateCache(size(4) - 1)               # one snapshot over the budget is not kept
    big.put(state(4, 1.0), [1, 1, 1, 1])
    assert len(big) == 0 and big.bytes == 0
    off = StateCache(0)
    off.put(state(1, 1.0), [1])
    assert len(off) == 0


def test_a_snapshot_with_a_base_shares_its_rows_and_restores_whole():
    live = state(4, 1.0)
    live.kv[1][0][:, :6] = np.arange(6, dtype=np.float32)[None, :, None]    # rows that tell positions apart
    c = StateCache(1 << 20)
    first = c.put(live, [1, 2, 3, 4])
    live.n_past = 6                                     # two more rows appended
    second = c.put(live, [1, 2, 3, 4, 5, 6], base=first)
    ks, vs = second.kv[1]
    assert ks[0] is first.kv[1][0][0] and vs[0] is first.kv[1][1][0] and ks[1].shape == (1, 2, 2)
    assert c.bytes == size(4) + size(6) - 2 * 4 * 2 * 4       # the shared rows count once
    target = state(0, 9.0)
    second.restore(target)
    assert target.n_past == 6
    np.testing.assert_array_equal(target.kv[1][0][:, :6], live.kv[1][0][:, :6])
    np.testing.assert_array_equal(target.ssm[0], live.ssm[0])
    c.budget = size(6) + size(1)                        # the first goes; its rows stay with the second
    c.put(state(1, 2.0), [7])
    assert c.longest_prefix([1, 2, 3, 4, 0]) is None and c.longest_prefix([1, 2, 3, 4, 5, 6, 0]) is second
    assert c.bytes == size(6) + size(1)
    c.clear()
    assert c.bytes == 0 and len(c) == 0
