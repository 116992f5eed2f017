"""`hybrid bench_kernels` (being written)."""
