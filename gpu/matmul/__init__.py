"""The GPU matrix products: the decode matvec (float lanes: matvec, quants; int8 activations:
matvec_q8, quants_q8) and the prompt-chunk GEMMs (gemm, gemm_mma, gemm_units), all specialised
per weight type from templates (kernel_source). The op set calls `matvec.matvec` / `matvecs`."""
