"""Block kernels that return the log-sum-exp (torch SDPA ops, flash-attn-4, Triton backward)."""
