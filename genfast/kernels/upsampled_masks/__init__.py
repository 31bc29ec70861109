"""Per-mask statistics and column runs at the image's size, from low-res logits: ops.py."""
