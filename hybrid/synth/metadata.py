"""The GGUF key/value metadata of a synthetic model, typed as llama.cpp's converter types them.

Keys and types: docs/MODEL_FORMAT.md §1.2 (architecture) and §7 (tokenizer), checked
against the trained qwen35 file in hybrid/data.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from gguf import GGUFValueType as V

from .spec import SynthSpec
from .types import ALIGNMENT, ModelPlan
from .vocab import CHATML_TEMPLATE, build_vocab


class KV(NamedTuple):
    key: str
    type: V
    value: Any
    item_type: V | None = None     # for arrays


def model_metadata(spec: SynthSpec, plan: ModelPlan) -> list[KV]:
    A = spec.arch
    kv = [
        KV("general.architecture", V.STRING, A),
        KV("general.type", V.STRING, "model"),
        KV("general.name", V.STRING, spec.name),
    ]
    if plan.alignment != ALIGNMENT:
        kv.append(KV("general.alignment", V.UINT32, plan.alignment))
    u32 = [
        ("block_count", spec.n_layer_all),
        ("context_length", spec.context_length),
        ("embedding_length", spec.n_embd),
        ("attention.head_count", spec.n_head),
        ("attention.head_count_kv", spec.n_head_kv),
        ("attention.key_length", spec.head_dim),
        ("attention.value_length", spec.head_dim),
        ("rope.dimension_count", spec.n_rot),
        ("ssm.conv_kernel", spec.ssm_conv_kernel),
        ("ssm.state_size", spec.ssm_d_state),
        ("ssm.group_count", spec.ssm_n_k_heads),
        ("ssm.time_step_rank", spec.ssm_n_v_heads),
        ("ssm.inner_size", spec.ssm_d_inner),
        ("full_attention_interval", spec.full_attention_interval),
    ]
    if spec.mtp:
        u32.append(("nextn_predict_layers", 1))
    if A == "qwen35":
        u32.append(("feed_forward_length", spec.n_ff))
    else:
        u32 += [("expert_count", spec.n_expert), ("expert_used_count", spec.n_expert_used),
                ("expert_feed_forward_length", spec.n_ff_exp)]
        if spec.n_ff_shexp:
            u32.append(("expert_shared_feed_forward_length", spec.n_ff_shexp))
    kv += [KV(f"{A}.{k}", V.UINT32, int(v)) for k, v in u32]
    kv += [KV(f"{A}.rope.freq_base", V.FLOAT32, float(spec.rope_theta)),
           KV(f"{A}.attention.layer_norm_rms_epsilon", V.FLOAT32, float(spec.rms_eps))]
    if A != "qwen3next":
        kv.append(KV(f"{A}.rope.dimension_sections", V.ARRAY, list(spec.sections), V.INT32))
    if spec.write_recurrent_layers:
        # One flag per block; the MTP block is never recurrent.
        flags = [k == "gdn" for k in spec.layer_kinds] + [False] * (spec.n_layer_all - spec.n_layer)
        kv.append(KV(f"{A}.attention.recurrent_layers", V.ARRAY, flags, V.BOOL))
    kv += tokenizer_metadata(spec)
    kv += [KV("general.quantization_version", V.UINT32, 2),
           KV("general.file_type", V.UINT32, plan.file_type)]
    return kv


def tokenizer_metadata(spec: SynthSpec) -> list[KV]:
    vocab = build_vocab(spec.n_vocab)
    return [
        KV("tokenizer.ggml.model", V.STRING, "gpt2"),
        KV("tokenizer.ggml.pre", V.STRING, "qwen2" if spec.arch == "qwen3next" else "qwen35"),
        KV("tokenizer.ggml.tokens", V.ARRAY, list(vocab.tokens), V.STRING),
        KV("tokenizer.ggml.token_type", V.ARRAY, list(vocab.token_types), V.INT32),
        KV("tokenizer.ggml.merges", V.ARRAY, list(vocab.merges), V.STRING),
        KV("tokenizer.ggml.eos_token_id", V.UINT32, vocab.eos_id),
        KV("tokenizer.ggml.padding_token_id", V.UINT32, vocab.padding_id),
        KV("tokenizer.ggml.add_bos_token", V.BOOL, False),
        KV("tokenizer.ggml.add_eos_token", V.BOOL, False),
        KV("tokenizer.chat_template", V.STRING, CHATML_TEMPLATE),
    ]
