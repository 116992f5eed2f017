"""hybrid.kernel_bench's weights and pass timer, and the source lookup of tools/vs_ggml_cpu.py (the
same bytes go to ggml's matvec there, so they must be valid blocks)."""
import io
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from gguf import quants

from cpu.ggml_types import BY_NAME
from hybrid.kernel_bench import BenchPlan, pass_seconds, random_weights

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import vs_ggml_cpu  # noqa: E402


@pytest.mark.parametrize("name", ["Q4_K", "IQ2_XXS", "IQ1_M", "MXFP4"])
def test_random_weights_are_finite_blocks_of_the_type(name):
    t = BY_NAME[name]
    w = random_weights(t, 3, 512, np.random.default_rng(0))
    assert w.shape == (3, t.row_bytes(512)) and w.dtype == np.uint8
    values = quants.dequantize(w, t.id)
    assert values.shape == (3, 512)
    assert np.isfinite(values).all() and np.abs(values).max() > 0


def test_pass_seconds_times_one_pass():
    t = BY_NAME["Q8_0"]
    w = random_weights(t, 64, 256, np.random.default_rng(1))
    plan = BenchPlan(("Q8_0",), stream_bytes=w.nbytes * 3, min_seconds=0.0, min_repeats=3)
    seconds = pass_seconds(t, w, plan)
    assert 0.0 < seconds < 1.0


def _tarball(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:xz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_sources_unpack_a_tarball_and_find_the_tree(tmp_path):
    src = _tarball(tmp_path / "llama.tar.xz", {"llama.cpp-x/ggml/include/ggml.h": b"/* */",
                                               "llama.cpp-x/CMakeLists.txt": b""})
    tree = vs_ggml_cpu.sources(src, tmp_path / "build")
    assert tree == tmp_path / "build" / "src" / "llama.cpp-x"
    assert vs_ggml_cpu.sources(tree, tmp_path / "other") == tree     # a folder is used as it is


def test_sources_refuse_a_tarball_without_ggml(tmp_path):
    src = _tarball(tmp_path / "other.tar.xz", {"something/README": b"hi"})
    with pytest.raises(SystemExit, match="no llama.cpp tree"):
        vs_ggml_cpu.sources(src, tmp_path / "build")
