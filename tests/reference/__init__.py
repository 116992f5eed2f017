"""Whole-model oracles: a slow numpy float64 qwen35 forward and a llama.cpp harness.

Deliberately independent of the engine: nothing here imports `hybrid.*`, `cpu.*` or `gpu.*`.
Weights come from `gguf.GGUFReader` + `gguf.quants.dequantize`, the math straight from
docs/MODEL_FORMAT.md §3–§4.
"""
