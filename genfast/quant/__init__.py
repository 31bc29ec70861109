"""Quantization shared by all workloads."""

# Weight-only modes a model can be loaded with (`--quant`).
QUANT_MODES = ("none", "int8")
