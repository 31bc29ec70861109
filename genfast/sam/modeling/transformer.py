"""The mask decoder's two-way transformer: prompt tokens and image tokens attend to each other.

Each layer: token self-attention, tokens -> image cross-attention, a token MLP, then image ->
tokens cross-attention, each followed by a residual and a LayerNorm (post-norm). Positional
encodings are re-added to queries and keys before every attention, never to values. The
cross-attentions run at half width (`downsample_rate`), which is why their projections are
narrower in the checkpoints.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from genfast.sam.config import SamConfig
from genfast.sam.modeling.attention import attention
from genfast.sam.modeling.common import MLPBlock


class Attention(nn.Module):
    """Multi-head attention whose projections may be absorbed into the few prompt tokens' side.

    The decoder's cross-attentions pair ~8 prompt tokens with 4,096 image tokens, and with 8 heads
    the tokens' side is 64 vectors a prompt, half the projections' 128 inner features. By
    associativity the image tokens then need no projection of their own:
    - few queries (tokens -> image): the score of token t and image token x in head h is
      q_h(t) . (W_k,h x) = (W_k,h^T q_h(t)) . x, and the head's output is
      W_v,h (sum_x p(x) x) + b_v,h (the weights sum to one); the keys' bias adds the same to every
      score of a query, which the softmax ignores;
    - few keys (image -> tokens): the scores are x . (W_q,h^T k_h(t)) + b_q,h . k_h(t), and the output
      projection of each token's value, W_o,h v_h(t), is mixed by the weights directly.
    Each image-side product then has H x (few tokens) columns instead of the inner width, and the
    same result up to rounding. "fused" and "auto" absorb a projection where that takes fewer
    FLOPs (`forward`); a projection shared by a batch of prompts (one image, computed once) stays.
    """

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

    @property
    def _score_scale(self) -> float:
        """1 / sqrt(head dim), as `attention` scales the scores."""
        return (self.q_proj.out_features // self.num_heads) ** -0.5

    def _per_head(self, linear: nn.Linear) -> Tensor:
        """An inner-width projection's weight as [heads, head dim, model dim]; the output
        projection's transposed to that shape."""
        weight = linear.weight if linear is not self.out_proj else linear.weight.t()
        return weight.reshape(self.num_heads, -1, weight.shape[-1])

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.attention_impl in ("auto", "fused"):
            if self._absorb_keys(q, k):
                return self._few_queries(q, k, v)
            if self.num_heads * k.shape[1] < self.q_proj.out_features:  # H x keys values < inner width
                return self._few_keys(q, k, v)
        out = attention(
            self._heads(self.q_proj(q)), self._heads(self.k_proj(k)), self._heads(self.v_proj(v)), self.attention_impl
        )
        b, _, n, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))

    def _absorb_keys(self, q: Tensor, k: Tensor) -> bool:
        """Whether absorbing the key and value projections into the queries takes fewer FLOPs: per
        key, H x (queries) products for each of q's batch against the inner width for each of k's
        (a batch of prompts over one image projects that image once)."""
        return q.shape[0] * self.num_heads * q.shape[1] < k.shape[0] * self.q_proj.out_features

    def _few_queries(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        b, n = max(q.shape[0], k.shape[0]), q.shape[1]
        queries = self._heads(self.q_proj(q)) * self._score_scale
        # [B, H * n, model dim]: each query head's key projection, applied to the image tokens as they are.
        absorbed = torch.einsum("bhnc,hcd->bhnd", queries, self._per_head(self.k_proj)).flatten(1, 2)
        weights = (absorbed @ k.transpose(1, 2)).softmax(dim=-1)
        pooled = (weights @ v).view(b, self.num_heads, n, -1)  # the weighted mean image token per query head
        out = torch.einsum("bhnd,hcd->bhnc", pooled, self._per_head(self.v_proj))
        out = out + self.v_proj.bias.view(self.num_heads, 1, -1)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))

    def _few_keys(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        b, n = max(q.shape[0], k.shape[0]), k.shape[1]
        keys = self._heads(self.k_proj(k)) * self._score_scale
        if q.shape[0] == b:  # the query projection absorbed into each prompt's keys
            absorbed = torch.einsum("bhnc,hcd->bhnd", keys, self._per_head(self.q_proj)).flatten(1, 2)
            bias = (keys * self.q_proj.bias.view(self.num_heads, 1, -1)).sum(-1).flatten(1)
            scores = q @ absorbed.transpose(1, 2) + bias[:, None]  # [B, queries, H * n]
        else:  # one image's queries for a batch of prompts: projected once
            scores = (self._heads(self.q_proj(q)) @ keys.transpose(2, 3)).transpose(1, 2).flatten(2)
        weights = scores.unflatten(2, (self.num_heads, n)).softmax(dim=-1).flatten(2)
        # [B, H * n, model dim]: each key's value through its head's slice of the output projection.
        values = torch.einsum("bhnc,hcd->bhnd", self._heads(self.v_proj(v)), self._per_head(self.out_proj))
        return weights @ values.flatten(1, 2) + self.out_proj.bias


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
