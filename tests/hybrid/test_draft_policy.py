"""DraftPolicy (hybrid/draft_policy.py): one owner of the draft depth's parsing, default, limits
and ring size; the library and the CLI default to the same depth."""
import inspect

import pytest

import hybrid
from hybrid.api import Model
from hybrid.cli.common import DraftOpt
from hybrid.cli.decode import pick_draft
from hybrid.draft_policy import AUTO, MAX_AUTO_DEPTH, MAX_DEPTH, DraftPolicy, parse_depth
from hybrid.errors import HybridError
from hybrid.events import Done
from hybrid.session import ChatSession


def test_parse_limits_and_ring():
    assert parse_depth("auto") == parse_depth(" AUTO ") == AUTO
    assert parse_depth("3") == parse_depth(3) == 3
    for bad in ("-1", "x", MAX_DEPTH + 1, -2):
        with pytest.raises(HybridError, match="draft depth"):
            parse_depth(bad)
    assert DraftPolicy(AUTO).ring == MAX_AUTO_DEPTH + 1
    assert DraftPolicy(2).ring == 3 and DraftPolicy(0).ring == 0
    with pytest.raises(HybridError, match="no MTP head"):
        DraftPolicy.parse(1, has_mtp=False)
    assert DraftPolicy.parse("0", has_mtp=False).depth == 0


def test_ring_for_a_draft_setting():
    def ring(draft, has_mtp):
        return DraftPolicy.parse(draft, has_mtp).ring
    assert ring(None, True) == 5          # auto drafts up to 4: ring of 5 slots
    assert ring("2", True) == 3 and ring(0, True) == 0
    assert ring(None, False) == 0
    with pytest.raises(HybridError, match="no MTP head"):
        ring("2", False)


@pytest.mark.parametrize("has_mtp", [True, False])
def test_library_and_cli_defaults_agree(has_mtp):
    default = DraftPolicy.parse(None, has_mtp).depth
    assert default == (AUTO if has_mtp else 0)
    assert pick_draft(None, has_mtp) == default
    assert DraftOpt.default is None                                       # the CLI passes None on
    assert inspect.signature(Model.generate).parameters["draft"].default is None
    assert inspect.signature(Model.session).parameters["draft"].default is None
    assert inspect.signature(ChatSession.__init__).parameters["draft"].default is None


def test_library_default_drafts_with_the_bundled_models_head():
    model = hybrid.load(device="cpu", threads=1)
    done = [e for e in model.generate("def add(a, b):", max_tokens=12, temperature=0) if isinstance(e, Done)][0]
    assert done.stats.draft and str(done.stats.draft["depth"]).startswith("auto")
