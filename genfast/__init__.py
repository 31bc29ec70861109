"""genfast: fast generative-AI inference in native PyTorch."""

__version__ = "0.1.0"

# The Python API, one object per workload: name -> (module, class), imported on first use.
_LAZY = {
    "LLM": ("genfast.serve.offline", "LLM"),
    "Segmenter": ("genfast.sam.segmenter", "Segmenter"),
    "ImageGenerator": ("genfast.diffusion.generator", "ImageGenerator"),
}


def __getattr__(name: str) -> object:
    """`genfast.LLM`, `genfast.Segmenter` and `genfast.ImageGenerator` without importing torch at
    `import genfast` (the CLI's start stays fast)."""
    if name not in _LAZY:
        raise AttributeError(f"module 'genfast' has no attribute {name!r}")
    import importlib

    module, attribute = _LAZY[name]
    return getattr(importlib.import_module(module), attribute)
