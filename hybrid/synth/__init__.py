"""Synthetic GGUF models: llama.cpp's exact layout and metadata, random well-scaled weights.

Used to test the engine on every architecture, type and size without downloading real models,
and to make benchmark-sized files (a 27B-shaped Q4_K_M in minutes, with bounded memory).
"""
from .quantize import quantize
from .spec import PRESET_NAMES, SynthSpec, preset
from .types import ModelPlan, PlannedTensor, plan_model
from .writer import tensor_floats, write_model

__all__ = ["SynthSpec", "preset", "PRESET_NAMES", "plan_model", "ModelPlan", "PlannedTensor",
           "write_model", "tensor_floats", "quantize"]
