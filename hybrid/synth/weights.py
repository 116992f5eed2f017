"""The random values each tensor of a synthetic model holds: scaled so a forward pass stays finite.

The rules follow from the forward math (docs/MODEL_FORMAT.md §3):
* a matrix that reads a normalised vector: N(0, 1/fan_in), so its outputs have unit scale;
* a matrix that writes into the residual stream (attn_output, ssm_out, ffn_down*): additionally
  divided by sqrt(2·blocks), so the residual grows slowly through many layers;
* embeddings N(0, 1/sqrt(D)) and lm_head 2/sqrt(D): logits of order 1–2, tied or not;
* RMSNorm weights ≈ 1 (the +1 is already folded in the file), `ssm_norm` ≈ 1 too;
* `ssm_a` = −exp(U(−1, 1)) (negative: the log-decay), `ssm_dt.bias` small, conv taps
  U(±1/sqrt(K)).
Values are a pure function of (seed, tensor name, row range), so any tensor can be regenerated
on its own (the tests do that to know what the writer meant).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from .spec import SynthSpec

_RESIDUAL_WRITERS = (".attn_output.weight", ".ssm_out.weight", ".ffn_down.weight",
                     ".ffn_down_exps.weight", ".ffn_down_shexp.weight")


@dataclass(frozen=True)
class Init:
    """A distribution: 'normal' (mean a, std b), 'uniform' (a..b) or 'neg_exp_uniform' (−exp(U(a, b)))."""
    kind: str
    a: float
    b: float

    @property
    def std(self) -> float:
        """The spread a random-code block should imitate."""
        if self.kind == "normal":
            return self.b
        return (self.b - self.a) / np.sqrt(12.0)


def init_for(name: str, ne: tuple[int, ...], spec: SynthSpec) -> Init:
    D, fan_in = spec.n_embd, ne[0]
    if name in ("token_embd.weight",) or name.endswith(".nextn.embed_tokens.weight"):
        return Init("normal", 0.0, 1.0 / np.sqrt(D))
    if name == "output.weight" or name.endswith(".nextn.shared_head_head.weight"):
        return Init("normal", 0.0, 2.0 / np.sqrt(D))
    if name.endswith(".ssm_a"):
        return Init("neg_exp_uniform", -1.0, 1.0)
    if name.endswith(".ssm_dt.bias"):
        return Init("normal", 0.0, 0.1)
    if name.endswith(".ssm_conv1d.weight"):
        r = 1.0 / np.sqrt(spec.ssm_conv_kernel)
        return Init("uniform", -r, r)
    if len(ne) == 1 and "norm" in name:
        return Init("normal", 1.0, 0.02)
    std = 1.0 / np.sqrt(fan_in)
    if name.endswith(_RESIDUAL_WRITERS):
        std /= np.sqrt(2.0 * spec.n_layer_all)
    return Init("normal", 0.0, float(std))


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """One independent stream per tensor, so a tensor's values do not depend on the others."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def sample(init: Init, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    if init.kind == "normal":
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(init.b) + np.float32(init.a)
    elif init.kind == "uniform":
        x = rng.uniform(init.a, init.b, shape).astype(np.float32)
    elif init.kind == "neg_exp_uniform":
        x = -np.exp(rng.uniform(init.a, init.b, shape)).astype(np.float32)
    else:
        raise ValueError(f"unknown init kind {init.kind!r}")
    return x.astype(np.float32, copy=False)
