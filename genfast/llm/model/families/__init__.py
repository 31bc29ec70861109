"""The decoder families genfast loads, one module each, registered by the names checkpoints use.

A family says which Hugging Face `model_type`s and GGUF `general.architecture`s it reads, how its
config differs from the shared reading (genfast.llm.model.config.ModelArgs), which block and attention
classes it builds (genfast/llm/model/layers.py, subclassed where it differs) and the names of any
tensors of its own in both formats. Adding a family is a module here plus its entry in `_registry`.

Registered: llama (Llama, Mistral, SmolLM/SmolLM2), ministral3 (Llama 4's attention temperature),
mixtral, qwen2, qwen3, qwen3_moe, phi3, gemma2, gemma3, smollm3 (NoPE layers), seed_oss, olmo2
(OLMo 2 and 3), granite, ernie4_5, exaone4, glm4 and hunyuan_dense (model_type hunyuan_v1_dense).
Several are a few lines of data over the shared blocks (qwen2, phi3, seed_oss, ernie4_5); the
others subclass the shared attention or block (or another family's) only where they differ.

Multimodal checkpoints whose language model is one of these (Gemma 3 4B-27B, Mistral Small 3.1/3.2,
LLaVA) load as that family, their text part only: multimodal.py says which, as data.
"""

from __future__ import annotations

from genfast.errors import UserError
from genfast.llm.model.families import (
    deepseek,
    ernie4_5,
    exaone4,
    gemma2,
    gemma3,
    glm4,
    glm4_moe,
    gpt_oss,
    granite,
    hunyuan_dense,
    llama,
    ministral3,
    mixtral,
    olmo2,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
    seed_oss,
    smollm3,
)
from genfast.llm.model.families.base import Family


def _registry() -> dict[str, Family]:
    found: dict[str, Family] = {}
    every = (
        llama,
        ministral3,
        mixtral,
        qwen2,
        qwen3,
        qwen3_moe,
        phi3,
        gemma2,
        gemma3,
        smollm3,
        seed_oss,
        olmo2,
        granite,
        ernie4_5,
        exaone4,
        glm4,
        hunyuan_dense,
        gpt_oss,
        deepseek,
        glm4_moe,
    )
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
