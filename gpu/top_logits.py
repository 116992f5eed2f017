"""The best logits of each row on the device: the op and output layout of `cpu/top_logits.py`.

One block per row. A radix select finds the C-th entry of the row in the op's total order
(order key descending, then id ascending), a byte of the 32-bit order key per round and then,
only when the C-th key is tied, a byte of the id per round: each round histograms the byte
over the entries that match what is already decided, and one thread walks the histogram to
the bin where the count reaches what is still wanted. The entries ahead of that C-th one are
then written out through an atomic counter (their order in the output is free).

The row (~1 MB at 248k tokens, just written by lm_head, so in L2) is read in full only twice:
for the first byte's histogram, and to copy every entry whose first key byte is at or above
the chosen bin into shared memory, which later rounds and the output read instead. Logits of
a trained model sit in a few exponent bins, so that list is a few hundred entries; a flat row
(ties, masks) that does not fit keeps reading the row.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32, int64, uint32

from .runtime.device import simulated
from .runtime.memory import stream

THREADS = 32 if simulated() else 512    # 1024 runs out of registers (int64 keys)
BINS = 256                      # one byte of the key or id per round
LIST_CAP = 2048                 # entries kept in shared memory after the first round
MAX_IDS = 1 << 24               # ids are three bytes in the tie rounds
_ABOVE, _IN_BIN = 0, 1


@cuda.jit(device=True, inline=True)
def _key(bits):
    """The order key of float32 bits (as cpu.top_logits.order_keys), as an int64."""
    b = int64(bits)
    if b == 0x80000000:                  # -0.0 ranks as 0.0
        return int64(0x80000000)
    if (b & 0x7FFFFFFF) > 0x7F800000:    # NaN above everything
        return int64(0xFFFFFFFF)
    if b >= 0x80000000:
        return b ^ 0xFFFFFFFF
    return b | 0x80000000


@cuda.jit(device=True, inline=True)
def _entry(bits, row, j, listed, list_id, list_key):
    """(id, key) of the j-th entry of the current source: the row, or the shared list."""
    if listed:
        return int64(list_id[j]), int64(list_key[j])
    return int64(j), _key(bits[row, j])


@cuda.jit(device=True, inline=True)
def _pick_bin(hist, part, want, descending, tid, state):
    """Walk hist from the top bin (descending) or the bottom one to the bin where the running
    count reaches `want`; state[_ABOVE] = the count before it, state[_IN_BIN] = its count. Every
    thread calls it (barriers); returns the bin."""
    if tid < 32:
        s = int32(0)
        for t in range(8):
            pos = 8 * tid + t
            s += hist[BINS - 1 - pos if descending else pos]
        part[tid] = s
    cuda.syncthreads()
    if tid == 0:
        acc = int64(0)
        lane = 0
        while acc + part[lane] < want:
            acc += part[lane]
            lane += 1
        pos = 8 * lane
        b = BINS - 1 - pos if descending else pos
        while acc + hist[b] < want:
            acc += hist[b]
            pos += 1
            b = BINS - 1 - pos if descending else pos
        part[32] = b
        state[_ABOVE] = acc
        state[_IN_BIN] = hist[b]
    cuda.syncthreads()
    return int64(part[32])


@cuda.jit(device=True, inline=True)
def _clear(hist, tid):
    for b in range(tid, BINS, THREADS):
        hist[b] = 0
    cuda.syncthreads()


@cuda.jit(cache=True)
def _top_logits(bits, out):
    hist = cuda.shared.array(BINS, int32)
    part = cuda.shared.array(33, int32)
    state = cuda.shared.array(2, int64)
    list_id = cuda.shared.array(LIST_CAP, int32)
    list_key = cuda.shared.array(LIST_CAP, uint32)
    count = cuda.shared.array(1, int32)
    row, tid = cuda.blockIdx.x, cuda.threadIdx.x
    V = bits.shape[1]
    C = out.shape[1] // 2

    # the first key byte, over the whole row
    _clear(hist, tid)
    for i in range(tid, V, THREADS):
        cuda.atomic.add(hist, _key(bits[row, i]) >> 24, 1)
    cuda.syncthreads()
    prefix = _pick_bin(hist, part, C, True, tid, state) << 24
    want = C - state[_ABOVE]
    listed = state[_ABOVE] + state[_IN_BIN] <= LIST_CAP
    n_src = V
    if listed:  # every entry from that bin up, into shared memory
        if tid == 0:
            count[0] = 0
        cuda.syncthreads()
        for i in range(tid, V, THREADS):
            k = _key(bits[row, i])
            if k >= prefix:
                at = cuda.atomic.add(count, 0, 1)
                list_id[at] = i
                list_key[at] = uint32(k)
        cuda.syncthreads()
        n_src = count[0]

    # the other key bytes, then (a tie on the C-th key only) the id's bytes, lowest id first
    id_prefix = int64(0)
    id_limit = int64(V)
    for r in range(6):
        by_id = r >= 3
        shift = 16 - 8 * (r % 3)
        if r == 3 and want == state[_IN_BIN]:
            break                         # every entry of the C-th key is in
        _clear(hist, tid)
        for j in range(tid, n_src, THREADS):
            i, k = _entry(bits, row, j, listed, list_id, list_key)
            if by_id:
                if k == prefix and (i >> (shift + 8)) == (id_prefix >> (shift + 8)):
                    cuda.atomic.add(hist, (i >> shift) & 0xFF, 1)
            elif (k >> (shift + 8)) == (prefix >> (shift + 8)):
                cuda.atomic.add(hist, (k >> shift) & 0xFF, 1)
        cuda.syncthreads()
        b = _pick_bin(hist, part, want, not by_id, tid, state)
        if by_id:
            id_prefix |= b << shift
        else:
            prefix |= b << shift
        want -= state[_ABOVE]
        if r == 5:
            id_limit = id_prefix

    # everything ahead of (prefix, id_limit) in the order
    if tid == 0:
        count[0] = 0
    cuda.syncthreads()
    for j in range(tid, n_src, THREADS):
        i, k = _entry(bits, row, j, listed, list_id, list_key)
        if k > prefix or (k == prefix and i <= id_limit):
            at = cuda.atomic.add(count, 0, 1)
            out[row, at] = uint32(i)
            out[row, C + at] = bits[row, i]


def top_logits(logits, out) -> None:
    """out[i] = the C = out.shape[1] // 2 best entries of logits[i] (ids, then float32 bits):
    cpu.top_logits.top_logits on the device. logits (n, V) float32, out (n, 2C) uint32."""
    C, V = out.shape[1] // 2, logits.shape[1]
    if not 0 < C <= V:
        raise ValueError(f"top_logits keeps 1..{V} entries of a row, not {C}")
    if V > MAX_IDS:
        raise ValueError(f"top_logits selects among at most {MAX_IDS} ids (three id bytes), not {V}")
    _top_logits[logits.shape[0], THREADS, stream()](logits.view(np.uint32), out)
