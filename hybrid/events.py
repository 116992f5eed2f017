"""What `Model.generate` yields: prefill progress, tokens, and the final stats.

Every event has `.text` ("" where there is none) so a caller can print all of them blindly.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Stats:
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    stop_reason: str = ""          # "eog", "stop_string", "length", "context", "interrupted"
    draft: dict | None = None      # speculative decoding counters, when drafting is on
    cached_tokens: int = 0         # prompt tokens a chat session reused from its state (not prefilled)

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        d = {
            "prompt_tokens": self.prompt_tokens,
            "prefill_seconds": round(self.prefill_seconds, 6),
            "prefill_tps": round(self.prefill_tps, 3),
            "generated_tokens": self.generated_tokens,
            "decode_seconds": round(self.decode_seconds, 6),
            "decode_tps": round(self.decode_tps, 3),
            "total_seconds": round(self.prefill_seconds + self.decode_seconds, 6),
            "stop_reason": self.stop_reason,
            "cached_tokens": self.cached_tokens,
        }
        if self.draft is not None:
            d["draft"] = self.draft
        return d


@dataclass
class Prefill:
    """Prompt processing progress: `done` of `total` prompt tokens after `seconds`."""
    done: int
    total: int
    seconds: float
    text: str = ""


@dataclass
class Token:
    """One generated token; `text` is the complete UTF-8 text it adds (may be "" mid-character)."""
    id: int
    text: str
    stats: Stats = field(repr=False, default_factory=Stats)   # running totals, for live displays
    reasoning: bool = False   # part of a thinking model's reasoning (chat prompts only; see hybrid.reasoning)
    logprobs: tuple | None = None   # (log p, [(id, log p) of the top alternatives]) when asked for


@dataclass
class Done:
    """Generation finished; `text` holds any text held back until the end (a pending stop-string prefix)."""
    stats: Stats
    text: str = ""
    reasoning: bool = False   # `text` is the end of the reasoning (generation stopped inside it)
