"""The GGUF reader: trained models against gguf-py's GGUFReader, crafted files, every bad-input error."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType as V, GGUFWriter
from gguf.quants import dequantize

from cpu import ggml_types as gt
from hybrid.errors import ModelError
from hybrid.gguf_file import read_gguf
from hybrid.layout import LayoutOptions
from hybrid.model_file import TensorInfo, default_model_path, open_model

from ..conftest import BUNDLED_MODEL
from .ggufs import (copy_prefix, patch, patch_tensor_type, tensor_info_offset, tiny_metadata,
                    write_broken, write_gguf, write_tiny_model)


# --- the trained model ---------------------------------------------------------------------------

def test_default_model_path_is_the_bundled_model():
    assert default_model_path() == BUNDLED_MODEL.resolve() and BUNDLED_MODEL.exists()


def check_readme_config(m):
    c = m.config
    assert (c.arch, c.n_layer, c.n_nextn, m.metadata["qwen35.block_count"]) == ("qwen35", 8, 1, 9)
    assert c.layer_kinds == ("gdn",) * 3 + ("attn",) + ("gdn",) * 3 + ("attn",)
    assert (c.n_embd, c.n_ff, c.n_vocab, c.tied_output) == (512, 1024, 8192, False)
    assert (c.n_head, c.n_head_kv, c.head_dim, c.n_rot, c.rope_theta) == (8, 2, 64, 16, 1e7)
    assert (c.ssm_n_k_heads, c.ssm_n_v_heads, c.ssm_d_state, c.ssm_conv_kernel) == (4, 8, 64, 4)
    assert m.metadata["qwen35.attention.recurrent_layers"] == [True, True, True, False, True, True, True, False, False]
    assert m.metadata["tokenizer.ggml.pre"] == "qwen35" and len(m.metadata["tokenizer.ggml.tokens"]) == 8192
    assert "<|im_end|>" in m.metadata["tokenizer.ggml.tokens"]
    assert sum(t.n_elements for t in m.tensors.values()) == pytest.approx(32.2e6, rel=0.002)
    assert sum(t.n_elements for t in m.tensors.values() if t.role == "mtp") == pytest.approx(3.0e6, rel=0.02)
    assert m.layout_options == LayoutOptions()


def test_bundled_q4km_matches_readme():
    with open_model(BUNDLED_MODEL) as m:
        check_readme_config(m)
        assert m.file_bytes == 20_584_608
        assert m.count_by_type() == {"Q4_K": 61, "F32": 52, "Q6_K": 11}
        assert m.tensors["output.weight"].type is gt.Q6_K
        assert m.tensors["blk.0.ssm_conv1d.weight"].type is gt.F32


def test_trained_q8_matches_readme(trained_model_q8):
    with open_model(trained_model_q8) as m:
        check_readme_config(m)
        assert m.file_bytes == 34_587_296
        assert set(m.count_by_type()) == {"Q8_0", "F32"}


@pytest.fixture(params=["q4km", "q8"])
def trained_path(request) -> Path:
    return request.getfixturevalue(f"trained_model_{request.param}")


def test_tensor_bytes_equal_gguf_reader(trained_path):
    ref = GGUFReader(trained_path)
    with open_model(trained_path) as m:
        assert set(m.tensors) == {t.name for t in ref.tensors}
        for r in ref.tensors:
            t = m.tensors[r.name]
            assert (t.type.id, t.ne, t.offset, t.nbytes) == (int(r.tensor_type), tuple(map(int, r.shape)),
                                                             r.data_offset, r.n_bytes), r.name
            assert t.shape == t.ne[::-1] and t.data.shape == (*t.shape[:-1], t.row_bytes)
            assert np.array_equal(t.data.reshape(-1), np.asarray(r.data).view(np.uint8).reshape(-1)), r.name


def test_metadata_equals_gguf_reader(trained_path):
    ref = GGUFReader(trained_path)
    with open_model(trained_path) as m:
        keys = [k for k in ref.fields if not k.startswith("GGUF.")]
        assert list(m.metadata) == keys
        for k in keys:
            assert m.metadata[k] == ref.fields[k].contents(), k


def test_data_is_a_zero_copy_view_and_f32_array_too():
    with open_model(BUNDLED_MODEL) as m:
        t = m.tensors["blk.0.ssm_a"]
        assert not t.data.flags.owndata and not t.data.flags.writeable
        assert np.shares_memory(t.array(), t.data)
        assert (t.array() < 0).all()   # ssm_a = -exp(A_log)
        with pytest.raises(TypeError, match="Q4_K"):
            m.tensors["blk.0.ffn_up.weight"].array()


def test_closed_model_refuses_reads_but_old_views_survive():
    m = open_model(BUNDLED_MODEL)
    t = m.tensors["output_norm.weight"]
    before = t.array()
    kept = before.copy()
    m.close()
    assert m.closed and np.array_equal(before, kept)
    with pytest.raises(ModelError, match="closed"):
        t.data


# --- crafted files ------------------------------------------------------------------------------

@pytest.mark.parametrize("arch, opts, tied", [
    ("qwen35", LayoutOptions(), False),
    ("qwen35", LayoutOptions(), True),
    ("qwen35moe", LayoutOptions(), False),
    ("qwen35moe", LayoutOptions(fused_gate_up_exps=True), True),
    ("qwen3next", LayoutOptions(), False),
    ("qwen3next", LayoutOptions(legacy_ssm_in=True), False),
])
def test_tiny_models_of_every_arch(tmp_path, arch, opts, tied):
    path = tmp_path / "m.gguf"
    written = write_tiny_model(path, arch, options=opts, tied_output=tied)
    with open_model(path) as m:
        assert m.config.arch == arch and m.layout_options == opts and m.config.tied_output == tied
        assert set(m.tensors) == set(written)
        for name, raw in written.items():
            assert np.array_equal(m.tensors[name].data.reshape(-1), raw.reshape(-1)), name
        assert sum(m.bytes_by_role().values()) == sum(r.nbytes for r in written.values())
        assert ("output.weight" in m.tensors) != tied
        if m.config.is_moe:
            e = m.tensors["blk.0.ffn_down_exps.weight"]
            assert e.data.shape == (4, 64, gt.Q8_0.row_bytes(32))   # (experts, rows, row bytes)


def test_float_arrays(tmp_path):
    path = tmp_path / "m.gguf"
    written = write_tiny_model(path, types={"output.weight": gt.BF16})
    with open_model(path) as m:
        for name, t in [("token_embd.weight", gt.F16), ("output.weight", gt.BF16), ("blk.0.ssm_norm.weight", gt.F32)]:
            info = m.tensors[name]
            assert info.type is t
            got = info.array()
            want = dequantize(written[name], GGMLQuantizationType(t.id))
            assert got.dtype == np.float32 and got.shape == info.shape == want.shape
            assert np.isfinite(got).all() and np.array_equal(got, want), name


def test_unknown_tensors_get_role_other(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_model(path, extra={"rope_freqs.weight": ((8,), gt.F32)})
    with open_model(path) as m:
        assert m.tensors["rope_freqs.weight"].role == "other"
        assert m.bytes_by_role()["other"] == 32
        assert list(m.bytes_by_role())[:5] == ["embeddings", "lm_head", "trunk", "ffn", "mtp"]


def test_custom_alignment(tmp_path):
    path = tmp_path / "m.gguf"
    written = write_tiny_model(path, alignment=256)
    with open_model(path) as m:
        assert m.alignment == 256 and m.data_offset % 256 == 0
        for name, raw in written.items():
            assert m.tensors[name].offset % 256 == 0
            assert np.array_equal(m.tensors[name].data.reshape(-1), raw.reshape(-1))


def test_every_metadata_value_type(tmp_path):
    path = tmp_path / "kv.gguf"
    values = {
        "t.u8": (255, V.UINT8), "t.i8": (-128, V.INT8), "t.u16": (65535, V.UINT16), "t.i16": (-32768, V.INT16),
        "t.u32": (2**32 - 1, V.UINT32), "t.i32": (-2**31, V.INT32), "t.f32": (0.5, V.FLOAT32),
        "t.bool": (True, V.BOOL), "t.str": ("héllo ✓", V.STRING), "t.u64": (2**64 - 1, V.UINT64),
        "t.i64": (-2**63, V.INT64), "t.f64": (1e-300, V.FLOAT64),
    }
    w = GGUFWriter(path, "qwen35")
    for k, (v, t) in values.items():
        w.add_key_value(k, v, t)
    arrays = {
        "a.u8": ([0, 7, 255], V.UINT8), "a.i16": ([-3, 4], V.INT16), "a.f64": ([1.5, -2.25], V.FLOAT64),
        "a.bool": ([True, False, True], V.BOOL), "a.str": (["a", "", "Ġx", "日本"], V.STRING),
        "a.nested": ([[1, 2], [3]], V.ARRAY),
    }
    for k, (v, t) in arrays.items():
        w.add_key_value(k, v, V.ARRAY, sub_type=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    kv = read_gguf(path).metadata
    assert {k: kv[k] for k in values} == {k: v for k, (v, _) in values.items()}
    assert {k: kv[k] for k in arrays} == {k: v for k, (v, _) in arrays.items()}
    assert kv["general.architecture"] == "qwen35"


def test_invalid_utf8_is_kept_not_fatal(tmp_path):
    path = tmp_path / "kv.gguf"
    w = GGUFWriter(path, "qwen35")
    w.add_key_value("t.raw", b"\xffab", V.STRING)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert read_gguf(path).metadata["t.raw"].encode("utf-8", "surrogateescape") == b"\xffab"


# --- bad input: one clear message each -----------------------------------------------------------

def opens_with(path, *patterns: str) -> str:
    with pytest.raises(ModelError) as e:
        open_model(path)
    msg = str(e.value)
    for p in patterns:
        assert p in msg, msg
    return msg


def test_missing_file(tmp_path):
    opens_with(tmp_path / "nope.gguf", "model file not found", "nope.gguf")


def test_directory(tmp_path):
    opens_with(tmp_path, "not a model file")


@pytest.mark.parametrize("content", [b"", b"GG", b"\x00" * 64])
def test_empty_or_tiny_or_zero_file(tmp_path, content):
    (tmp_path / "x.gguf").write_bytes(content)
    opens_with(tmp_path / "x.gguf", "is not a GGUF file")


def test_bad_magic(tmp_path):
    path = write_broken(tmp_path / "m.gguf", lambda p: patch(p, 0, b"GGML"))
    opens_with(path, "is not a GGUF file", "b'GGML'")


@pytest.mark.parametrize("version", [1, 4])
def test_unsupported_version(tmp_path, version):
    path = write_broken(tmp_path / "m.gguf", lambda p: patch(p, 4, struct.pack("<I", version)))
    opens_with(path, f"GGUF version {version}", "reads versions 2, 3")


def test_big_endian(tmp_path):
    path = write_broken(tmp_path / "m.gguf", lambda p: patch(p, 4, struct.pack(">I", 3)))
    opens_with(path, "big-endian")


@pytest.mark.parametrize("n_bytes, where", [
    (10, "the tensor count"),
    (200, ""),                                   # inside the metadata
    (3000, "tokenizer.ggml.tokens"),             # inside the 8192-entry token array
])
def test_truncated_header(tmp_path, n_bytes, where):
    path = copy_prefix(BUNDLED_MODEL, tmp_path / "cut.gguf", n_bytes)
    opens_with(path, "is truncated", "GGUF header", f"has {n_bytes:,}", where)


def test_truncated_in_tensor_infos(tmp_path):
    full = tmp_path / "m.gguf"
    write_tiny_model(full)
    at = tensor_info_offset(full, "blk.2.ssm_a")
    opens_with(copy_prefix(full, tmp_path / "cut.gguf", at + 2), "is truncated", "blk.2.ssm_a")


def test_truncated_tensor_data_names_the_tensor(tmp_path):
    last = max(open_model(BUNDLED_MODEL).tensors.values(), key=lambda t: t.offset)
    cut = copy_prefix(BUNDLED_MODEL, tmp_path / "cut.gguf", last.offset + last.nbytes - 1)
    opens_with(cut, "is truncated", f"tensor {last.name} needs bytes")


def test_data_section_past_end(tmp_path):
    full = tmp_path / "m.gguf"
    write_tiny_model(full, alignment=256)
    g = read_gguf(full)
    header_end, data_offset = g.header_end, g.data_offset
    g.close()
    assert header_end < data_offset   # there is padding to cut
    opens_with(copy_prefix(full, tmp_path / "cut.gguf", header_end), "is truncated",
               f"tensor data should start at byte {data_offset:,}")


def test_unsupported_architecture(tmp_path):
    kv = {"general.architecture": "llama", "llama.block_count": 2}
    path = tmp_path / "m.gguf"
    write_gguf(path, kv, {"token_embd.weight": ((64, 8), gt.F32)})
    opens_with(path, "unsupported architecture 'llama'", "qwen35, qwen35moe, qwen3next", str(path))


def test_no_architecture(tmp_path):
    kv = tiny_metadata("qwen35")
    del kv["general.architecture"]
    path = tmp_path / "m.gguf"
    write_gguf(path, kv, {"token_embd.weight": ((64, 8), gt.F32)})
    opens_with(path, "no 'general.architecture'")


def test_missing_metadata_key(tmp_path):
    path = tmp_path / "m.gguf"
    kv = tiny_metadata("qwen35moe", expert_count=None)
    write_gguf(path, kv, {"token_embd.weight": ((64, 128), gt.F16)})
    opens_with(path, str(path), "'qwen35moe.expert_count' is missing")


@pytest.mark.parametrize("type_id, type_name", [(34, "TQ1_0"), (99, "type#99")])
def test_unsupported_tensor_type(tmp_path, type_id, type_name):
    path = write_broken(tmp_path / "m.gguf", lambda p: patch_tensor_type(p, "blk.0.ffn_up.weight", type_id))
    opens_with(path, f"blk.0.ffn_up.weight has type {type_name}; supported: F32, F16, BF16, Q4_0, Q8_0, Q4_K")


def test_missing_required_tensor(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_model(path, "qwen35moe", drop=("blk.2.ssm_a",))
    opens_with(path, "missing required tensor blk.2.ssm_a")


def test_missing_token_embd(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_model(path, drop=("token_embd.weight",))
    opens_with(path, "missing required tensor token_embd.weight")


def test_missing_mtp_tensor(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_model(path, drop=("blk.4.nextn.eh_proj.weight",))
    opens_with(path, "missing required tensor blk.4.nextn.eh_proj.weight")


def test_wrong_shape(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_model(path, reshape={"blk.1.attn_gate.weight": (64, 32)})
    opens_with(path, "blk.1.attn_gate.weight has ne=(64, 32), expected ne=(64, 64)")


def test_wrong_expert_shape(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_model(path, "qwen3next", reshape={"blk.3.ffn_up_exps.weight": (64, 32, 3)})
    opens_with(path, "blk.3.ffn_up_exps.weight has ne=(64, 32, 3), expected ne=(64, 32, 4)")


def test_one_dimensional_token_embd(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_model(path, reshape={"token_embd.weight": (64 * 128,)})
    opens_with(path, "token_embd.weight has ne=(8192,); expected 2 dims")


def test_f32_only_tensor_of_another_type(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_model(path, types={"blk.0.ssm_conv1d.weight": gt.F16})
    opens_with(path, "blk.0.ssm_conv1d.weight has type F16; this tensor must be F32")


def test_row_not_a_multiple_of_block(tmp_path):
    # ssm_out rows have 64 elements: fine for Q8_0 (32), not for Q4_K (256).
    path = write_broken(tmp_path / "m.gguf", lambda p: patch_tensor_type(p, "blk.0.ssm_out.weight", gt.Q4_K.id))
    opens_with(path, "blk.0.ssm_out.weight has rows of 64 elements", "Q4_K block size 256")


def test_duplicate_tensor_name(tmp_path):
    def rename(p: Path) -> None:
        at = tensor_info_offset(p, "blk.1.ssm_a")
        patch(p, at - len("blk.1.ssm_a"), b"blk.0.ssm_a")
    opens_with(write_broken(tmp_path / "m.gguf", rename), "tensor blk.0.ssm_a appears twice")


def test_misaligned_tensor_offset(tmp_path):
    def shift(p: Path) -> None:
        at = tensor_info_offset(p, "blk.0.ssm_a") + 4 + 8 + 4   # n_dims, ne[0], type → offset
        (off,) = struct.unpack_from("<Q", p.read_bytes(), at)
        patch(p, at, struct.pack("<Q", off + 4))
    opens_with(write_broken(tmp_path / "m.gguf", shift), "blk.0.ssm_a starts at data offset", "alignment 32")


def test_unknown_metadata_value_type(tmp_path):
    def retype(p: Path) -> None:
        key = b"qwen35.ssm.conv_kernel"
        at = p.read_bytes().find(struct.pack("<Q", len(key)) + key) + 8 + len(key)
        patch(p, at, struct.pack("<I", 13))
    opens_with(write_broken(tmp_path / "m.gguf", retype), "'qwen35.ssm.conv_kernel' has unknown value type 13")


def test_bad_alignment_value(tmp_path):
    def realign(p: Path) -> None:
        key = b"general.alignment"
        at = p.read_bytes().find(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4
        patch(p, at, struct.pack("<I", 48))
    opens_with(write_broken(tmp_path / "m.gguf", realign, alignment=64), "'general.alignment' is 48")


def test_too_many_dimensions(tmp_path):
    def dims(p: Path) -> None:
        patch(p, tensor_info_offset(p, "blk.0.ssm_a"), struct.pack("<I", 5))
    opens_with(write_broken(tmp_path / "m.gguf", dims), "blk.0.ssm_a has 5 dimensions")


def test_tensor_info_is_frozen():
    with open_model(BUNDLED_MODEL) as m:
        t = m.tensors["blk.0.ssm_a"]
        assert isinstance(t, TensorInfo)
        with pytest.raises(AttributeError):
            t.offset = 0  # type: ignore[misc]


FLOAT_EXPERTS = {f"blk.{i}.ffn_{kind}_exps.weight": gt.F32 for i in range(4) for kind in ("gate", "up", "down")}


def test_trailing_unit_dimensions_are_the_same_tensor(tmp_path):
    """The HF→GGUF converter writes the shared-expert gate (a Linear D→1) as ne=(D, 1) where
    llama-quantize writes (D,): both load (as llama.cpp's shape check allows) and compute alike."""
    from hybrid.forward import Forward
    from hybrid.model_file import canonical_ne
    assert canonical_ne((64, 1)) == (64,) and canonical_ne((64, 1, 1)) == (64,) and canonical_ne((1,)) == (1,)
    assert canonical_ne((64, 32, 4)) == (64, 32, 4) and canonical_ne((1, 64)) == (1, 64)
    logits = []
    for name, reshape in (("quantized-shape.gguf", None), ("converter-shape.gguf", (64, 1))):
        path = tmp_path / name
        # float experts: the grouped float path, not the quantised experts' kernel (minutes to compile)
        write_tiny_model(path, "qwen35moe", types=FLOAT_EXPERTS, reshape=(
            {f"blk.{i}.ffn_gate_inp_shexp.weight": reshape for i in range(4)} if reshape else None))
        with open_model(path) as m:
            assert m.tensors["blk.0.ffn_gate_inp_shexp.weight"].ne == (64,)
            fw = Forward(m)
            logits.append(fw.forward(fw.new_state(16), [1, 2, 3], logits="all")[0])
    np.testing.assert_array_equal(logits[0], logits[1])
