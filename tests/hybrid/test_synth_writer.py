"""Written files read back with gguf.GGUFReader (independent of our writer) and hybrid's own reader."""
import tracemalloc
from collections import namedtuple

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GQ
from gguf import GGUFValueType as V

from cpu import ggml_types as gt
from hybrid.config import config_from_metadata
from hybrid.errors import HybridError
from hybrid.synth import plan_model, preset, tensor_floats, write_model
from hybrid.synth import writer as writer_module
from hybrid.synth.dequantize import dequantize
from hybrid.synth.quantize import QUANTIZABLE
from hybrid.synth.types import synth_layout
from hybrid.synth.vocab import CHATML_TEMPLATE

try:
    from hybrid.model_file import open_model
except ImportError:      # the reader is another module's job; these checks then rely on GGUFReader alone
    open_model = None

# GDN + attention + MTP at the tiny dims: every tensor kind, small enough to quantise fast.
SMALL = dict(n_layer=2, full_attention_interval=2)
MAX_REL_ERR = {"F32": 0.0, "F16": 1e-3, "BF16": 5e-3, "Q8_0": 0.01, "Q6_K": 0.03, "Q5_K": 0.05,
               "Q4_K": 0.10, "Q4_0": 0.12, "Q4_1": 0.12, "Q5_0": 0.06, "Q5_1": 0.06, "MXFP4": 0.25}


def read_tensors(path):
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def metadata(path) -> dict:
    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}


def expected_bytes(spec, t, seed, method):
    return np.concatenate([c.reshape(-1) for c in writer_module.tensor_chunks(spec, t, seed, method)])


@pytest.mark.parametrize("type_name", sorted(QUANTIZABLE))
def test_round_trip_every_type(tmp_path, type_name):
    spec, seed = preset("tiny", **SMALL), 5
    path = tmp_path / "m.gguf"
    plan = write_model(path, spec, type_name, seed=seed, method="quantize")
    tensors = read_tensors(path)
    assert list(tensors) == [t.name for t in plan]
    for t in plan:
        raw = np.asarray(tensors[t.name].data).reshape(-1).view(np.uint8)
        assert tensors[t.name].tensor_type == GQ(t.type.id)
        meant = expected_bytes(spec, t, seed, "quantize")
        np.testing.assert_array_equal(raw, meant, err_msg=t.name)       # streamed bytes land in place
        truth = gguf.quants.dequantize(raw, GQ(t.type.id)).reshape(t.n_rows, t.ne[0])
        ours = dequantize(meant, t.type, t.ne[0])
        np.testing.assert_array_equal(ours.view(np.uint32), truth.view(np.uint32), err_msg=t.name)
        floats = tensor_floats(spec, t.name, seed)
        if t.type is gt.F32:
            np.testing.assert_array_equal(truth, floats, err_msg=t.name)
        else:
            rel = np.sqrt(np.mean((truth - floats) ** 2) / np.mean(floats ** 2))
            assert rel <= MAX_REL_ERR[t.type.name], (t.name, rel)


def test_weights_are_well_scaled(tmp_path):
    spec = preset("tiny")
    f = {name: tensor_floats(spec, name) for name in
         ("blk.0.ssm_a", "blk.0.ssm_dt.bias", "blk.0.attn_norm.weight", "blk.0.ssm_norm.weight",
          "blk.0.attn_qkv.weight", "blk.0.ffn_down.weight", "blk.4.nextn.enorm.weight")}
    assert np.all(f["blk.0.ssm_a"] < 0)                      # A = −exp(A_log)
    assert np.abs(f["blk.0.ssm_dt.bias"]).max() < 1
    for norm in ("blk.0.attn_norm.weight", "blk.0.ssm_norm.weight", "blk.4.nextn.enorm.weight"):
        assert abs(f[norm].mean() - 1) < 0.01               # +1 already folded: ≈ 1
    assert abs(f["blk.0.attn_qkv.weight"].std() * np.sqrt(256) - 1) < 0.05     # N(0, 1/fan_in)
    assert f["blk.0.ffn_down.weight"].std() < f["blk.0.attn_qkv.weight"].std()  # residual writers smaller


LAYOUTS = [
    ("qwen35", dict(mtp=True)), ("qwen35", dict(mtp=False)), ("qwen35", dict(tied_output=True)),
    ("qwen35moe", dict(mtp=True)), ("qwen35moe", dict(mtp=False)),
    ("qwen35moe", dict(fused_gate_up_exps=True, write_recurrent_layers=True)),
    ("qwen3next", dict(mtp=True)), ("qwen3next", dict(mtp=False)), ("qwen3next", dict(legacy_ssm_in=True)),
]


@pytest.mark.parametrize("arch,options", LAYOUTS, ids=lambda v: v if isinstance(v, str) else
                         ",".join(f"{k}={x}" for k, x in v.items()))
def test_layout_and_metadata_match_llama_cpp(tmp_path, arch, options):
    spec = preset("tiny", arch=arch, **options)
    path = tmp_path / f"{arch}.gguf"
    plan = write_model(path, spec, "Q4_K_M", seed=1, method="codes")
    tensors = read_tensors(path)
    assert [(n, tuple(int(x) for x in t.shape)) for n, t in tensors.items()] == \
           [(s.name, s.ne) for s in synth_layout(spec)]
    assert {n: t.tensor_type.name for n, t in tensors.items()} == {t.name: t.type.name for t in plan}
    assert any(n.startswith(f"blk.{spec.n_layer}.nextn.") for n in tensors) == spec.mtp
    kv = metadata(path)
    tied = "output.weight" not in tensors
    assert tied == spec.tied_output
    assert config_from_metadata(kv, n_vocab=spec.n_vocab, tied_output=tied) == spec.config()
    if open_model is not None:
        with open_model(path) as m:
            assert m.config == spec.config()
            assert m.layout_options == spec.layout_options()


def test_metadata_keys_and_types(tmp_path):
    spec = preset("tiny", write_recurrent_layers=True)
    path = tmp_path / "m.gguf"
    write_model(path, spec, "Q4_K_M", method="codes")
    fields = gguf.GGUFReader(path).fields
    want = {
        "general.architecture": ([V.STRING], "qwen35"), "general.file_type": ([V.UINT32], 15),
        "general.quantization_version": ([V.UINT32], 2), "general.name": ([V.STRING], "tiny"),
        "qwen35.block_count": ([V.UINT32], 5), "qwen35.nextn_predict_layers": ([V.UINT32], 1),
        "qwen35.context_length": ([V.UINT32], 4096), "qwen35.embedding_length": ([V.UINT32], 256),
        "qwen35.feed_forward_length": ([V.UINT32], 512), "qwen35.attention.head_count": ([V.UINT32], 4),
        "qwen35.attention.head_count_kv": ([V.UINT32], 2), "qwen35.attention.key_length": ([V.UINT32], 64),
        "qwen35.attention.value_length": ([V.UINT32], 64), "qwen35.rope.dimension_count": ([V.UINT32], 16),
        "qwen35.rope.freq_base": ([V.FLOAT32], 1e7),
        "qwen35.attention.layer_norm_rms_epsilon": ([V.FLOAT32], np.float32(1e-6)),
        "qwen35.rope.dimension_sections": ([V.ARRAY, V.INT32], [3, 3, 2, 0]),
        "qwen35.ssm.conv_kernel": ([V.UINT32], 4), "qwen35.ssm.state_size": ([V.UINT32], 64),
        "qwen35.ssm.group_count": ([V.UINT32], 2), "qwen35.ssm.time_step_rank": ([V.UINT32], 4),
        "qwen35.ssm.inner_size": ([V.UINT32], 256), "qwen35.full_attention_interval": ([V.UINT32], 4),
        "qwen35.attention.recurrent_layers": ([V.ARRAY, V.BOOL], [True, True, True, False, False]),
        "tokenizer.ggml.model": ([V.STRING], "gpt2"), "tokenizer.ggml.pre": ([V.STRING], "qwen35"),
        "tokenizer.ggml.eos_token_id": ([V.UINT32], 381), "tokenizer.ggml.padding_token_id": ([V.UINT32], 379),
        "tokenizer.ggml.add_bos_token": ([V.BOOL], False), "tokenizer.chat_template": ([V.STRING], CHATML_TEMPLATE),
    }
    for key, (types, value) in want.items():
        assert fields[key].types == types, key
        assert fields[key].contents() == value, key
    assert fields["tokenizer.ggml.tokens"].types == [V.ARRAY, V.STRING]
    assert fields["tokenizer.ggml.token_type"].types == [V.ARRAY, V.INT32]
    assert fields["tokenizer.ggml.merges"].types == [V.ARRAY, V.STRING]
    assert len(fields["tokenizer.ggml.tokens"].contents()) == 384
    assert "general.alignment" not in fields                 # default 32


def test_qwen3next_metadata_differs_where_llama_cpp_does(tmp_path):
    path = tmp_path / "n.gguf"
    write_model(path, preset("tiny", arch="qwen3next"), "Q4_K_M", method="codes")
    kv = metadata(path)
    assert kv["tokenizer.ggml.pre"] == "qwen2"
    assert "qwen3next.rope.dimension_sections" not in kv
    assert kv["qwen3next.expert_count"] == 4 and kv["qwen3next.expert_used_count"] == 2
    assert kv["qwen3next.expert_feed_forward_length"] == 256
    assert kv["qwen3next.expert_shared_feed_forward_length"] == 256


def test_small_chunks_write_the_same_file(tmp_path, monkeypatch):
    spec = preset("tiny", **SMALL)
    write_model(tmp_path / "a.gguf", spec, "Q8_0", seed=3, method="quantize")
    monkeypatch.setattr(writer_module, "CHUNK_BYTES", 3000)      # rows of 256 floats: 2 per chunk
    write_model(tmp_path / "b.gguf", spec, "Q8_0", seed=3, method="quantize")
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()


def test_codes_are_deterministic_per_seed(tmp_path):
    spec = preset("tiny", **SMALL)
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        write_model(tmp_path / f"{name}.gguf", spec, "Q4_K_M", seed=seed, method="codes")
    a, b, c = ((tmp_path / f"{n}.gguf").read_bytes() for n in "abc")
    assert a == b and a != c


def test_memory_stays_bounded_by_the_chunk(tmp_path, monkeypatch):
    # token_embd is 256 × 8192 floats = 8 MiB; with 256 KiB chunks the writer never holds it whole.
    spec = preset("tiny", n_vocab=8192, n_layer=1, full_attention_interval=1, mtp=False)
    monkeypatch.setattr(writer_module, "CHUNK_BYTES", 256 << 10)
    tracemalloc.start()
    try:
        write_model(tmp_path / "m.gguf", spec, "Q8_0", method="quantize")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 6 << 20


def test_progress_reaches_the_file_size(tmp_path):
    seen = []
    path = tmp_path / "m.gguf"
    write_model(path, preset("tiny", **SMALL), "Q4_K_M", method="codes",
                progress=lambda done, total, name: seen.append((done, total)))
    done = [d for d, _ in seen]
    assert done == sorted(done) and seen[-1] == (path.stat().st_size,) * 2


def test_no_space_is_a_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(writer_module.shutil, "disk_usage", lambda p: usage(10**6, 0, 10**6))
    with pytest.raises(HybridError, match="not enough disk space"):
        write_model(tmp_path / "m.gguf", preset("tiny"), "Q4_K_M")
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_write_leaves_no_file(tmp_path):
    def stop(done, total, name):
        if name.startswith("blk.1."):
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        write_model(tmp_path / "m.gguf", preset("tiny", **SMALL), "Q4_K_M", method="codes", progress=stop)
    assert list(tmp_path.iterdir()) == []


def test_plan_total_matches_the_file(tmp_path):
    path = tmp_path / "m.gguf"
    spec = preset("tiny", arch="qwen35moe")
    plan = write_model(path, spec, "Q5_K", method="codes")
    r = gguf.GGUFReader(path)
    assert path.stat().st_size == r.data_offset + plan.total_bytes
    assert plan_model(spec, "Q5_K") == plan


def test_a_deep_synthetic_model_stays_finite_through_the_reference_forward(tmp_path):
    ref = pytest.importorskip("tests.reference.qwen35_ref")     # numpy float64 oracle (qwen35 only)
    path = tmp_path / "deep.gguf"
    write_model(path, preset("tiny", n_layer=16), "Q4_K_M", method="codes")
    ids = list(range(5, 21))
    logits, mtp = ref.reference_logits(str(path), ids), ref.reference_mtp_logits(str(path), ids)
    assert np.isfinite(logits).all() and np.isfinite(mtp).all()
    assert 0.5 < logits.std() < 5 and 0.5 < mtp.std() < 5      # neither flat nor saturated


@pytest.mark.parametrize("type_name", [t.name for t in gt.DECODED])
def test_decoded_types_write_random_codes(tmp_path, type_name):
    """The types without a float quantiser: "auto" picks random codes, "quantize" says why not,
    and what lands in the file is what the writer meant (gguf-py reads the same values)."""
    spec, seed = preset("tiny", **SMALL), 5
    path = tmp_path / "m.gguf"
    if type_name not in QUANTIZABLE:
        with pytest.raises(HybridError, match="--method codes"):
            write_model(path, spec, type_name, seed=seed, method="quantize")
    plan = write_model(path, spec, type_name, seed=seed, method="codes")
    tensors = read_tensors(path)
    for t in plan:
        if t.type is gt.F32:
            continue
        raw = np.asarray(tensors[t.name].data).reshape(-1).view(np.uint8)
        np.testing.assert_array_equal(raw, expected_bytes(spec, t, seed, "codes"), err_msg=t.name)
        truth = gguf.quants.dequantize(raw, GQ(t.type.id)).reshape(t.n_rows, t.ne[0])
        ours = dequantize(raw, t.type, t.ne[0])
        np.testing.assert_array_equal(ours.view(np.uint32), truth.view(np.uint32), err_msg=t.name)
        assert 0.2 < truth.std() / tensor_floats(spec, t.name, seed).std() < 5, t.name   # well scaled
