"""What runs the GPU kernels: the device check, streams and buffers and the host hand-off
(memory), CUDA-graph capture and replay (graphs), page-locked host memory (host_mapping), the
PCIe share of MoE experts (pcie) and FFN weights streamed in for prompt chunks (weight_stream).
It imports no kernel: what it runs is handed to it (pyproject.toml's import contracts)."""
