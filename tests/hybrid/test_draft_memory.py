"""What `--draft auto` learnt, kept from one process to the next (hybrid/draft_memory.py,
DepthController.learnt / resumed)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid import draft_memory
from hybrid.draft_depth import DepthController
from tests.hybrid.test_draft_depth import MAX, bernoulli, drive, linear


def taught(steps: int = 300) -> DepthController:
    """A controller that ran long enough to settle: drafts kept 95% of the time, rows cheap."""
    c = DepthController(MAX)
    drive(c, steps, accepted=bernoulli(0.95), cost=linear(0.1))
    return c


def test_a_resumed_controller_knows_what_the_one_it_came_from_knew():
    c = taught()
    r = DepthController.resumed(MAX, json.loads(json.dumps(c.learnt())))
    assert r.acceptance() == pytest.approx(c.acceptance())
    assert r.cost == pytest.approx(c.cost)
    assert r.choice == c.choice == r.depth
    assert r.choice >= 3                                    # the settled choice, not the start depth (1)
    fresh = DepthController(MAX)
    assert r.acceptance() != pytest.approx(fresh.acceptance())


def test_a_resumed_controller_starts_where_the_other_ended_and_skips_the_learning():
    """A fresh controller explores from depth 1 while it learns; one resumed from a settled
    record drafts at the settled depth from its first steps."""
    c = taught()
    r = DepthController.resumed(MAX, c.learnt())
    fresh = DepthController(MAX)
    first_resumed = drive(r, 12, accepted=lambda d: d, cost=linear(0.1))
    first_fresh = drive(fresh, 12, accepted=lambda d: d, cost=linear(0.1))
    assert first_resumed[0] == c.choice
    assert sum(first_resumed) > sum(first_fresh)


def test_a_resumed_controller_keeps_learning_where_the_machine_changed():
    """The record's prices are where a resumed controller starts, not where it stays: on a
    machine where drafting rows now cost twice a step, it leaves drafting behind."""
    r = DepthController.resumed(MAX, taught().learnt())
    chosen = drive(r, 400, accepted=lambda d: d, cost=linear(2.0))
    assert chosen[-50:].count(0) >= 45


@pytest.mark.parametrize("record", [
    {}, {"kept": [0, 1], "tried": [0, 1], "choice": 1},                       # missing fields
    {"kept": [0, 2.0], "tried": [0, 1.0], "choice": 1, "seconds": {}},         # kept more than tried
    {"kept": [0, 1.0], "tried": [0, 1.0], "choice": 1, "seconds": {"9": [1.0]}},   # no such depth
    {"kept": [0, 1.0], "tried": [0, 1.0], "choice": 1, "seconds": {"1": [-1.0]}},  # negative seconds
    {"kept": "x", "tried": [0, 1.0], "choice": 1, "seconds": {}},
    [1, 2, 3],
])
def test_a_record_that_is_not_one_is_refused(record):
    with pytest.raises(ValueError):
        DepthController.resumed(MAX, record)


def test_recall_starts_fresh_without_a_readable_record_and_remember_writes_one(tmp_path):
    path = tmp_path / "sub" / "record.json"
    fresh = DepthController(MAX)
    assert draft_memory.recall(path, MAX).acceptance() == fresh.acceptance()      # none yet
    path.parent.mkdir()
    path.write_text("{not json")
    assert draft_memory.recall(path, MAX).acceptance() == fresh.acceptance()      # unreadable
    c = taught()
    draft_memory.remember(path, c)
    assert draft_memory.recall(path, MAX).acceptance() == pytest.approx(c.acceptance())
    assert [p.name for p in path.parent.iterdir()] == ["record.json"]              # no temporary left


def test_remember_passes_over_a_folder_it_cannot_write(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    draft_memory.remember(blocked / "record.json", taught())      # its parent is a file: no error
    assert blocked.read_text() == ""


def test_record_paths_differ_by_setup_and_lie_in_the_users_cache():
    a = draft_memory.record_path("model-1", "cuda", 100)
    assert a == draft_memory.record_path("model-1", "cuda", 100)
    assert a != draft_memory.record_path("model-1", "cpu", 100)
    assert a != draft_memory.record_path("model-2", "cuda", 100)
    assert Path(os.environ["XDG_CACHE_HOME"]) in a.parents


def test_a_process_leaves_its_record_and_the_next_model_load_starts_from_it():
    """End to end: `hybrid decode` at its default (auto) depth writes its record when the process
    exits (its model is long gone by then); a model loaded afterwards on the same file and
    placement starts from it."""
    import hybrid
    subprocess.run([sys.executable, "-c", "from hybrid.cli import main; main()", "decode", "-p", "def fibonacci(n):",
                    "-n", "24", "--temp", "0", "--device", "cpu"],
                   check=True, capture_output=True, timeout=600, stdin=subprocess.DEVNULL)
    model = hybrid.load(None, device="cpu")
    c = model.depth_controller
    learnt = c.learnt()
    assert learnt["tried"][1] > 0 and learnt["seconds"]          # a fresh controller has neither
    assert c.choice == learnt["choice"]
