"""How a prompt is cut into forward calls (`hybrid.generate.prompt_chunks`): PREFILL_CHUNK rows
each, and no call below the backend's `min_prompt_rows` where the prompt has that many tokens."""
import pytest

from hybrid.generate import PREFILL_CHUNK, prompt_chunks


@pytest.mark.parametrize("n", [1, 5, 31, 32, 33, PREFILL_CHUNK - 1, PREFILL_CHUNK, PREFILL_CHUNK + 1,
                               PREFILL_CHUNK + 31, 2 * PREFILL_CHUNK + 7, 30 * PREFILL_CHUNK + 1])
@pytest.mark.parametrize("min_rows", [1, 32])
def test_chunks_cover_the_prompt_in_order_and_none_is_short(n, min_rows):
    chunks = prompt_chunks(n, min_rows)
    assert chunks[0][0] == 0 and chunks[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))            # contiguous, in order
    assert all(0 < stop - start <= PREFILL_CHUNK for start, stop in chunks)
    if n >= min_rows:
        assert all(stop - start >= min_rows for start, stop in chunks)
    assert len(chunks) == -(-n // PREFILL_CHUNK)                             # no extra calls


def test_only_the_last_two_chunks_move():
    n = 3 * PREFILL_CHUNK + 1
    assert prompt_chunks(n, 1) == [(0, PREFILL_CHUNK), (PREFILL_CHUNK, 2 * PREFILL_CHUNK),
                                   (2 * PREFILL_CHUNK, 3 * PREFILL_CHUNK), (3 * PREFILL_CHUNK, n)]
    assert prompt_chunks(n, 32)[:2] == prompt_chunks(n, 1)[:2]
    assert prompt_chunks(n, 32)[2:] == [(2 * PREFILL_CHUNK, n - 32), (n - 32, n)]
