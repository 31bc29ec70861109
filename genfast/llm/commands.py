"""`genfast generate` and `genfast chat`: text to stdout, progress and stats to stderr."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from genfast.bench.machine import peak_read_bandwidth
from genfast.errors import UserError
from genfast.llm.generate import Generator
from genfast.llm.sampling import SamplingParams
from genfast.llm.session import LoadedModel, load, make_generator
from genfast.llm.stats import format_stats
from genfast.llm.tensor_parallel import check_same_tokens, from_main_rank, is_main_rank


def _log(message: str) -> None:
    if is_main_rank():  # tensor-parallel ranks run in step; rank 0 speaks for all
        print(message, file=sys.stderr, flush=True)


def _sampling(args: argparse.Namespace) -> SamplingParams:
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


def _prepare(args: argparse.Namespace, batch_size: int) -> tuple[LoadedModel, Generator, SamplingParams]:
    params = _sampling(args)  # validate flags before the slow load
    draft = _draft(args)
    loaded = load_announced(args)
    generator = make_generator(loaded, args.max_seq_len, batch_size, args.compile, draft, args.speculate_k)
    if draft is not None:
        _log(f"genfast: speculative decoding: {generator.drafter.name} drafts {generator.k} tokens per target pass")
    return loaded, generator, params


def _draft(args: argparse.Namespace) -> str | None:
    """The draft (genfast.llm.speculative.parse_draft) that --draft, --self-draft or
    --prompt-lookup ask for, validated before the slow load."""
    from genfast.llm.speculative import parse_draft

    if args.self_draft is not None and parse_draft(args.self_draft)[0] not in ("int4", "int8", "layers"):
        raise UserError(f"--self-draft takes int4, int8 or layers:N, got {args.self_draft!r}")
    spec = f"model:{args.draft}" if args.draft else args.self_draft or ("prompt-lookup" if args.prompt_lookup else None)
    if spec is None and args.speculate_k is not None:
        raise UserError("--speculate-k needs --draft, --self-draft or --prompt-lookup")
    return spec


def load_announced(args: argparse.Namespace) -> LoadedModel:
    """Load the model the model flags name and say on stderr what was loaded (and how it runs)."""
    loaded = load(args.model, args.device, args.dtype, args.threads, args.quant, args.group_size, args.tp)
    dtype = loaded.dtype_label()
    quant = "" if loaded.quant == "none" else f", {loaded.quant} weights"
    ranks = "" if loaded.tp == 1 else f" | tensor parallel over {loaded.tp} ranks"
    _log(f"genfast: {loaded.path} | {loaded.model.args.n_params / 1e6:.0f}M parameters | "
         f"{dtype}{quant} on {loaded.device}{ranks}")
    if loaded.quant != "none":
        from genfast.kernels import QLINEAR

        reason = QLINEAR.unavailable_reason() if loaded.device.type == "cpu" else "not on CPU"
        if reason:
            _log(f"genfast: note: quantized weights use the slow dequantize path ({reason}); "
                 "they save memory, but decode is slower than unquantized here (`genfast info` says why)")
    return loaded


def generate_command(args: argparse.Namespace) -> int:
    prompts = from_main_rank(lambda: _read_prompts(args))
    loaded, generator, params = _prepare(args, len(prompts))
    if args.chat:
        prompts = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    ids = [generator.encode_prompt(p) for p in prompts]
    compile_s = None
    if args.compile:
        _log("genfast: compiling prefill and decode (fast after the first run: the result is cached)...")
        compile_s = generator.warmup(params)

    single = len(ids) == 1

    def stream(index: int, text: str) -> None:
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
        if loaded.tp > 1:
            _log(f"bytes/step and MBU are one rank's (each of the {loaded.tp} reads its own shard)")
    return 0


def chat_command(args: argparse.Namespace) -> int:
    loaded, generator, params = _prepare(args, 1)
    tokenizer = loaded.tokenizer
    if not tokenizer.chat_template:
        raise UserError(f"{loaded.path} has no chat template; use `genfast generate` instead")
    if args.compile:
        _log("genfast: compiling prefill and decode (fast after the first run: the result is cached)...")
        generator.warmup(params)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = []
    interactive = sys.stdin.isatty() and is_main_rank()
    _log("genfast chat: type a message; /reset clears the conversation, /exit or Ctrl-D quits.")
    while True:
        if interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
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
        history.append({"role": "user", "content": message})
        ids = _fit_conversation(generator, system, history, args.max_new_tokens)

        def stream(_: int, text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

        result = generator.generate([ids], args.max_new_tokens, params, args.stop, args.seed, on_text=stream)
        check_same_tokens(result.token_ids)
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": result.texts[0]})
        _log(f"[{result.new_tokens} tokens, {result.decode_tok_s:.1f} tok/s]")
    return 0


def _fit_conversation(generator: Generator, system: list[dict[str, str]], history: list[dict[str, str]],
                      max_new_tokens: int) -> list[int]:
    """Token ids of the conversation, dropping the oldest turns until it fits the context."""
    tokenizer = generator.tokenizer
    while True:
        ids = generator.encode_prompt(tokenizer.apply_chat_template(system + history))
        if len(ids) + max_new_tokens <= generator.max_seq_len or len(history) <= 1:
            return ids
        del history[:2]  # the oldest user/assistant pair
        _log("(oldest turn dropped to fit the context)")
