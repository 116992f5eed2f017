"""Typed model configuration parsed from GGUF metadata (docs/MODEL_FORMAT.md §1).

One `ModelConfig` covers the three GDN-hybrid architectures. Trunk layers are 0..n_layer-1;
the MTP (nextn) blocks follow at n_layer..n_layer+n_nextn-1.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from .errors import ModelError
from .metadata import Meta, shown

ARCHITECTURES = ("qwen35", "qwen35moe", "qwen3next")
GDN, ATTN = "gdn", "attn"
# Upper bounds for counts and dimensions read from a file, far above any real model, so that a
# crafted value fails as a bad key instead of as a huge allocation further on.
MAX_BLOCKS = 4096
MAX_DIM = 1 << 24


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layer: int                 # trunk layers L
    n_nextn: int                 # MTP blocks (0 or 1), stored at blk.L
    n_embd: int                  # D
    n_vocab: int
    n_head: int                  # full-attention query heads
    n_head_kv: int
    head_dim: int                # d_h
    n_rot: int                   # rotated dims per head (partial NEOX RoPE)
    rope_theta: float
    rms_eps: float
    context_length: int
    layer_kinds: tuple[str, ...]  # GDN or ATTN per trunk layer
    # Gated DeltaNet
    ssm_conv_kernel: int         # K
    ssm_d_state: int             # d_k = d_v
    ssm_n_k_heads: int           # H_k
    ssm_n_v_heads: int           # H_v
    ssm_d_inner: int             # H_v * d_v
    # FFN: dense width, or MoE dims (n_expert == 0 for dense)
    n_ff: int = 0
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    tied_output: bool = False    # no output.weight: lm_head reuses token_embd
    rope_sections: tuple[int, ...] = field(default=())

    # --- derived -------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    @property
    def n_layer_all(self) -> int:
        return self.n_layer + self.n_nextn

    @property
    def ssm_key_dim(self) -> int:
        return self.ssm_n_k_heads * self.ssm_d_state

    @property
    def ssm_conv_channels(self) -> int:
        """C = 2·H_k·d_k + H_v·d_v: the channels of attn_qkv's output and of the conv."""
        return 2 * self.ssm_key_dim + self.ssm_d_inner

    @property
    def gdn_head_pairing(self) -> str:
        """How v-head j picks its k-head: 'tiled' (j mod H_k) or 'grouped' (j // r)."""
        return "grouped" if self.arch == "qwen3next" else "tiled"

    def is_recurrent(self, layer: int) -> bool:
        return layer < self.n_layer and self.layer_kinds[layer] == GDN

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- parsing ---------------------------------------------------------------------------------

def layer_kinds_from(kv: Mapping[str, Any], arch: str, n_layer: int, n_layer_all: int) -> tuple[str, ...]:
    """Per trunk layer: the explicit `attention.recurrent_layers` flags, else the interval rule."""
    m = Meta(kv, f"{arch}.")
    flags = m.ints("attention.recurrent_layers", None, lo=0, hi=1, max_len=n_layer_all)
    if flags is not None:
        if len(flags) not in (n_layer, n_layer_all):
            raise ModelError(
                f"'{arch}.attention.recurrent_layers' has {len(flags)} entries; expected {n_layer_all} "
                f"(one per block, MTP included)")
        return tuple(GDN if f else ATTN for f in flags[:n_layer])
    interval = m.int("full_attention_interval", 4, lo=1)
    return tuple(ATTN if (i + 1) % interval == 0 else GDN for i in range(n_layer))


def config_from_metadata(kv: Mapping[str, Any], *, n_vocab: int, tied_output: bool) -> ModelConfig:
    """Build the config from a plain dict of GGUF key → python value.

    `n_vocab` comes from the token embedding's shape (the authoritative count);
    `tied_output` from whether `output.weight` exists. block_count is bounded by MAX_BLOCKS before anything
    per layer is built (the caller also bounds it by the file's tensor count).
    """
    arch = Meta(kv).str("general.architecture", None)
    if arch is None:
        raise ModelError("GGUF metadata has no 'general.architecture'")
    if arch not in ARCHITECTURES:
        raise ModelError(
            f"unsupported architecture {shown(arch)}; hybrid runs: {', '.join(ARCHITECTURES)}")
    m = Meta(kv, f"{arch}.")
    n_all = m.int("block_count", lo=1, hi=MAX_BLOCKS)
    n_nextn = m.int("nextn_predict_layers", 0)
    if n_nextn not in (0, 1):
        raise ModelError(f"'{arch}.nextn_predict_layers' is {n_nextn}; only 0 or 1 MTP block is supported")
    n_layer = n_all - n_nextn
    if n_layer < 1:
        raise ModelError(f"'{arch}.block_count' is {n_all}: no trunk layers left after {n_nextn} MTP block(s)")
    head_dim = m.int("attention.key_length", lo=1, hi=MAX_DIM)
    if m.int("attention.value_length", head_dim, hi=MAX_DIM) != head_dim:
        raise ModelError(f"'{arch}.attention.key_length' and 'value_length' differ; they must be equal")
    moe = arch in ("qwen35moe", "qwen3next")

    def dim(key: str, default: Any = ...) -> int:
        return m.int(key, hi=MAX_DIM) if default is ... else m.int(key, default, hi=MAX_DIM)

    cfg = ModelConfig(
        arch=arch,
        n_layer=n_layer,
        n_nextn=n_nextn,
        n_embd=dim("embedding_length"),
        n_vocab=n_vocab,
        n_head=dim("attention.head_count"),
        n_head_kv=dim("attention.head_count_kv"),
        head_dim=head_dim,
        n_rot=dim("rope.dimension_count", head_dim),
        rope_theta=m.float("rope.freq_base", 10000.0, positive=True),
        rms_eps=m.float("attention.layer_norm_rms_epsilon", positive=True),
        context_length=m.int("context_length", 4096, lo=1),
        layer_kinds=layer_kinds_from(kv, arch, n_layer, n_all),
        ssm_conv_kernel=dim("ssm.conv_kernel"),
        ssm_d_state=dim("ssm.state_size"),
        ssm_n_k_heads=dim("ssm.group_count"),
        ssm_n_v_heads=dim("ssm.time_step_rank"),
        ssm_d_inner=dim("ssm.inner_size"),
        n_ff=dim("feed_forward_length", 0) if moe else dim("feed_forward_length"),
        n_expert=dim("expert_count") if moe else 0,
        n_expert_used=dim("expert_used_count") if moe else 0,
        n_ff_exp=dim("expert_feed_forward_length") if moe else 0,
        n_ff_shexp=dim("expert_shared_feed_forward_length", 0) if moe else 0,
        tied_output=tied_output,
        rope_sections=tuple(m.ints("rope.dimension_sections", [], hi=MAX_DIM, max_len=8)),
    )
    _check_consistent(cfg)
    return cfg


def _check_consistent(c: ModelConfig) -> None:
    def bad(msg: str) -> None:
        raise ModelError(f"inconsistent {c.arch} metadata: {msg}")

    if c.n_head % max(c.n_head_kv, 1) != 0:
        bad(f"head_count {c.n_head} is not a multiple of head_count_kv {c.n_head_kv}")
    if not 0 < c.n_rot <= c.head_dim or c.n_rot % 2:
        bad(f"rope.dimension_count {c.n_rot} must be even and within head dim {c.head_dim}")
    if c.ssm_d_inner != c.ssm_n_v_heads * c.ssm_d_state:
        bad(f"ssm.inner_size {c.ssm_d_inner} != time_step_rank {c.ssm_n_v_heads} × state_size {c.ssm_d_state}")
    if c.ssm_n_v_heads % max(c.ssm_n_k_heads, 1) != 0:
        bad(f"ssm.time_step_rank {c.ssm_n_v_heads} is not a multiple of ssm.group_count {c.ssm_n_k_heads}")
    if c.is_moe and not 0 < c.n_expert_used <= c.n_expert:
        bad(f"expert_used_count {c.n_expert_used} must be in 1..expert_count {c.n_expert}")
    if min(c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.ssm_conv_kernel, c.ssm_d_state,
           c.ssm_n_k_heads, c.ssm_n_v_heads) < 1:
        bad("a dimension is zero")
