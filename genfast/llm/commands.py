"""The LLM commands: `genfast generate` and `genfast chat` (text to stdout, progress and stats to
stderr) and `genfast quantize` (a quantized copy of a model in a directory)."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

from genfast import __version__
from genfast.bench.machine import peak_read_bandwidth
from genfast.errors import UserError
from genfast.interface.startup import Phases
from genfast.llm.checkpoints.checkpoint import QUANTIZED_FILE, resolve_checkpoint
from genfast.llm.checkpoints.quantize import HEAD, describe_quantization, quantize_loaded
from genfast.llm.decoding.generate import Generator
from genfast.llm.decoding.precompiled import attach
from genfast.llm.decoding.sampling import SamplingParams
from genfast.llm.decoding.stats import format_stats
from genfast.llm.harmony import ReplyPrinter
from genfast.llm.loading import LoadedModel, load
from genfast.llm.model import invariance
from genfast.llm.model.transformer import describe_size
from genfast.llm.recipe import RECIPE, LlmSettings, genfast_chooses_threads, load_for_command, make_generator, plan
from genfast.llm.tensor_parallel import check_same_tokens, from_main_rank, is_main_rank
from genfast.platform.hardware import DTYPES
from genfast.platform.threads import OtherWork, follow_other_work
from genfast.quant import DEFAULT_INT4_GROUP_SIZE, INT4_GROUP_SIZES
from genfast.recipe import Target
from genfast.storage.hub import publish_directory, resolve_model, staging_dir


def _log(message: str) -> None:
    if is_main_rank():  # tensor-parallel ranks run in step; rank 0 speaks for all
        print(message, file=sys.stderr, flush=True)


def sampling_of(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(args.temperature, args.top_k, args.top_p)


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = []
    for text in args.prompt:
        prompts.append(sys.stdin.read() if text == "-" else text)
    for name in args.prompt_file:
        path = Path(name)
        if not path.is_file():
            raise UserError(f"prompt file not found: {path}")
        try:
            prompts.append(path.read_text())
        except UnicodeDecodeError as e:
            raise UserError(f"prompt file {path} is not UTF-8 text") from e
    if not prompts:
        raise UserError("no prompt given: pass the prompt text, '-' for stdin, or --prompt-file")
    return prompts


def _prepare(args: argparse.Namespace, batch_size: int) -> tuple[LoadedModel, LlmSettings, Generator, SamplingParams]:
    params = sampling_of(args)  # validate flags before the slow load
    draft = draft_of(args)
    loaded, settings = load_announced(args)
    generator = make_generator(loaded, args.max_seq_len, batch_size, settings.compile, draft, args.speculate_k)
    if draft is not None:
        _log(f"genfast: speculative decoding: {generator.drafter.name} drafts {generator.k} tokens per target pass")
    return loaded, settings, generator, params


def _start_compiled(
    generator: Generator, loaded: LoadedModel, params: SamplingParams, compile_missing: str = "after",
    defer: bool = False,
) -> float | None:  # fmt: skip
    """Make the compiled steps available: from disk or a background compile, streaming eagerly
    meanwhile (genfast/llm/decoding/precompiled.py; `defer`: saved steps load after the first token);
    where that does not apply (CUDA, --tp, speculative decoding), compile here first, as
    torch.compile does. Returns the seconds spent waiting."""
    steps = attach(generator, loaded, params, _log)
    if steps is not None:
        _log(f"genfast: {steps.start(compile_missing, defer)}")
        return None
    _log("genfast: compiling prefill and decode (fast after the first run: the result is cached)...")
    return generator.warmup(params)


def draft_of(args: argparse.Namespace) -> str | None:
    """The draft (genfast.llm.decoding.speculative.parse_draft) that --draft, --self-draft or
    --prompt-lookup ask for, validated before the slow load."""
    from genfast.llm.decoding.drafters import parse_draft

    if args.self_draft is not None and parse_draft(args.self_draft)[0] not in ("int4", "int8", "layers"):
        raise UserError(f"--self-draft takes int4, int8 or layers:N, got {args.self_draft!r}")
    if args.draft:
        resolve_model(args.draft)  # a missing draft is named (a hub one fetched) before the target loads
    spec = f"model:{args.draft}" if args.draft else args.self_draft or ("prompt-lookup" if args.prompt_lookup else None)
    if spec is None and args.speculate_k is not None:
        raise UserError("--speculate-k needs --draft, --self-draft or --prompt-lookup")
    return spec


def load_announced(args: argparse.Namespace) -> tuple[LoadedModel, LlmSettings]:
    """Load the model the model flags name, run as the recipe flags say (--recipe, with --dtype,
    --quant and --no-compile on top), and say on stderr what was loaded and how it runs."""
    recipe = plan(args.recipe, args.device, args.dtype, args.quant, args.compile, args.batch_invariant)
    settings = recipe.settings
    loaded = load_for_command(args, settings, _log, args.tp)
    dtype = loaded.dtype_label()
    quant = "" if loaded.quant == "none" else f", {loaded.quant} weights"
    ranks = "" if loaded.tp == 1 else f" | tensor parallel over {loaded.tp} ranks"
    invariant = " | batch-invariant" if loaded.batch_invariant else ""
    _log(
        f"genfast: {loaded.path} | {describe_size(loaded.model.args)} | {dtype}{quant} on {loaded.device}"
        f"{ranks}{invariant}"
    )
    notes = [note for step, note in recipe.notes if step not in ("int8", "int4")]
    arch = loaded.checkpoint.multimodal_architecture
    if arch is not None:
        notes.insert(0, f"text only: {arch}'s language model is loaded, not its image encoder: images are unsupported")
    if loaded.quant != "none":  # quantized on load, or a quantized checkpoint
        notes.append(RECIPE.step("int8").fallback(Target(loaded.device, args.dtype)))
    if settings.batch_invariant is None and not loaded.batch_invariant:
        why = invariance.unavailable_reason(loaded.model)
        notes.append(f"not batch-invariant ({why}): a greedy reply can change with batching or caching")
    for note in filter(None, notes):
        _log(f"genfast: note: {note}")
    return loaded, settings


def generate_command(args: argparse.Namespace) -> int:
    phases = Phases()
    phases.mark("imports")
    prompts = from_main_rank(lambda: _read_prompts(args))
    loaded, settings, generator, params = _prepare(args, len(prompts))
    phases.mark("load")
    if args.chat:
        prompts = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    ids = [generator.encode_prompt(p) for p in prompts]
    generator.check_request(ids, args.max_new_tokens)  # a bad request fails before any compile starts
    compile_s = _start_compiled(generator, loaded, params, defer=True) if settings.compile else None
    steps = generator.precompiled
    if settings.compile and (steps is None or steps.ready):  # (deferred steps load after the first token)
        phases.mark("compile" if steps is None else "compiled steps")

    single = len(ids) == 1

    def stream(index: int, text: str) -> None:
        if not phases.marks or phases.marks[-1][0] != "first token":
            phases.mark("first token")
        if single:
            sys.stdout.write(text)
            sys.stdout.flush()

    result = generator.generate(ids, args.max_new_tokens, params, args.stop, args.seed, on_text=stream)
    check_same_tokens(result.token_ids)
    if single:
        sys.stdout.write("\n")
    else:  # one JSON object per prompt and line: completions may contain any text
        for prompt, text, reason in zip(prompts, result.texts, result.stop_reasons):
            sys.stdout.write(json.dumps({"prompt": prompt, "completion": text, "stop_reason": reason}) + "\n")
    sys.stdout.flush()
    if not args.quiet:
        _log(format_stats(loaded.model, result, peak_read_bandwidth(loaded.device), compile_s, loaded.device))
        notes = steps.take_notes() if steps is not None else []
        _log(f"start-up: {'; '.join([phases.summary(), *notes])}")
        if loaded.tp > 1:
            _log(f"bytes/step and MBU are one rank's (each of the {loaded.tp} reads its own shard)")
    if steps is not None:
        steps.finish()
    return 0


CHAT_COMMANDS = "/reset clears the conversation, /help shows this, /exit or Ctrl-D quits"


def chat_command(args: argparse.Namespace) -> int:
    default_threads = torch.get_num_threads()  # before the load leaves busy CPUs to other work
    loaded, settings, generator, params = _prepare(args, 1)
    # Other work that starts or stops during a chat is measured while it waits for the user.
    follows = genfast_chooses_threads(args, loaded)
    tokenizer = loaded.tokenizer
    if not tokenizer.chat_template:
        raise UserError(f"{loaded.path} has no chat template; use `genfast generate` instead")
    if settings.compile:
        _start_compiled(generator, loaded, params, compile_missing="now")  # a chat lasts: switch when compiled
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = []
    generator.reuse_prefix = True  # each turn prefills only what follows the earlier turns' cache
    interactive = sys.stdin.isatty() and is_main_rank()
    _log(f"genfast chat: type a message; {CHAT_COMMANDS}")
    while True:
        if interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
        waiting = OtherWork() if follows else None
        line = from_main_rank(sys.stdin.readline)
        if not line:
            break
        message = line.strip()
        if not message:
            continue
        if message in ("/exit", "/quit"):
            break
        if message == "/reset":
            history.clear()
            _log("(conversation cleared)")
            continue
        if re.fullmatch(r"/\w+", message):  # a message that starts with a path has more to it
            _log(f"({CHAT_COMMANDS})" if message == "/help" else f"(unknown command {message}; {CHAT_COMMANDS})")
            continue
        if waiting is not None:
            follow_other_work(waiting, default_threads, _log)
        history.append({"role": "user", "content": message})
        ids = _fit_conversation(generator, system, history, args.max_new_tokens)

        # A harmony reply (gpt-oss) shows its final answer; its analysis goes to stderr, labelled.
        printer = ReplyPrinter() if tokenizer.harmony else None

        def stream(_: int, text: str, printer: ReplyPrinter | None = printer) -> None:
            if printer is not None:
                printer.write(text)
                return
            sys.stdout.write(text)
            sys.stdout.flush()

        result = generator.generate([ids], args.max_new_tokens, params, args.stop, args.seed, on_text=stream)
        check_same_tokens(result.token_ids)
        answer = printer.finish() if printer is not None else result.texts[0]
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": answer})
        notes = generator.precompiled.take_notes() if generator.precompiled is not None else []
        prompt = f"prompt {result.prompt_tokens} tokens ({result.cached_prompt_tokens} cached), first token "
        prompt += f"{result.ttft_s * 1000:.0f} ms"
        summary = [f"{result.new_tokens} tokens, {result.decode_tok_s:.1f} tok/s", prompt, *notes]
        _log(f"[{', '.join(summary)}]")
    return 0


def _fit_conversation(
    generator: Generator, system: list[dict[str, str]], history: list[dict[str, str]], max_new_tokens: int
) -> list[int]:
    """Token ids of the conversation, dropping the oldest turns until it fits the context."""
    tokenizer = generator.tokenizer
    while True:
        ids = generator.encode_prompt(tokenizer.apply_chat_template(system + history))
        if len(ids) + max_new_tokens <= generator.max_seq_len or len(history) <= 1:
            return ids
        del history[:2]  # the oldest user/assistant pair
        _log("(oldest turn dropped to fit the context)")


# ---- genfast quantize ----------------------------------------------------------------------------


def check_output_dir(out: Path, force: bool) -> None:
    """Refuse to touch anything but an empty directory or, with --force, an earlier output."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise UserError(f"{out} is not empty; pass --force to replace an earlier `genfast quantize` output")
        if not _is_quantize_output(out):
            raise UserError(f"refusing to replace {out}: it is not a `genfast quantize` output")
    if not out.parent.is_dir():
        raise UserError(f"directory {out.parent} does not exist")


def _is_quantize_output(directory: Path) -> bool:
    from genfast.quant.checkpoint import QuantizedCheckpoint

    if (directory / "config.json").exists() or not (directory / QUANTIZED_FILE).is_file():
        return False
    try:
        QuantizedCheckpoint(directory / QUANTIZED_FILE)
    except UserError:
        return False
    return True


def read_calibration(path: Path | None) -> tuple[str, str]:
    """The GPTQ calibration text and a description of where it came from: the user's file, or the
    half of the shipped corpus that perplexity does not measure."""
    from genfast.llm.corpus import calibration_text

    if path is None:
        return calibration_text(), "pydoc_data.topics (calibration half)"
    if not path.is_file():
        raise UserError(f"calibration file not found: {path}")
    try:
        return path.read_text(), str(path)
    except UnicodeDecodeError as e:
        raise UserError(f"calibration file {path} is not UTF-8 text") from e


def gptq_quantize_model(
    loaded: LoadedModel, group_size: int, calibration: tuple[str, str], n_windows: int, window: int
) -> str:
    """Replace the model's linears by GPTQ int4 layers, calibrated on `calibration` (text, source
    from `read_calibration`); returns a description of the calibration."""
    from genfast.llm.checkpoints.calibration import calibrate_gptq, calibration_windows

    text, source = calibration
    window = min(window, loaded.model.args.max_seq_len)
    try:
        windows = calibration_windows(loaded.tokenizer, text, n_windows, window)
    except ValueError as e:
        raise UserError(f"calibration text too short: {e}") from e
    start = time.perf_counter()
    # The head is not GPTQ'd: int4 models keep it in int8 (genfast.llm.checkpoints.quantize.INT4_HEAD_BITS).
    weights = calibrate_gptq(
        loaded.model, windows, bits=4, group_size=group_size, progress=_log, skip=lambda name, _: name == HEAD
    )
    _log(f"genfast: GPTQ done in {time.perf_counter() - start:.0f} s")
    if loaded.model.args.n_experts:
        # GPTQ's Hessian per expert would come from only the calibration tokens routed to it.
        _log("genfast: the experts are quantized round-to-nearest (GPTQ covers attention, dense MLPs)")
    quantize_loaded(loaded.checkpoint, loaded.model, 4, group_size, precomputed=weights)
    return f"{source}: {windows.shape[0]} windows x {windows.shape[1]} tokens"


def quantize_command(args: argparse.Namespace) -> int:
    out = Path(args.output)
    check_output_dir(out, args.force)
    if args.dtype not in DTYPES:
        raise UserError(f"unknown --dtype {args.dtype!r}; use bfloat16 or float32")
    bits = 8 if args.mode == "int8" else 4
    group_size = args.group_size
    if bits == 4:
        group_size = group_size or DEFAULT_INT4_GROUP_SIZE
        if group_size not in INT4_GROUP_SIZES:
            raise UserError(f"--group-size for int4 must be one of {', '.join(map(str, INT4_GROUP_SIZES))}")
    elif group_size is not None and group_size % 32:
        raise UserError("--group-size for int8 must be a multiple of 32")
    if args.calibration is not None and args.mode != "int4-gptq":
        raise UserError("--calibration only applies to --mode int4-gptq")
    calibration_input = read_calibration(args.calibration) if args.mode == "int4-gptq" else None
    checkpoint = resolve_checkpoint(args.model)
    if checkpoint.format == "genfast":
        raise UserError(f"{checkpoint.path} is already quantized; quantize the original model instead")
    _log(f"genfast: quantizing {checkpoint.path} ({describe_size(checkpoint.args)}) to {args.mode}")
    # Quantization arithmetic runs in fp32; unquantized tensors are stored in --dtype.
    calibration = None
    if calibration_input is not None:  # GPTQ calibrates on the whole float model
        loaded = load(checkpoint, "cpu", "float32", args.threads)
        calibration = gptq_quantize_model(
            loaded, group_size, calibration_input, args.calibration_windows, args.calibration_window
        )
    else:  # round-to-nearest, block by block as the model is read: the float model never exists whole
        loaded = load(checkpoint, "cpu", "float32", args.threads, quant=args.mode, group_size=group_size)
    scheme = describe_quantization(loaded.model)
    metadata = {
        "model_args": json.dumps(loaded.model.args.to_dict()),
        "mode": args.mode,
        "scheme": scheme,
        "source": str(loaded.path),
        "genfast_version": __version__,
    }
    if calibration:
        metadata["calibration"] = calibration
    from genfast.quant.checkpoint import save_quantized

    staging = staging_dir(out)
    try:
        save_quantized(loaded.model, staging / QUANTIZED_FILE, metadata, float_dtype=DTYPES[args.dtype])
        loaded.tokenizer.save(staging)
    except BaseException:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish_directory(staging, out)
    size = (out / QUANTIZED_FILE).stat().st_size
    print(f"wrote {out} ({scheme}, {size / 1e6:.1f} MB); use it with --model {out}")
    return 0
