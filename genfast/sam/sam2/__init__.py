"""Segment Anything 2 (SAM 2 and 2.1): models, image and video predictors."""
