"""Segment Anything (SAM ViT-B/L/H): model, official checkpoints and image transforms."""
