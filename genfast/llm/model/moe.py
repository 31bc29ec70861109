"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE, gpt-oss, DeepSeek-V3): a router picks each
token's top-k experts, gated MLPs of the shared shape whose outputs are summed with the router's
weights (DeepSeek's router, `GroupLimitedRouter`, is a subclass; its shared experts are added by
its family, genfast/llm/model/families/deepseek.py).

The experts' weights are stacked per projection ([E, 2 * width, dim] and [E, dim, width]) in
`ExpertLinear`s, which multiply each row by its own expert's weight only (genfast.nn.
grouped_by_expert): a decode step reads the k active experts' weights, not all E, and a prefill
runs one matmul per expert over the tokens routed to it. Quantization, tensor parallelism and
checkpoints treat the stacks as they treat linears, one more leading dimension.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genfast.nn import ExpertLinear

if TYPE_CHECKING:
    from genfast.llm.model.config import ModelArgs


class Router(nn.Module):
    """Top-k routing: softmax over the experts' logits (fp32), the k most probable, their
    probabilities renormalized to sum to 1 where the family does (Mixtral always; Qwen3-MoE per
    its norm_topk_prob). Kept in floating point: quantizing it would change which experts run
    (llama.cpp keeps it in F32 too)."""

    # The logits by the few-row kernel, whatever the row count (set by genfast.llm.model.invariance):
    # a token's experts then never depend on the tokens beside it.
    batch_invariant = False

    def __init__(self, dim: int, n_experts: int, n_active: int, normalize: bool, bias: bool = False) -> None:
        super().__init__()
        self.n_active, self.normalize = n_active, normalize
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        # A logit bias per expert (gpt-oss); None: none.
        self.bias = nn.Parameter(torch.empty(n_experts)) if bias else None

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, dim] -> (weights [T, k] in x's dtype, experts [T, k] int64)."""
        probs = self.logits(x).float().softmax(dim=-1)
        weights, experts = torch.topk(probs, self.n_active, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def logits(self, x: Tensor) -> Tensor:
        if not self.batch_invariant:
            logits = F.linear(x, self.weight.to(x.dtype))
        else:
            # The kernel takes bf16 weights: a wider router goes in as two bf16 parts, its leading
            # bits and the rest (16 of fp32's 24 mantissa bits), each summed in fp32.
            high = self.weight.to(torch.bfloat16)
            logits = torch.ops.genfast.linear_few_rows(x, high)
            if self.weight.dtype != torch.bfloat16:
                logits = logits + torch.ops.genfast.linear_few_rows(x, (self.weight.float() - high.float()).bfloat16())
        return logits if self.bias is None else logits + self.bias.to(logits.dtype)


class GroupLimitedRouter(Router):
    """DeepSeek-V3's routing: sigmoid scores; the experts are chosen by score plus a per-expert
    `correction_bias` (load balancing: it decides the choice only), among the `topk_group` of
    `n_group` groups whose two best biased scores sum highest; their weights are the unbiased
    scores, renormalized to sum to 1 if `normalize`, times `scale` (routed_scaling_factor)."""

    def __init__(
        self, dim: int, n_experts: int, n_active: int, normalize: bool, n_group: int, topk_group: int, scale: float
    ) -> None:
        super().__init__(dim, n_experts, n_active, normalize)
        self.n_group, self.topk_group, self.scale = n_group, topk_group, scale
        self.correction_bias = nn.Parameter(torch.zeros(n_experts))  # e_score_correction_bias

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        scores = self.logits(x).float().sigmoid()
        choice = scores + self.correction_bias.float()
        if self.n_group > 1:
            per_group = choice.shape[-1] // self.n_group
            group_scores = choice.view(-1, self.n_group, per_group).topk(2, dim=-1).values.sum(dim=-1)
            kept = group_scores.topk(self.topk_group, dim=-1).indices
            in_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            choice = choice.masked_fill(~in_kept.repeat_interleave(per_group, dim=1), float("-inf"))
        experts = choice.topk(self.n_active, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.scale).to(x.dtype), experts


class MoEFeedForward(nn.Module):
    """Each token through its k experts' gated MLPs (SwiGLU), summed with the router's weights.
    `w13`, `w2` and `intermediate_size` mirror the dense FeedForward's, per expert. A family whose
    experts differ (gpt-oss: biases, a clamped activation) overrides `experts`."""

    def __init__(self, args: ModelArgs, router_bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = args.expert_intermediate_size
        self.router = Router(
            args.dim, args.n_experts, args.n_active_experts, args.normalize_expert_weights, router_bias
        )
        self.w13 = ExpertLinear(args.n_experts, args.dim, 2 * args.expert_intermediate_size)  # gate ‖ up
        self.w2 = ExpertLinear(args.n_experts, args.expert_intermediate_size, args.dim)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts = self.router(x)
        k = experts.shape[-1]
        rows = x.repeat_interleave(k, dim=0)  # row t * k + j: token t for its j-th expert
        out = self.experts(rows, experts.reshape(-1)).view(-1, k, shape[-1])
        return (out * weights[..., None]).sum(dim=1).view(shape)

    def expert_tensors(self) -> list[Tensor]:
        """The weights stacked per expert, leading dim n_experts, in whatever format they are stored
        (parameters, or a quantized stack's buffers): a token uses k of E of them."""
        stacks = (self.w13, self.w2)
        return [t for stack in stacks for t in (*stack.parameters(), *stack.buffers())]

    def experts(self, rows: Tensor, per_row: Tensor) -> Tensor:
        """Each row [R, dim] through its own expert's gated MLP (per_row [R]): [R, dim]."""
        gate, up = self.w13(rows, per_row).split(self.intermediate_size, dim=-1)
        return self.w2(F.silu(gate) * up, per_row)
