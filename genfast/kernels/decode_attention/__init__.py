"""Attention over the KV cache, one or several queries per sequence, each query's result independent
of the rest of its call: ops.py."""
