"""Quantization shared by all workloads (kept torch-free at import: the CLI parser reads these)."""

# Weight-only modes a model can be loaded with (`--quant`), quantized on the fly.
QUANT_MODES = ("none", "int8", "int4")
# What `genfast quantize --mode` writes to disk.
QUANTIZE_MODES = ("int8", "int4", "int4-gptq")
INT4_GROUP_SIZES = (32, 64, 128, 256)
# int4 defaults to llama.cpp's block of 32: the best quality of the four, and GGUF Q4_0/Q4_1
# tensors then load without requantization.
DEFAULT_INT4_GROUP_SIZE = 32
