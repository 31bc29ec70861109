"""The decoder families genfast loads, one module each, registered by the names checkpoints use.

A family says which Hugging Face `model_type`s and GGUF `general.architecture`s it reads, how its
config differs from the shared reading (genfast.llm.model.config.ModelArgs), which block and attention
classes it builds (genfast/llm/model/layers.py, subclassed where it differs) and the names of any
tensors of its own in both formats. Adding a family is a module here plus its entry in `_registry`.
"""

from __future__ import annotations

from genfast.errors import UserError
from genfast.llm.model.families import (
    deepseek,
    gemma2,
    gemma3,
    glm4_moe,
    llama,
    mixtral,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
)
from genfast.llm.model.families.base import Family


def _registry() -> dict[str, Family]:
    found: dict[str, Family] = {}
    every = (llama, mixtral, qwen2, qwen3, qwen3_moe, phi3, gemma2, gemma3, deepseek, glm4_moe)
    for fam in (module.FAMILY for module in every):
        for name in {fam.name, *fam.hf_model_types, *fam.gguf_architectures}:
            found[name] = fam
    return found


FAMILIES = _registry()  # every name a checkpoint may use -> its family


def family(name: str) -> Family:
    """The family a model_type or GGUF architecture (ModelArgs.family) belongs to."""
    if name not in FAMILIES:
        raise UserError(f"unsupported architecture {name!r}; genfast loads {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


def hf_model_types() -> list[str]:
    return sorted({t for f in FAMILIES.values() for t in f.hf_model_types})


def gguf_architectures() -> list[str]:
    return sorted({a for f in FAMILIES.values() for a in f.gguf_architectures})
