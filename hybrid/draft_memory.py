"""What `--draft auto` learnt about a model on this machine, kept from one process to the next.

A fresh depth controller spends a run's first steps learning what the last process on the same
model and placement already knew: each depth's step cost and how often each draft is kept. On a
one-shot `hybrid decode` of a few dozen tokens that learning is a large share of the run. So
the controller's record (`DepthController.learnt`) is written, when the process exits, to one
small JSON file per model file, device, placement and thread policy in hybrid's cache folder
(`cpu.kernel_cache.cache_root`, beside the compiled kernels), and a later process on the same
setup starts from it (`DepthController.resumed`).

The record changes the speed only, never the text: greedy output is the same at every depth and
seeded sampling draws each position's numbers from (seed, position). So a record that is
missing, unreadable or malformed is a fresh start, and a cache directory that cannot be written
is passed over in silence: the next run's head start is all either loses.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import tempfile
from pathlib import Path

from cpu.kernel_cache import cache_root

from .draft_depth import DepthController

_FOLDER = "draft-depth"     # under hybrid's cache folder
_latest: dict[Path, DepthController] = {}   # per record, the controller last handed out: written at exit


def record_path(*setup) -> Path:
    """The record of one setup: `setup` is every value the learnt costs depend on (the model
    file's identity, the device, the placement, the threads, the deepest draft)."""
    key = hashlib.sha256(json.dumps([str(v) for v in setup]).encode()).hexdigest()[:32]
    return cache_root() / _FOLDER / f"{key}.json"


def recall(path: Path, max_depth: int) -> DepthController:
    """The controller the record at `path` describes, or a fresh one; either way it is written
    back to `path` when the process exits (the one last handed out per path: a model loaded
    again in the same process learnt the latest)."""
    try:
        controller = DepthController.resumed(max_depth, json.loads(path.read_text()))
    except (OSError, ValueError):           # none yet, unreadable, or not a record (json's errors are ValueErrors)
        controller = DepthController(max_depth)
    if not _latest:
        atexit.register(_write_all)
    _latest[path] = controller              # held to the end: a CLI command's model is gone before exit
    return controller


def remember(path: Path, controller: DepthController) -> None:
    """Write `controller`'s record to `path` (whole or not at all: a reader never sees half)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(controller.learnt(), f)
        os.replace(f.name, path)
    except OSError:
        return


def _write_all() -> None:
    for path, controller in _latest.items():
        if controller.steps:                # a controller that never ran learnt nothing
            remember(path, controller)
