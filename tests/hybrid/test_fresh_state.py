"""Model.generate reuses one reset state between generations (so captured GPU steps replay
across calls), and never hands the same state to two unfinished generations."""
import hybrid
from hybrid.events import Token


def ids(events):
    return [e.id for e in events if isinstance(e, Token)]


def test_generations_reuse_a_reset_state_and_interleaved_ones_do_not_share():
    m = hybrid.load(device="cpu")
    first = ids(m.generate("hello", max_tokens=6, temperature=0))
    kept = m._idle_state
    assert kept is not None and kept.n_past > 0
    assert ids(m.generate("hello", max_tokens=6, temperature=0)) == first      # reset, not carried over
    assert m._idle_state is kept

    running = m.generate("hello", max_tokens=6, temperature=0)
    next(running)                                    # its prefill event: it holds the kept state now
    other = m.generate("hello", max_tokens=6, temperature=0)
    assert ids(other) == first and m._idle_state is not kept                 # got a state of its own
    assert ids(running) == first and m._idle_state is kept
