"""Write a synthetic GGUF model tensor by tensor, in row chunks: bounded memory at any size.

Two ways to fill a quantised tensor (`method`):
* "quantize": draw the floats of `weights.init_for` and quantise them (tiny models; the floats
  can be regenerated with `tensor_floats` to see how close the file is to what was meant);
* "codes": random codes under sane scales (`codes.random_blocks`), hundreds of MB/s, for
  benchmark-sized files.
"auto" picks "quantize" up to `AUTO_QUANTIZE_ELEMENTS`. F32/F16/BF16 tensors always hold the
drawn floats (norms ≈ 1 and a negative `ssm_a` matter more than speed there).
The file appears under its name only when complete (written as `<name>.partial`, then renamed).
Only a new path or a regular file is ever replaced: renaming over a device node, a folder or a
symlink would destroy something that is not ours (as root, `make-model /dev/full --force`
replaced the device).
"""
from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Callable, Iterator, Mapping

import numpy as np

from ..errors import HybridError
from .codes import random_blocks
from .gguf_out import encode_header, write_padding
from .metadata import model_metadata
from .quantize import QUANTIZABLE, quantize
from .spec import SynthSpec
from .types import ModelPlan, PlannedTensor, plan_model, synth_layout
from .weights import init_for, sample, tensor_rng

Progress = Callable[[int, int, str], None]      # (bytes done, bytes total, tensor name)

METHODS = ("auto", "quantize", "codes")
AUTO_QUANTIZE_ELEMENTS = 64 << 20
CHUNK_BYTES = 32 << 20                             # float32 bytes generated per step
DISK_MARGIN_BYTES = 64 << 20                      # kept free beside a big model (at most a tenth of it)


def write_model(path: str | os.PathLike, spec: SynthSpec, types: str = "Q4_K_M", seed: int = 0,
                progress: Progress | None = None, *, method: str = "auto",
                overrides: Mapping[str, str] | None = None) -> ModelPlan:
    """Write `spec` as a GGUF file at `path` (replacing it) and return the plan it followed."""
    path = Path(path)
    plan = plan_model(spec, types, overrides)
    method = _resolve_method(method, plan)
    header = encode_header(model_metadata(spec, plan),
                           ((t.name, t.ne, t.type.id, t.nbytes) for t in plan), plan.alignment)
    total = len(header) + plan.total_bytes
    check_replaceable(path)
    partial = path.with_name(path.name + ".partial")
    check_replaceable(partial)
    check_free_space(path, total)
    done = len(header)
    try:
        partial.unlink(missing_ok=True)          # a regular file left by an interrupted run
        # O_EXCL|O_NOFOLLOW: never write through a link or into something created meanwhile
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            for t in plan:
                for chunk in tensor_chunks(spec, t, seed, method):
                    f.write(chunk.data)
                    done += chunk.nbytes
                    if progress:
                        progress(done, total, t.name)
                done += write_padding(f, t.nbytes, plan.alignment)
        os.replace(partial, path)
    except BaseException as e:
        partial.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise HybridError(f"cannot write {path}: {e.strerror or e}") from None
        raise
    if progress:
        progress(total, total, "")
    return plan


def _resolve_method(method: str, plan: ModelPlan) -> str:
    if method not in METHODS:
        raise HybridError(f"unknown fill method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "auto":
        n = sum(t.n_elements for t in plan)
        floats_ok = all(t.type.name in QUANTIZABLE for t in plan)
        return "quantize" if n <= AUTO_QUANTIZE_ELEMENTS and floats_ok else "codes"
    return method


def check_replaceable(path: Path) -> None:
    """`path` is new or a regular file (not followed if it is a link); anything else is refused."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise HybridError(f"cannot write {path}: {path.absolute().parent} is not a folder") from None
    except OSError as e:
        raise HybridError(f"cannot write {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        kind = ("a folder" if stat.S_ISDIR(mode) else "a symbolic link" if stat.S_ISLNK(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        raise HybridError(f"{path} is {kind}; hybrid only writes new files or replaces regular files")


def check_free_space(path: Path, nbytes: int) -> None:
    folder = path.absolute().parent
    if not folder.exists():
        raise HybridError(f"folder {folder} does not exist")
    if not folder.is_dir():
        raise HybridError(f"{folder} is not a folder")
    free = shutil.disk_usage(folder).free
    margin = min(DISK_MARGIN_BYTES, nbytes // 10)
    if free < nbytes + margin:
        raise HybridError(f"not enough disk space in {folder}: the model needs {_size(nbytes)} "
                          f"(plus {_size(margin)} kept free), {_size(free)} is free")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _row_chunks(n_rows: int, n: int) -> Iterator[int]:
    """Row counts per step: about CHUNK_BYTES of float32 each."""
    per = max(1, CHUNK_BYTES // (4 * n))
    for start in range(0, n_rows, per):
        yield min(per, n_rows - start)


def tensor_chunks(spec: SynthSpec, t: PlannedTensor, seed: int, method: str) -> Iterator[np.ndarray]:
    """The bytes of tensor `t`, a few row chunks at a time."""
    init = init_for(t.name, t.ne, spec)
    rng = tensor_rng(seed, t.name)
    n = t.ne[0]
    for rows in _row_chunks(t.n_rows, n):
        if method == "codes" and t.type.block_elems > 1:
            yield random_blocks(rng, rows, n, t.type, init.std)
        else:
            yield quantize(sample(init, rng, (rows, n)), t.type)


def tensor_floats(spec: SynthSpec, name: str, seed: int = 0) -> np.ndarray:
    """The floats the "quantize" method draws for tensor `name`, shaped (rows, ne[0])."""
    ne = next((tuple(s.ne) for s in synth_layout(spec) if s.name == name), None)
    if ne is None:
        raise KeyError(f"{spec.arch} spec has no tensor {name!r}")
    init, rng = init_for(name, ne, spec), tensor_rng(seed, name)
    n_rows = int(np.prod(ne[1:], dtype=np.int64))
    return np.concatenate([sample(init, rng, (rows, ne[0])) for rows in _row_chunks(n_rows, ne[0])])
