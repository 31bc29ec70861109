"""genfast's SAM 2 video memory (memory attention, memory encoder) and sine position encodings
against the official sam2 modules: same (perturbed) weights, same outputs in fp32."""

from __future__ import annotations

import pytest
import torch

from genfast.kernels.rel_pos_attention import ops as kernel
from genfast.sam.modeling.attention import set_attention
from genfast.sam.sam2.config import Sam2Config, sam2_preset, tiny_sam2_config
from genfast.sam.sam2.modeling.memory import MemoryAttention, MemoryEncoder
from genfast.sam.sam2.modeling.position import PositionEmbeddingSine, get_1d_sine_pe
from genfast.sam.sam2.official import build_official_sam2, import_sam2
from tests.sam.oracle import randomize_

TINY = tiny_sam2_config()


def _close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> float:
    """Max abs error, asserted below rel * (1 + max |expected|)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= rel * (1 + expected.abs().max().item()), f"max abs error {err:.3g}"
    return err


_MODULES: dict[str, tuple[Sam2Config, torch.nn.Module, MemoryAttention, MemoryEncoder]] = {}


def _pair(config: Sam2Config) -> tuple[torch.nn.Module, MemoryAttention, MemoryEncoder]:
    """The official video model's memory modules, perturbed, and genfast's with their weights."""
    if config.name not in _MODULES:
        torch.manual_seed(0)
        official = build_official_sam2(config, video=True)
        randomize_(official.memory_attention, seed=1)
        randomize_(official.memory_encoder, seed=2)
        attention, encoder = MemoryAttention(config).eval(), MemoryEncoder(config).eval()
        attention.load_state_dict(official.memory_attention.state_dict(), strict=True)
        encoder.load_state_dict(official.memory_encoder.state_dict(), strict=True)
        _MODULES[config.name] = (official, attention, encoder)
    return _MODULES[config.name]


def _memory_inputs(
    config: Sam2Config, batch: int, grid: int, frames: int, pointers: int, dtype: torch.dtype = torch.float32
) -> dict[str, object]:
    """Inputs as the official tracker lays them out: the frame's tokens [HW, B, C], then the
    memory frames' tokens followed by the object pointers, each split into d_model/mem_dim tokens."""
    gen = torch.Generator().manual_seed(batch * 100 + frames * 10 + pointers)
    d, m, hw = config.d_model, config.mem_dim, grid * grid
    split = d // m
    memory_tokens = frames * hw + pointers * split

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    return dict(
        curr=[randn(hw, batch, d)],
        curr_pos=[randn(hw, batch, d)],
        memory=randn(memory_tokens, batch, m),
        memory_pos=randn(memory_tokens, batch, m),
        num_obj_ptr_tokens=pointers * split,
    )


@torch.no_grad()
@pytest.mark.parametrize(
    "batch, grid, frames, pointers",
    [(1, 8, 1, 0), (2, 8, 3, 2), (1, 8, 2, 5), (2, 6, 2, 3), (2, 8, 0, 4)],
    ids=["one_frame", "frames_and_pointers_b2", "pointers_b1", "other_grid", "pointers_only"],
)
def test_memory_attention_matches_official(batch: int, grid: int, frames: int, pointers: int) -> None:
    official, attention, _ = _pair(TINY)
    inputs = _memory_inputs(TINY, batch, grid, frames, pointers)
    expected = official.memory_attention(**{k: [v[0].clone()] if isinstance(v, list) else v for k, v in inputs.items()})
    actual = attention(**inputs)
    assert actual.shape == (grid * grid, batch, TINY.d_model)
    _close(actual, expected)
    # The tracker reshapes the output (HW)BC -> BCHW with a view.
    actual.permute(1, 2, 0).view(batch, TINY.d_model, grid, grid)


@torch.no_grad()
def test_memory_attention_batch_rows_are_independent() -> None:
    _, attention, _ = _pair(TINY)
    inputs = _memory_inputs(TINY, 2, 8, 2, 2)
    both = attention(**inputs)
    one = {
        k: [v[0][:, 1:]] if isinstance(v, list) else v[:, 1:] if torch.is_tensor(v) else v for k, v in inputs.items()
    }
    _close(attention(**one), both[:, 1:])


@torch.no_grad()
def test_memory_attention_in_bf16() -> None:
    """bf16 weights and inputs: bf16 out, within bf16's error of fp32 (RoPE is applied in fp32)."""
    _, attention, _ = _pair(TINY)
    inputs = _memory_inputs(TINY, 2, 8, 2, 2)
    expected = attention(**inputs)
    half = MemoryAttention(TINY).eval().to(torch.bfloat16)
    half.load_state_dict(attention.state_dict())
    low = {
        k: [v[0].bfloat16()] if isinstance(v, list) else v.bfloat16() if torch.is_tensor(v) else v
        for k, v in inputs.items()
    }
    actual = half(**low)
    assert actual.dtype == torch.bfloat16
    _close(actual.float(), expected, rel=0.03)


@torch.no_grad()
def test_memory_attention_fused_takes_the_kernel_and_matches_sdpa(monkeypatch) -> None:
    """The recipe's fused step: both attentions of every layer through the native kernel where it
    takes bf16 and pays, within bf16's error of the SDPA the other steps run."""
    if not kernel.takes(torch.bfloat16):
        pytest.skip("no native attention kernel for bf16 here")
    _, attention, _ = _pair(TINY)
    half = MemoryAttention(TINY).eval().to(torch.bfloat16)
    half.load_state_dict(attention.state_dict())
    inputs = {
        k: [v[0].bfloat16()] if isinstance(v, list) else v.bfloat16() if torch.is_tensor(v) else v
        for k, v in _memory_inputs(TINY, 2, 8, 2, 2).items()
    }
    set_attention(half, "sdpa")
    expected = half(**inputs).float()
    set_attention(half, "fused")
    calls = []
    original = kernel.attention
    monkeypatch.setattr(kernel, "attention", lambda *args: calls.append(args[1].shape[-2]) or original(*args))
    actual = half(**inputs).float()
    key_counts = [8 * 8, 2 * 8 * 8 + 2 * (TINY.d_model // TINY.mem_dim)] * len(half.layers)
    # The cross-attention's values are the memory's mem_dim channels where the kernel takes them.
    queries = torch.empty(2, 1, 8 * 8, TINY.d_model, dtype=torch.bfloat16)
    widths = [TINY.d_model, TINY.mem_dim] * len(half.layers)
    assert calls == [n for n, c in zip(key_counts, widths) if kernel.runs_on_kernel(queries, n, c)]
    _close(actual, expected, rel=0.03)


@torch.no_grad()
def test_memory_attention_applies_the_value_projection_after_the_attention(monkeypatch) -> None:
    """Where the kernel takes the cross-attention, P multiplies the memory (mem_dim channels) and
    the value projection follows, the same products reassociated: within bf16's error of the
    values projected first (the path SDPA takes). Attention of two heads projects first (the
    reassociation would be per head)."""
    from genfast.sam.sam2.modeling import memory

    _, attention, _ = _pair(TINY)
    half = MemoryAttention(TINY).eval().to(torch.bfloat16)
    half.load_state_dict(attention.state_dict())
    set_attention(half, "fused")
    inputs = {
        k: [v[0].bfloat16()] if isinstance(v, list) else v.bfloat16() if torch.is_tensor(v) else v
        for k, v in _memory_inputs(TINY, 2, 8, 2, 2).items()
    }
    value_widths = []  # (heads, channels) of the values of each attention call
    original = memory.sam2_attention

    def recorded(q, k, v, *args):
        value_widths.append((v.shape[1], v.shape[-1]))
        return original(q, k, v, *args)

    monkeypatch.setattr(memory, "sam2_attention", recorded)

    def widths_with(on_kernel: bool) -> tuple[list[tuple[int, int]], torch.Tensor]:
        monkeypatch.setattr(memory, "runs_on_kernel", lambda *args: on_kernel)
        value_widths.clear()
        out = half(**inputs).float()
        return value_widths[1::2], out  # (heads, channels) of each layer's cross-attention's values

    widths, absorbed = widths_with(True)
    assert widths == [(1, TINY.mem_dim)] * len(half.layers)
    widths, projected_first = widths_with(False)
    assert widths == [(1, TINY.d_model)] * len(half.layers)
    _close(absorbed, projected_first, rel=0.03)
    assert not torch.equal(absorbed, projected_first)

    two_heads = memory.RoPEAttention(TINY.d_model, TINY.mem_dim, num_heads=2).eval().bfloat16()
    rope = memory.axial_rope_tables(TINY.d_model // 2, 8, torch.device("cpu"))
    q = two_heads.queries(inputs["curr"][0].transpose(0, 1), rope)
    mem = inputs["memory"].transpose(0, 1)
    value_widths.clear()
    two_heads.attend_memory(q, mem, mem, rope, inputs["num_obj_ptr_tokens"])
    assert value_widths == [(2, TINY.d_model // 2)]


@torch.no_grad()
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("skip_mask_sigmoid", [True, False])
def test_memory_encoder_matches_official(batch: int, skip_mask_sigmoid: bool) -> None:
    official, _, encoder = _pair(TINY)
    gen = torch.Generator().manual_seed(batch)
    grid = TINY.image_embedding_size
    pix_feat = torch.randn(batch, TINY.d_model, grid, grid, generator=gen)
    masks = torch.randn(batch, 1, TINY.image_size, TINY.image_size, generator=gen) * 10
    expected = official.memory_encoder(pix_feat, masks, skip_mask_sigmoid=skip_mask_sigmoid)
    actual = encoder(pix_feat, masks, skip_mask_sigmoid=skip_mask_sigmoid)
    _close(actual["vision_features"], expected["vision_features"])
    (actual_pos,), (expected_pos,) = actual["vision_pos_enc"], expected["vision_pos_enc"]
    _close(actual_pos, expected_pos, rel=1e-6)


@torch.no_grad()
def test_real_size_memory_matches_official() -> None:
    """sam2.1-hiera-tiny's memory modules at their 64x64 features, two objects."""
    config = sam2_preset("sam2.1-hiera-tiny")
    official, attention, encoder = _pair(config)
    inputs = _memory_inputs(config, 2, config.image_embedding_size, 1, 2)
    expected = official.memory_attention(**inputs)
    _close(attention(**inputs), expected)

    gen = torch.Generator().manual_seed(0)
    pix_feat = torch.randn(2, config.d_model, 64, 64, generator=gen)
    masks = torch.randn(2, 1, config.image_size, config.image_size, generator=gen)
    expected = official.memory_encoder(pix_feat, masks, skip_mask_sigmoid=True)
    actual = encoder(pix_feat, masks, skip_mask_sigmoid=True)
    _close(actual["vision_features"], expected["vision_features"])
    _close(actual["vision_pos_enc"][0], expected["vision_pos_enc"][0], rel=1e-6)


@torch.no_grad()
@pytest.mark.parametrize("channels, height, width", [(256, 64, 64), (32, 256, 256), (64, 32, 32), (16, 6, 10)])
def test_position_embedding_sine_matches_official(channels: int, height: int, width: int) -> None:
    import_sam2()
    from sam2.modeling.position_encoding import PositionEmbeddingSine as OfficialSine

    official = OfficialSine(channels, normalize=True, temperature=10000, warmup_cache=False)
    ours = PositionEmbeddingSine(channels)
    x = torch.zeros(2, 3, height, width)
    expected = official(x)
    _close(ours(x), expected, rel=1e-6)
    _close(ours(x), expected, rel=1e-6)  # from the cache
    assert ours(x.bfloat16()).dtype == torch.bfloat16
    _close(ours(x.bfloat16()), expected.bfloat16(), rel=0)


def test_1d_sine_pe_matches_official() -> None:
    import_sam2()
    from sam2.modeling.sam2_utils import get_1d_sine_pe as official

    positions = torch.tensor([-15.0, -3.0, -1.0, 0.0, 1.0, 2.0, 15.0]) / 15
    for dim in (16, 64, 256):
        _close(get_1d_sine_pe(positions, dim), official(positions, dim), rel=1e-6)
