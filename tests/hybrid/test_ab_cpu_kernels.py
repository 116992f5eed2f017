"""tools/ab_cpu_kernels.py: the revision's copy is a package of its own, and the comparison times
both trees and says whether their outputs agree."""
import sys
from pathlib import Path

import numpy as np
import pytest

from cpu.matvec import matvec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import ab_cpu_kernels as ab  # noqa: E402


def test_the_base_copy_imports_itself_not_the_working_tree(tmp_path):
    package = ab.copy_base("HEAD", tmp_path)
    assert package == tmp_path / ab.BASE_PACKAGE
    texts = {p.name: p.read_text() for p in package.rglob("*.py")}
    assert "matvec.py" in texts and "simd.py" in texts
    assert not any(ab._CPU_IMPORT.search(t) for t in texts.values())
    assert "from cpu_base.ggml_types import" in texts["matvec.py"]
    assert "kernel_cache.use()" not in texts["__init__.py"]     # the working tree's cache directory


def test_an_unknown_revision_is_a_one_line_error(tmp_path):
    with pytest.raises(SystemExit, match="error: git archive no-such-rev"):
        ab.copy_base("no-such-rev", tmp_path)


def test_compare_times_both_and_checks_their_outputs():
    def off_by_one(wtype, w, x, out):
        matvec(wtype, w, x, out)
        out += 1.0

    same = ab.compare("Q8_0", 16, 256, 3, {"base": matvec, "tree": matvec})
    assert same["equal"]
    assert all(0.0 < same["best"][k] <= same["total"][k] for k in ("base", "tree"))
    assert not ab.compare("Q8_0", 16, 256, 1, {"base": matvec, "tree": off_by_one})["equal"]
    assert np.isfinite(same["total"]["tree"] / same["total"]["base"])
