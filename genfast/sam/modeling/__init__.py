"""SAM's model, state-dict compatible with the official checkpoints (`sam_vit_{b,l,h}_*.pth`)."""

from genfast.sam.modeling.image_encoder import ImageEncoderViT
from genfast.sam.modeling.mask_decoder import MaskDecoder
from genfast.sam.modeling.prompt_encoder import PromptEncoder
from genfast.sam.modeling.sam import Sam
from genfast.sam.modeling.transformer import TwoWayTransformer

__all__ = ["ImageEncoderViT", "MaskDecoder", "PromptEncoder", "Sam", "TwoWayTransformer"]
