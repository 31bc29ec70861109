"""Segment Anything (SAM ViT-B/L/H): model, official checkpoints, predictor and automatic mask
generator (genfast.sam.predictor.SamPredictor, genfast.sam.automatic.SamAutomaticMaskGenerator)."""
