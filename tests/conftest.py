import os
import pathlib

# Before numpy loads: multi-threaded BLAS is ~30x slower than one thread on the small
# products of the reference forwards, and it fights Numba's threads for the cores.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# numba.cuda chooses real GPU or simulator once, at its first import, from this variable; any
# test module (CPU ones too, through hybrid.forward's backends) may be the first to import it,
# so the choice is made here, before collection starts.
from gpu.device import available as _gpu_available, simulated as _gpu_simulated  # noqa: E402

if not _gpu_available() and not _gpu_simulated():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARED_MODELS = ROOT.parent / "shared" / "models"
BUNDLED_MODEL = ROOT / "hybrid" / "data" / "tiny-qwen35-mtp-Q4_K_M.gguf"


@pytest.fixture(scope="session")
def trained_model_q8() -> pathlib.Path:
    p = SHARED_MODELS / "tiny-qwen35-mtp-Q8_0.gguf"
    if not p.exists():
        pytest.skip(f"trained test model not found at {p}")
    return p


@pytest.fixture(scope="session")
def trained_model_q4km() -> pathlib.Path:
    return BUNDLED_MODEL


def pytest_sessionfinish(session, exitstatus):
    """A run that executed no test, or skipped every test, must not look green."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or exitstatus != 0:
        return
    passed = len(reporter.stats.get("passed", []))
    if passed == 0:
        session.exitstatus = 1
