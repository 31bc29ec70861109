"""Weights and tokenizers in and out: safetensors, GGUF, genfast's quantized directories."""
