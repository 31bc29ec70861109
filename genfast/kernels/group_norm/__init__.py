"""GroupNorm of channels-last activations: ops.py."""
