"""genfast: fast generative-AI inference in native PyTorch."""

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """`genfast.LLM` and `genfast.ImageGenerator` without importing torch at `import genfast` (the
    CLI's start stays fast)."""
    if name == "LLM":
        from genfast.serve.offline import LLM

        return LLM
    if name == "ImageGenerator":
        from genfast.diffusion.generator import ImageGenerator

        return ImageGenerator
    raise AttributeError(f"module 'genfast' has no attribute {name!r}")
