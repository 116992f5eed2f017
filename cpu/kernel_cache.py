"""Where Numba keeps the compiled kernels of cpu/ and gpu/: one directory per version of their source.

Numba checks a cached kernel against the stamp (mtime, size) of the one file that defines the
jitted function. Our kernels are assembled from intrinsics and helpers in other files (a matvec in
cpu/matvec.py inlines the row dots of cpu/simd.py), so after a `git pull` that changed only
cpu/simd.py, Numba would load the old machine code of every kernel that inlines it: wrong results
or a crash, silently. The cache therefore lives under a directory named by a hash of the contents
of every source file of both kernel packages: a change anywhere compiles everything afresh (the
count-and-progress warm-up of hybrid/kernel_prep.py does that on the next run), and an unchanged
tree finds its kernels whatever the files' mtimes.

The directory is NUMBA_CACHE_DIR (else ~/.cache/hybrid, XDG_CACHE_HOME respected) / kernels-<hash>.
It is written back into the environment so that the processes the warm-up spawns, and numba-cuda
(which reads the variable when it loads), use the same one; `use()` is idempotent, so a child
that inherits the directory keeps it. Directories of other source versions untouched for
PRUNE_AFTER_S are removed when a new one is made (a developer's every edit makes one).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

PREFIX = "kernels-"
PRUNE_AFTER_S = 24 * 3600
_PACKAGES = ("cpu", "gpu")


def source_hash(root: Path) -> str:
    """A hash of the relative paths and contents of the .py files of the kernel packages."""
    h = hashlib.blake2b(digest_size=10)
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def cache_root() -> Path:
    """hybrid's folder in the user's cache directory (XDG_CACHE_HOME, else ~/.cache): the kernels'
    default parent, and where hybrid keeps what else it learns about a machine."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybrid"


def _prune(parent: Path, keep: Path) -> None:
    """Remove sibling kernel directories of other source versions not written for PRUNE_AFTER_S."""
    cutoff = time.time() - PRUNE_AFTER_S
    for other in parent.glob(PREFIX + "*"):
        try:
            if other != keep and other.is_dir() and other.stat().st_mtime < cutoff:
                shutil.rmtree(other, ignore_errors=True)
        except OSError:
            pass


def use() -> str:
    """Point Numba's disk cache at this source version's directory; returns it."""
    name = PREFIX + source_hash(Path(__file__).resolve().parents[1])
    given = os.environ.get("NUMBA_CACHE_DIR")
    if given and Path(given).name == name:         # inherited from a parent that chose it
        directory = Path(given)
    else:
        parent = Path(given) if given else cache_root()
        directory = parent / name
        if not directory.exists():
            _prune(parent, directory)
    os.environ["NUMBA_CACHE_DIR"] = str(directory)
    # Numba modules already loaded read the variable at their import: set their copies too
    for config in ("numba.core.config", "numba.cuda.core.config"):
        if config in sys.modules:
            sys.modules[config].CACHE_DIR = str(directory)
    return str(directory)
