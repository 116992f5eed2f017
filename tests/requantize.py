"""Test models made from the bundled one, so no test reads a model from outside the repository."""
from __future__ import annotations

import pathlib

import gguf
import numpy as np

KEEP = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}


def requantize(src: pathlib.Path, dst: pathlib.Path, target=gguf.GGMLQuantizationType.Q8_0) -> pathlib.Path:
    """Copy the GGUF at `src` with every quantized tensor dequantized and quantized again as
    `target` (float tensors kept), metadata unchanged: a uniform Q8_0 file of the bundled
    trained model, like the converter's Q8_0 output of the same weights."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue     # written by GGUFWriter itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        if t.tensor_type in KEEP:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        q = gguf.quants.quantize(values, target)
        writer.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
