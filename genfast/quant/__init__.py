"""Quantization shared by all workloads."""
