"""The LLM path on a CUDA GPU: logits against the CPU in fp32, compiled (CUDA graphs) against
eager, the int8/int4 kernels (genfast's Triton ones, torch's) against the dequantized weights, no
host syncs in the decode loop, speculative decoding and the serving engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from genfast.llm.decoding.sampling import SamplingParams
from genfast.quant.grids import quantize
from genfast.quant.linear import QuantLinear
from tests.cuda.syncs import host_syncs, needs_cuda
from tests.llm.hf_fixtures import TINY_CONFIGS, hf_model_from_config, save_hf_model, word_tokenizer

pytestmark = needs_cuda

# llama3's tiny config widened so every linear fits tinygemm's tiles (K a multiple of 128).
CONFIG = dict(
    TINY_CONFIGS["llama3"], vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512,
)  # fmt: skip
PROMPT = [5, 17, 99, 3, 250, 7, 41, 300, 12, 8]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = save_hf_model(hf_model_from_config(CONFIG), tmp_path_factory.mktemp("cuda-llm"))
    word_tokenizer(CONFIG["vocab_size"]).save(directory)
    return directory


def load(directory: Path, device: str, dtype: str, quant: str = "none"):
    from genfast.llm.loading import load as load_model

    return load_model(str(directory), device, dtype, quant=quant)


def generator(loaded, compile: bool, draft: str | None = None, batch: int = 1):
    from genfast.llm.recipe import make_generator

    return make_generator(loaded, 256, batch, compile, draft, 4 if draft else None)


def logits(loaded, tokens: list[int]) -> torch.Tensor:
    from genfast.llm.model.transformer import attention_mask

    model = loaded.model
    model.setup_caches(1, 64)
    ids = torch.tensor([tokens], device=loaded.device)
    pos = torch.arange(len(tokens), device=loaded.device)
    with torch.inference_mode():
        return model(ids, pos, attention_mask(pos, len(tokens))).float().cpu()


@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_logits_match_the_cpu_in_fp32(model_dir, dtype, tolerance):
    want = logits(load(model_dir, "cpu", "float32"), PROMPT)
    got = logits(load(model_dir, "cuda", dtype), PROMPT)
    assert ((got - want).norm() / want.norm()).item() < tolerance


def test_compiled_decode_with_cuda_graphs_matches_eager_and_prefill_does_not_recompile(model_dir):
    from torch._dynamo.utils import counters

    loaded = load(model_dir, "cuda", "bfloat16")
    eager = generator(loaded, compile=False).generate([PROMPT], 40, stop_at_eos=False).token_ids
    compiled = generator(load(model_dir, "cuda", "bfloat16"), compile=True)
    assert compiled.generate([PROMPT], 40, stop_at_eos=False).token_ids == eager
    graphs = counters["stats"]["unique_graphs"]
    for n in (3, 17, 33):  # other prompt lengths: the same graphs
        compiled.generate([(PROMPT * 4)[:n]], 8, stop_at_eos=False)
    assert counters["stats"]["unique_graphs"] == graphs
    assert counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_a_quantized_prefill_compiles_once_for_every_prompt_length(model_dir, quant):
    """The few-row kernels are picked by the row count (Triton's 16, 32 and 64 rows, tinygemm's 16):
    a compiled prefill, whose length is dynamic, must not guard on it (QuantLinear: rows_at_most)."""
    from torch._dynamo.utils import counters

    compiled = generator(load(model_dir, "cuda", "bfloat16", quant), compile=True)
    compiled.generate([PROMPT], 4, stop_at_eos=False)
    graphs = counters["stats"]["unique_graphs"]
    for n in (3, 17, 33, 80):
        compiled.generate([(PROMPT * 8)[:n]], 4, stop_at_eos=False)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("compile", [False, True])
def test_the_decode_loop_does_not_synchronize(model_dir, compile):
    gen = generator(load(model_dir, "cuda", "bfloat16"), compile=compile)
    for _ in range(2):  # compile, record the CUDA graphs
        want = gen.generate([PROMPT], 24, stop_at_eos=False).token_ids
    with host_syncs() as syncs:
        got = gen.generate([PROMPT], 24, stop_at_eos=False).token_ids
    assert got == want
    assert syncs == [], f"{len(syncs)} host syncs in generate(): {syncs[:3]}"


def check_rows(layer, compiled, reference: torch.Tensor, dtypes) -> None:
    for dtype, rows in ((d, r) for d in dtypes for r in (1, 5, 20, 64, 100)):  # each few-row BLOCK_M
        x = torch.randn(rows, reference.shape[1], device="cuda", dtype=dtype)
        want = F.linear(x.double(), reference)
        for fn in (layer, compiled):
            got = fn(x)
            assert got.dtype == dtype
            error = ((got.double() - want).norm() / want.norm()).item()
            assert error < (1e-5 if dtype == torch.float32 else 1e-2), (dtype, rows, fn, error)


@pytest.mark.parametrize(
    "bits,group,kernel,k",
    [(8, None, "triton", 512), (4, 32, "triton", 2048), (4, 128, "triton", 512), (8, 64, "triton", 384),
     (8, None, "int8pack", 512), (4, 32, "int4pack", 512)],
)  # fmt: skip
def test_cuda_kernels_match_the_dequantized_weight(bits, group, kernel, k):
    """Each width takes its own one-row block sizes (triton.qlinear.gemv_config): int4 at 2048 the
    1024-column sub-blocks, at 512 the 256-column ones with K split; int8 at 384 the split ones.
    The few-row kernel runs with each of its BLOCK_M sizes (gemm_config; int4 with K split)."""
    torch.manual_seed(0)
    weight = torch.randn(392, k, device="cuda") * 0.05  # 392 rows: not a whole number of blocks
    qweight = quantize(weight, bits, group)
    layer = QuantLinear(qweight, kernel=kernel)
    reference = qweight.dequantize(torch.float64)
    # The canonical form reads back exactly (int4pack: unpacked from tinygemm's layout).
    back = layer.quantized_weight()
    assert torch.equal(back.codes, qweight.codes) and torch.equal(back.scales, qweight.scales)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    dtypes = (torch.bfloat16, torch.float32) if kernel == "triton" else (torch.bfloat16,)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=16):  # a graph per row count and dtype
        check_rows(layer, compiled, reference, dtypes)
    if kernel == "triton":
        # eager and compiled take the same block sizes for a shape: the same summation order, the same bits
        from genfast.kernels.triton.qlinear import qlinear

        args = (layer.codes, layer.scales, layer.mins, bits, layer.group_size)
        op = torch.compile(lambda x: torch.ops.genfast.qlinear_triton(x, *args), fullgraph=True)
        for rows in (1, 5):  # 5: the few-row kernel, K split for int4
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            assert torch.equal(qlinear(x, *args), op(x))
        # the one-row candidate with the minima's part from x's sums (X_SUMS), compiled for the GPU
        from genfast.kernels.triton.qlinear import gemv_config

        x = torch.randn(1, k, device="cuda", dtype=torch.float32)
        got = qlinear(x, *args, {**gemv_config(392, k, bits), "X_SUMS": 1})
        want = x.double() @ reference.t()
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-5


def test_int4_runs_tinygemm_with_bf16_activations_and_triton_otherwise():
    """tinygemm beat the Triton GEMV for int4 in a compiled 7B-shape decode step (docs/performance.md)."""
    from genfast.quant.linear import choose_kernel

    weight = torch.randn(256, 512, device="cuda")
    assert choose_kernel(quantize(weight, 4, 32), False, torch.bfloat16) == "int4pack"
    assert choose_kernel(quantize(weight, 4, 128), False, torch.bfloat16) == "int4pack"
    assert choose_kernel(quantize(weight, 4, 32), False, torch.float32) == "triton"
    assert choose_kernel(quantize(weight, 4, 32), False, None) == "triton"
    assert choose_kernel(quantize(weight, 8, None), False, torch.bfloat16) == "triton"
    assert choose_kernel(quantize(weight[:100], 4, 32), False, torch.bfloat16) == "triton"  # rows: not tiles of 8
    linear = torch.nn.Linear(512, 256, device="cuda", dtype=torch.bfloat16)
    assert QuantLinear.from_linear(linear, 4, 32).kernel == "int4pack"


def test_tinygemm_packs_as_genfast_reads_it():
    """genfast packs and unpacks tinygemm's layout itself (genfast/quant/tinygemm.py, checked on
    the CPU against a transcription of aten's kernel): here against aten's own op."""
    from genfast.quant import tinygemm

    assert tinygemm.layout_matches(torch.device("cuda", torch.cuda.current_device()))
    codes = torch.randint(0, 16, (392, 1024), dtype=torch.uint8, device="cuda")
    for tiles in (2, 4, 8):
        theirs = torch.ops.aten._convert_weight_to_int4pack(tinygemm.aten_bytes(codes), tiles)
        assert torch.equal(theirs, tinygemm.pack(codes, tiles)) and torch.equal(tinygemm.unpack(theirs), codes)


def test_a_bf16_int4_model_runs_tinygemm_and_its_prefill_dequantizes(model_dir):
    """The default CUDA int4 path end to end: the blocks on tinygemm for a few rows, a longer
    prompt through the dequantized weight and cuBLAS, the int8 head on Triton. The two agree on
    the same positions within bf16's rounding (tinygemm's grid is bf16, the dequantized weight's
    fp16), and the compiled model generates."""
    from genfast.llm.model.transformer import attention_mask

    loaded = load(model_dir, "cuda", "bfloat16", "int4")
    kernels = {(m.bits, m.kernel) for m in loaded.model.modules() if isinstance(m, QuantLinear)}
    assert kernels == {(4, "int4pack"), (8, "triton")}
    model = loaded.model
    model.setup_caches(1, 64)

    def all_logits(tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens], device="cuda")
        pos = torch.arange(len(tokens), device="cuda")
        with torch.inference_mode():
            return model(ids, pos, attention_mask(pos, len(tokens)), all_logits=True)[0].float()

    few = all_logits(PROMPT)  # 10 rows: tinygemm
    many = all_logits(PROMPT * 3)[: len(PROMPT)]  # 30 rows: dequantized
    assert ((few - many).norm() / few.norm()).item() < 3e-2
    compiled = generator(load(model_dir, "cuda", "bfloat16", "int4"), compile=True)
    assert len(compiled.generate([PROMPT], 8, stop_at_eos=False).token_ids[0]) == 8


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_models_compiled_match_eager(model_dir, quant):
    """In fp32: compiled bf16 code rounds differently from eager (inductor fuses the norms and
    rotary embedding), which flipped a near-tie of this random model's int4 logits at the fifth
    token on an H200; the Triton kernels' own agreement is checked per kernel above."""
    from torch._dynamo.utils import counters

    eager = generator(load(model_dir, "cuda", "float32", quant), compile=False)
    compiled = generator(load(model_dir, "cuda", "float32", quant), compile=True)
    kernels = {m.kernel for m in compiled.model.modules() if isinstance(m, QuantLinear)}
    assert kernels == {"triton"}
    want = eager.generate([PROMPT], 32, stop_at_eos=False).token_ids
    counters.clear()
    assert compiled.generate([PROMPT], 32, stop_at_eos=False).token_ids == want
    # The Triton kernels are captured in the decode step's CUDA graph, not launched around it.
    assert counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.parametrize("draft", ["int4", "layers:1", "prompt-lookup"])
def test_speculative_decoding_gives_the_plain_greedy_tokens(model_dir, draft):
    want = generator(load(model_dir, "cuda", "bfloat16"), compile=True).generate([PROMPT], 40, stop_at_eos=False)
    spec = generator(load(model_dir, "cuda", "bfloat16"), compile=True, draft=draft)
    got = spec.generate([PROMPT], 40, stop_at_eos=False)
    assert got.token_ids == want.token_ids


def test_batched_generation_matches_single_sequences(model_dir):
    """In fp32: bf16 GEMMs of other batch sizes round differently, which flips near-ties of
    this random model's logits."""
    prompts = [PROMPT, PROMPT[:4], [9, 8, 7, 6, 5, 4, 3]]
    single = generator(load(model_dir, "cuda", "float32"), compile=True)
    want = [single.generate([p], 16, stop_at_eos=False).token_ids[0] for p in prompts]
    batched = generator(load(model_dir, "cuda", "float32"), compile=True, batch=3)
    assert batched.generate(prompts, 16, stop_at_eos=False).token_ids == want


def test_gptq_on_the_gpu(model_dir):
    from genfast.llm.checkpoints.calibration import calibrate_gptq

    loaded = load(model_dir, "cuda", "float32")
    windows = torch.randint(0, CONFIG["vocab_size"], (8, 64))
    quantized = calibrate_gptq(loaded.model, windows, bits=4, group_size=32)
    assert quantized and all(q.codes.is_cuda for q in quantized.values())


def test_serve_engine_batches_requests_on_the_gpu(model_dir):
    pytest.importorskip("fastapi")
    from genfast.serve.engine import Engine, GenerationRequest
    from tests.serve.test_engine import run_concurrently

    # fp32: the engine's batched rows run other kernels than one sequence does, and in bf16 their
    # rounding flips the random model's near-ties (as it did for the compiled int4 model).
    prompts = [PROMPT, PROMPT[:4], [9, 8, 7, 6, 5, 4, 3]]
    single = generator(load(model_dir, "cuda", "float32"), compile=True)
    want = [single.generate([p], 12 + i, stop_at_eos=False).token_ids[0] for i, p in enumerate(prompts)]
    loaded = load(model_dir, "cuda", "float32")
    engine = Engine(loaded.model, loaded.tokenizer, max_batch=2, max_seq_len=256, compile=True).start()
    try:
        got = run_concurrently(engine, [GenerationRequest(tuple(p), 12 + i) for i, p in enumerate(prompts)])
    finally:
        engine.shutdown()
    assert [r.error for r in got] == [None] * 3  # (a failed decode step ends every running request)
    assert [r.token_ids for r in got] == want


def test_greedy_params_are_sync_free_samplers():
    """Sampling with temperature/top-k/top-p inside a compiled step on the GPU: no host reads."""
    from genfast.llm.decoding.sampling import sample

    logits = torch.randn(2, 512, device="cuda")
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
    sample(logits, params)
    with host_syncs() as syncs:
        sample(logits, params)
    assert syncs == []


def test_tensor_parallel_wants_a_gpu_per_rank(model_dir):
    """NCCL runs each rank on a GPU of its own. With fewer GPUs than ranks, `--tp 2 --device cuda`
    is refused in one line before any rank starts; `--device cpu` runs the ranks over gloo on the
    same machine (where join() must not claim a GPU per rank)."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "genfast", "generate", "w1 w2", "--model", str(model_dir), "--tp", "2",
            "--dtype", "float32", "--no-compile", "-n", "4", "--quiet"]  # fmt: skip
    on_cpu = subprocess.run([*argv, "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert on_cpu.returncode == 0 and on_cpu.stdout.strip(), on_cpu.stderr[-2000:]
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has a GPU per rank: NCCL's path runs (not checked here)")
    on_gpu = subprocess.run([*argv, "--device", "cuda"], capture_output=True, text=True, timeout=300)
    assert on_gpu.returncode == 2 and "Traceback" not in on_gpu.stderr, on_gpu.stderr[-2000:]
    assert on_gpu.stderr.strip().splitlines()[-1] == (
        "genfast: error: --tp 2 on CUDA runs each rank on a GPU of its own, but torch sees 1; "
        "use --device cpu to run the ranks on the CPU"
    )
