"""SAM 2 model configuration: the official presets (2.0 and 2.1, Hiera tiny to large) and small
ones for tests.

Every official model shares everything but the Hiera trunk; 2.1 differs from 2.0 only in how the
video tracker encodes time and absent objects (`release`). The values are the official configs'.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from genfast.errors import UserError
from genfast.sam.config import SamConfig


@dataclass(frozen=True)
class Sam2Config:
    """Everything that fixes the shapes and behaviour of a SAM 2 model."""

    # Hiera trunk: four stages, each halving the resolution (q-pooling) and doubling the width.
    embed_dim: int = 96
    num_heads: int = 1
    stages: tuple[int, ...] = (1, 2, 7, 2)
    global_att_blocks: tuple[int, ...] = (5, 7, 9)  # the rest attend within windows
    window_spec: tuple[int, ...] = (8, 4, 14, 7)  # window side per stage
    window_pos_embed_bkg_spatial_size: tuple[int, int] = (7, 7)
    # FPN neck: all levels projected to d_model; the coarsest (1/32) is dropped ("scalp").
    d_model: int = 256
    fpn_top_down_levels: tuple[int, ...] = (2, 3)
    image_size: int = 1024
    # Video memory: masks are encoded to mem_dim channels, num_maskmem frames are remembered.
    mem_dim: int = 64
    num_maskmem: int = 7
    memory_attention_layers: int = 4
    memory_attention_ffn_dim: int = 2048
    max_obj_ptrs_in_encoder: int = 16
    release: str = "2.1"
    name: str = "custom"

    def __post_init__(self) -> None:
        for field in ("stages", "global_att_blocks", "window_spec", "window_pos_embed_bkg_spatial_size"):
            object.__setattr__(self, field, tuple(getattr(self, field)))
        object.__setattr__(self, "fpn_top_down_levels", tuple(self.fpn_top_down_levels))
        problems = []
        if len(self.stages) != 4 or len(self.window_spec) != 4:
            problems.append("Hiera needs four stages and a window size for each")
        if self.image_size % 32:
            problems.append(f"image size {self.image_size} is not a multiple of 32")
        if any(not 0 <= i < sum(self.stages) for i in self.global_att_blocks):
            problems.append(f"global attention blocks {self.global_att_blocks} are outside 0..{sum(self.stages) - 1}")
        if self.release not in ("2.0", "2.1"):
            problems.append(f"release {self.release!r} is neither '2.0' nor '2.1'")
        if self.d_model % self.mem_dim:
            problems.append(f"d_model {self.d_model} is not a multiple of mem_dim {self.mem_dim}")
        if problems:
            raise UserError(f"invalid SAM 2 config: {'; '.join(problems)}")

    @property
    def depth(self) -> int:
        return sum(self.stages)

    @property
    def channel_list(self) -> tuple[int, ...]:
        """Output channels of the trunk's stages, coarsest first (the neck's input order)."""
        return tuple(self.embed_dim * 2**i for i in reversed(range(len(self.stages))))

    @property
    def backbone_stride(self) -> int:
        return 16

    @property
    def image_embedding_size(self) -> int:
        """Side of the square embedding the mask decoder reads (64 at 1024)."""
        return self.image_size // self.backbone_stride

    # What changed from 2.0 to 2.1 (all in the video tracker).
    @property
    def no_obj_embed_spatial(self) -> bool:
        return self.release == "2.1"

    @property
    def add_tpos_enc_to_obj_ptrs(self) -> bool:
        return self.release == "2.1"

    @property
    def proj_tpos_enc_in_obj_ptrs(self) -> bool:
        return self.release == "2.1"

    @property
    def use_signed_tpos_enc_to_obj_ptrs(self) -> bool:
        return self.release == "2.1"

    def decoder_config(self) -> SamConfig:
        """The config of the parts SAM 2 shares with SAM (prompt encoder, two-way transformer):
        only its decoder fields are read."""
        return SamConfig(
            encoder_embed_dim=self.d_model,
            encoder_depth=1,
            encoder_num_heads=1,
            encoder_global_attn_indexes=(),
            image_size=self.image_size,
            patch_size=self.backbone_stride,
            prompt_embed_dim=self.d_model,
            name=f"{self.name} decoder",
        )

    def same_shapes(self, other: Sam2Config) -> bool:
        """Equal apart from the name."""
        return replace(self, name=other.name) == other


def _presets() -> dict[str, Sam2Config]:
    trunks = {
        "tiny": dict(embed_dim=96, num_heads=1, stages=(1, 2, 7, 2), global_att_blocks=(5, 7, 9)),
        "small": dict(embed_dim=96, num_heads=1, stages=(1, 2, 11, 2), global_att_blocks=(7, 10, 13)),
        "base-plus": dict(
            embed_dim=112,
            num_heads=2,
            stages=(2, 3, 16, 3),
            global_att_blocks=(12, 16, 20),
            window_pos_embed_bkg_spatial_size=(14, 14),
        ),
        "large": dict(
            embed_dim=144,
            num_heads=2,
            stages=(2, 6, 36, 4),
            global_att_blocks=(23, 33, 43),
            window_spec=(8, 4, 16, 8),
        ),
    }
    presets = {}
    for release in ("2.1", "2.0"):
        for size, trunk in trunks.items():
            name = f"sam{release}-hiera-{size}".replace("sam2.0", "sam2")
            presets[name] = Sam2Config(**trunk, release=release, name=name)
    return presets


SAM2_PRESETS: dict[str, Sam2Config] = _presets()


def sam2_preset(name: str) -> Sam2Config:
    try:
        return SAM2_PRESETS[name]
    except KeyError:
        raise UserError(f"unknown SAM 2 model {name!r}; choose one of {', '.join(SAM2_PRESETS)}") from None


def tiny_sam2_config(release: str = "2.1", **overrides: object) -> Sam2Config:
    """A small model with every official feature, for tests: 128-pixel input (8x8 embedding)."""
    fields = dict(
        embed_dim=8,
        num_heads=1,
        stages=(1, 2, 2, 1),
        global_att_blocks=(4,),  # never a stage's first block (it pools), as in the official ones
        window_spec=(8, 4, 4, 2),
        window_pos_embed_bkg_spatial_size=(4, 4),
        d_model=32,
        image_size=128,
        mem_dim=16,
        memory_attention_layers=2,
        memory_attention_ffn_dim=64,
        release=release,
        name=f"tiny-{release}",
    )
    fields.update(overrides)
    return Sam2Config(**fields)
