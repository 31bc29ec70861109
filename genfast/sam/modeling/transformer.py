"""The mask decoder's two-way transformer: prompt tokens and image tokens attend to each other.

Each layer: token self-attention, tokens -> image cross-attention, a token MLP, then image ->
tokens cross-attention, each followed by a residual and a LayerNorm (post-norm). Positional
encodings are re-added to queries and keys before every attention, never to values. The
cross-attentions run at half width (`downsample_rate`), which is why their projections are
narrower in the checkpoints.
"""

from __future__ import annotations

from torch import Tensor, nn

from genfast.sam.config import SamConfig
from genfast.sam.modeling.attention import attention
from genfast.sam.modeling.common import MLPBlock


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, downsample_rate: int = 1) -> None:
        super().__init__()
        self.num_heads = num_heads
        inner = dim // downsample_rate
        self.q_proj = nn.Linear(dim, inner)
        self.k_proj = nn.Linear(dim, inner)
        self.v_proj = nn.Linear(dim, inner)
        self.out_proj = nn.Linear(inner, dim)
        self.attention_impl = "auto"  # see modeling/attention.py

    def _heads(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        return x.view(b, n, self.num_heads, c // self.num_heads).transpose(1, 2)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = attention(
            self._heads(self.q_proj(q)), self._heads(self.k_proj(k)), self._heads(self.v_proj(v)), self.attention_impl
        )
        b, _, n, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class TwoWayAttentionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_dim: int, downsample_rate: int, skip_first_layer_pe: bool) -> None:
        super().__init__()
        self.self_attn = Attention(dim, num_heads)
        self.norm1 = nn.LayerNorm(dim)
        self.cross_attn_token_to_image = Attention(dim, num_heads, downsample_rate)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLPBlock(dim, mlp_dim, nn.ReLU)
        self.norm3 = nn.LayerNorm(dim)
        self.norm4 = nn.LayerNorm(dim)
        self.cross_attn_image_to_token = Attention(dim, num_heads, downsample_rate)
        # The first layer's queries *are* the prompt embeddings (positions included), so its
        # self-attention replaces them instead of adding a residual.
        self.skip_first_layer_pe = skip_first_layer_pe

    def forward(self, queries: Tensor, keys: Tensor, query_pe: Tensor, key_pe: Tensor) -> tuple[Tensor, Tensor]:
        if self.skip_first_layer_pe:
            queries = self.self_attn(queries, queries, queries)
        else:
            q = queries + query_pe
            queries = queries + self.self_attn(q, q, queries)
        queries = self.norm1(queries)

        q, k = queries + query_pe, keys + key_pe
        queries = self.norm2(queries + self.cross_attn_token_to_image(q, k, keys))
        queries = self.norm3(queries + self.mlp(queries))

        q = queries + query_pe
        keys = self.norm4(keys + self.cross_attn_image_to_token(k, q, queries))
        return queries, keys


class TwoWayTransformer(nn.Module):
    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        dim, heads, rate = config.prompt_embed_dim, config.decoder_num_heads, config.decoder_attn_downsample
        self.layers = nn.ModuleList(
            TwoWayAttentionBlock(dim, heads, config.decoder_mlp_dim, rate, skip_first_layer_pe=i == 0)
            for i in range(config.decoder_depth)
        )
        self.final_attn_token_to_image = Attention(dim, heads, rate)
        self.norm_final_attn = nn.LayerNorm(dim)

    def forward(self, image_embedding: Tensor, image_pe: Tensor, point_embedding: Tensor) -> tuple[Tensor, Tensor]:
        """image_embedding, image_pe: [B, C, h, w] (or [1, C, h, w]: one image for all B prompts,
        whose first-layer projections are then computed once); point_embedding: [B, N, C].

        Returns the processed tokens [B, N, C] and image tokens [B, h*w, C].
        """
        keys = image_embedding.flatten(2).transpose(1, 2)
        key_pe = image_pe.flatten(2).transpose(1, 2)
        queries = point_embedding
        for layer in self.layers:
            queries, keys = layer(queries, keys, point_embedding, key_pe)
        q, k = queries + point_embedding, keys + key_pe
        queries = self.norm_final_attn(queries + self.final_attn_token_to_image(q, k, keys))
        return queries, keys
