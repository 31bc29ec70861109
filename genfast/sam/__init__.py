"""Segment Anything (SAM ViT-B/L/H): model, official checkpoints and image transforms."""

from genfast.sam.automatic import SamAutomaticMaskGenerator as SamAutomaticMaskGenerator
