"""genfast: fast generative-AI inference in native PyTorch."""

__version__ = "0.1.0"
