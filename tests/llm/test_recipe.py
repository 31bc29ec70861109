"""The LLM recipe (genfast/llm/recipe.py) and how --recipe, --dtype, --quant and --no-compile
combine into the settings a command loads with."""

from __future__ import annotations

import pytest
import torch

from genfast.errors import UserError
from genfast.llm.recipe import RECIPE, LlmSettings, plan
from tests.cpus import ZEN3, ZEN4, pretend_cpu


def test_steps_are_cumulative_and_flags_are_shorthands_on_top(monkeypatch):
    pretend_cpu(monkeypatch, ZEN4)
    assert plan("baseline", "cpu").settings == LlmSettings()
    assert plan("compile", "cpu").settings == LlmSettings(dtype="auto", compile=True)
    assert plan("int4", "cpu").settings == LlmSettings(dtype="auto", compile=True, quant="int4")
    assert plan("compile", "cpu", quant="int8").settings.quant == "int8"  # --quant
    assert plan("int8", "cpu", compile=False).settings == LlmSettings(dtype="auto", quant="int8")  # --no-compile
    assert plan("compile", "cpu", "bf16").settings.dtype == "bfloat16"  # aliases are resolved
    with pytest.raises(UserError, match="unknown --quant"):
        plan("compile", "cpu", quant="int3")
    with pytest.raises(UserError, match="unknown dtype"):
        plan("compile", "cpu", "int3")


def test_the_bf16_step_where_bf16_is_emulated(monkeypatch):
    """--dtype auto keeps bf16 weights with fp32 arithmetic (no note: the load line says so);
    an explicit bfloat16 runs, with a note that auto is faster; float32 leaves the step out."""
    pretend_cpu(monkeypatch, ZEN3)
    auto = plan("compile", "cpu")
    assert auto.settings.dtype == "auto" and not auto.notes and not auto.skipped
    explicit = plan("compile", "cpu", "bfloat16")
    assert explicit.notes == (("bf16", "bfloat16 arithmetic is emulated on this CPU: --dtype auto is faster"),)
    fp32 = plan("int8", "cpu", "float32")
    assert fp32.settings == LlmSettings(dtype="float32", compile=True, quant="int8")
    assert fp32.declined == (("bf16", "--dtype float32 asks for fp32 throughout"),) and not fp32.messages()
    with pytest.raises(UserError, match="step bf16 cannot run here: --dtype float32"):
        plan("bf16", "cpu", "float32")


def test_quantized_steps_say_when_they_are_slower_than_unquantized(monkeypatch):
    """Without a native kernel variant (GENFAST_ISA=none) int8/int4 dequantize on every call."""
    pretend_cpu(monkeypatch, ZEN4, isa_cap="none")
    ((step, note),) = plan("int8", "cpu").notes
    assert step == "int8" and "slow dequantize path" in note and "slower than unquantized" in note
    pretend_cpu(monkeypatch, ZEN4)
    assert not plan("int4", "cpu").notes


def test_quantized_steps_on_cuda_name_their_kernel_and_what_it_measured(monkeypatch):
    """On CUDA each quantized step says which kernel runs and what it measured; int4 with bf16
    activations is tinygemm with or without Triton (the device's type alone decides: no GPU here)."""
    import genfast.quant.linear as linear
    from genfast.recipe import Target

    bf16, fp32 = Target(torch.device("cuda"), "auto"), Target(torch.device("cuda"), "float32")
    monkeypatch.setattr(linear, "triton_available", lambda: True)
    assert "Triton GEMV: 1.26x compiled bf16" in RECIPE.step("int8").fallback(bf16)
    assert "tinygemm" in RECIPE.step("int4").fallback(bf16) and "1.68x" in RECIPE.step("int4").fallback(bf16)
    assert "0.7-0.8 TB/s" in RECIPE.step("int4").fallback(fp32)
    monkeypatch.setattr(linear, "triton_available", lambda: False)
    assert "tinygemm" in RECIPE.step("int4").fallback(bf16)
    for step, target in (("int8", bf16), ("int4", fp32)):
        assert "Triton is not installed" in RECIPE.step(step).fallback(target)
        assert "slower than unquantized" in RECIPE.step(step).fallback(target)
