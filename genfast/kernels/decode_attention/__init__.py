"""Attention of one query per sequence over the KV cache (LLM decode): ops.py."""
