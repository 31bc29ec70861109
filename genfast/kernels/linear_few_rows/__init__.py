"""A bf16-weight linear for a few input rows (decode, batched decode, verification): ops.py."""
