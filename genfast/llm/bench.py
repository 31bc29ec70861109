"""`genfast bench llm`: the LLM optimization ladder, one fresh process per step.

Each step loads the model, warms up (compiles), then runs `repeats` generations of
`new_tokens` greedy tokens after a `prompt_tokens`-token prompt (text from Python's own
`pydoc_data` topics, so anyone can reproduce it). Rates are medians over the repeats; compile
time is reported separately. Accuracy: how many of the baseline's greedy tokens the step
reproduces before the first difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from genfast.bench.machine import describe_machine, machine_info, peak_read_bandwidth
from genfast.bench.table import check_writable, median, report, write_json_atomic
from genfast.errors import UserError
from genfast.hardware import peak_memory_bytes
from genfast.llm.corpus import pydoc_text
from genfast.llm.sampling import SamplingParams
from genfast.llm.session import load, make_generator
from genfast.llm.stats import decode_traffic
from genfast.llm.tensor_parallel import check_same_tokens, is_main_rank


@dataclass(frozen=True)
class Step:
    name: str
    dtype: str
    compile: bool
    what: str
    quant: str = "none"
    draft: str | None = None  # speculative decoding (genfast.llm.speculative.parse_draft)


LADDER = [
    Step("eager-fp32", "float32", False, "baseline: eager PyTorch, fp32, static KV cache"),
    Step("eager-bf16", "bfloat16", False, "bf16 weights and cache"),
    Step("compiled-fp32", "float32", True, "torch.compile (freezing) of prefill and decode, fp32"),
    Step("compiled-bf16", "bfloat16", True, "torch.compile (freezing) of prefill and decode, bf16"),
    # What `genfast generate` runs by default: bf16 where the CPU has native bf16 dot products;
    # elsewhere fp32 arithmetic on bf16-stored linear weights (genfast.nn.auto_weight_dtype).
    Step("compiled-auto", "auto", True, "torch.compile, --dtype auto (the default)"),
    Step("compiled-bf16-int8", "bfloat16", True, "+ int8 weights (per-channel scales; native kernel on CPU)", "int8"),
    Step("compiled-bf16-int4", "bfloat16", True, "+ int4 weights (groups of 32, int8 head; native kernel on CPU)", "int4"),
    # Without native bf16 (AVX2) bf16 activations are emulated: there the quantized kernels are
    # fastest with fp32 activations (and `--dtype auto` picks fp32).
    Step("compiled-fp32-int8", "float32", True, "int8 weights, fp32 activations", "int8"),
    Step("compiled-fp32-int4", "float32", True, "int4 weights, fp32 activations", "int4"),
]
BASELINE = LADDER[0].name
BF16 = "compiled-bf16"  # the quantized rows' reference (the issue's speed bars are relative to it)
# Speculative rows are named spec-<draft> (any draft parse_draft accepts, e.g. spec-layers:20 or
# spec-model:PATH); `--steps speculative` runs these against compiled bf16.
SPECULATIVE = ["compiled-bf16", "spec-int4", "spec-int8", "spec-layers:24", "spec-prompt-lookup"]

COLUMNS = [
    ("step", "step", ""),
    ("decode_tok_s", "decode tok/s", ".1f"),
    ("decode_range", "min-max", ""),
    ("speedup", "vs baseline", ".2f"),
    ("vs_bf16", "vs bf16", ".2f"),
    ("prefill_tok_s", "prefill tok/s", ".0f"),
    ("ttft_ms", "TTFT ms", ".0f"),
    ("bytes_per_token_mb", "MB/token", ".1f"),
    ("gb_s", "GB/s", ".1f"),
    ("mbu", "MBU", ".0%"),
    ("peak_mem_gb", "peak mem GB", ".2f"),
    ("compile_s", "compile s", ".0f"),
    ("greedy_match", "same greedy tokens", ".0%"),
    ("acceptance", "drafts accepted", ".0%"),
    ("tokens_per_pass", "tokens/target pass", ".2f"),
    ("draft_share", "drafting share", ".0%"),
    ("same_as_bf16", "same tokens as bf16", ".0%"),
]

# What the benchmark continues: `code` and `chat` show how speculation depends on the text.
PROMPT_KINDS = ("pydoc", "code", "chat")
CHAT_REQUEST = "Explain step by step how a hash table works, and show a short Python example."


def benchmark_prompt(tokenizer: Any, n_tokens: int, kind: str = "pydoc") -> list[int]:
    """A deterministic prompt from text that ships with Python. pydoc: the first `n_tokens` tokens
    of the documentation topics; code: of the `colorsys` module's code; chat: a fixed request in
    the model's chat template (its own length; `n_tokens` does not apply)."""
    if kind == "chat":
        if not tokenizer.chat_template:
            raise UserError("--prompt chat needs a model with a chat template")
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": CHAT_REQUEST}]))
    if kind == "code":
        import colorsys

        source = Path(colorsys.__file__).read_text()
        text = source[source.index("__all__"):]  # the code after the module docstring
    elif kind == "pydoc":
        text = pydoc_text()
    else:
        raise UserError(f"unknown --prompt {kind!r}; use one of {', '.join(PROMPT_KINDS)}")
    ids = tokenizer.encode(text[: n_tokens * 8])
    if len(ids) < n_tokens:
        raise UserError(f"--prompt-tokens {n_tokens} is more than the benchmark text provides")
    return ids[:n_tokens]


def run_step(step: Step, args: argparse.Namespace) -> dict[str, Any]:
    """Measure one step in this process."""
    loaded = load(args.model, args.device, step.dtype, args.threads, step.quant, tp=args.tp)
    prompt = benchmark_prompt(loaded.tokenizer, args.prompt_tokens, args.prompt)
    k = args.speculate_k if step.draft else None
    max_seq = len(prompt) + args.new_tokens + (k or 0)  # speculative: room for the last verify pass
    generator = make_generator(loaded, max_seq, 1, step.compile, step.draft, k)
    greedy = SamplingParams()
    compile_s = generator.warmup(greedy) if step.compile else None
    results = [generator.generate([prompt], args.new_tokens, greedy, stop_at_eos=False)
               for _ in range(args.repeats)]
    decode = median([r.decode_tok_s for r in results])
    mid = min(results, key=lambda r: abs(r.decode_tok_s - decode))
    traffic = replace(decode_traffic(loaded.model, mid), steps_per_s=decode)  # at the median rate
    peak_bw = peak_read_bandwidth(loaded.device)
    spec = step.draft is not None  # a target pass yields several tokens: bytes per token and MBU do not apply
    return {
        "step": step.name,
        "what": step.what,
        "dtype": loaded.dtype_label(),
        "compiled": step.compile,
        "decode_tok_s": decode,
        "decode_tok_s_min": min(r.decode_tok_s for r in results),
        "decode_tok_s_max": max(r.decode_tok_s for r in results),
        "prefill_tok_s": median([r.prefill_tok_s for r in results]),
        "ttft_ms": 1000 * median([r.ttft_s for r in results]),
        "bytes_per_token_mb": None if spec else traffic.bytes_per_step / 1e6,
        "gb_s": None if spec else traffic.bytes_per_s / 1e9,
        "mbu": None if spec else traffic.mbu(peak_bw),
        "acceptance": mid.acceptance_rate if spec else None,
        "tokens_per_pass": mid.tokens_per_pass if spec else None,
        "draft_share": mid.draft_s / mid.decode_s if spec and mid.decode_s else None,
        "speculate_k": mid.speculate_k or None,
        "prompt": args.prompt,
        "peak_bw_gb_s": peak_bw / 1e9,
        "quant": loaded.quant,
        "peak_mem_gb": peak_memory_bytes(loaded.device) / 1e9,
        "compile_s": compile_s,
        "tokens": results[0].token_ids[0],
        "tp": loaded.tp,
    }


def bench_command(args: argparse.Namespace) -> int:
    if args.one_step:
        step = _step_named(args.one_step)
        row = run_step(step, args)
        check_same_tokens([row["tokens"]])
        if is_main_rank():
            write_json_atomic(args.json_path, row)
        return 0
    if args.json_path:
        check_writable(args.json_path, args.force)
    names = args.steps.replace("speculative", ",".join(SPECULATIVE)).split(",") if args.steps else None
    steps = [_step_named(n) for n in names] if names else LADDER
    from genfast.hardware import resolve_device
    from genfast.hub import resolve_model

    model_path = resolve_model(args.model)  # fail early on a missing model
    device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)  # so the machine line and bandwidth match the steps
    info = machine_info(device)
    # Bandwidth varies with the machine's state (shared hosts): measure it now, for every step.
    peak_bw = peak_read_bandwidth(device, remeasure=not os.environ.get("GENFAST_PEAK_BW_GBS"))
    ranks = f", tensor parallel over {args.tp} ranks (per-rank bytes and MBU)" if args.tp > 1 else ""
    print(f"genfast bench llm: {model_path} on {describe_machine(info)}{ranks}", file=sys.stderr)
    print(f"prompt: {args.prompt}, {args.prompt_tokens} tokens; {args.new_tokens} new tokens (greedy), "
          f"median of {args.repeats}", file=sys.stderr)
    rows = []
    for step in steps:
        print(f"  {step.name}: {step.what} ...", file=sys.stderr, flush=True)
        rows.append(_run_isolated(step, args, str(model_path), peak_bw))
    base = next((r for r in rows if r["step"] == BASELINE), None)
    base_tokens = base["tokens"] if base else None
    bf16 = next((r for r in rows if r["step"] == BF16), None)
    bf16_tokens = bf16["tokens"] if bf16 else None
    for row in rows:
        if bf16 is not None:
            row["vs_bf16"] = row["decode_tok_s"] / bf16["decode_tok_s"]
        tokens = row.pop("tokens")
        row["decode_range"] = f"{row['decode_tok_s_min']:.0f}-{row['decode_tok_s_max']:.0f}"
        if base is not None:
            row["speedup"] = row["decode_tok_s"] / base["decode_tok_s"]
            row["greedy_match"] = _common_prefix(tokens, base_tokens) / max(len(base_tokens), 1)
        if bf16_tokens is not None and row.get("acceptance") is not None:
            row["same_as_bf16"] = _common_prefix(tokens, bf16_tokens) / max(len(bf16_tokens), 1)
    report(rows, COLUMNS, info, str(model_path),
           f"MBU: bytes read per decode step (weights + valid KV cache) x steps/s / "
           f"{rows[0]['peak_bw_gb_s']:.1f} GB/s measured read bandwidth.", args.json_path)
    return 0


def _run_isolated(step: Step, args: argparse.Namespace, model: str, peak_bw: float) -> dict[str, Any]:
    """A fresh interpreter per step: honest peak memory, no compile state shared between steps."""
    with tempfile.TemporaryDirectory(prefix="genfast-bench-") as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, "-m", "genfast", "bench", "llm", "--one-step", step.name, "--model", model,
               "--device", args.device, "--prompt-tokens", str(args.prompt_tokens),
               "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats), "--json", str(out),
               "--prompt", args.prompt, "--speculate-k", str(args.speculate_k)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if args.tp > 1:
            cmd += ["--tp", str(args.tp)]
        env = {**os.environ, "GENFAST_PEAK_BW_GBS": f"{peak_bw / 1e9:.3f}"}  # one figure for all steps
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, env=env)
        if done.returncode != 0 or not out.exists():
            raise UserError(f"benchmark step {step.name} failed (exit code {done.returncode}); see the error above")
        return json.loads(out.read_text())


def _step_named(name: str) -> Step:
    for step in LADDER:
        if step.name == name:
            return step
    if name.startswith("spec-"):
        from genfast.llm.speculative import parse_draft

        draft = name.removeprefix("spec-")
        parse_draft(draft)
        return Step(name, "bfloat16", True, f"compiled bf16, speculative decoding with draft {draft}", draft=draft)
    raise UserError(f"unknown step {name!r}; steps: {', '.join(s.name for s in LADDER)}, "
                    "spec-<draft> (e.g. spec-int4, spec-layers:24, spec-prompt-lookup, spec-model:PATH) "
                    "or speculative (compiled-bf16 and the spec- rows)")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

