"""SAM model configuration: the three official presets, and small ones for tests."""

from __future__ import annotations

from dataclasses import dataclass, replace

from genfast.errors import UserError


@dataclass(frozen=True)
class SamConfig:
    """Everything that fixes the shapes of a SAM model (defaults are the official values).

    The official models differ only in the image encoder; the prompt encoder and mask decoder are
    shared. `prompt_embed_dim` is also the image encoder's output channels: the decoder adds
    prompt and image embeddings, so they must agree.
    """

    encoder_embed_dim: int
    encoder_depth: int
    encoder_num_heads: int
    encoder_global_attn_indexes: tuple[int, ...]  # blocks with global attention; the rest are windowed
    image_size: int = 1024  # the padded square input
    patch_size: int = 16
    window_size: int = 14
    mlp_ratio: float = 4.0
    prompt_embed_dim: int = 256
    mask_in_chans: int = 16  # hidden channels of the mask-prompt downscaler
    decoder_depth: int = 2
    decoder_num_heads: int = 8
    decoder_mlp_dim: int = 2048
    decoder_attn_downsample: int = 2  # cross-attention works at prompt_embed_dim // this
    iou_head_depth: int = 3
    iou_head_hidden_dim: int = 256
    num_multimask_outputs: int = 3
    name: str = "custom"

    def __post_init__(self) -> None:
        object.__setattr__(self, "encoder_global_attn_indexes", tuple(self.encoder_global_attn_indexes))
        problems = []
        if self.image_size % self.patch_size:
            problems.append(f"image size {self.image_size} is not a multiple of patch size {self.patch_size}")
        if self.encoder_embed_dim % self.encoder_num_heads:
            problems.append(f"encoder dim {self.encoder_embed_dim} is not a multiple of {self.encoder_num_heads} heads")
        if (self.prompt_embed_dim // self.decoder_attn_downsample) % self.decoder_num_heads:
            problems.append(
                f"decoder cross-attention dim {self.prompt_embed_dim // self.decoder_attn_downsample} "
                f"is not a multiple of {self.decoder_num_heads} heads"
            )
        if self.prompt_embed_dim % 8 or self.mask_in_chans % 4:
            problems.append("prompt_embed_dim must be a multiple of 8 and mask_in_chans of 4")
        if any(not 0 <= i < self.encoder_depth for i in self.encoder_global_attn_indexes):
            problems.append(
                f"global attention indexes {self.encoder_global_attn_indexes} are outside 0..{self.encoder_depth - 1}"
            )
        if problems:
            raise UserError(f"invalid SAM config: {'; '.join(problems)}")

    @property
    def image_embedding_size(self) -> int:
        """Side of the square image embedding (64 for the official 1024 / 16)."""
        return self.image_size // self.patch_size

    def same_shapes(self, other: SamConfig) -> bool:
        """Equal apart from the name."""
        return replace(self, name=other.name) == other


SAM_PRESETS: dict[str, SamConfig] = {
    "vit_b": SamConfig(768, 12, 12, (2, 5, 8, 11), name="vit_b"),
    "vit_l": SamConfig(1024, 24, 16, (5, 11, 17, 23), name="vit_l"),
    "vit_h": SamConfig(1280, 32, 16, (7, 15, 23, 31), name="vit_h"),
}


def sam_preset(name: str) -> SamConfig:
    try:
        return SAM_PRESETS[name]
    except KeyError:
        raise UserError(f"unknown SAM model {name!r}; choose one of {', '.join(SAM_PRESETS)}") from None
