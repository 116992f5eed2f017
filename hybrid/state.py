"""Everything one sequence carries between forward calls.

* KV cache per full-attention trunk layer: k, v (n_head_kv, n_ctx, d_h), head-major, of the op
  set's KV_DTYPE (float32 on the CPU, fp16 on the GPU: cpu/attention.py, gpu/attention.py).
  Preallocated to n_ctx; positions ≥ n_past are stale and ignored.
* GDN recurrent state per GDN layer: float32 (H_v, d_v, d_k), S_j[key i][value c] at
  [j, c, i] (cpu/gdn.py); conv state (K−1, C), last K−1 pre-conv inputs, oldest first.
* MTP block(s) at layer index L..: their own KV caches and position counter `mtp_n_past`,
  owned by the MTP decoder (the trunk forward never touches them).
* Snapshot ring per GDN layer, n_ring slots: a forward with snapshot=True writes the state
  after its token i into slot i; `rollback(n_keep)` restores "after token n_keep−1".

The arrays live where the forward's backend keeps them (hybrid/backend.py: numpy arrays on the
CPU, device arrays on the GPU); save/load go through host copies either way, and a saved file
holds float32 whatever the cache type (fp16 widens exactly; a CPU state loaded on the GPU is
rounded to fp16 as its rows would have been).
"""
from __future__ import annotations

import itertools
import json
import os
import zipfile
import zlib

import numpy as np

from .backend import CPUBackend
from .config import ModelConfig
from .errors import HybridError
from .metadata import safe_text, shown

DEFAULT_N_CTX = 4096
STATE_FORMAT = 1                # bump when the saved layout changes
_identities = itertools.count()


class SessionState:
    def __init__(self, config: ModelConfig, n_ctx: int = DEFAULT_N_CTX, n_ring: int = 0, backend=None):
        if n_ctx < 1:
            raise HybridError(f"context size must be ≥ 1, got {n_ctx}")
        if n_ring < 0:
            raise HybridError(f"snapshot ring size must be ≥ 0, got {n_ring}")
        c = config
        self.backend = backend = backend or CPUBackend()
        zeros = backend.zeros
        self.config, self.n_ctx, self.n_ring = c, int(n_ctx), int(n_ring)
        self.n_past = 0
        self.mtp_n_past = 0
        self.identity = next(_identities)     # buffers never move: a captured step may key on this
        kv_shape = (c.n_head_kv, self.n_ctx, c.head_dim)
        attn_layers = [i for i in range(c.n_layer) if not c.is_recurrent(i)]
        gdn_layers = [i for i in range(c.n_layer) if c.is_recurrent(i)]
        kv_dtype = backend.ops.KV_DTYPE
        self.kv = {i: (zeros(kv_shape, kv_dtype), zeros(kv_shape, kv_dtype)) for i in attn_layers}
        self.mtp_kv = {i: (zeros(kv_shape, kv_dtype), zeros(kv_shape, kv_dtype))
                       for i in range(c.n_layer, c.n_layer_all)}
        ssm_shape = (c.ssm_n_v_heads, c.ssm_d_state, c.ssm_d_state)
        conv_shape = (c.ssm_conv_kernel - 1, c.ssm_conv_channels)
        self.ssm = {i: zeros(ssm_shape) for i in gdn_layers}
        self.conv = {i: zeros(conv_shape) for i in gdn_layers}
        self.ring_ssm = {i: zeros((self.n_ring, *ssm_shape)) for i in gdn_layers}
        self.ring_conv = {i: zeros((self.n_ring, *conv_shape)) for i in gdn_layers}
        # Zero-slot rings for calls without snapshots: same array types, so no extra kernel compile.
        self.no_ring_ssm = zeros((0, *ssm_shape))
        self.no_ring_conv = zeros((0, *conv_shape))
        self.ring_base = 0      # n_past before the last snapshotting call
        self.ring_len = 0       # valid slots (0: nothing to roll back to)

    # --- bookkeeping the forward calls --------------------------------------------------------
    def check_fits(self, n: int) -> None:
        if self.n_past + n > self.n_ctx:
            used = f" ({self.n_past} positions already used)" if self.n_past else ""
            raise HybridError(f"prompt of {n} tokens does not fit the context of {self.n_ctx}{used}")

    def check_ring(self, n: int) -> None:
        if n > self.n_ring:
            raise HybridError(f"a snapshotting forward of {n} tokens needs a ring of ≥ {n} slots; "
                              f"this state has {self.n_ring}")

    def advance(self, n: int, snapshot: bool) -> None:
        """After a forward of n tokens: move n_past; the ring is valid only right after a snapshotting call."""
        self.ring_base, self.ring_len = (self.n_past, n) if snapshot else (0, 0)
        self.n_past += n

    # --- speculative rollback -----------------------------------------------------------------
    def rollback(self, n_keep: int) -> None:
        """Keep the first n_keep tokens of the last snapshotting forward, drop the rest.

        GDN and conv states come back from ring slot n_keep−1; attention KV is truncated by
        moving n_past (stale cells get overwritten). Single use: the ring is spent afterwards.
        """
        if not 1 <= n_keep <= self.ring_len:
            raise HybridError(f"cannot roll back to {n_keep} kept tokens: the last snapshotting "
                              f"forward left {self.ring_len} slot(s)")
        if n_keep < self.ring_len:
            slot = n_keep - 1
            # two copies per GDN layer, each a Python-level launch on the GPU backend (most of a
            # drafting step's host time on a MoE model): one captured step replays them all
            self.backend.run_step(self._restore, slot)
        self.n_past = self.ring_base + n_keep
        self.ring_len = 0

    def _restore(self, slot: int) -> None:
        """Every GDN layer's live SSM and conv state := ring slot `slot`."""
        for i in self.ssm:
            self.backend.copy(self.ssm[i], self.ring_ssm[i][slot])
            self.backend.copy(self.conv[i], self.ring_conv[i][slot])

    # --- whole-state operations ---------------------------------------------------------------
    def reset(self) -> None:
        """An empty sequence. KV cells need no clearing (n_past bounds what is read)."""
        self.n_past = self.mtp_n_past = 0
        self.ring_base = self.ring_len = 0
        for i in self.ssm:
            self.backend.fill_zero(self.ssm[i])
            self.backend.fill_zero(self.conv[i])

    def copy(self) -> "SessionState":
        """An independent state with the same contents (KV copied up to the used positions)."""
        new = SessionState(self.config, self.n_ctx, self.n_ring, self.backend)
        new.n_past, new.mtp_n_past = self.n_past, self.mtp_n_past
        new.ring_base, new.ring_len = self.ring_base, self.ring_len
        copy = self.backend.copy
        for group in ("ssm", "conv", "ring_ssm", "ring_conv"):
            for i, arr in getattr(self, group).items():
                copy(getattr(new, group)[i], arr)
        for src_kv, dst_kv, used in ((self.kv, new.kv, self.n_past), (self.mtp_kv, new.mtp_kv, self.mtp_n_past)):
            for i, (k, v) in src_kv.items():
                copy(dst_kv[i][0][:, :used], k[:, :used])
                copy(dst_kv[i][1][:, :used], v[:, :used])
        return new

    def save(self, path: str | os.PathLike[str], model_id: str | None = None) -> None:
        """Write an .npz: recurrent states plus only the used KV positions (the ring is not kept).
        `model_id` (ModelFile.identity) ties the state to the exact file it was computed with."""
        meta = {"format": STATE_FORMAT, "config": _fingerprint(self.config), "n_ctx": self.n_ctx,
                "n_past": self.n_past, "mtp_n_past": self.mtp_n_past, "model": model_id}
        arrays = {"meta": np.array(json.dumps(meta))}
        host = self.backend.to_host
        for i in self.ssm:
            arrays[f"ssm_{i}"], arrays[f"conv_{i}"] = host(self.ssm[i]), host(self.conv[i])
        for prefix, kv, used in (("kv", self.kv, self.n_past), ("mtp_kv", self.mtp_kv, self.mtp_n_past)):
            for i, (k, v) in kv.items():
                arrays[f"{prefix}_k_{i}"] = host(k)[:, :used].astype(np.float32, copy=False)
                arrays[f"{prefix}_v_{i}"] = host(v)[:, :used].astype(np.float32, copy=False)
        try:
            with open(path, "wb") as f:
                np.savez(f, **arrays)
        except OSError as e:
            raise HybridError(f"cannot write state file {path}: {e.strerror or e}") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str], config: ModelConfig,
             n_ctx: int | None = None, n_ring: int = 0, backend=None,
             model_id: str | None = None) -> "SessionState":
        """Read a state saved by `save` for the same model (on `backend`, default the CPU);
        n_ctx defaults to the saved one. With `model_id`, a state saved with another id is refused.

        The file is untrusted: only the members this config implies are read, each one's name,
        dtype and shape are checked against the model before its data, and no more bytes than
        that shape holds are decompressed (a zip bomb costs what a real state would). Pickled
        objects are never loaded.
        """
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise HybridError(f"state file {path} does not exist") from None
        except OSError as e:
            raise HybridError(f"cannot read state file {path}: {e.strerror or e}") from None
        try:
            with f, zipfile.ZipFile(f) as z:
                return cls._load_zip(z, path, config, n_ctx, n_ring, backend, model_id)
        except (OSError, zipfile.BadZipFile, EOFError, RuntimeError, NotImplementedError, zlib.error) as e:
            # RuntimeError/NotImplementedError: an encrypted or oddly compressed member
            raise HybridError(f"{path} is not a hybrid state file ({safe_text(str(e))})") from None

    @classmethod
    def _load_zip(cls, z: zipfile.ZipFile, path, config: ModelConfig, n_ctx: int | None, n_ring: int,
                  backend, model_id: str | None) -> "SessionState":
        def damaged(why: str) -> HybridError:
            return HybridError(f"{path} is not a usable hybrid state file: {why}")

        members = {info.filename: info for info in z.infolist()}
        if "meta.npy" not in members:
            raise damaged("it has no metadata")
        meta_text = _read_member(z, members["meta.npy"], None, damaged)
        try:
            meta = json.loads(str(meta_text))
        except ValueError:
            raise damaged("its metadata is not JSON") from None
        if not isinstance(meta, dict):
            raise damaged("its metadata is not an object")
        if meta.get("format") != STATE_FORMAT:
            raise HybridError(f"{path} has state format {shown(meta.get('format'))}; "
                              f"this version reads {STATE_FORMAT}")
        if meta.get("config") != _fingerprint(config):
            raise HybridError(f"{path} was saved for a different model; it cannot be used with this one")
        saved_id = meta.get("model")
        if model_id is not None and saved_id is not None and saved_id != model_id:
            raise HybridError(f"{path} was saved with another model file of the same shape "
                              f"({shown(saved_id)}, this one is {model_id}); it cannot be used with this one")

        def count(key: str, hi: int) -> int:
            value = meta.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= hi:
                raise damaged(f"'{key}' is {shown(value)}; expected an integer in 0..{hi:,}")
            return value

        # The saved context is bounded by the model's own before anything is allocated for it.
        saved_ctx = count("n_ctx", config.context_length)
        n_ctx = int(saved_ctx if n_ctx is None else n_ctx)
        n_past, mtp_n_past = count("n_past", config.context_length), count("mtp_n_past", config.context_length)
        if max(n_past, mtp_n_past) > n_ctx:
            raise HybridError(f"{path} holds {n_past} positions; they do not fit the context of {n_ctx}")
        if n_ctx < 1:
            raise damaged("its context size is 0")

        c = config
        ssm_shape = (c.ssm_n_v_heads, c.ssm_d_state, c.ssm_d_state)
        conv_shape = (c.ssm_conv_kernel - 1, c.ssm_conv_channels)
        expected: dict[str, tuple[int, ...]] = {}
        for i in range(c.n_layer):
            if c.is_recurrent(i):
                expected[f"ssm_{i}"], expected[f"conv_{i}"] = ssm_shape, conv_shape
            else:
                for kv in "kv":
                    expected[f"kv_{kv}_{i}"] = (c.n_head_kv, n_past, c.head_dim)
        for i in range(c.n_layer, c.n_layer_all):
            for kv in "kv":
                expected[f"mtp_kv_{kv}_{i}"] = (c.n_head_kv, mtp_n_past, c.head_dim)
        names = {name[:-4] for name in members if name.endswith(".npy")} - {"meta"}
        extra = sorted(set(members) - {f"{n}.npy" for n in expected} - {"meta.npy"})
        if extra:
            raise damaged(f"it holds members this model has no place for ({shown(extra)})")
        missing = sorted(set(expected) - names)
        if missing:
            raise damaged(f"it lacks {shown(missing)}")

        state = cls(config, n_ctx, n_ring, backend)
        state.n_past, state.mtp_n_past = n_past, mtp_n_past
        copy = state.backend.copy
        for i in state.ssm:
            copy(state.ssm[i], _read_member(z, members[f"ssm_{i}.npy"], ssm_shape, damaged))
            copy(state.conv[i], _read_member(z, members[f"conv_{i}.npy"], conv_shape, damaged))
        for prefix, kv, used in (("kv", state.kv, n_past), ("mtp_kv", state.mtp_kv, mtp_n_past)):
            for i, (k, v) in kv.items():
                shape = (c.n_head_kv, used, c.head_dim)
                for live, kind in ((k, "k"), (v, "v")):
                    saved = _read_member(z, members[f"{prefix}_{kind}_{i}.npy"], shape, damaged)
                    copy(live[:, :used], saved.astype(live.dtype, copy=False))
        return state


MAX_META_CHARS = 1 << 16      # the JSON metadata of a state is a few hundred characters


def _read_member(z: zipfile.ZipFile, info: zipfile.ZipInfo, shape: tuple[int, ...] | None, damaged) -> np.ndarray:
    """One .npy member: its header checked (float32 of `shape`, or a short string when shape is
    None) before exactly the bytes that header promises are decompressed."""
    name = info.filename
    with z.open(info) as fp:
        try:
            version = np.lib.format.read_magic(fp)
            header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                      else np.lib.format.read_array_header_2_0)(fp)
        except (ValueError, SyntaxError, TypeError) as e:
            raise damaged(f"{safe_text(name)} is not a numpy array ({safe_text(str(e))})") from None
        got_shape, fortran, dtype = header
        if shape is None:
            if dtype.kind != "U" or got_shape != () or dtype.itemsize > 4 * MAX_META_CHARS:
                raise damaged(f"{safe_text(name)} is not a short text")
        elif dtype != np.dtype("<f4") or tuple(got_shape) != shape or fortran:
            raise damaged(f"{safe_text(name)} is {dtype} {tuple(got_shape)}; this model needs float32 {shape}")
        nbytes = dtype.itemsize * int(np.prod(got_shape, dtype=np.int64))
        data = fp.read(nbytes)
        if len(data) != nbytes:
            raise damaged(f"{safe_text(name)} is cut short")
    array = np.frombuffer(data, dtype=dtype).reshape(got_shape)
    return array[()] if shape is None else array


def _fingerprint(config: ModelConfig) -> dict:
    """The config as JSON values: a saved state only loads into the model it came from."""
    return json.loads(json.dumps(config.to_dict()))
