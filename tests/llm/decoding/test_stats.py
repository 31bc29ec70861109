"""Bytes per decode step, the numerator of MBU."""

import torch

from genfast.llm.decoding.stats import kv_bytes_per_slot, kv_bytes_read, weight_bytes_per_step
from genfast.llm.model.transformer import parameter_counts
from tests.llm.hf_fixtures import tiny_genfast_model


def test_tied_model_reads_every_parameter_once(tmp_path):
    _, model = tiny_genfast_model("smollm", tmp_path)
    model.setup_caches(1, 16)  # caches are not weights
    assert weight_bytes_per_step(model) == parameter_counts(model.args)[0] * 4


def test_untied_input_embedding_is_not_read_per_step(tmp_path):
    _, model = tiny_genfast_model("llama3", tmp_path)
    a = model.args
    assert weight_bytes_per_step(model) == (parameter_counts(a)[0] - a.vocab_size * a.dim) * 4
    model.setup_caches(1, 16)
    assert kv_bytes_per_slot(model) == 2 * a.n_layers * a.n_kv_heads * a.head_dim * 4


def test_int8_weights_count_one_byte_plus_scales(tmp_path):
    from genfast.kernels.qlinear import ops as kernels
    from genfast.quant.linear import quantize_linears

    _, model = tiny_genfast_model("smollm", tmp_path)
    model = model.to(torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    linear_params = sum(m.weight.numel() for m in linears)
    before = weight_bytes_per_step(model)
    quantize_linears(model, 8)
    # Every linear (the tied head included) goes from 2 bytes a weight to 1, plus an fp16 scale and
    # minimum per row (kernel layout: rows padded to 64, columns to 32); the bf16 embedding the head
    # shared is now only looked up, so it drops out.
    pad = (lambda n, m: -(-n // m) * m) if kernels.available() else (lambda n, m: n)
    quantized = sum(pad(m.out_features, 64) * (-(-m.in_features // 32) * 32 + 4) for m in linears)
    expected = before - linear_params * 2 + quantized
    assert weight_bytes_per_step(model) == expected


def test_sliding_window_layers_read_at_most_their_ring(tmp_path):
    from genfast.llm.model.layers import WINDOW_SLACK

    _, model = tiny_genfast_model("gemma2", tmp_path)  # window 6 on layers 0 and 2 of 3
    model.setup_caches(1, 128)
    a = model.args
    per_layer_slot = 2 * a.n_kv_heads * a.head_dim * 4
    assert kv_bytes_read(model, 20) == 3 * 20 * per_layer_slot  # within the ring: every layer alike
    ring = a.family_args.sliding_window + WINDOW_SLACK
    assert kv_bytes_read(model, 100) == (100 + 2 * ring) * per_layer_slot
