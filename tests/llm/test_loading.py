"""genfast.llm.loading.load: what `--dtype auto` means on this machine (and on others)."""

import pytest
import torch
import torch.nn.functional as F

from genfast.kernels.linear_few_rows.ops import unavailable_reason as few_rows_unavailable_reason
from genfast.llm.loading import load
from genfast.nn import Linear
from genfast.platform import hardware
from tests.cpus import ZEN4, pretend_cpu
from tests.llm.gguf_fixtures import write_gguf_from_hf
from tests.llm.hf_fixtures import make_hf_model


@pytest.fixture
def tiny_gguf(tmp_path):
    """A tiny random Qwen2 (q/k/v biases, output head tied to the embedding) as an F32 GGUF."""
    return str(write_gguf_from_hf(make_hf_model("qwen2"), tmp_path / "m.gguf", arch="qwen2"))


def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    model.setup_caches(1, 32)
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]), all_logits=True)[0]


@pytest.mark.skipif(
    hardware.has_native_bf16() or few_rows_unavailable_reason() is not None,
    reason="auto stores bf16 linear weights only where bf16 is emulated and the few-row kernel runs",
)
def test_auto_computes_in_fp32_on_bf16_stored_linear_weights_and_cache(tiny_gguf):
    auto, fp32 = load(tiny_gguf, "cpu", "auto"), load(tiny_gguf, "cpu", "float32")
    assert (auto.dtype, auto.weight_dtype) == (torch.float32, torch.bfloat16)
    assert auto.dtype_label() == "float32 (bfloat16 linear weights and KV cache)"
    linears = [m for m in auto.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert auto.model.tok_embeddings.weight is auto.model.output.weight  # still tied
    assert auto.model.norm.weight.dtype == torch.float32
    tokens = torch.randint(0, 100, (1, 12))
    # bf16 storage rounds each weight and cached key/value once: the bf16 budget (cosine >= 0.999
    # against fp32).
    assert F.cosine_similarity(logits(auto.model, tokens), logits(fp32.model, tokens), dim=-1).min() >= 0.999
    assert auto.model.layers[0].attention.kv_cache.k.dtype == torch.bfloat16
    assert fp32.weight_dtype is None and fp32.dtype_label() == "float32"
    assert fp32.model.layers[0].attention.kv_cache.k.dtype == torch.float32


def test_auto_is_bf16_throughout_where_the_cpu_has_native_bf16(tiny_gguf, monkeypatch):
    pretend_cpu(monkeypatch, ZEN4)
    loaded = load(tiny_gguf, "cpu", "auto")
    assert (loaded.dtype, loaded.weight_dtype) == (torch.bfloat16, None)
    assert loaded.model.output.weight.dtype == torch.bfloat16
