"""#32 item 6: a state file is untrusted input. Every broken or hostile one ends in one
HybridError, allocates no more than the model's own state, and pickles are never loaded."""
import io
import json
import resource
import zipfile

import numpy as np
import pytest

from hybrid.errors import HybridError
from hybrid.state import SessionState

from .test_state import filled, tiny_config


def saved(tmp_path, **meta_changes):
    """A valid state file, then its metadata changed (a key set to ... is dropped)."""
    cfg = tiny_config()
    path = tmp_path / "s.npz"
    filled(cfg).save(path, model_id="A")
    if meta_changes:
        rewrite(path, meta=lambda m: {**{k: v for k, v in m.items() if meta_changes.get(k, 0) is not ...},
                                      **{k: v for k, v in meta_changes.items() if v is not ...}})
    return cfg, path


def rewrite(path, meta=None, arrays=None, raw_meta=None):
    with np.load(path) as z:
        files = {n: z[n] for n in z.files}
    if meta is not None:
        files["meta"] = np.array(json.dumps(meta(json.loads(str(files["meta"])))))
    if raw_meta is not None:
        files["meta"] = raw_meta
    if arrays is not None:
        files = arrays(files)
    with open(path, "wb") as f:
        np.savez(f, **files)


@pytest.mark.parametrize("change, message", [
    (dict(n_past=...), "'n_past' is None"),
    (dict(n_past="five"), "'n_past' is 'five'"),
    (dict(n_past=-3), "'n_past' is -3"),
    (dict(n_past=True), "'n_past' is True"),
    (dict(n_ctx=10**9), "'n_ctx' is 1000000000; expected an integer in 0..128"),
])
def test_bad_counts_are_refused_before_allocating(tmp_path, change, message):
    cfg, path = saved(tmp_path, **change)
    with pytest.raises(HybridError, match=message):
        SessionState.load(path, cfg)


def test_empty_and_non_object_files(tmp_path):
    cfg, path = saved(tmp_path)
    empty = tmp_path / "empty.npz"
    empty.write_bytes(b"")
    with pytest.raises(HybridError, match="not a hybrid state file"):
        SessionState.load(empty, cfg)
    rewrite(path, raw_meta=np.array(json.dumps([1, 2, 3])))
    with pytest.raises(HybridError, match="metadata is not an object"):
        SessionState.load(path, cfg)


def test_shapes_and_dtypes_are_checked(tmp_path):
    cfg, path = saved(tmp_path)
    rewrite(path, arrays=lambda f: {**f, "ssm_0": np.zeros(1, np.float32)})
    with pytest.raises(HybridError, match=r"ssm_0.npy is float32 \(1,\); this model needs float32 \(4, 8, 8\)"):
        SessionState.load(path, cfg)
    cfg, path = saved(tmp_path)
    rewrite(path, arrays=lambda f: {**f, "conv_1": f["conv_1"].astype(np.float64)})
    with pytest.raises(HybridError, match="conv_1.npy is float64"):
        SessionState.load(path, cfg)
    cfg, path = saved(tmp_path)
    rewrite(path, arrays=lambda f: {**f, "extra": np.zeros(3)})
    with pytest.raises(HybridError, match="no place for"):
        SessionState.load(path, cfg)


def test_pickled_members_are_never_loaded(tmp_path):
    cfg, path = saved(tmp_path)
    rewrite(path, arrays=lambda f: {**f, "ssm_0": np.array([object()], dtype=object)})
    with pytest.raises(HybridError, match="ssm_0.npy is object"):
        SessionState.load(path, cfg)


def test_zip_bomb_costs_no_more_than_the_state(tmp_path):
    """Unknown members are never decompressed and a known one only as far as its checked header
    says: a 1 GiB member of zeros (about a MB compressed) is refused without reading it."""
    cfg, path = saved(tmp_path)
    with zipfile.ZipFile(path, "a", zipfile.ZIP_DEFLATED) as z:
        with z.open("bomb.npy", "w", force_zip64=True) as w:
            chunk = bytes(1 << 24)
            for _ in range(64):
                w.write(chunk)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(HybridError, match="no place for"):
        SessionState.load(path, cfg)
    # a known member whose header lies about nothing but whose stream goes on for 1 GiB
    cfg, path = saved(tmp_path)
    with np.load(path) as z:
        files = {n: z[n] for n in z.files}
    buf = io.BytesIO()
    np.lib.format.write_array(buf, files["ssm_0"])
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, a in files.items():
            if name != "ssm_0":
                with z.open(f"{name}.npy", "w") as w:
                    np.lib.format.write_array(w, a)
        with z.open("ssm_0.npy", "w", force_zip64=True) as w:
            w.write(buf.getvalue())
            for _ in range(64):
                w.write(chunk)
    state = SessionState.load(path, cfg)       # the trailing bytes are never decompressed
    np.testing.assert_array_equal(state.ssm[0], files["ssm_0"])
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 256 << 10, f"loading grew the peak RSS by {grown_kib} KiB"


def test_state_from_another_file_of_the_same_shape_is_refused(tmp_path):
    cfg, path = saved(tmp_path)
    assert SessionState.load(path, cfg, model_id="A").n_past == 5
    with pytest.raises(HybridError, match="another model file of the same shape"):
        SessionState.load(path, cfg, model_id="B")


def test_model_identity_differs_between_files_of_the_same_shape(tmp_path):
    from hybrid.model_file import open_model
    from hybrid.synth import preset, write_model
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_model(a, preset("tiny", "qwen35"), seed=1)
    write_model(b, preset("tiny", "qwen35"), seed=2)
    with open_model(a) as ma, open_model(b) as mb, open_model(a) as ma2:
        assert ma.identity != mb.identity and ma.identity == ma2.identity


def test_model_save_and_load_state_tie_the_state_to_its_file(tmp_path):
    import hybrid
    from hybrid.synth import preset, write_model
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_model(a, preset("tiny", "qwen35"), seed=1)
    write_model(b, preset("tiny", "qwen35"), seed=2)
    ma, mb = hybrid.load(a, device="cpu", threads=1), hybrid.load(b, device="cpu", threads=1)
    state = ma.new_state(64)
    state.n_past = 3
    ma.save_state(state, tmp_path / "s.npz")
    assert ma.load_state(tmp_path / "s.npz").n_past == 3
    with pytest.raises(HybridError, match="another model file of the same shape"):
        mb.load_state(tmp_path / "s.npz")
