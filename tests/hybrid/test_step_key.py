"""backend.step_key: what a captured GPU step is keyed by, so that a replay happens exactly when the
step is handed the same states, scratch, buffers (by address and shape) and flags."""
import numpy as np
import pytest

from hybrid.backend import step_key
from hybrid.errors import HybridError


class Owner:
    def __init__(self, identity):
        self.identity = identity

    def step(self, *args):
        pass


def host_address(a):
    return a.__array_interface__["data"][0]


def key(fn, *args):
    return step_key(fn, args, host_address)


def test_the_same_arguments_give_the_same_key_and_any_change_another():
    owner, state, buf, other = Owner(1), Owner(2), np.zeros((4, 8), np.float32), np.zeros((4, 8), np.float32)
    base = key(owner.step, state, buf, True, None, (buf, other))
    assert key(owner.step, state, buf, True, None, (buf, other)) == base
    assert key(owner.step, state, buf, np.bool_(True), None, (buf, other)) == base    # numpy flags by value
    changed = [
        key(Owner(3).step, state, buf, True, None, (buf, other)),        # another owner (a state's rollback)
        key(owner.step, Owner(4), buf, True, None, (buf, other)),        # another state or scratch
        key(owner.step, state, other, True, None, (buf, other)),         # another buffer of the same shape
        key(owner.step, state, buf[1:], True, None, (buf, other)),       # a view: another address and shape
        key(owner.step, state, buf.view(np.int32), True, None, (buf, other)),   # another type
        key(owner.step, state, buf, False, None, (buf, other)),          # a flag
        key(owner.step, state, buf, True, buf, (buf, other)),            # a buffer where there was none
        key(owner.step, state, buf, True, None, (other, buf)),           # the pair swapped
    ]
    assert all(k != base for k in changed) and len(set(changed)) == len(changed)


def test_a_function_without_an_owner_and_a_count():
    def step(slot):
        pass
    assert key(step, 3) == key(step, np.int64(3)) != key(step, 4)


def test_an_argument_the_key_cannot_name_is_refused():
    with pytest.raises(HybridError, match="buffers, states, flags and counts"):
        key(Owner(1).step, object())
