"""Turning a model into text: generation, sampling, speculative decoding, saved compiled steps."""
