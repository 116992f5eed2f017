"""cpu/kernel_cache.py: Numba's disk cache lives in one directory per version of the kernel sources,
so a kernel never loads machine code compiled from helpers (in other files) that have since changed."""
import os
import subprocess
import sys
import time
from pathlib import Path

import numba.core.config
import pytest

from cpu import kernel_cache

ROOT = Path(__file__).resolve().parents[2]


def _tree(tmp_path: Path) -> Path:
    for package in ("cpu", "gpu"):
        (tmp_path / package / "sub").mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "sub" / "helper.py").write_text("def f():\n    return 1\n")
    return tmp_path


def test_the_hash_follows_every_source_file_and_only_the_sources(tmp_path):
    root = _tree(tmp_path)
    first = kernel_cache.source_hash(root)
    (root / "gpu" / "sub" / "helper.py").write_text("def f():\n    return 2\n")
    changed = kernel_cache.source_hash(root)
    assert changed != first
    (root / "gpu" / "notes.txt").write_text("not a source file")
    os.utime(root / "cpu" / "__init__.py", (1, 1))          # an mtime alone is no change
    assert kernel_cache.source_hash(root) == changed


@pytest.fixture
def cache_env(monkeypatch, tmp_path):
    """NUMBA_CACHE_DIR and Numba's loaded copies of it, restored after the test."""
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(numba.core.config, "CACHE_DIR", numba.core.config.CACHE_DIR)
    if "numba.cuda.core.config" in sys.modules:
        cuda_config = sys.modules["numba.cuda.core.config"]
        monkeypatch.setattr(cuda_config, "CACHE_DIR", cuda_config.CACHE_DIR)
    return tmp_path


def test_use_picks_the_versions_directory_once_and_prunes_only_stale_others(cache_env):
    stale, recent = cache_env / "kernels-stale", cache_env / "kernels-recent"
    stale.mkdir()
    recent.mkdir()
    old = time.time() - 2 * kernel_cache.PRUNE_AFTER_S
    os.utime(stale, (old, old))
    directory = kernel_cache.use()
    name = kernel_cache.PREFIX + kernel_cache.source_hash(ROOT)
    assert directory == str(cache_env / name)
    assert os.environ["NUMBA_CACHE_DIR"] == directory and numba.core.config.CACHE_DIR == directory
    assert not stale.exists() and recent.exists()
    assert kernel_cache.use() == directory                    # a child inheriting it keeps it


def test_a_changed_source_tree_gets_its_own_directory_in_a_new_process(tmp_path):
    """What `git pull` does to a checkout: the next process must not find the old kernels."""
    tree = tmp_path / "tree"
    for package in ("cpu", "gpu"):
        (tree / package).mkdir(parents=True)
        for path in (ROOT / package).glob("*.py"):
            (tree / package / path.name).write_text(path.read_text())
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(tree)}
    probe = [sys.executable, "-c", "import os, cpu; print(os.environ['NUMBA_CACHE_DIR'])"]

    def directory():
        run = subprocess.run(probe, capture_output=True, text=True, env=env, cwd=tree, timeout=120)
        assert run.returncode == 0, run.stderr
        return run.stdout.strip()
    before = directory()
    assert directory() == before
    simd = tree / "cpu" / "simd.py"
    simd.write_text(simd.read_text() + "\n# edited\n")
    after = directory()
    assert after != before and Path(after).parent == Path(before).parent == tmp_path / "cache"
