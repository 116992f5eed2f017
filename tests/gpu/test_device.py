import pytest

import gpu
from gpu.runtime import device
from hybrid.errors import HybridError


def test_require_cuda_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr(device, "available", lambda: False)
    monkeypatch.setattr(device, "simulated", lambda: False)
    with pytest.raises(HybridError, match="no CUDA GPU found"):
        device.require_cuda()


def test_available_is_a_plain_bool():
    assert gpu.available() in (True, False)
