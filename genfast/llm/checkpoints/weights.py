"""Loading Llama-family weights from a Hugging Face directory (safetensors), a GGUF file, or a
directory written by `genfast quantize` (see genfast/quant/checkpoint.py), opened as a
Checkpoint (genfast/llm/checkpoints/checkpoint.py), which also gives the config.

All formats are read lazily (memory-mapped) and tensor by tensor into a model built on the meta
device, one transformer block at a time, so peak memory is the model plus one tensor; a caller
that quantizes or shards each block as it is filled (`load_model`'s `prepare_block`) never holds
more than one block at full size. Pickle checkpoints are refused: they can
run code when loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from genfast.errors import UserError
from genfast.llm.checkpoints import random_model
from genfast.llm.checkpoints.checkpoint import Checkpoint
from genfast.llm.checkpoints.gguf_file import GGUFFile
from genfast.llm.model import families
from genfast.llm.model.config import ModelArgs
from genfast.llm.model.families import multimodal
from genfast.llm.model.layers import TransformerBlock
from genfast.llm.model.transformer import Transformer
from genfast.nn import ExpertLinear
from genfast.quant.grids import QuantizedWeight
from genfast.quant.mxfp4 import MXFP4ExpertLinear

# GGUF block types whose codes are a genfast grid as they are (gguf_file.GGUFFile.quantized).
GGUF_TYPES_FOR_BITS = {8: ("Q8_0",), 4: ("Q4_0", "Q4_1")}

# genfast parameter suffix -> source tensor names (several are concatenated along dim 0).
_HF_LAYER = {
    "attention.wqkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    "attention.wqkv.bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
    "attention.wo.weight": ["self_attn.o_proj.weight"],
    "attention.wo.bias": ["self_attn.o_proj.bias"],
    "feed_forward.w13.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "feed_forward.w2.weight": ["mlp.down_proj.weight"],
    "attention_norm.weight": ["input_layernorm.weight"],
    "ffn_norm.weight": ["post_attention_layernorm.weight"],
}
# genfast name -> the source tensor's name after the decoder's or the output head's prefix
# (multimodal.text_prefixes: "model." and "" in a text model's checkpoint).
_HF_GLOBAL = {
    "tok_embeddings.weight": ("decoder", "embed_tokens.weight"),
    "norm.weight": ("decoder", "norm.weight"),
    "output.weight": ("head", "lm_head.weight"),
}
_GGUF_LAYER = {
    "attention.wqkv.weight": ["attn_q.weight", "attn_k.weight", "attn_v.weight"],
    "attention.wqkv.bias": ["attn_q.bias", "attn_k.bias", "attn_v.bias"],
    "attention.wo.weight": ["attn_output.weight"],
    "attention.wo.bias": ["attn_output.bias"],
    "feed_forward.w13.weight": ["ffn_gate.weight", "ffn_up.weight"],
    "feed_forward.w2.weight": ["ffn_down.weight"],
    "attention_norm.weight": ["attn_norm.weight"],
    "ffn_norm.weight": ["ffn_norm.weight"],
}
# A mixture-of-experts MLP in GGUF: the experts stacked in one tensor per projection, under the
# same names for every architecture (HF names differ per family: Family.hf_expert_tensors).
_GGUF_EXPERTS = {
    "feed_forward.router.weight": ["ffn_gate_inp.weight"],
    "feed_forward.w13.weight": ["ffn_gate_exps.weight", "ffn_up_exps.weight"],
    "feed_forward.w2.weight": ["ffn_down_exps.weight"],
}
_GGUF_GLOBAL = {
    "tok_embeddings.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "output.weight": "output.weight",
}


BlockHook = Callable[[str, TransformerBlock], None]


def load_model(
    checkpoint: Checkpoint,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    prepare_block: BlockHook | None = None,
) -> Transformer:
    """Build the model `checkpoint` describes and fill it with its weights.

    Transformer blocks are allocated and filled one at a time. `prepare_block(prefix, block)`
    (e.g. quantize and shard it, in place) runs on each before the next is read, so peak memory
    is the prepared model plus one block as stored, never the whole model at full size."""
    args = checkpoint.args
    if checkpoint.format == "genfast":
        fill = _quantized_filler(checkpoint, dtype)
    elif checkpoint.format == "random":
        fill = random_model.fill_random
    else:
        fill = _source_filler(checkpoint)
    with torch.device("meta"):
        model = Transformer(args).to(dtype)  # cast while empty: memory is allocated once, in dtype
    blocks, model.layers = model.layers, torch.nn.ModuleList()
    model.to_empty(device=device)  # everything but the blocks
    fill(model, "")
    if args.tie_embeddings and isinstance(model.output, torch.nn.Linear):
        model.output.weight = model.tok_embeddings.weight
    for i, block in enumerate(blocks):
        prefix = f"layers.{i}."
        fill(block.to_empty(device=device), prefix)
        if prepare_block is not None:
            prepare_block(prefix, block)
    model.layers = blocks
    model.reset_rope()  # computed buffers (the model's and its blocks') were left uninitialized by to_empty
    return model.eval().requires_grad_(False)


Filler = Callable[[torch.nn.Module, str], None]


def _source_filler(checkpoint: Checkpoint) -> Filler:
    """A function that fills a part of the model (the module stored under a prefix) from a Hugging
    Face or GGUF checkpoint, tensor by tensor."""
    args, path = checkpoint.args, checkpoint.path
    family = families.family(args.family)
    if checkpoint.format == "hf":
        get, available = _hf_source(checkpoint, args if family.hf_rope_interleaved else None)
        layer_names = {**_HF_LAYER, **family.hf_layer_tensors}
        # A multimodal checkpoint's language model lies under its own prefixes; the rest is not read.
        wrapped = checkpoint.multimodal_architecture is not None
        prefixes = dict(zip(("decoder", "head"), multimodal.text_prefixes(available, wrapped)))
        layer_prefix = prefixes["decoder"] + "layers.{i}."
        global_names = {name: prefixes[part] + source for name, (part, source) in _HF_GLOBAL.items()}
        expert_names = family.hf_expert_tensors
        mxfp4_experts = _hf_mxfp4_experts(get, available, partial(family.load_tensor, args, "hf"))
        older_names: dict[str, list[str]] = {}
    else:
        gguf = checkpoint.gguf
        get, available = _gguf_getter(gguf, args), gguf.tensor_names
        layer_names = {**_GGUF_LAYER, **family.gguf_layer_tensors}
        layer_prefix, global_names = "blk.{i}.", _GGUF_GLOBAL
        expert_names = _GGUF_EXPERTS
        older_names = family.gguf_older_layer_tensors
        mxfp4_experts = _gguf_mxfp4_experts(gguf)

    def keep_mxfp4_codes(module: torch.nn.Module, prefix: str) -> None:
        """Expert stacks stored as MXFP4 (gpt-oss's) become MXFP4ExpertLinears of their codes, not
        dequantized weights: a quarter of bf16's bytes per decode step."""
        for local, child in list(module.named_modules()):
            name = prefix + local
            if not isinstance(child, ExpertLinear) or not name.startswith("layers."):
                continue
            _, idx, suffix = name.split(".", 2)
            sources = [layer_prefix.format(i=idx) + s for s in expert_names.get(suffix + ".weight", ())]
            layer = mxfp4_experts(name + ".weight", sources) if sources else None
            if layer is None:
                continue
            if (layer.n_experts, layer.out_features, layer.in_features) != child.weight.shape:
                raise UserError(
                    f"{path}: MXFP4 tensor {sources[0]} holds {layer.n_experts} experts of "
                    f"{layer.out_features}x{layer.in_features} but the config implies {tuple(child.weight.shape)}"
                )
            module.set_submodule(local, layer.to(child.weight.device))

    def fill(module: torch.nn.Module, prefix: str) -> None:
        keep_mxfp4_codes(module, prefix)
        for local, param in module.named_parameters(remove_duplicate=False):
            name = prefix + local
            if name == "output.weight" and args.tie_embeddings:
                continue
            suffix = name
            if name.startswith("layers."):
                _, idx, suffix = name.split(".", 2)
                names = expert_names if args.is_moe_layer(int(idx)) and suffix in expert_names else layer_names
                per_expert = len(names[suffix]) if any("{e}" in s for s in names[suffix]) else None
                experts = range(args.n_experts) if per_expert else [0]
                sources = [layer_prefix.format(i=idx) + s.format(e=e) for e in experts for s in names[suffix]]
            else:
                sources, per_expert = [global_names[name]], None
            missing = [s for s in sources if s not in available]
            if missing and name.startswith("layers.") and suffix in older_names:  # an older file's layout
                sources = [layer_prefix.format(i=idx) + s for s in older_names[suffix]]
                missing = [s for s in sources if s not in available]
            if missing:
                raise UserError(f"{path}: checkpoint lacks tensor {missing[0]} (needed for {name})")
            tensor = _assemble([get(s) for s in sources], per_expert, bias=name.endswith("bias"))
            tensor = family.load_tensor(args, checkpoint.format, name, tensor)
            if tensor.shape != param.shape:
                raise UserError(
                    f"{path}: tensor {sources[0]} has shape {tuple(tensor.shape)} but the config implies "
                    f"{tuple(param.shape)} for {name}; the checkpoint and its config disagree"
                )
            with torch.no_grad():
                param.copy_(tensor)

    return fill


MXFP4Experts = Callable[[str, list[str]], MXFP4ExpertLinear | None]


def _hf_mxfp4_experts(
    get: Callable[[str], torch.Tensor], available: set[str], to_model: Callable[[str, torch.Tensor], torch.Tensor]
) -> MXFP4Experts:
    """For a Hugging Face checkpoint: the MXFP4ExpertLinear of an expert stack stored as one
    tensor's `_blocks` and `_scales`, its rows put in genfast's order (None: not stored so).
    `to_model(name, tensor)`: the family's load_tensor for HF tensors."""

    def experts(name: str, sources: list[str]) -> MXFP4ExpertLinear | None:
        if len(sources) != 1 or sources[0] + "_blocks" not in available:
            return None
        blocks, scales = get(sources[0] + "_blocks"), get(sources[0] + "_scales")
        # The family's reordering of output rows (gpt-oss: gate and up de-interleaved), read off
        # what it does to a tensor of row numbers in the unquantized layout [E, in, out].
        rows = torch.arange(blocks.shape[1], dtype=torch.float32).view(1, 1, -1)
        order = to_model(name, rows)[0, :, 0].long()
        return MXFP4ExpertLinear.from_hf(blocks[:, order].contiguous(), scales[:, order].contiguous())

    return experts


def _gguf_mxfp4_experts(gguf: GGUFFile) -> MXFP4Experts:
    """For a GGUF: the MXFP4ExpertLinear of an expert stack whose parts (gate and up, or down)
    are all of type MXFP4, joined along the output rows (None: not stored so)."""

    def experts(name: str, sources: list[str]) -> MXFP4ExpertLinear | None:
        if not all(s in gguf.tensor_names and gguf.tensor_type(s) == "MXFP4" for s in sources):
            return None
        return MXFP4ExpertLinear.from_gguf(torch.cat([gguf.raw_blocks(s) for s in sources], dim=1))

    return experts


def _assemble(parts: list[torch.Tensor], per_expert: int | None, bias: bool = False) -> torch.Tensor:
    """One parameter from its source tensors: fused projections are concatenated along the output
    features (GGUF's expert stacks [E, out, in] too; a bias's last dimension, of each expert for
    stacked expert biases [E, out]); experts stored a tensor each (HF; `per_expert` tensors per
    expert, expert by expert) are concatenated per expert and stacked."""
    if per_expert is not None:
        return torch.stack([torch.cat(parts[i : i + per_expert]) for i in range(0, len(parts), per_expert)])
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts, dim=-1 if bias else max(parts[0].dim() - 2, 0))


def _quantized_filler(checkpoint: Checkpoint, dtype: torch.dtype) -> Filler:
    """The same for a `genfast quantize` directory: a part gets the header's layers under its prefix
    (the top level: those outside the blocks)."""
    from genfast.quant.checkpoint import load_quantized_into

    quantized, args = checkpoint.quantized, checkpoint.args
    block_prefixes = tuple(f"layers.{i}." for i in range(args.n_layers))
    for name in quantized.layers:
        if name.startswith("layers.") and not name.startswith(block_prefixes):
            raise UserError(f"{quantized.path}: header lists layer {name}, which this model has no linear for")

    def fill(module: torch.nn.Module, prefix: str) -> None:
        if prefix:
            layers = [n for n in quantized.layers if n.startswith(prefix)]
        else:
            layers = [n for n in quantized.layers if not n.startswith("layers.")]
        load_quantized_into(module, quantized, convert=lambda _, t: t.to(dtype), prefix=prefix, layers=layers)

    return fill


def gguf_quantized_linears(
    checkpoint: Checkpoint, bits: int, only: set[str] | None = None
) -> dict[str, QuantizedWeight]:
    """The linears of a GGUF model whose blocks are already `bits`-bit codes on a genfast grid
    (Q8_0 for int8; Q4_0/Q4_1 for int4), in genfast module names, ready to use without
    dequantizing and requantizing. Layers stored in other types are absent; `only` limits the
    search to some module names."""
    gguf, args = checkpoint.gguf, checkpoint.args
    interleaved = families.family(args.family).gguf_rope_interleaved
    permuted = {"attn_q.weight": args.n_heads, "attn_k.weight": args.n_kv_heads} if interleaved else {}
    types = GGUF_TYPES_FOR_BITS[bits]
    found: dict[str, QuantizedWeight] = {}

    def fused(sources: list[str]) -> QuantizedWeight | None:
        # Check every part's type before decoding any: a fused layer needs all of them.
        if not all(s in gguf.tensor_names and gguf.tensor_type(s) in types for s in sources):
            return None
        parts = []
        for source in sources:
            qw = gguf.quantized(source)
            suffix = source.split(".", 2)[-1]
            if suffix in permuted:
                qw = QuantizedWeight(
                    *(
                        unpermute_rope_rows(t, permuted[suffix], args.rotary_dim)
                        for t in (qw.codes, qw.scales, qw.mins)
                    ),
                    qw.bits,
                    qw.group_size,
                    qw.in_features,
                )
            parts.append(qw)
        return QuantizedWeight(  # along the output features (of each expert, for experts)
            torch.cat([p.codes for p in parts], dim=-2),
            torch.cat([p.scales for p in parts], dim=-2),
            torch.cat([p.mins for p in parts], dim=-2),
            bits,
            parts[0].group_size,
            parts[0].in_features,
        )

    sources = {
        f"layers.{i}.{module}": [f"blk.{i}.{s}" for s in _GGUF_LAYER[f"{module}.weight"]]
        for i in range(args.n_layers)
        for module in ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")
    }
    for i in range(args.n_layers):  # a mixture's experts: stacks of codes, read the same way
        if args.is_moe_layer(i):
            for module in ("feed_forward.w13", "feed_forward.w2"):
                sources[f"layers.{i}.{module}"] = [f"blk.{i}.{s}" for s in _GGUF_EXPERTS[f"{module}.weight"]]
    sources["output"] = ["output.weight" if "output.weight" in gguf.tensor_names else "token_embd.weight"]
    for name, parts in sources.items():
        if only is None or name in only:
            qw = fused(parts)
            if qw is not None:
                found[name] = qw
    return found


def _hf_source(
    checkpoint: Checkpoint, interleaved: ModelArgs | None = None
) -> tuple[Callable[[str], torch.Tensor], set[str]]:
    """A getter of the tensors of a HF directory, and their names; `interleaved`: the args of a model
    whose q/k rows are in interleaved rotary pairs, reordered to halves here. A file is opened when
    a tensor is first read from it: a shard holding only what the model does not use (a
    multimodal checkpoint's image encoder) is never opened."""
    from safetensors import SafetensorError, safe_open

    weight_map = checkpoint.hf_weight_map
    handles = {}

    def handle(name: str) -> Any:  # safetensors' handle type is not public
        if name not in handles:
            try:
                handles[name] = safe_open(str(checkpoint.path / name), framework="pt")
            except (OSError, SafetensorError) as e:
                raise UserError(f"cannot read {checkpoint.path / name} (missing, truncated or corrupt): {e}") from e
        return handles[name]

    heads = {} if interleaved is None else {"q_proj": interleaved.n_heads, "k_proj": interleaved.n_kv_heads}

    def get(name: str) -> torch.Tensor:
        tensor = handle(weight_map[name]).get_tensor(name)
        kind = name.split(".")[-2]
        return unpermute_rope_rows(tensor, heads[kind], interleaved.rotary_dim) if kind in heads else tensor

    return get, set(weight_map)


def _gguf_getter(gguf: GGUFFile, args: ModelArgs) -> Callable[[str], torch.Tensor]:
    # llama.cpp's converter interleaves the rotary halves of q/k rows for the "llama"
    # architecture; undo it so the rows are in Hugging Face's rotate-half order.
    family = families.family(args.family)
    permuted = {"attn_q": args.n_heads, "attn_k": args.n_kv_heads} if family.gguf_rope_interleaved else {}

    def get(name: str) -> torch.Tensor:
        tensor = gguf.tensor(name)
        kind = name.split(".")[-2]
        if kind in permuted:
            tensor = unpermute_rope_rows(tensor, permuted[kind], args.rotary_dim)
        return family.gguf_tensor(name, tensor)

    return get


def unpermute_rope_rows(w: torch.Tensor, n_heads: int, rotary_dim: int | None = None) -> torch.Tensor:
    """Inverse of llama.cpp's q/k row permutation (per head: [pairs interleaved] -> [half | half]),
    of the first `rotary_dim` rows of each head (default: all; the others do not rotate)."""
    head_dim = w.shape[0] // n_heads
    rotary = rotary_dim or head_dim
    heads = w.reshape(n_heads, head_dim, *w.shape[1:])
    rotated = heads[:, :rotary].reshape(n_heads, rotary // 2, 2, *w.shape[1:]).transpose(1, 2)
    return torch.cat([rotated.reshape(n_heads, rotary, *w.shape[1:]), heads[:, rotary:]], dim=1).reshape(w.shape)
