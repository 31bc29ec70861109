"""The native channels-last GroupNorm against a float64 reference, its fallbacks, and compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from genfast.diffusion.group_norm import ChannelsLastGroupNorm, use_channels_last_group_norm
from genfast.kernels.group_norm.ops import unavailable_reason

native = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def norm(groups: int, channels: int, dtype: torch.dtype, affine: bool = True) -> nn.GroupNorm:
    gn = nn.GroupNorm(groups, channels, eps=1e-6, affine=affine)
    if affine:
        with torch.no_grad():
            gn.weight.normal_()
            gn.bias.normal_()
    return gn.to(dtype)


def reference(gn: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
    weight = None if gn.weight is None else gn.weight.double()
    bias = None if gn.bias is None else gn.bias.double()
    return F.group_norm(x.double(), gn.num_groups, weight, bias, gn.eps)


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "batch,groups,channels,hw", [(2, 16, 32, (8, 8)), (1, 32, 320, (13, 7)), (2, 32, 128, (37, 37)), (1, 4, 80, (1, 3))]
)
def test_native_matches_float64_as_well_as_aten(dtype, batch, groups, channels, hw):
    torch.manual_seed(0)
    gn = norm(groups, channels, dtype)
    # Offset inputs (|mean| >> std in places): the one-pass variance must not cancel.
    x = (torch.randn(batch, channels, *hw) * 0.5 + 20).to(dtype).to(memory_format=torch.channels_last)
    module = ChannelsLastGroupNorm(gn)
    assert module.native
    y, want = module(x), reference(gn, x)
    assert y.dtype == dtype and y.is_contiguous(memory_format=torch.channels_last)
    ours = (y.double() - want).abs().max().item()
    aten = (gn(x).double() - want).abs().max().item()
    if dtype == torch.float32:
        assert ours <= 1e-4
    else:  # bf16 output: within one rounding of the exact value, as ATen's
        assert ours <= max(aten, want.abs().max().item() * 2**-8) * 1.01


def test_fallbacks_are_aten_exactly():
    """Contiguous (NCHW) inputs, channels not a multiple of 16 and non-affine norms take F.group_norm."""
    torch.manual_seed(0)
    for gn, x in [
        (norm(4, 32, torch.float32), torch.randn(2, 32, 5, 5)),
        (norm(3, 24, torch.float32), torch.randn(1, 24, 5, 5).to(memory_format=torch.channels_last)),
    ]:
        assert torch.equal(ChannelsLastGroupNorm(gn)(x), gn(x))


@native
def test_not_affine_and_compiled():
    torch.manual_seed(0)
    gn = norm(8, 64, torch.bfloat16, affine=False)
    module = ChannelsLastGroupNorm(gn)
    x = torch.randn(2, 64, 9, 11, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    assert (module(x).double() - reference(gn, x)).abs().max().item() < 0.05
    compiled = torch.compile(lambda t: F.silu(module(t)), fullgraph=True)
    assert torch.equal(compiled(x), F.silu(module(x)))


def test_swap_keeps_parameters_and_state_dict():
    model = nn.Sequential(nn.Conv2d(3, 32, 1), nn.GroupNorm(8, 32), nn.SiLU())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    use_channels_last_group_norm(model)
    assert isinstance(model[1], ChannelsLastGroupNorm)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
