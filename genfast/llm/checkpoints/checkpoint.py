"""A model checkpoint as genfast reads it: where it is, its format (detected once, when it is
opened) and its files, each opened once, on first use, then shared by everything that reads the
checkpoint: its config (`Checkpoint.args`), its weights (genfast/llm/checkpoints/weights.py), its
tokenizer (tokenizer.py) and quantization on load, which takes a GGUF file's blocks as they are
where it can (quantize.py).

Formats: "hf" (a directory with config.json and safetensors weights), "gguf" (a GGUF file, or a
directory holding exactly one), "genfast" (a directory written by `genfast quantize`:
genfast/quant/checkpoint.py) and "random" (`random:NAME`, random weights at a published shape and
no files: genfast.llm.checkpoints.random_model).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from genfast.errors import UserError
from genfast.llm.checkpoints import random_model
from genfast.llm.checkpoints.gguf_file import GGUFFile, is_gguf, open_gguf
from genfast.llm.model.config import ModelArgs, RopeScaling, longrope_attention_factor
from genfast.llm.model.families import multimodal
from genfast.llm.model.reading import args_from_dict, args_from_gguf_metadata, args_from_hf_config

if TYPE_CHECKING:
    from genfast.quant.checkpoint import QuantizedCheckpoint

Format = Literal["hf", "gguf", "genfast", "random"]
# The weights file of a `genfast quantize` output directory.
QUANTIZED_FILE = "model.safetensors"


def detect_format(path: Path) -> Format:
    """'hf' (a directory with config.json), 'genfast' (a directory written by `genfast quantize`),
    'gguf' (a file with the GGUF magic, or a directory holding exactly one) or 'random'
    (`random:NAME` of a known shape); anything else is a UserError that says what was found."""
    if random_model.is_random(path):
        random_model.shape_name(path)  # a known shape
        return "random"
    if not path.exists():
        raise UserError(f"model not found: {path} does not exist")
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf"
        if (path / QUANTIZED_FILE).is_file():
            return "genfast"
        if len(_gguf_files(path)) == 1:
            return "gguf"
        raise UserError(f"{path} holds neither a config.json (Hugging Face model) nor exactly one .gguf file")
    if is_gguf(path):
        return "gguf"
    raise UserError(f"{path} is neither a GGUF file nor a Hugging Face model directory")


def _gguf_files(directory: Path) -> list[Path]:
    """The GGUF files in a directory, less a vision model's projector (llama.cpp names it
    mmproj-*.gguf) beside its language model: a download of Gemma 3's GGUF holds both."""
    found = sorted(p for p in directory.glob("*.gguf") if is_gguf(p))
    models = [p for p in found if "mmproj" not in p.name.lower()]
    return models if models else found


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """A checkpoint opened for reading (`Checkpoint.open`); pass it, not its path, to the loaders."""

    path: Path
    format: Format

    @classmethod
    def open(cls, path: Path | str) -> Checkpoint:
        """The checkpoint at `path` (a local file or directory, or `random:NAME`), its format
        detected; a missing path or one of no known format is a UserError."""
        path = Path(path)
        return cls(path, detect_format(path))

    @property
    def gguf_path(self) -> Path:
        """The GGUF file itself: the path, or the one GGUF file in the directory it names."""
        if self.format != "gguf":
            raise ValueError(f"{self.path} is a {self.format} checkpoint, not a GGUF file")
        return self.path if self.path.is_file() else _gguf_files(self.path)[0]

    @cached_property
    def gguf(self) -> GGUFFile:
        """The GGUF file, parsed once for the config, weights and tokenizer read from it."""
        gguf = open_gguf(self.gguf_path)
        meta = gguf.metadata
        if meta.get("general.architecture") == "clip" or meta.get("general.type") == "mmproj":
            raise UserError(
                f"{self.gguf_path} is a multimodal projector (mmproj: a vision model's image encoder), not a "
                "language model; pass the model's own GGUF as --model (genfast loads the text part only)"
            )
        return gguf

    @cached_property
    def quantized(self) -> QuantizedCheckpoint:
        """The weights file of a `genfast quantize` directory, its header checked."""
        from genfast.quant.checkpoint import QuantizedCheckpoint

        if self.format != "genfast":
            raise ValueError(f"{self.path} is a {self.format} checkpoint, not a `genfast quantize` output")
        return QuantizedCheckpoint(self.path / QUANTIZED_FILE)

    @cached_property
    def hf_config(self) -> dict[str, Any]:
        """A Hugging Face directory's config.json."""
        if self.format != "hf":
            raise ValueError(f"{self.path} is a {self.format} checkpoint, not a Hugging Face directory")
        return read_json(self.path / "config.json")

    @cached_property
    def hf_weight_map(self) -> dict[str, str]:
        """A Hugging Face directory's tensor names -> the safetensors file holding each: from its
        index, or else from the files' headers (no tensor is read)."""
        from safetensors import SafetensorError, safe_open

        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            return dict(read_json(index)["weight_map"])
        files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            pickles = [p.name for p in self.path.glob("*.bin")] + [p.name for p in self.path.glob("*.pt*")]
            hint = (
                f" (found {pickles[0]}: pickle checkpoints are not loaded, as they can run code; "
                "convert them to safetensors)"
                if pickles
                else ""
            )
            raise UserError(f"{self.path}: no .safetensors weights found{hint}")
        weight_map = {}
        for name in files:
            try:
                with safe_open(str(self.path / name), framework="pt") as f:
                    weight_map.update(dict.fromkeys(f.keys(), name))
            except (OSError, SafetensorError) as e:
                raise UserError(f"cannot read {self.path / name} (missing, truncated or corrupt): {e}") from e
        return weight_map

    @property
    def multimodal_architecture(self) -> str | None:
        """The architecture of a multimodal checkpoint (e.g. Gemma3ForConditionalGeneration) whose
        language model alone genfast loads; None for a text model."""
        if self.format != "hf" or not multimodal.is_wrapper(self.hf_config):
            return None
        return multimodal.architecture(self.hf_config)

    @cached_property
    def args(self) -> ModelArgs:
        """The model's architecture, read without its weights (a multimodal checkpoint's tensor
        names say whether its output head is tied)."""
        if self.format == "hf":
            names = set(self.hf_weight_map) if self.multimodal_architecture else None
            return args_from_hf_config(self.hf_config, names)
        if self.format == "random":
            return random_model.random_args(self.path)
        if self.format == "gguf":
            return _gguf_args(self.gguf)
        try:
            return args_from_dict(json.loads(self.quantized.metadata["model_args"]))
        except (KeyError, json.JSONDecodeError) as e:
            raise UserError(f"{self.quantized.path}: header has no valid model_args: {e}") from e


def resolve_checkpoint(spec: str | None) -> Checkpoint:
    """The checkpoint a --model value names: a path, `random:NAME`, a built-in name or a hub id
    (genfast.storage.hub.resolve_model, which downloads what is not cached yet)."""
    from genfast.storage.hub import resolve_model

    return Checkpoint.open(resolve_model(spec))


def read_json(path: Path) -> dict:
    """A checkpoint's JSON file; one that cannot be read or parsed is a UserError that names it."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:  # ValueError: bad JSON, or text that is not UTF-8
        raise UserError(f"cannot read {path}: {e}") from e


def _gguf_args(gguf: GGUFFile) -> ModelArgs:
    """A GGUF file's config: its metadata, and the rope scaling that some files store as tensors."""
    args = args_from_gguf_metadata(gguf.metadata, gguf.tensor_names)
    if "rope_freqs.weight" in gguf.tensor_names:
        divisors = tuple(gguf.tensor("rope_freqs.weight").tolist())
        args = ModelArgs(**{**args.__dict__, "rope_freq_divisors": divisors})
    if "rope_factors_long.weight" in gguf.tensor_names:  # LongRoPE (Phi-3): its factors are tensors
        arch = gguf.metadata["general.architecture"]
        original = int(gguf.metadata.get(f"{arch}.rope.scaling.original_context_length", args.max_seq_len))
        factor = args.max_seq_len / original
        scaling = RopeScaling(
            "longrope",
            factor,
            original_max_position_embeddings=original,
            short_factor=tuple(gguf.tensor("rope_factors_short.weight").tolist()),
            long_factor=tuple(gguf.tensor("rope_factors_long.weight").tolist()),
            attention_factor=float(
                gguf.metadata.get(f"{arch}.rope.scaling.attn_factor") or longrope_attention_factor(factor, original)
            ),
        )
        args = ModelArgs(**{**args.__dict__, "rope_scaling": scaling})
    return args
