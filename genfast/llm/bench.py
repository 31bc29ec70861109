"""`genfast bench llm`: the LLM recipe's ladder (genfast/llm/recipe.py), one fresh process per row.

Each row loads the model as its step says, then generates `new_tokens` greedy tokens after a
`prompt_tokens`-token prompt (text from Python's own `pydoc_data` topics, so anyone can reproduce
it): a first call (compiling, for compiled rows), then `repeats` timed ones. Rates are medians
over the repeats. Accuracy: how many of the baseline's greedy tokens the row reproduces before the
first difference. Rows named spec-<draft> add speculative decoding with that draft to the compile
step (genfast.llm.decoding.drafters.parse_draft); `--steps speculative` runs compile and four of them.
Recipe rows run batch-invariant where the model and machine allow (genfast/llm/model/invariance.py,
as the run commands do); the row no-batch-invariant runs the --spec-target step on the library
kernels instead: beside the compile row, what that mode costs.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from genfast.bench.ladder import COMPILE_TIME, NOTE, PEAK_MEMORY, SPEEDUP, STEP, Case, Ladder, Options, Row
from genfast.bench.table import median
from genfast.errors import UserError
from genfast.llm.corpus import pydoc_text
from genfast.llm.recipe import RECIPE
from genfast.recipe import Plan, Target
from genfast.storage.files import write_json_atomic

COMPILE = "compile"  # the quantized and speculative rows' reference (the issues' speed bars are relative to it)
SPECULATIVE = [COMPILE, "spec-int4", "spec-int8", "spec-layers:24", "spec-prompt-lookup"]
LIBRARY_KERNELS = "no-batch-invariant"  # the --spec-target step with --no-batch-invariant

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
        text = source[source.index("__all__") :]  # the code after the module docstring
    elif kind == "pydoc":
        text = pydoc_text()
    else:
        raise UserError(f"unknown --prompt {kind!r}; use one of {', '.join(PROMPT_KINDS)}")
    ids = tokenizer.encode(text[: n_tokens * 8])
    if len(ids) < n_tokens:
        available = len(tokenizer.encode(text))
        raise UserError(
            f"--prompt-tokens {n_tokens} is more than the {kind} text provides: {available} tokens with this tokenizer"
        )
    return ids[:n_tokens]


def draft_of(step: str) -> str | None:
    """The draft a spec-<draft> row speculates with (checked), None for a recipe step."""
    if not step.startswith("spec-"):
        return None
    from genfast.llm.decoding.drafters import parse_draft

    draft = step.removeprefix("spec-")
    parse_draft(draft)
    return draft


def on_spec_target(step: str) -> bool:
    """Whether a row runs the --spec-target step with something added (a draft, batch invariance)
    rather than a recipe step of its own."""
    return step == LIBRARY_KERNELS or draft_of(step) is not None


class LlmLadder(Ladder):
    workload = "llm"
    recipe = RECIPE
    speed_key = "decode_tok_s"
    # fmt: off
    columns = (
        STEP, ("decode_tok_s", "decode tok/s", ".1f"), ("decode_range", "min-max", ""), SPEEDUP,
        ("vs_compile", "vs compile", ".2f"), ("prefill_tok_s", "prefill tok/s", ".0f"), ("ttft_ms", "TTFT ms", ".0f"),
        ("bytes_per_token_mb", "MB/token", ".1f"), ("gb_s", "GB/s", ".1f"), ("mbu", "MBU", ".0%"), PEAK_MEMORY,
        COMPILE_TIME, ("greedy_match", "same greedy tokens", ".0%"), ("acceptance", "drafts accepted", ".0%"),
        ("tokens_per_pass", "tokens/target pass", ".2f"), ("draft_share", "drafting share", ".0%"),
        ("first_token_s", "first token s after launch", ".1f"),
        ("same_as_target", "same tokens as target", ".0%"), ("dtype", "dtype", ""),
        ("batch_invariant", "batch-invariant", ""), NOTE,
    )
    # fmt: on

    def options(self, args: Any) -> Options:
        from genfast.bench.machine import peak_read_bandwidth
        from genfast.llm.checkpoints.checkpoint import resolve_checkpoint
        from genfast.platform.hardware import resolve_device

        checkpoint = resolve_checkpoint(args.model)  # fail early on a missing model or an unknown random: shape
        model_args = checkpoint.args
        if args.tp and args.tp > 1:
            from genfast.llm.tensor_parallel import check_devices, check_shardable

            check_shardable(model_args, args.tp)
            check_devices(args.device, args.tp)
        # Bandwidth varies with the machine's state (shared hosts): measure it now, for every row.
        peak_bw = peak_read_bandwidth(resolve_device(args.device), remeasure=not os.environ.get("GENFAST_PEAK_BW_GBS"))
        return {
            **super().options(args),
            "model": str(checkpoint.path),
            "prompt": args.prompt,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "int4_group_size": args.int4_group_size,
            "speculate_k": args.speculate_k,
            "spec_target": self.recipe.step(args.spec_target).name,  # checked: a step of the recipe
            "tp": args.tp or 1,
            "peak_bw": peak_bw,
        }

    def steps(self, text: str | None) -> list[str]:
        if not text:
            return list(self.recipe.names)
        names = text.replace("speculative", ",".join(SPECULATIVE)).split(",")
        plain = self.recipe.ordered(n for n in names if not on_spec_target(n))
        return plain + list(dict.fromkeys(n for n in names if on_spec_target(n)))

    def header(self, options: Options, machine: str) -> str:
        ranks = f", tensor parallel over {options['tp']} ranks (per-rank bytes and MBU)" if options["tp"] > 1 else ""
        groups = f"; int4 rows in groups of {options['int4_group_size']}" if options["int4_group_size"] else ""
        return (
            f"genfast bench llm: {options['model']} on {machine}{ranks}\nprompt: {options['prompt']}, "
            f"{options['prompt_tokens']} tokens; {options['new_tokens']} new tokens (greedy), median of "
            f"{options['repeats']}{groups}"
        )

    def model(self, options: Options) -> str:
        from genfast.storage.paths import model_label

        return model_label(options["model"])

    def footnote(self, options: Options, rows: list[dict[str, Any]]) -> str:
        from genfast.platform import hugepages
        from genfast.platform.hardware import resolve_device

        on_cpu = resolve_device(options["device"]).type == "cpu"
        return (
            f"MBU: bytes read per decode step (weights + valid KV cache) x steps/s / {options['peak_bw'] / 1e9:.1f} "
            "GB/s measured read bandwidth. vs compile: decode against the compile row (the quantized and "
            "speculative rows' reference)." + (f" Weights {hugepages.describe()}." if on_cpu else "")
        )

    def finish(self, rows: list[dict[str, Any]]) -> None:
        reference = next((r for r in rows if r["step"] == COMPILE and r.get("decode_tok_s")), None)
        for row in rows:
            if row.get("decode_tok_s"):
                row["decode_range"] = f"{row['decode_tok_s_min']:.0f}-{row['decode_tok_s_max']:.0f}"
                if reference is not None:
                    row["vs_compile"] = row["decode_tok_s"] / reference["decode_tok_s"]

    def launch(self, spec: Path, options: Options) -> int | None:
        from genfast.llm.tensor_parallel import launch_tp, launched

        if options["tp"] == 1 or launched():
            return None
        return launch_tp([str(spec)], options["tp"], module="genfast.bench")

    def skip_reason(self, row: Row, options: Options, target: Target) -> str | None:
        if not on_spec_target(row.step):
            return super().skip_reason(row, options, target)
        if options["tp"] > 1 and row.step != LIBRARY_KERNELS:
            return "speculative decoding does not combine with --tp yet"
        return super().skip_reason(Row(options["spec_target"]), options, target)

    def build(self, row: Row, plan: Plan | None, options: Options, target: Target, workdir: Path) -> Case:
        from genfast.llm.decoding.generate import GenerationResult
        from genfast.llm.decoding.precompiled import attach
        from genfast.llm.decoding.sampling import SamplingParams
        from genfast.llm.decoding.stats import decode_traffic
        from genfast.llm.recipe import apply_recipe, make_generator
        from genfast.llm.tensor_parallel import check_same_tokens, join

        draft = draft_of(row.step)
        settings = (plan or self.recipe.plan(options["spec_target"], target)).settings
        if row.step == LIBRARY_KERNELS:
            settings = replace(settings, batch_invariant=False)
        tp = options["tp"]
        if tp > 1:
            join(tp)
        group_size = options["int4_group_size"] if settings.quant == "int4" else None
        loaded = apply_recipe(options["model"], settings, options["device"], options["threads"], group_size, tp)
        prompt = benchmark_prompt(loaded.tokenizer, options["prompt_tokens"], options["prompt"])
        k = options["speculate_k"] if draft else None
        max_seq = len(prompt) + options["new_tokens"] + (k or 0)  # speculative: room for the last verify pass
        generator = make_generator(loaded, max_seq, 1, settings.compile, draft, k)
        greedy = SamplingParams()
        steps = attach(generator, loaded, greedy, lambda m: print(m, file=sys.stderr)) if settings.compile else None
        calls = 0

        def run() -> GenerationResult:
            # The first call starts as `genfast generate` does (saved compiled steps load in the
            # background, eager meanwhile); then the compiled steps are loaded or compiled here, so
            # the timed calls all run them. The first call's time includes that (compile s).
            nonlocal calls
            calls += 1
            if calls == 1 and steps is not None:
                steps.start(compile_missing="never", defer=True)
            result = generator.generate([prompt], options["new_tokens"], greedy, stop_at_eos=False)
            if calls == 1 and settings.compile:
                generator.warmup(greedy)
            return result

        def first(result: GenerationResult, started: float) -> dict[str, Any]:
            return {"first_token_s": started + result.ttft_s}

        def measure(results: list[GenerationResult], seconds: list[float]) -> dict[str, Any]:
            check_same_tokens([results[-1].token_ids[0]])
            # A speculative row's greedy tokens against its target's row (run before it, if asked for).
            on_target = on_spec_target(row.step)
            same_as_target = agreement(results[-1].token_ids[0], workdir, options["spec_target"]) if on_target else None
            decode = median([r.decode_tok_s for r in results])
            mid = min(results, key=lambda r: abs(r.decode_tok_s - decode))
            traffic = replace(decode_traffic(loaded.model, mid), steps_per_s=decode)  # at the median rate
            spec = draft is not None  # a target pass yields several tokens: bytes per token and MBU do not apply
            if spec:
                what = f"{options['spec_target']} step, speculative decoding with draft {draft}"
            elif row.step == LIBRARY_KERNELS:
                what = f"{options['spec_target']} step on the library kernels (--no-batch-invariant)"
            else:
                what = self.recipe.step(row.step).changes
            return {
                "what": what,
                "dtype": loaded.dtype_label(),
                "batch_invariant": "yes" if loaded.batch_invariant else "no",
                "quant": loaded.quant,
                "compiled": settings.compile,
                "tp": loaded.tp,
                "decode_tok_s": decode,
                "decode_tok_s_min": min(r.decode_tok_s for r in results),
                "decode_tok_s_max": max(r.decode_tok_s for r in results),
                "prefill_tok_s": median([r.prefill_tok_s for r in results]),
                "ttft_ms": 1000 * median([r.ttft_s for r in results]),
                "bytes_per_token_mb": None if spec else traffic.bytes_per_step / 1e6,
                "gb_s": None if spec else traffic.bytes_per_s / 1e9,
                "mbu": None if spec else traffic.mbu(options["peak_bw"]),
                "acceptance": mid.acceptance_rate if spec else None,
                "tokens_per_pass": mid.tokens_per_pass if spec else None,
                "draft_share": mid.draft_s / mid.decode_s if spec and mid.decode_s else None,
                "speculate_k": mid.speculate_k or None,
                "same_as_target": same_as_target,
                "prompt": options["prompt"],
                "peak_bw_gb_s": options["peak_bw"] / 1e9,
            }

        return Case(run, measure, compiled=settings.compile, first=first)

    def compare(self, row: Row, output: Any, workdir: Path) -> dict[str, Any]:
        """greedy_match: the share of the baseline's greedy tokens reproduced before the first
        difference. Every recipe row leaves its tokens for the rows after it (a speculative row
        compares itself with its target's, in `build`)."""
        tokens = output.token_ids[0]
        if not on_spec_target(row.step):
            # Atomically: under --tp every rank writes the same file while the others may read it.
            write_json_atomic(workdir / f"tokens-{row.step}.json", tokens)
        match = agreement(tokens, workdir, self.recipe.baseline)
        return {} if match is None else {"greedy_match": match}


def agreement(tokens: list[int], workdir: Path, step: str) -> float | None:
    """The share of `step`'s row's greedy tokens (left in `workdir` by `LlmLadder.compare`) that
    `tokens` reproduce before the first difference; None where that row did not run."""
    from genfast.llm.decoding.generate import common_prefix

    path = workdir / f"tokens-{step}.json"
    if not path.exists():
        return None
    reference = json.loads(path.read_text())
    return common_prefix(tokens, reference) / max(len(reference), 1)


def bench_command(args: Any) -> int:
    from genfast.bench.ladder import run

    return run(LlmLadder(), args)
