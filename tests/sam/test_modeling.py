"""genfast's SAM against the original segment-anything code: same weights, same outputs (fp32)."""

from __future__ import annotations

import pytest
import torch

from genfast.errors import UserError
from genfast.sam.build import build_sam, config_from_state_dict, load_sam_checkpoint
from genfast.sam.config import SAM_PRESETS, SamConfig
from genfast.sam.modeling import Sam
from genfast.sam.transforms import ResizeLongestSide
from tests.sam.oracle import build_original_sam, import_segment_anything, randomize_

# grid 8 with window 3: windows need padding (8 -> 9); decoder heads 8 as in the official models.
TINY = SamConfig(
    32,
    2,
    4,
    (1,),
    image_size=64,
    patch_size=8,
    window_size=3,
    prompt_embed_dim=64,
    mask_in_chans=8,
    decoder_mlp_dim=64,
    iou_head_hidden_dim=32,
)
# grid 8 with window 4: windows tile exactly; a global first block; 3 heads of 16.
TINY_B = SamConfig(
    48,
    2,
    3,
    (0,),
    image_size=128,
    patch_size=16,
    window_size=4,
    prompt_embed_dim=32,
    mask_in_chans=4,
    decoder_num_heads=4,
    decoder_mlp_dim=48,
    iou_head_hidden_dim=16,
)


def _close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> float:
    """Max abs error, asserted below rel * (1 + max |expected|)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if not actual.numel():
        return 0.0
    err = (actual - expected).abs().max().item()
    assert err <= rel * (1 + expected.abs().max().item()), f"max abs error {err:.3g}"
    return err


@pytest.fixture(scope="module", params=[TINY, TINY_B], ids=["tiny_padded_windows", "tiny_exact_windows"])
def pair(request) -> tuple[SamConfig, torch.nn.Module, Sam]:
    config = request.param
    torch.manual_seed(0)
    original = build_original_sam(config)
    randomize_(original)
    ours = build_sam(config)
    ours.load_state_dict(original.state_dict(), strict=True)  # the key-compatibility proof
    return config, original, ours


def _prompts(config: SamConfig, n: int = 3, n_points: int = 2) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    s = config.image_size
    coords = torch.rand(n, n_points, 2, generator=gen) * s
    labels = torch.tensor([[1, 0], [1, -1], [0, 1]])[:n, :n_points]
    corners = (torch.rand(n, 2, 2, generator=gen) * s).sort(dim=1).values
    masks = torch.randn(n, 1, 4 * config.image_embedding_size, 4 * config.image_embedding_size, generator=gen)
    return {"coords": coords, "labels": labels, "boxes": corners.reshape(n, 4), "masks": masks}


@torch.no_grad()
def test_image_encoder_matches(pair):
    config, original, ours = pair
    x = torch.randn(2, 3, config.image_size, config.image_size, generator=torch.Generator().manual_seed(2))
    expected = original.image_encoder(x)
    assert expected.shape == (2, config.prompt_embed_dim, config.image_embedding_size, config.image_embedding_size)
    _close(ours.image_encoder(x), expected)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["points", "points+boxes", "boxes", "masks", "points+masks", "none"])
def test_prompt_encoder_matches(pair, kind):
    config, original, ours = pair
    p = _prompts(config)
    args = {
        "points": (p["coords"], p["labels"]) if "points" in kind else None,
        "boxes": p["boxes"] if "boxes" in kind else None,
        "masks": p["masks"] if "masks" in kind else None,
    }
    sparse_ref, dense_ref = original.prompt_encoder(**args)
    sparse, dense = ours.prompt_encoder(**args)
    _close(sparse, sparse_ref)
    _close(dense, dense_ref)
    _close(ours.prompt_encoder.get_dense_pe(), original.prompt_encoder.get_dense_pe())


@torch.no_grad()
@pytest.mark.parametrize("multimask", [True, False])
def test_mask_decoder_matches(pair, multimask):
    config, original, ours = pair
    p = _prompts(config)
    gen = torch.Generator().manual_seed(3)
    grid = config.image_embedding_size
    image_embeddings = torch.randn(1, config.prompt_embed_dim, grid, grid, generator=gen)
    sparse, dense = original.prompt_encoder(points=(p["coords"], p["labels"]), boxes=p["boxes"], masks=p["masks"])
    args = {
        "image_embeddings": image_embeddings,
        "image_pe": original.prompt_encoder.get_dense_pe(),
        "sparse_prompt_embeddings": sparse,
        "dense_prompt_embeddings": dense,
        "multimask_output": multimask,
    }
    masks_ref, iou_ref = original.mask_decoder(**args)
    masks, iou = ours.mask_decoder(**args)
    n_out = config.num_multimask_outputs if multimask else 1
    assert masks.shape == (3, n_out, 4 * grid, 4 * grid) and iou.shape == (3, n_out)
    _close(masks, masks_ref)
    _close(iou, iou_ref)
    # One embedding per prompt gives the same answer as one shared embedding.
    per_prompt = {**args, "image_embeddings": image_embeddings.expand(3, -1, -1, -1)}
    _close(ours.mask_decoder(**per_prompt)[0], masks_ref)


@torch.no_grad()
def test_pre_and_postprocess_match(pair):
    config, original, ours = pair
    gen = torch.Generator().manual_seed(4)
    s = config.image_size
    image = torch.rand(3, s * 3 // 4, s, generator=gen) * 255
    _close(ours.preprocess(image), original.preprocess(image))
    low_res = torch.randn(2, 3, 4 * config.image_embedding_size, 4 * config.image_embedding_size, generator=gen)
    for input_size, original_size in [((s * 3 // 4, s), (45, 60)), ((s, s // 2), (300, 150))]:
        _close(
            ours.postprocess_masks(low_res, input_size, original_size),
            original.postprocess_masks(low_res, input_size, original_size),
        )


@torch.no_grad()
def test_end_to_end_matches_original_forward(pair):
    """The original Sam.forward (preprocess, encode, prompt, decode, postprocess, threshold)."""
    config, original, ours = pair
    p = _prompts(config)
    s = config.image_size
    image = torch.rand(3, s, s * 3 // 4, generator=torch.Generator().manual_seed(5)) * 255
    record = {
        "image": image,
        "original_size": (100, 75),
        "point_coords": p["coords"],
        "point_labels": p["labels"],
        "boxes": p["boxes"],
    }
    ref = original([record], multimask_output=True)[0]

    embedding = ours.image_encoder(ours.preprocess(image)[None])
    sparse, dense = ours.prompt_encoder((p["coords"], p["labels"]), p["boxes"], None)
    low_res, iou = ours.mask_decoder(embedding, ours.prompt_encoder.get_dense_pe(), sparse, dense, True)
    masks = ours.postprocess_masks(low_res, image.shape[-2:], (100, 75))
    _close(low_res, ref["low_res_logits"])
    _close(iou, ref["iou_predictions"])
    # Thresholded masks may only differ where the logit is within rounding of the threshold.
    differ = (masks > ours.mask_threshold) != ref["masks"]
    assert (masks[differ].abs() < 1e-4).all()


@pytest.mark.parametrize("name", sorted(SAM_PRESETS))
def test_presets_match_official_state_dicts(name):
    """Parameter names and shapes of the official vit_b/l/h (built on the meta device: no memory)."""
    sa = import_segment_anything()
    with torch.device("meta"):
        original = sa.sam_model_registry[name]()
        ours = build_sam(name)
    expected = {k: tuple(v.shape) for k, v in original.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == expected
    assert config_from_state_dict(original.state_dict()) is SAM_PRESETS[name]


def test_load_checkpoint_infers_architecture(tmp_path):
    torch.manual_seed(0)
    source = build_original_sam(TINY)
    randomize_(source)
    path = tmp_path / "sam_vit_h_4b8939.pth"  # a misleading name: the shapes decide
    torch.save(source.state_dict(), path)
    model = load_sam_checkpoint(path)
    assert model.config.same_shapes(TINY) and model.config.name == "custom"
    assert not model.training and all(not t.is_meta for t in [*model.parameters(), *model.buffers()])
    x = torch.randn(1, 3, TINY.image_size, TINY.image_size)
    with torch.no_grad():
        _close(model.image_encoder(x), source.image_encoder(x))
        _close(model.preprocess(x * 255), source.preprocess(x * 255))


def test_load_checkpoint_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_sam_checkpoint(tmp_path / "missing.pth")
    not_sam = tmp_path / "not_sam.pth"
    torch.save({"weight": torch.randn(3, 3), "bias": torch.randn(3)}, not_sam)
    with pytest.raises(UserError, match="not a Segment Anything checkpoint"):
        load_sam_checkpoint(not_sam)
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="cannot read") as error:
        load_sam_checkpoint(garbage)
    # what torch met, on one line, without its advice to unpickle with code (weights_only=False)
    assert "Unsupported operand" in str(error.value) and "weights_only" not in str(error.value)
    assert "\n" not in str(error.value)
    partial_sd = tmp_path / "partial.pth"
    sd = build_sam(TINY).state_dict()
    torch.save({k: v for k, v in sd.items() if not k.startswith("mask_decoder")}, partial_sd)
    with pytest.raises(UserError, match="not a complete Segment Anything checkpoint"):
        load_sam_checkpoint(partial_sd)
    tiny = tmp_path / "tiny.pth"
    torch.save(sd, tiny)
    with pytest.raises(UserError, match="does not match the custom architecture"):
        load_sam_checkpoint(tiny, config=TINY_B)


def test_transforms_match_original():
    import_segment_anything()
    from segment_anything.utils.transforms import ResizeLongestSide as OriginalResize

    ours, ref = ResizeLongestSide(1024), OriginalResize(1024)
    for size in [(480, 640), (1200, 800), (333, 1024), (7, 5)]:
        assert ours.get_preprocess_shape(*size, 1024) == ref.get_preprocess_shape(*size, 1024)
    gen = torch.Generator().manual_seed(6)
    coords, boxes = torch.rand(4, 3, 2, generator=gen) * 600, torch.rand(5, 4, generator=gen) * 600
    for size in [(480, 640), (777, 333)]:
        assert torch.equal(ours.apply_coords_torch(coords, size), ref.apply_coords_torch(coords, size))
        assert torch.equal(ours.apply_boxes_torch(boxes, size), ref.apply_boxes_torch(boxes, size))
        assert (ours.apply_coords(coords.numpy(), size) == ref.apply_coords(coords.numpy(), size)).all()
        assert (ours.apply_boxes(boxes.numpy(), size) == ref.apply_boxes(boxes.numpy(), size)).all()
    # The original sizes tensors from shape[0:2] (batch, channels); ours from H and W.
    image = torch.rand(2, 3, 48, 64, generator=gen) * 255
    resized = ours.apply_image_torch(image)
    expected = torch.nn.functional.interpolate(image, (768, 1024), mode="bilinear", antialias=True)
    assert resized.shape == (2, 3, 768, 1024) and torch.equal(resized, expected)
    as_uint8 = ours.apply_image(image[0].permute(1, 2, 0).round().to(torch.uint8).numpy())
    assert as_uint8.shape == (768, 1024, 3) and as_uint8.dtype.name == "uint8"


@pytest.mark.slow
@torch.no_grad()
def test_vit_b_at_real_size_matches_original():
    """The official vit_b architecture at 1024 x 1024 (random weights): image embedding, low-res
    masks and IoU predictions of the original's modules, in fp32 (its encoder runs once: the
    decoder's reference reads its embedding, as the original's Sam.forward does)."""
    from genfast.sam.build import build_random_sam

    ours = build_random_sam("vit_b")
    original = build_original_sam(SAM_PRESETS["vit_b"])
    original.load_state_dict(ours.state_dict(), strict=True)
    image = torch.rand(3, 1024, 768, generator=torch.Generator().manual_seed(5)) * 255
    point, label = torch.tensor([[[400.0, 300.0]]]), torch.tensor([[1]])
    expected_embedding = original.image_encoder(original.preprocess(image[None]))
    embedding = ours.image_encoder(ours.preprocess(image)[None])
    _close(embedding, expected_embedding, rel=1e-4)
    ref_sparse, ref_dense = original.prompt_encoder(points=(point, label), boxes=None, masks=None)
    ref_low_res, ref_iou = original.mask_decoder(
        image_embeddings=expected_embedding,
        image_pe=original.prompt_encoder.get_dense_pe(),
        sparse_prompt_embeddings=ref_sparse,
        dense_prompt_embeddings=ref_dense,
        multimask_output=True,
    )
    sparse, dense = ours.prompt_encoder((point, label), None, None)
    low_res, iou = ours.mask_decoder(embedding, ours.prompt_encoder.get_dense_pe(), sparse, dense, True)
    _close(low_res, ref_low_res, rel=1e-4)
    _close(iou, ref_iou, rel=1e-4)


@torch.no_grad()
@pytest.mark.parametrize(
    "q_batch,k_batch,queries,keys,absorbed",
    [
        (3, 3, 4, 50, "few_queries"),  # tokens -> image, one image per prompt
        (1, 1, 4, 50, "few_queries"),  # a single prompt
        (3, 1, 6, 50, None),  # a batch over one image: its projections once, not absorbed
        (3, 3, 50, 4, "few_keys"),  # image -> tokens, query projection absorbed too
        (1, 3, 50, 4, "few_keys"),  # one image's queries for three prompts: projected once
        (2, 2, 40, 30, None),  # many tokens on both sides
    ],
)
def test_absorbed_projections_match_plain_attention(monkeypatch, q_batch, k_batch, queries, keys, absorbed):
    """The decoder's attention with its projections absorbed into the few tokens' side equals the
    plain one (float64, so up to rounding only), and is taken exactly where it saves FLOPs."""
    from genfast.sam.modeling import transformer

    torch.manual_seed(0)
    module = transformer.Attention(dim=64, num_heads=2, downsample_rate=2).double()  # 2 heads x 16
    for p in module.parameters():
        p.normal_(0, 0.3)
    q = torch.randn(q_batch, queries, 64, dtype=torch.float64)
    k = torch.randn(k_batch, keys, 64, dtype=torch.float64)
    v = torch.randn(k_batch, keys, 64, dtype=torch.float64)
    module.attention_impl = "math"
    plain = module(q, k, v)
    taken = []
    for name in ("_few_queries", "_few_keys"):
        method = getattr(transformer.Attention, name)
        recorded = lambda self, *a, m=method, n=name: taken.append(n) or m(self, *a)  # noqa: E731
        monkeypatch.setattr(transformer.Attention, name, recorded)
    module.attention_impl = "fused"
    fused = module(q, k, v)
    assert taken == ([f"_{absorbed}"] if absorbed else [])
    assert fused.shape == plain.shape == (max(q_batch, k_batch), queries, 64)
    torch.testing.assert_close(fused, plain, rtol=1e-10, atol=1e-10)
