"""The LLM's commands on the command line: generate, chat, quantize, eval ppl and bench llm (and
the model and sampling flags `genfast serve` shares). Torch-free: handlers are imported to run."""

from __future__ import annotations

import argparse
from pathlib import Path

from genfast.interface.arguments import (
    add_bench_args,
    add_device,
    add_ray,
    add_recipe,
    add_threads,
    lazy,
    positive_int,
    seed,
)
from genfast.llm.recipe import DEFAULT_STEP, RECIPE
from genfast.quant import DEFAULT_INT4_GROUP_SIZE, INT4_GROUP_SIZES, QUANT_MODES, QUANTIZE_MODES

INT4_GROUPS_HELP = (
    f"{', '.join(map(str, INT4_GROUP_SIZES[:-1]))} or {INT4_GROUP_SIZES[-1]} (default {DEFAULT_INT4_GROUP_SIZE})"
)
DTYPE_HELP = """the recipe's bf16 step: auto (bfloat16 on CUDA and CPUs with native bf16; elsewhere float32 arithmetic
on bf16-stored linear weights: see `genfast info`), bfloat16, float32 (no bf16 step) or float16 (CUDA only)"""

GENERATE_DESCRIPTION = """Complete a prompt: the completion streams to stdout, stats go to stderr. Several prompts run
as one batch and print one JSON object per line."""
QUANTIZE_DESCRIPTION = """Quantize a model's linear layers and write weights (safetensors with the scheme in its
header), config and tokenizer to a directory that --model accepts."""
PPL_DESCRIPTION = """Perplexity on the evaluation half of Python's pydoc topics, in non-overlapping windows (protocol:
genfast/llm/perplexity.py). The recipe's compile step, --no-compile and --max-seq-len have no effect here."""
BENCH_LLM_HELP = "LLM decode/prefill ladder on the default (or given) model"
BENCH_LLM_DESCRIPTION = """Decode and prefill tok/s, MBU, TTFT, peak memory, compile time and greedy agreement with
the baseline for each step of the LLM recipe (genfast/llm/recipe.py), one fresh process per row."""


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        "-m",
        default=None,
        help="GGUF file, Hugging Face model directory, hub id (org/name) or built-in name "
        "(default: smollm2-135m-instruct; fetch it with `genfast pull`)",
    )
    add_device(g)
    add_recipe(g, RECIPE, DEFAULT_STEP, dtype_help=DTYPE_HELP)
    g.add_argument(
        "--quant",
        default=None,
        choices=QUANT_MODES,
        help="weight-only quantization on load, round-to-nearest (default: what --recipe says: int8 and "
        "int4 are its last steps); for GPTQ, write a checkpoint with `genfast quantize`",
    )
    g.add_argument(
        "--group-size",
        type=positive_int,
        default=None,
        help=f"input columns per quantization scale: int4 {INT4_GROUPS_HELP}; "
        "int8 a multiple of 32 (default: one scale per output channel)",
    )
    g.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="run eagerly, whatever --recipe says (no torch.compile warm-up; slower decode)",
    )
    g.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a prompt's logits, so its greedy tokens, the same bits however they are computed: alone or "
        "batched with other requests, whole or in chunks, after a cached prefix, under speculative "
        "decoding (genfast's own kernels for every linear and attention). Default: on where the model "
        "and machine allow (CPU, bf16 weights); --batch-invariant demands it, --no-batch-invariant "
        "takes the library kernels. Decode costs nothing; prefill runs up to ~1.8x slower on 1B-class "
        "models (docs/llm.md has the measurements)",
    )
    g.add_argument(
        "--max-seq-len",
        type=positive_int,
        default=4096,
        help="KV-cache slots: prompt + new tokens must fit (default 4096, capped at the model's context)",
    )
    add_threads(g, beside_other_work=True)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", "-n", type=positive_int, default=128)
    g.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument(
        "--seed", type=seed, default=None, help="for sampling (temperature > 0): the same seed, the same text"
    )
    g.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop when this text is generated (repeatable); EOS always stops",
    )


def add_tp_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup, launches: bool = True) -> None:
    """--tp N; `launches`: this command starts the N ranks itself (genfast.cli.main does)."""
    p.add_argument(
        "--tp",
        type=positive_int,
        default=None,
        metavar="N",
        help="tensor parallelism: run N processes (gloo on CPU, one GPU each on CUDA), each holding "
        "1/N of every layer's heads and MLP; the model's heads must divide by N "
        "(default: 1, or the process count under torchrun)",
    )
    p.set_defaults(launches_ranks=launches)


def _add_speculative_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "speculative decoding",
        "A cheap draft proposes tokens that the model checks K+1 at a time in one pass; the output is "
        "the model's own (greedy: the same tokens up to floating-point rounding, which can flip near-ties "
        "in bfloat16; sampling: the same distribution). One prompt at a time.",
    )
    m = g.add_mutually_exclusive_group()
    m.add_argument(
        "--draft",
        default=None,
        metavar="MODEL",
        help="a smaller model with the same tokenizer drafts (as --model: file, directory or name)",
    )
    m.add_argument(
        "--self-draft",
        default=None,
        metavar="int4|int8|layers:N",
        help="the model drafts for itself: an int4 or int8 copy of it, or its first N layers with "
        "its head (sharing its weights and KV cache)",
    )
    m.add_argument(
        "--prompt-lookup",
        action="store_true",
        help="draft the tokens that followed the last occurrence of the latest 1-3 tokens in the "
        "prompt or output (no draft model; pays off on repetitive text such as code edits)",
    )
    g.add_argument(
        "--speculate-k",
        type=positive_int,
        default=None,
        metavar="K",
        help="tokens drafted per verify pass, 1 to 16 (default 4)",
    )


def _generate(args: argparse.Namespace) -> int:
    """`genfast generate`: prompts from the command line (genfast/llm/commands.py), a file of
    them through the batching engine (--input: genfast/serve/batch_file.py) or on a Ray cluster
    (--ray: genfast/ray/llm.py)."""
    if args.input is None and args.output is None and args.ray is None:
        return lazy("genfast.llm.commands", "generate_command")(args)
    if args.ray is not None:
        return lazy("genfast.ray.llm", "generate_command")(args)
    return lazy("genfast.serve.batch_file", "generate_file_command")(args)


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "generate", help="complete a prompt (streams to stdout, stats to stderr)", description=GENERATE_DESCRIPTION
    )
    p.add_argument("prompt", nargs="*", help="prompt text; several prompts run as one batch; '-' reads stdin")
    p.add_argument("--prompt-file", action="append", default=[], help="read a prompt from a file (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn")
    p.add_argument("--quiet", "-q", action="store_true", help="no stats on stderr")
    g = p.add_argument_group("many prompts from a file (genfast/serve/batch_file.py)")
    g.add_argument(
        "--input",
        default=None,
        metavar="PROMPTS.jsonl",
        help='one JSON object a line: {"id": ..., "prompt": "..."} or {"id": ..., "messages": [...]}, '
        "optionally with its own max_new_tokens, temperature, top_k, top_p, seed, stop; all run through "
        "the continuous-batching engine",
    )
    g.add_argument(
        "--output",
        default=None,
        metavar="ANSWERS.jsonl",
        help='with --input: {"id", "text", "finish_reason", "usage"} appended a line per answer as it '
        "completes; a re-run skips the ids already there",
    )
    g.add_argument(
        "--max-batch",
        type=positive_int,
        default=8,
        help="with --input: prompts decoded together (KV-cache slots; default 8)",
    )
    add_ray(
        g,
        "with --input; --output is then a folder of JSONL files, each row the input row with the answer's fields",
    )
    add_model_args(p)
    add_sampling_args(p)
    add_tp_arg(p)
    _add_speculative_args(p)
    p.set_defaults(run=_generate)

    p = commands.add_parser("chat", help="interactive multi-turn chat (streams replies)")
    p.add_argument("--system", default=None, help="system prompt")
    add_model_args(p)
    add_sampling_args(p)
    add_tp_arg(p)
    _add_speculative_args(p)
    p.set_defaults(max_new_tokens=512, run=lazy("genfast.llm.commands", "chat_command"))

    p = commands.add_parser(
        "quantize", help="write a quantized copy of a model to a directory", description=QUANTIZE_DESCRIPTION
    )
    p.add_argument("--model", "-m", default=None, help="source model (as for generate)")
    p.add_argument(
        "--mode",
        required=True,
        choices=QUANTIZE_MODES,
        help="int8: per-channel (or --group-size) round-to-nearest; int4: groupwise "
        "round-to-nearest; int4-gptq: groupwise GPTQ, calibrated on --calibration",
    )
    p.add_argument(
        "--group-size",
        type=positive_int,
        default=None,
        help=f"int4: {INT4_GROUPS_HELP}; int8: a multiple of 32 (default: per channel)",
    )
    p.add_argument("--output", "-o", required=True, help="output directory (must be empty or absent)")
    p.add_argument("--force", action="store_true", help="replace an earlier `genfast quantize` output")
    p.add_argument("--dtype", default="bfloat16", help="storage dtype of unquantized tensors (default bfloat16)")
    p.add_argument(
        "--calibration",
        type=Path,
        default=None,
        help="GPTQ calibration text file (default: the calibration half of Python's pydoc topics)",
    )
    p.add_argument("--calibration-windows", type=positive_int, default=32, help="GPTQ: windows (default 32)")
    p.add_argument("--calibration-window", type=positive_int, default=512, help="GPTQ: tokens per window (default 512)")
    add_threads(p)
    p.set_defaults(run=lazy("genfast.llm.commands", "quantize_command"))

    p = commands.add_parser("eval", help="evaluate a model (perplexity on the shipped corpus)")
    evals = p.add_subparsers(dest="evaluation", required=True, metavar="EVALUATION")
    e = evals.add_parser(
        "ppl", help="perplexity on the evaluation half of the pydoc corpus", description=PPL_DESCRIPTION
    )
    add_model_args(e)
    e.add_argument("--window", type=positive_int, default=512, help="tokens per window (default 512)")
    e.add_argument("--max-windows", type=positive_int, default=None, help="score only the first N windows")
    e.add_argument("--batch-size", type=positive_int, default=4, help="windows per forward pass (default 4)")
    e.add_argument("--json", dest="json_path", default=None, help="also write the result as JSON to this file")
    e.add_argument("--force", action="store_true", help="overwrite an existing --json file")
    e.set_defaults(run=lazy("genfast.llm.perplexity", "eval_ppl_command"))


def register_bench(bench: argparse._SubParsersAction) -> None:
    b = bench.add_parser("llm", help=BENCH_LLM_HELP, description=BENCH_LLM_DESCRIPTION)
    b.add_argument("--model", "-m", default=None)
    add_bench_args(b, "llm", repeats=5)
    g = b.add_argument_group("llm")
    g.add_argument(
        "--prompt",
        default="pydoc",
        choices=("pydoc", "code", "chat"),
        help="the text to continue: Python's pydoc topics (default), the source of its colorsys "
        "module, or a chat request in the model's template",
    )
    g.add_argument("--prompt-tokens", type=positive_int, default=128)
    g.add_argument("--new-tokens", type=positive_int, default=128)
    g.add_argument(
        "--int4-group-size",
        type=int,
        choices=INT4_GROUP_SIZES,
        default=None,
        help=f"input columns per scale in the int4 rows (default {DEFAULT_INT4_GROUP_SIZE}): larger groups read "
        "fewer scale bytes per token for some accuracy",
    )
    g.add_argument(
        "--speculate-k",
        type=positive_int,
        default=4,
        metavar="K",
        help="tokens drafted per verify pass in spec- rows (default 4); --steps also takes spec-<draft> "
        "rows (spec-int4, spec-int8, spec-layers:N, spec-prompt-lookup, spec-model:PATH: the "
        "--spec-target step plus speculative decoding), 'speculative' (compile and the first four of those) "
        "and no-batch-invariant (the --spec-target step on the library kernels: what batch invariance costs)",
    )
    g.add_argument(
        "--spec-target",
        default="compile",
        metavar="STEP",
        help="the recipe step whose model the spec- rows speculate for (default compile: the model in "
        "bf16); int4 or int8 for a model that fits the device only quantized, e.g. --model "
        "random:llama-2-70b --steps int4,spec-model:random:llama-2-7b --spec-target int4",
    )
    add_tp_arg(g, launches=False)
    b.set_defaults(run=lazy("genfast.llm.bench", "bench_command"))
