"""A GEMM of fp32 rows and a bf16 weight, widened while it is packed: ops.py."""
