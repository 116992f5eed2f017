"""The MTP drafting depth a run asked for, and everything that follows from it: the one owner of
"auto", the depth limits, the snapshot ring a depth needs and the no-MTP-head rule.

The default (None) is "auto" when the model has an MTP head and 0 otherwise, for the library, the
CLI and the planner alike: auto measures each depth's step cost and acceptance and keeps the best
(hybrid/draft_depth.py), so it is the fast path on every model that can draft.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import HybridError

AUTO = -1               # depth chosen per step by draft_depth.DepthController
MAX_AUTO_DEPTH = 4      # the deepest draft auto tries
MAX_DEPTH = 16          # the deepest fixed draft accepted
NO_MTP = "this model has no MTP head, so it cannot draft: drop --draft (or use --draft 0)"


@dataclass(frozen=True)
class DraftPolicy:
    depth: int          # 0 = no drafting, 1..MAX_DEPTH fixed, AUTO

    @classmethod
    def parse(cls, draft: int | str | None, has_mtp: bool) -> "DraftPolicy":
        """From an int, "auto", a number as text, or None (the default); HybridError for a bad
        value or a draft asked of a model without an MTP head."""
        if draft is None:
            return cls(AUTO if has_mtp else 0)
        depth = parse_depth(draft)
        if depth != 0 and not has_mtp:
            raise HybridError(NO_MTP)
        return cls(depth)

    @property
    def auto(self) -> bool:
        return self.depth == AUTO

    @property
    def max_depth(self) -> int:
        """The most drafts one step may make."""
        return MAX_AUTO_DEPTH if self.auto else self.depth

    @property
    def ring(self) -> int:
        """Snapshot ring slots a state needs: one per token of the widest verify, 0 without drafting."""
        return self.max_depth + 1 if self.depth else 0

    @property
    def label(self) -> int | str:
        return "auto" if self.auto else self.depth


def parse_depth(draft: int | str) -> int:
    """A depth from an int (AUTO passes through) or text ("auto" → AUTO); HybridError outside
    0..MAX_DEPTH."""
    if isinstance(draft, str):
        if draft.strip().lower() == "auto":
            return AUTO
        try:
            draft = int(draft)
        except ValueError:
            raise HybridError(f"draft depth must be a number ≥ 0 or 'auto', got {draft!r}") from None
    elif draft == AUTO:
        return AUTO
    if draft < 0 or draft > MAX_DEPTH:
        raise HybridError(f"draft depth must be between 0 and {MAX_DEPTH} (or 'auto'), got {draft}")
    return int(draft)
