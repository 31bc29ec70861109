"""Mixture-of-experts MLPs (genfast/llm/model/moe.py): the grouped expert matmuls read only the experts
their rows use, in every weight format; decode bytes count the active experts; quantized
checkpoints, GGUF expert blocks, GPTQ, batching and speculative decoding work on MoE models.
(Logits, CLI, compile, quantization budgets for Mixtral and Qwen3-MoE: tests/llm/model/test_families.py;
TP: tests/llm/test_tensor_parallel.py.)"""

from __future__ import annotations

import pytest
import torch

from genfast.cli import main
from genfast.kernels.linear_few_rows.ops import unavailable_reason as few_rows_unavailable_reason
from genfast.kernels.qlinear import ops as packing
from genfast.llm.checkpoints.checkpoint import Checkpoint
from genfast.llm.checkpoints.quantize import quantize_loaded
from genfast.llm.checkpoints.weights import gguf_quantized_linears, load_model
from genfast.llm.decoding.drafters import LayerDrafter
from genfast.llm.decoding.generate import Generator
from genfast.llm.decoding.speculative import SpeculativeGenerator
from genfast.llm.decoding.stats import weight_bytes_per_step
from genfast.llm.loading import load
from genfast.llm.model.config import ModelArgs
from genfast.llm.model.transformer import describe_size, parameter_counts
from genfast.nn import ExpertLinear
from genfast.quant.grids import quantize
from genfast.quant.linear import QuantExpertLinear, expert_qlinear_dequantized
from tests.llm.gguf_fixtures import write_gguf_from_hf
from tests.llm.hf_fixtures import make_hf_model, save_hf_model, word_tokenizer

N_EXPERTS, IN, OUT = 5, 64, 48
USED = (1, 3)  # the experts the rows pick; the others are poisoned with NaN


def _rows(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    experts = torch.tensor(USED)[torch.randint(0, len(USED), (n,), generator=g)]
    return torch.randn(n, IN, generator=g), experts


def _reference(x: torch.Tensor, experts: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.stack([weight[e].float() @ row for row, e in zip(x, experts.tolist(), strict=True)])


@pytest.mark.parametrize("kind", ["fp32", "bf16-weights", "int8", "int4", "int4-dequantized"])
@pytest.mark.parametrize("n_rows", [1, 2, 9])  # a decode row, a few rows, a prefill's grouped rows
def test_expert_linear_uses_only_each_rows_expert(kind, n_rows):
    """Each row times its own expert's weight, within the format's tolerance; experts no row
    picks hold NaN, so reading any of them would show in the output."""
    if kind == "bf16-weights" and few_rows_unavailable_reason() and n_rows <= 5:
        pytest.skip(few_rows_unavailable_reason())
    if kind in ("int8", "int4") and not packing.available():
        pytest.skip(packing.unavailable_reason())
    x, experts = _rows(n_rows)
    weight = torch.randn(N_EXPERTS, OUT, IN, generator=torch.Generator().manual_seed(0))
    unused = [e for e in range(N_EXPERTS) if e not in USED]
    if kind in ("fp32", "bf16-weights"):
        layer = ExpertLinear(N_EXPERTS, IN, OUT)
        layer.weight = torch.nn.Parameter(weight.to(torch.bfloat16 if kind == "bf16-weights" else torch.float32))
        want = _reference(x, experts, layer.weight)
        with torch.no_grad():
            layer.weight[unused] = float("nan")
            got = layer(x, experts)
        tolerance = 1e-5 if kind == "fp32" else 0.02  # the kernel may round rows to bf16 (AVX512-BF16)
    else:
        qw = quantize(weight, 8 if kind == "int8" else 4, None if kind == "int8" else 32)
        want = _reference(x, experts, qw.dequantize())
        qw.scales[unused] = float("nan")
        if kind == "int4-dequantized":  # the path without a native kernel, on its storage form
            codes = qw.codes[..., 0::2] | (qw.codes[..., 1::2] << 4)
            got = expert_qlinear_dequantized(x, experts, codes, qw.scales, qw.mins, 4, 32)
            tolerance = 1e-5
        else:
            got = QuantExpertLinear(qw)(x, experts)
            tolerance = 0.02  # the kernel quantizes activations to int8 per block of 32
    assert got.shape == (n_rows, OUT) and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=tolerance * want.abs().max().item(), rtol=0)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict:
    dirs = {}
    for name in ("mixtral", "qwen3_moe"):
        hf = make_hf_model(name)
        dirs[name] = save_hf_model(hf, tmp_path_factory.mktemp(name) / name)
        word_tokenizer(hf.config.vocab_size).save(dirs[name])
        dirs[f"{name}-hf"] = hf
    return dirs


def test_decode_bytes_count_only_the_active_experts(moe_dirs):
    checkpoint = Checkpoint.open(moe_dirs["qwen3_moe"])
    model = load_model(checkpoint)
    a = model.args
    moe_layers = sum(a.is_moe_layer(i) for i in range(a.n_layers))
    experts = moe_layers * a.n_experts * 3 * a.dim * a.expert_intermediate_size * 4  # fp32 bytes, all experts
    # Untied: the input embedding is only looked up.
    everything = sum(p.nbytes for p in model.parameters()) - model.tok_embeddings.weight.nbytes
    assert weight_bytes_per_step(model) == everything - experts + experts * a.n_active_experts // a.n_experts
    # A batch of 3 runs at most 9 of the 8 experts: all of them.
    assert weight_bytes_per_step(model, batch_size=3) == everything
    quantize_loaded(checkpoint, model, 8, None)
    stacks = [m for m in model.modules() if isinstance(m, QuantExpertLinear)]
    stacked = sum(m.packed.nbytes if m.native else m.codes.nbytes + 2 * m.scales.nbytes for m in stacks)
    assert weight_bytes_per_step(model, 3) - weight_bytes_per_step(model) == stacked - stacked * 3 // 8


def test_parameter_count_includes_every_expert():
    # (Every family's count against transformers' checkpoint: tests/llm/model/test_config.py.)
    # Qwen3-30B-A3B's config.json; its model card says 30.5B parameters (29.9B without the
    # embedding and the head) and "3.3B activated": 3.35B, embedding and head included.
    qwen3_30b_a3b = ModelArgs(
        vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, intermediate_size=6144, head_dim=128,
        family="qwen3_moe", n_experts=128, n_active_experts=8, expert_intermediate_size=768,
    )  # fmt: skip
    assert parameter_counts(qwen3_30b_a3b)[0] - 2 * 151936 * 2048 == pytest.approx(29.9e9, abs=0.05e9)
    assert parameter_counts(qwen3_30b_a3b)[1] == pytest.approx(3.35e9, abs=0.005e9)
    assert describe_size(qwen3_30b_a3b) == "30.5B parameters, 3.4B active (8 of 128 experts)"


def test_quantized_directory_of_a_moe_model_loads_to_the_same_model(moe_dirs, tmp_path, capsys):
    out = tmp_path / "q"
    argv = ["quantize", "-m", str(moe_dirs["qwen3_moe"]), "--mode", "int4", "-o", str(out), "--dtype", "float32"]
    assert main(argv) == 0
    saved = load(str(out), "cpu", "float32").model
    on_the_fly = load(str(moe_dirs["qwen3_moe"]), "cpu", "float32", quant="int4").model
    assert (
        isinstance(saved.layers[0].feed_forward.w13, QuantExpertLinear) and saved.layers[0].feed_forward.w13.bits == 4
    )
    want, got = on_the_fly.state_dict(), saved.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_gptq_quantizes_the_experts_round_to_nearest(moe_dirs, tmp_path, capsys):
    out = tmp_path / "q"
    argv = ["quantize", "-m", str(moe_dirs["mixtral"]), "--mode", "int4-gptq", "-o", str(out),
            "--calibration-windows", "2", "--calibration-window", "32"]  # fmt: skip
    assert main(argv) == 0
    assert "experts are quantized round-to-nearest" in capsys.readouterr().err
    model = load(str(out), "cpu", "float32").model
    rtn = load(str(moe_dirs["mixtral"]), "cpu", "float32", quant="int4").model
    ff, attention = model.layers[1].feed_forward, model.layers[1].attention
    assert torch.equal(ff.w2.quantized_weight().codes, rtn.layers[1].feed_forward.w2.quantized_weight().codes)
    assert not torch.equal(
        attention.wqkv.quantized_weight().codes, rtn.layers[1].attention.wqkv.quantized_weight().codes
    )


@pytest.mark.parametrize("qtype,bits", [("Q8_0", 8), ("Q4_0", 4)])
def test_gguf_expert_blocks_load_without_requantization(moe_dirs, qtype, bits, tmp_path):
    path = write_gguf_from_hf(moe_dirs["mixtral-hf"], tmp_path / "m.gguf", arch="llama", qtype=qtype)
    checkpoint = Checkpoint.open(path)
    direct = gguf_quantized_linears(checkpoint, bits)
    model = load_model(checkpoint)
    for i in range(model.args.n_layers):
        for module in ("feed_forward.w13", "feed_forward.w2"):
            qw = direct[f"layers.{i}.{module}"]
            want = model.get_submodule(f"layers.{i}.{module}").weight
            assert qw.codes.dim() == 3 and qw.bits == bits
            torch.testing.assert_close(qw.dequantize(), want, atol=1e-6 * want.abs().max().item(), rtol=0)
    loaded = load(str(path), "cpu", "float32", quant=f"int{bits}").model
    w13 = loaded.layers[0].feed_forward.w13
    assert torch.equal(w13.quantized_weight().codes, direct["layers.0.feed_forward.w13"].codes)


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_batched_and_speculative_decoding_equal_one_sequence_at_a_time(moe_dirs, quant):
    """Several rows per expert (a batch; a speculative verification pass of k + 1 tokens) give
    the tokens of plain one-row decoding."""
    loaded = load(str(moe_dirs["qwen3_moe"]), "cpu", "float32", quant=quant)
    plain = Generator(loaded.model, loaded.tokenizer, max_seq_len=64, compile=False)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    want = [plain.generate([p], 12, stop_at_eos=False).token_ids[0] for p in prompts]
    batched = Generator(loaded.model, loaded.tokenizer, max_seq_len=64, max_batch_size=2, compile=False)
    assert batched.generate(prompts, 12, stop_at_eos=False).token_ids == want
    spec = SpeculativeGenerator(loaded.model, loaded.tokenizer, LayerDrafter(1), k=3, max_seq_len=64, compile=False)
    assert spec.generate([prompts[0]], 12, stop_at_eos=False).token_ids[0] == want[0]


@pytest.mark.skipif(few_rows_unavailable_reason() is not None, reason=str(few_rows_unavailable_reason()))
def test_a_batch_invariant_router_keeps_an_fp32_routers_precision_and_each_rows_logits():
    """Batch-invariant mode computes the router's logits by the few-row kernel, which takes bf16
    weights: an fp32 router goes in as two bf16 parts, so its logits stay within fp32-like error
    (bf16 alone would be ~1e-2), and a row's logits do not depend on the rows beside it."""
    from genfast.kernels.linear_few_rows.ops import KERNEL
    from genfast.llm.model.moe import Router

    torch.manual_seed(0)
    router = Router(64, 8, 2, normalize=True)
    torch.nn.init.normal_(router.weight)
    router.batch_invariant = True
    x = torch.randn(9, 64)
    logits = router.logits(x)
    rows = x.bfloat16() if KERNEL.loaded_isa() == "avx512" else x  # AVX-512's products are bf16 x bf16
    want = rows.double() @ router.weight.double().t()
    torch.testing.assert_close(logits.double(), want, atol=1e-3, rtol=1e-4)
    assert all(torch.equal(router.logits(x[i : i + 1]), logits[i : i + 1]) for i in range(9))
