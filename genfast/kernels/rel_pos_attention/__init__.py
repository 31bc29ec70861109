"""Attention with SAM's decomposed relative-position bias, fused: ops.py."""
