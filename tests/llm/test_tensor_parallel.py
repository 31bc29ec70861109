"""Tensor parallelism: TP=2 (two gloo processes on this CPU) equals TP=1.

One pair of processes runs every case (a process group costs seconds to start). Per case, each
rank loads the tiny random model, quantizes it if asked, keeps its shard and records the logits
of a prompt and the greedy tokens of a generation; the test compares them with the unsharded
model in this process. Tolerance (fp32): the ranks split the sums of wo and w2 into two partial
sums, so only the order of additions changes: logits agree to atol = rtol = 1e-5, and the greedy
tokens exactly. Both ranks' results are identical bit for bit (same reduced sums everywhere).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from genfast.cli import main
from genfast.errors import UserError
from genfast.llm.checkpoints.checkpoint import Checkpoint
from genfast.llm.checkpoints.quantize import quantize_loaded
from genfast.llm.checkpoints.weights import load_model
from genfast.llm.decoding.generate import Generator
from genfast.llm.loading import load
from genfast.llm.tensor_parallel import (
    RowParallelLinear,
    check_devices,
    check_same_tokens,
    check_shardable,
    gpu_per_rank,
    launch_tp,
    leave,
    shard_model,
    tp_device,
)
from tests.llm.hf_fixtures import TINY_CONFIGS, make_hf_model, save_hf_model, word_tokenizer

WORLD = 2
NEW_TOKENS = 12
QUANTIZED_DIR = "qwen2-int4-directory"


@dataclass(frozen=True)
class Case:
    model: str  # a TINY_CONFIGS name
    quant: str = "none"
    compile: bool = False

    @property
    def key(self) -> str:
        return f"{self.model}-{self.quant}" + ("-compiled" if self.compile else "")


CASES = [
    Case("llama3"),  # GQA (4 q heads, 2 kv heads), untied head, Llama 3.1 rope
    Case("llama2_linear"),  # MHA with q/k/v and out biases (the out bias is added once, after the sum)
    Case("qwen2"),  # GQA with q/k/v bias, tied embeddings
    Case("qwen3"),  # per-head q/k norms (replicated on every rank), head_dim apart from dim / heads
    Case("phi3_longrope"),  # checkpoint-fused qkv and gate_up, LongRoPE past 16 tokens
    Case("gemma2"),  # four norms per block, soft-capping, a sliding window on even layers
    Case("gemma3"),  # q/k norms, local layers with their own rope base
    Case("qwen3_moe"),  # every expert's columns split, the router replicated; a dense layer between
    Case("mixtral", "int4"),  # quantized experts split in whole groups
    Case("qwen2", "int8"),  # per-channel scales: each rank's columns keep the row's scale
    Case("qwen2", "int4"),  # groups of 32: whole groups per rank
    Case(QUANTIZED_DIR),  # a `genfast quantize --mode int4` directory: its blocks are read as codes
    Case("smollm3"),  # a NoPE layer among rotary ones
    Case("granite"),  # its own attention scale and residual multiplier on every rank
    Case("glm4"),  # four norms per block, q/k rows reordered from interleaved pairs of half the head
    Case("exaone4"),  # post-norms (OLMo 2's block) with per-head q/k norms
]
# The functional all-reduce inside the compiled prefill and decode graphs (fullgraph): ~35 s of
# compiling on two cores, so in its own (slow) test.
COMPILED = Case("qwen2", compile=True)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp_models")
    dirs = {}
    for name in {c.model for c in CASES} - {QUANTIZED_DIR} | {COMPILED.model, "smollm"}:
        hf = make_hf_model(name)
        dirs[name] = save_hf_model(hf, root / name)
        word_tokenizer(hf.config.vocab_size).save(dirs[name])
    dirs[QUANTIZED_DIR] = root / QUANTIZED_DIR
    assert (
        main(
            [
                "quantize",
                "-m",
                str(dirs["qwen2"]),
                "--mode",
                "int4",
                "--dtype",
                "float32",
                "-o",
                str(dirs[QUANTIZED_DIR]),
            ]
        )
        == 0
    )
    return dirs


def prompt_for(path: Path) -> list[int]:
    vocab = Checkpoint.open(path).args.vocab_size
    return torch.randint(0, vocab, (9,), generator=torch.Generator().manual_seed(1)).tolist()


@torch.inference_mode()
def run_case(path: Path, case: Case, rank: int, world: int) -> tuple[torch.Tensor, list[int]]:
    """(logits of the prompt at every position, greedy tokens) on rank `rank` of `world`. TP=1
    loads the whole model and then quantizes it; TP=2 loads as the CLI does (`session.load`:
    each block quantized and sharded as it is read)."""
    if world == 1:
        checkpoint = Checkpoint.open(path)
        model = load_model(checkpoint)
        if case.quant != "none":
            quantize_loaded(checkpoint, model, 8 if case.quant == "int8" else 4, None)
    else:
        model = load(str(path), device="cpu", dtype="float32", quant=case.quant, tp=world).model
        assert isinstance(model.layers[0].attention.wo, RowParallelLinear)
    prompt = prompt_for(path)
    logits = model(torch.tensor([prompt]), torch.arange(len(prompt)), all_logits=True)
    generator = Generator(model, word_tokenizer(model.args.vocab_size), max_seq_len=32, compile=case.compile)
    tokens = generator.generate([prompt], NEW_TOKENS, stop_at_eos=False).token_ids[0]
    check_same_tokens([tokens])
    return logits, tokens


def _rank_main(rank: int, world: int, store: str, cases: list[Case], dirs: dict[str, Path], out: Path) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        results = {case.key: run_case(dirs[case.model], case, rank, world) for case in cases}
    finally:
        leave()  # as a CLI rank does at exit (without it, ~1 exit in 8 aborts: see leave)
    torch.save(results, out / f"rank{rank}.pt")


def run_tp2(cases: list[Case], dirs: dict[str, Path], out: Path) -> list[dict]:
    """Every case on two gloo ranks: per rank, {case key: (logits, tokens)}."""
    mp.spawn(_rank_main, args=(WORLD, str(out / "store"), cases, dirs, out), nprocs=WORLD)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def tp2_results(model_dirs, tmp_path_factory) -> list[dict]:
    return run_tp2(CASES, model_dirs, tmp_path_factory.mktemp("tp_out"))


def check_equals_tp1(case: Case, dirs: dict[str, Path], results: list[dict]) -> None:
    ref_logits, ref_tokens = run_case(dirs[case.model], Case(case.model, case.quant), 0, 1)  # eager TP=1
    logits, tokens = results[0][case.key]
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert tokens == ref_tokens
    other_logits, other_tokens = results[1][case.key]
    assert torch.equal(other_logits, logits) and other_tokens == tokens


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.key)
def test_tp2_equals_tp1(case, model_dirs, tp2_results):
    check_equals_tp1(case, model_dirs, tp2_results)


@pytest.mark.slow
def test_compiled_tp2_equals_tp1(model_dirs, tmp_path):
    check_equals_tp1(COMPILED, model_dirs, run_tp2([COMPILED], model_dirs, tmp_path))


def test_heads_that_do_not_divide_are_a_clear_error(model_dirs):
    model = load_model(Checkpoint.open(model_dirs["smollm"]))  # 3 heads, 1 kv head
    with pytest.raises(
        UserError, match=r"--tp 2 needs .* 3 attention heads and 1 key/value heads; this model supports no --tp above 1"
    ):
        shard_model(model, 0, 2)
    assert model.layers[0].attention.n_heads == 3  # untouched


def test_real_smollm2_supports_tp3_not_tp2(smollm2_gguf):
    args = Checkpoint.open(smollm2_gguf).args  # 9 heads, 3 kv heads, feed-forward 1536
    with pytest.raises(UserError, match="9 attention heads and 3 key/value heads; this model supports --tp 3"):
        check_shardable(args, 2)
    check_shardable(args, 3)


def test_quantized_groups_must_not_straddle_ranks(model_dirs):
    path = model_dirs["llama3"]  # feed-forward 160: 80 columns per rank, not whole groups of 32
    checkpoint = Checkpoint.open(path)
    model = load_model(checkpoint)
    quantize_loaded(checkpoint, model, 4, None)
    with pytest.raises(
        UserError,
        match=r"layers\.0\.feed_forward\.w2 has 160 input features quantized in groups of 32; "
        r"split over the ranks, each gets 80 columns",
    ):
        shard_model(model, 0, 2)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "genfast", *args], capture_output=True, text=True, timeout=300)


def test_cli_generate_tp2_prints_the_text_of_tp1(model_dirs):
    argv = [
        "generate",
        "w1 w2 w3",
        "--model",
        str(model_dirs["qwen2"]),
        "--dtype",
        "float32",
        "--no-compile",
        "-n",
        "8",
        "--quiet",
    ]
    one, two = run_cli(*argv), run_cli(*argv, "--tp", "2")
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    assert one.stdout.strip() and two.stdout == one.stdout  # printed once (rank 0), the same text


def test_cli_tp_error_is_one_line_before_launching(model_dirs):
    done = run_cli("generate", "w1", "--model", str(model_dirs["smollm"]), "--tp", "2", "--no-compile")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "genfast: error: --tp 2 needs the model's heads and feed-forward widths to divide by 2, but it has "
        "3 attention heads and 1 key/value heads; this model supports no --tp above 1"
    ]


def test_tp_on_cuda_needs_a_gpu_per_rank(monkeypatch):
    """NCCL runs each rank on a GPU of its own: --tp 2 with one GPU is a clear error before any
    rank starts (rank 1's set_device(1) would fail on an invalid device ordinal), and --device cpu
    runs them on gloo."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    with pytest.raises(UserError, match=r"--tp 2 on CUDA .* GPU of its own, but torch sees 1; use --device cpu"):
        check_devices("cuda", 2)
    check_devices("cpu", 2)
    assert gpu_per_rank(1) and not gpu_per_rank(2)  # join() then takes gloo alone
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_devices("auto", 2)
    with pytest.raises(UserError, match=r"torch sees 2; use --tp 2 at most, or --device cpu"):
        check_devices("cuda:0", 4)


@pytest.mark.parametrize("has_shutdown_timeout", [True, False])
def test_launch_gives_the_ranks_their_grace_where_torch_can(monkeypatch, has_shutdown_timeout):
    """The ranks get `grace_s` to finish after Ctrl-C where LaunchConfig takes shutdown_timeout
    (torch 2.13); torch 2.11's has no such field (the lent GPU machines' --tp failed on it), and
    the launch goes on without it."""
    from torch.distributed.launcher import api

    @dataclass
    class OldLaunchConfig:  # torch 2.11's fields that launch_tp sets
        min_nodes: int
        max_nodes: int
        nproc_per_node: int
        run_id: str = ""
        rdzv_endpoint: str = ""
        rdzv_backend: str = "etcd"
        max_restarts: int = 3

    configs, commands = [], []

    def elastic_launch(config, entrypoint):
        configs.append(config)
        return lambda *args: commands.append((entrypoint, args))

    monkeypatch.setattr(api, "elastic_launch", elastic_launch)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # launch_tp sets it where unset
    if not has_shutdown_timeout:
        monkeypatch.setattr(api, "LaunchConfig", OldLaunchConfig)
    assert launch_tp(["generate", "w1"], 2, grace_s=7.5) == 0
    assert commands == [(sys.executable, ("-m", "genfast", "generate", "w1"))]
    assert configs[0].nproc_per_node == 2 and configs[0].max_restarts == 0
    assert getattr(configs[0], "shutdown_timeout", None) == (8 if has_shutdown_timeout else None)


def test_a_rank_runs_on_the_gpu_of_its_local_rank(monkeypatch):
    """Each rank's model goes to cuda:LOCAL_RANK, which is also made current (Triton launches its
    kernels on the current device), whatever --device cuda:N made current before."""
    current = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(name, value)
    assert tp_device(torch.device("cuda", 0)) == torch.device("cuda", 1) and current == [torch.device("cuda", 1)]
    assert tp_device(torch.device("cpu")) == torch.device("cpu") and len(current) == 1


def test_cli_tp_on_a_missing_gpu_is_one_line(model_dirs):
    done = run_cli("generate", "w1", "--model", str(model_dirs["qwen2"]), "--tp", "2", "--device", "cuda")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "genfast: error: --device cuda was asked for, but this torch build sees no CUDA GPU"
    ]


def test_bench_llm_measures_a_row_on_two_ranks(smollm2_gguf, tmp_path):
    """`genfast bench llm --tp 2`: each row's process launches its two ranks, rank 0 reports; a
    speculative row says why it is left out."""
    import transformers

    from genfast.llm.checkpoints.tokenizer import load_tokenizer

    cfg = dict(TINY_CONFIGS["qwen2"], vocab_size=49152)  # SmolLM2's tokenizer: the bench prompt needs real text
    model_type = cfg.pop("model_type")
    cfg.pop("architectures")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **cfg))
    directory = save_hf_model(model.eval(), tmp_path / "model")
    load_tokenizer(Checkpoint.open(smollm2_gguf)).save(directory)
    out = tmp_path / "rows.json"
    done = run_cli(
        "bench",
        "llm",
        "--model",
        str(directory),
        "--tp",
        "2",
        "--steps",
        "baseline,spec-prompt-lookup",
        "--repeats",
        "1",
        "--prompt-tokens",
        "8",
        "--new-tokens",
        "4",
        "--json",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    baseline, spec = json.loads(out.read_text())
    assert baseline["tp"] == 2 and baseline["decode_tok_s"] > 0 and baseline["greedy_match"] == 1.0
    assert spec["note"] == "skipped: speculative decoding does not combine with --tp yet"
