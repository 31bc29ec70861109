"""`genfast bench diffusion`: the recipe's ladder (genfast/diffusion/recipe.py) on the user's machine.

Every row runs in a fresh interpreter on the same pipeline (random weights at the real
architecture size: speed does not depend on weight values; `tiny-*` for smoke tests), the same
prompt and seed: seconds per image (text encoding + N denoising steps + VAE decode), seconds per
denoiser step (the denoiser's own calls, timed around it), compile time (first call minus a warm
one), peak memory, and PSNR of the image against the baseline's (fp32, explicit-softmax attention)
and against the same fp32 pipeline with SDPA attention. Rows compiled with symbolic sizes also
generate one image at a second resolution and report the graphs it added (0: no recompile).

The first row, `diffusers`, is diffusers' own pipeline as users run it: bf16, its default
attention, eager, nothing of genfast's applied; its PSNR is computed by the baseline's process
(which runs after it) and moved into its row. FLUX.1 and SD 3.5 (genfast.diffusion.transformer_archs)
are built with `--blocks` transformer blocks at the real width; every row says how many. genfast's
steps on these transformers are new: a row whose step fails on one is reported with the reason in
its note and the ladder goes on. Before any row is built, rows whose weights and attention would
not fit in this machine's memory are refused with the GiB they need.

On FLUX.1 and SD 3.5 the last row, `cache-dit`, is cache-dit's DBCache (the package's one-call
`enable_cache`) on diffusers' own pipeline as the first row runs it, configured as genfast's block
cache is (feature-cache: first block only, F1B0, unless `--cache-blocks` says otherwise; the same
threshold, warm-up and cached steps in a row): the peer of the feature-cache row. It is skipped,
saying so, where cache-dit is not installed (scripts/setup.sh bench installs it). With random
weights, how many steps a cache skips is not what a trained model's would be: both rows say how
many they skipped. `--cache-threshold` sets both rows' threshold and `--cache-blocks` their front
and back blocks (the feature-cache step's parameters, Step.tunes, which travel to every row's
process in the options and change only the plans that apply that step), so that random weights
can show what a cached step costs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from genfast.bench.ladder import COMPILE_TIME, NOTE, PEAK_MEMORY, STEP, TUNED, Case, Ladder, Options, Row
from genfast.bench.table import median
from genfast.diffusion.pipelines import DIT_ARCHS, DenoiserWrapper
from genfast.diffusion.recipe import BLOCK_CACHE_THRESHOLD, RECIPE, DiffusionSettings
from genfast.errors import UserError
from genfast.platform.hardware import available_memory_bytes, synchronize
from genfast.recipe import Plan, Target

TINY_ARCHS = ("tiny-sd15", "tiny-sdxl", "tiny-flux", "tiny-sd3")
ARCHS = ("sd15", "sdxl", *DIT_ARCHS, *TINY_ARCHS)
DIFFUSERS = "diffusers"  # the row of diffusers' own pipeline (bf16, eager, unmodified)
CACHE_DIT = "cache-dit"  # cache-dit's DBCache on diffusers' own pipeline (FLUX.1 and SD 3.5 only)
FEATURE_CACHE = "feature-cache"  # the recipe's step that cache-dit's row is configured as
PROMPT = "a photograph of a lighthouse on a rocky coast at dusk"
# Reference images and the row keys of the PSNR against them; both come from the baseline's process
# (fp32-sdpa: the baseline pipeline switched to SDPA attention, the quality reference).
REFERENCES = {"baseline": "psnr_db", "fp32-sdpa": "psnr_vs_sdpa_db"}
# The diffusers row's PSNR, computed by the baseline's process and moved into its row by `finish`.
DIFFUSERS_PSNR = "diffusers_psnr"
GIB = 2**30
# Speed-ups are against the diffusers row where it runs, else the baseline (`reference_steps`).
SPEEDUP_VS_FIRST = ("speedup", "speed-up", ".2f")


def _is_dit(arch: str) -> bool:
    """FLUX.1- and SD 3.5-shaped pipelines, real or tiny: where genfast's steps are still new."""
    return arch in DIT_ARCHS or arch in ("tiny-flux", "tiny-sd3")


def _denoiser_class(arch: str) -> str:
    """The class of the arch's denoiser, known before it is built (steps such as the feature
    cache depend on it)."""
    if arch in DIT_ARCHS:
        from genfast.diffusion.transformer_archs import ARCHS as DIT

        family = DIT[arch].family
    else:
        family = arch.removeprefix("tiny-")
    return {"flux": "FluxTransformer2DModel", "sd3": "SD3Transformer2DModel"}.get(family, "UNet2DConditionModel")


def _pipeline_target(options: Options, target: Target) -> Target:
    from genfast.diffusion.recipe import PipelineTarget

    return PipelineTarget(target.device, target.dtype, _denoiser_class(options["arch"]))


def _cast_quietly(pipe: Any, dtype: torch.dtype) -> None:
    """pipe.to(dtype) without diffusers' warning, on every cast, that no module asks for fp32."""
    from diffusers.utils import logging as diffusers_logging

    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        pipe.to(dtype=dtype)
    finally:
        diffusers_logging.set_verbosity(verbosity)


def _pipeline(options: Options, device: torch.device) -> Any:
    from genfast.diffusion.pipelines import random_pipeline, tiny_pipeline

    arch = options["arch"]
    if arch.startswith("tiny-"):
        return tiny_pipeline(arch.removeprefix("tiny-")).to(device)
    if arch in DIT_ARCHS:  # drawn in bf16; a fp32 row casts the same weights up
        return random_pipeline(arch, device=device, blocks=options["blocks"])
    return random_pipeline(arch, device=device).to(device)


def _call_arguments(arch: str) -> dict[str, Any]:
    """How the architecture's model card calls its pipeline (guidance, T5 sequence length)."""
    if arch not in DIT_ARCHS:
        return {}
    from genfast.diffusion.transformer_archs import ARCHS as DIT

    return dict(DIT[arch].call)


def _row_dtype(step: str, target: Target) -> str:
    """What the row's weights and activations are in: the diffusers row in bf16 (fp16 where
    --dtype asks for it on CUDA), the baseline in fp32, later steps as the bf16 step says."""
    from genfast import steps

    if step in (DIFFUSERS, CACHE_DIT):
        return steps.low_precision_name(target) or "bfloat16"
    return "float32" if step == RECIPE.baseline else steps.low_precision_name(target) or "float32"


def memory_needed_bytes(options: Options, step: str, target: Target) -> int:
    """An estimate of a row's peak memory: every parameter in the row's dtype, the explicit-softmax
    attention scores of the baseline (SDPA keeps none), and 1 GiB for the other activations."""
    itemsize = torch.empty(0, dtype=getattr(torch, _row_dtype(step, target))).element_size()
    need = options["parameters"] * itemsize + GIB
    if step == RECIPE.baseline:
        need += options["attention_scores"] * 4 * 2  # fp32 scores and their softmax
    return need


def _dit_sizes(arch: str, blocks: int | None, size: int) -> dict[str, Any]:
    """The parameter count (from the configs, on the meta device) and the largest attention's
    score count of `arch` at `size` x `size` pixels, for the memory estimate."""
    from genfast.diffusion.transformer_archs import ARCHS as DIT
    from genfast.diffusion.transformer_archs import parameter_counts

    spec = DIT[arch]
    image_tokens = (size // 16) ** 2  # VAE factor 8, 2x2 patches
    text_tokens = spec.call["max_sequence_length"] + (77 if spec.family == "sd3" else 0)
    batch = 2 if spec.family == "sd3" else 1  # classifier-free guidance
    heads = spec.transformer["num_attention_heads"]
    return {
        "parameters": sum(parameter_counts(arch, blocks).values()),
        "attention_scores": batch * heads * (image_tokens + text_tokens) ** 2,
    }


class _TimedDenoiser(DenoiserWrapper):
    """Times the denoiser's calls from outside (hooks on a module compiled in place would be
    traced into its graph); device-synchronized on CUDA."""

    def __init__(self, denoiser: torch.nn.Module, device: torch.device) -> None:
        super().__init__(denoiser)
        self.device, self.seconds = device, 0.0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        synchronize(self.device)
        start = time.perf_counter()
        out = self.denoiser(*args, **kwargs)
        synchronize(self.device)
        self.seconds += time.perf_counter() - start
        return out


class DiffusionLadder(Ladder):
    workload = "diffusion"
    recipe = RECIPE
    speed_key = "s_per_image"
    higher_is_faster = False
    reference_steps = (DIFFUSERS, RECIPE.baseline)  # speed-ups against what users run, when measured
    # fmt: off
    columns = (
        STEP, ("blocks", "blocks", ""), ("s_per_image", "s/image", ".2f"), SPEEDUP_VS_FIRST,
        ("s_per_denoiser_step", "s/denoiser step", ".3f"), COMPILE_TIME, PEAK_MEMORY,
        ("psnr_db", "PSNR vs baseline dB", ".1f"), ("psnr_vs_sdpa_db", "PSNR vs fp32 SDPA dB", ".1f"),
        ("new_size_graphs", "graphs at new size", "d"), NOTE,
    )
    # fmt: on

    def options(self, args: argparse.Namespace) -> Options:
        if args.arch not in ARCHS:
            raise UserError(f"unknown --arch {args.arch!r}; choose one of {', '.join(ARCHS)}")
        if args.size % 8 or not 8 <= args.size <= 4096:
            raise UserError(f"--size {args.size}: must be a multiple of 8 between 8 and 4096")
        if args.arch in DIT_ARCHS and args.size % 16:  # the VAE's factor 8 times the transformers' 2x2 patches
            raise UserError(f"--size {args.size}: {args.arch} needs a multiple of 16")
        if CACHE_DIT in (getattr(args, "steps", None) or "").split(",") and not _is_dit(args.arch):
            raise UserError(f"the {CACHE_DIT} row caches transformer blocks: {args.arch}'s denoiser is a UNet")
        options = {
            **super().options(args),
            "arch": args.arch,
            "size": args.size,
            "denoising_steps": args.denoising_steps,
            **self._depth(args.arch, getattr(args, "blocks", None)),
        }
        tuned = {
            **self._cache_threshold(args.arch, getattr(args, "cache_threshold", None)),
            **self._cache_blocks(args.arch, getattr(args, "cache_blocks", None), options["blocks"]),
        }
        if tuned:
            options[TUNED] = tuned
        if args.arch in DIT_ARCHS:
            options.update(_dit_sizes(args.arch, options["blocks"], args.size))
        return options

    @staticmethod
    def _cache_threshold(arch: str, threshold: float | None) -> Options:
        """--cache-threshold as the feature-cache step's tuned threshold (none: the recipe's)."""
        if threshold is None:
            return {}
        if not math.isfinite(threshold) or threshold < 0:
            raise UserError(
                f"--cache-threshold {threshold}: must be a finite number >= 0 (the first block's relative residual "
                "change under which a cached step skips the other blocks; 0 caches none)"
            )
        if not _is_dit(arch):
            raise UserError(
                f"--cache-threshold sets the block cache's threshold of FLUX.1 and SD 3.5: {arch}'s feature cache is "
                "DeepCache, which reuses a UNet's deep features at a fixed interval and has no threshold"
            )
        return {"block_cache_threshold": threshold}

    @staticmethod
    def _cache_blocks(arch: str, blocks: str | None, built: int | None) -> Options:
        """--cache-blocks F,B as the feature-cache step's tuned front and back block counts."""
        if blocks is None:
            return {}
        if not _is_dit(arch):
            raise UserError(f"--cache-blocks sets the block cache of FLUX.1 and SD 3.5: {arch}'s denoiser is a UNet")
        parts = blocks.split(",")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or int(parts[0]) < 1:
            raise UserError(f"--cache-blocks {blocks}: give F,B, front blocks >= 1 and back blocks >= 0 (e.g. 1,0)")
        front, back = int(parts[0]), int(parts[1])
        if built is not None and front + back >= built:
            raise UserError(
                f"--cache-blocks {blocks}: the cache needs a block to skip between its front and back blocks, and "
                f"{built} are built (--blocks)"
            )
        return {"block_cache_front": front, "block_cache_back": back}

    @staticmethod
    def _depth(arch: str, blocks: int | None) -> Options:
        """`blocks` (the transformer blocks built; --blocks, or the architecture's default) and
        `depth` (how they split, for the header); UNets and tiny pipelines are always whole."""
        if arch not in DIT_ARCHS:
            if blocks is not None:
                raise UserError(f"--blocks applies to {', '.join(DIT_ARCHS)}; {arch} is always built whole")
            return {"blocks": None, "depth": "all blocks"}
        from genfast.diffusion.transformer_archs import ARCHS as DIT

        spec = DIT[arch]
        blocks = spec.bench_blocks if blocks is None else blocks
        if not 1 <= blocks <= spec.full_blocks:
            raise UserError(
                f"--blocks {blocks}: {arch} has {spec.full_blocks} transformer blocks; choose 1 to {spec.full_blocks}"
            )
        return {"blocks": blocks, "depth": spec.depth(blocks).describe()}

    def steps(self, text: str | None) -> list[str]:
        """The recipe's steps, between the `diffusers` row and the `cache-dit` row (both by
        default, or when named; `rows` leaves cache-dit out on UNet pipelines)."""
        if not text:
            return [DIFFUSERS, *self.recipe.names, CACHE_DIT]
        names = text.split(",")
        first = [DIFFUSERS] if DIFFUSERS in names else []
        last = [CACHE_DIT] if CACHE_DIT in names else []
        return first + self.recipe.ordered(n for n in names if n not in (DIFFUSERS, CACHE_DIT)) + last

    def rows(self, steps: list[str], options: Options) -> list[Row]:
        """The rows; refused before any is built when none would fit in memory (the others
        are skipped in their own process with the GiB they need)."""
        if not _is_dit(options["arch"]):
            steps = [step for step in steps if step != CACHE_DIT]
        if "parameters" in options:
            target = self._target(options)
            available = available_memory_bytes(target.device)
            needs = {step: memory_needed_bytes(options, step, target) for step in steps}
            if available is not None and needs and min(needs.values()) > available:
                raise UserError(
                    f"{options['arch']} with {options['depth']} needs ~{min(needs.values()) / GIB:.1f} GiB "
                    f"({options['parameters'] / 1e9:.2f} G parameters), this machine has {available / GIB:.1f} GiB "
                    "available: use a smaller --blocks (or --size)"
                )
        return [Row(step) for step in steps]

    @staticmethod
    def _target(options: Options) -> Target:
        from genfast.platform.hardware import resolve_device

        return Target(resolve_device(options["device"]), options["dtype"])

    def header(self, options: Options, machine: str) -> str:
        from genfast import steps

        dtype = steps.low_precision_name(self._target(options)) or "float32"
        depth = f", {options['depth']}" if options["blocks"] is not None else ""
        header = (
            f"genfast bench diffusion: {options['arch']} with RANDOM weights (speed only){depth}, {options['size']}x"
            f"{options['size']}, {options['denoising_steps']} denoising steps, on {machine}; median of "
            f"{options['repeats']}; steps from bf16 on in {dtype}"
        )
        tuned = options.get(TUNED, {})
        threshold = tuned.get("block_cache_threshold", BLOCK_CACHE_THRESHOLD)
        if threshold != BLOCK_CACHE_THRESHOLD:  # --cache-threshold
            header += f"; both caches' threshold {threshold} (the recipe's: {BLOCK_CACHE_THRESHOLD})"
        if "block_cache_front" in tuned:  # --cache-blocks
            header += f"; both caches' front and back blocks F{tuned['block_cache_front']}B{tuned['block_cache_back']}"
        return header

    def model(self, options: Options) -> str:
        blocks = options.get("blocks")
        depth = "" if blocks is None else f", {options['depth'].split(';')[0]}"
        return f"{options['arch']} (random weights{depth})"

    def footnote(self, options: Options, rows: list[dict[str, Any]]) -> str:
        arch = options["arch"]
        if arch == "flux-schnell":
            guidance = "no guidance"
        elif arch in ("flux-dev", "tiny-flux"):
            guidance = "guidance embedding 3.5, no classifier-free guidance"
        else:
            guidance = "classifier-free guidance"
        return (
            f"s/image: prompt encoding + {options['denoising_steps']} denoising steps ({guidance}) + VAE decode, "
            f"median of {options['repeats']} after a warm-up. diffusers: its own pipeline in bf16, eager, "
            "unmodified. cache-dit: cache-dit's DBCache on that pipeline, configured as genfast's feature-cache row's "
            "block cache. speed-up: against the diffusers row (the baseline where it is not run). PSNR: same seed "
            "and prompt, images in [0, 1]."
        )

    def skip_reason(self, row: Row, options: Options, target: Target) -> str | None:
        if row.step in self.recipe.names:  # as the recipe says for this pipeline
            reason = self.recipe.unavailable(row.step, _pipeline_target(options, target))
            if reason:
                return reason
        if row.step == CACHE_DIT and importlib.util.find_spec("cache_dit") is None:
            return "cache-dit is not installed (pip install cache-dit; scripts/setup.sh bench installs it)"
        if "parameters" not in options:
            return None
        need, available = memory_needed_bytes(options, row.step, target), available_memory_bytes(target.device)
        if available is not None and need > available:
            return (
                f"needs ~{need / GIB:.1f} GiB in {_row_dtype(row.step, target)}, {available / GIB:.1f} GiB available "
                "(use a smaller --blocks)"
            )
        return None

    def launch(self, spec: Path, options: Options) -> int | None:
        """On FLUX.1 and SD 3.5 pipelines, measures the row here and reports a step that fails on
        them in the row's note (genfast's steps on these transformers are new), so the ladder
        goes on with the others; other pipelines are measured as every ladder's rows are."""
        if not _is_dit(options["arch"]):
            return None
        from genfast.bench.ladder import measure_row
        from genfast.storage.files import write_json_atomic

        row_spec = json.loads(spec.read_text())
        try:
            result = measure_row(row_spec)
        except Exception as e:  # any failure of the step becomes the row's note
            traceback.print_exc(file=sys.stderr)
            reason = str(e).splitlines()[0] if str(e) else ""
            step = row_spec["row"]["step"]
            result = {"step": step, "group": [], "note": f"failed on {options['arch']}: {type(e).__name__}: {reason}"}
        write_json_atomic(row_spec["out"], result)
        return 0

    def build(self, row: Row, plan: Plan | None, options: Options, target: Target, workdir: Path) -> Case:
        from genfast.diffusion.attention import set_attention
        from genfast.diffusion.pipelines import call_kwargs, denoiser_name, denoiser_of, initial_latents
        from genfast.diffusion.recipe import apply_recipe

        size, steps = options["size"], options["denoising_steps"]
        pipe = _pipeline(options, target.device)
        pipeline_notes: list[str] = []
        if plan is None:  # the diffusers row: its own pipeline in bf16, nothing else changed
            _cast_quietly(pipe, getattr(torch, _row_dtype(DIFFUSERS, target)))
            dynamic = False
            if row.step == CACHE_DIT:  # as the feature-cache row's block cache, --cache-threshold included
                cache = self.recipe.plan(FEATURE_CACHE, _pipeline_target(options, target), options.get(TUNED))
                pipeline_notes.append(_enable_cache_dit(pipe, cache.settings))
        else:
            apply_recipe(pipe, plan.settings)
            dynamic = plan.settings.dynamic_shapes
            # What the steps do on this pipeline (e.g. the convolution steps change only a DiT's
            # VAE): the child's plan was made before the pipeline existed.
            planned = self.plan(row, options, _pipeline_target(options, target)).notes  # type: ignore[union-attr]
            pipeline_notes = [f"{step}: {note}" for step, note in planned if (step, note) not in plan.notes]
        # A smaller, non-square second size for dynamic-shape rows: cheaper than the timed one.
        sizes = [(size, size)] + ([(max(size - 64, 64), max(size - 128, 64))] if dynamic else [])
        # Drawn before the timer wraps the denoiser (they read its type, dtype and device), as
        # inference tensors like every later step's latents: a compiled denoiser's guards see
        # one kind of tensor.
        with torch.inference_mode():
            latents = {hw: initial_latents(pipe, *hw, seed=0) for hw in sizes}
        arguments = {**call_kwargs(pipe), **_call_arguments(options["arch"])}
        timer = _TimedDenoiser(denoiser_of(pipe), target.device)  # around the feature cache too: what the loop calls
        setattr(pipe, denoiser_name(pipe), timer)

        def generate(height: int = size, width: int = size) -> torch.Tensor:
            generator = torch.Generator("cpu").manual_seed(0)
            with torch.inference_mode():
                return (
                    pipe(
                        PROMPT,
                        height=height,
                        width=width,
                        num_inference_steps=steps,
                        latents=latents[(height, width)],
                        generator=generator,
                        output_type="pt",
                        **arguments,
                    )
                    .images.float()
                    .cpu()
                )

        denoiser_times: list[float] = []

        def run() -> torch.Tensor:
            timer.seconds = 0.0
            image = generate()
            denoiser_times.append(timer.seconds / steps)
            return image

        def measure(images: list[torch.Tensor], seconds: list[float]) -> dict[str, Any]:
            result: dict[str, Any] = {
                "s_per_image": median(seconds),
                "s_per_denoiser_step": median(denoiser_times[1:]),
                "arch": options["arch"],
                "blocks": options["blocks"],
                "size": size,
                "denoising_steps": steps,
            }
            if dynamic:
                from torch._dynamo.utils import counters

                graphs = counters["stats"]["unique_graphs"]
                generate(*sizes[1])
                result["new_size_graphs"] = counters["stats"]["unique_graphs"] - graphs
            if row.step == DIFFUSERS:  # compared by the baseline's process, which runs after
                torch.save(images[-1], workdir / f"{DIFFUSERS}.pt")
            if row.step == self.recipe.baseline:  # the references: this image, and SDPA's in fp32
                torch.save(images[-1], workdir / "baseline.pt")
                for model in (timer.denoiser, pipe.vae):
                    set_attention(model, "sdpa")
                torch.save(generate(), workdir / "fp32-sdpa.pt")
                result |= _diffusers_psnr(workdir)
            return result

        def notes() -> list[str]:
            from genfast.compilation.saved import compile_notes

            cached = _cached_steps(pipe, timer.denoiser, steps)
            return pipeline_notes + cached + compile_notes(timer.denoiser) + compile_notes(pipe.vae)

        return Case(run, measure, compiled=plan is not None and plan.settings.compile != "none", notes=notes)

    def compare(self, row: Row, output: Any, workdir: Path) -> dict[str, Any]:
        from genfast.diffusion.quality import psnr

        result = {}
        for reference, key in REFERENCES.items():
            path = workdir / f"{reference}.pt"
            if path.exists() and row.step != self.recipe.baseline:
                result[key] = psnr(output, torch.load(path))
        return result

    def finish(self, rows: list[dict[str, Any]]) -> None:
        """The diffusers row's PSNR, which the baseline's process computed, into its row."""
        measured = next((r.pop(DIFFUSERS_PSNR) for r in rows if DIFFUSERS_PSNR in r), None)
        for row in rows:
            if row["step"] == DIFFUSERS and measured:
                row.update(measured)


def _enable_cache_dit(pipe: Any, settings: DiffusionSettings) -> str:
    """cache-dit's DBCache on `pipe`, configured as genfast's block cache with `settings` (the
    feature-cache row's): the same front and back blocks (F1B0 by default), threshold, warm-up steps
    and cached steps in a row. Returns the row's note."""
    os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "warning")  # read when it is imported: info logs every call
    import cache_dit

    config = cache_dit.DBCacheConfig(
        Fn_compute_blocks=settings.block_cache_front,
        Bn_compute_blocks=settings.block_cache_back,
        residual_diff_threshold=settings.block_cache_threshold,
        max_warmup_steps=settings.block_cache_warmup,
        max_continuous_cached_steps=settings.feature_cache_interval - 1,
    )
    cache_dit.enable_cache(pipe, cache_config=config)
    return f"cache-dit {cache_dit.__version__} {config.strify()}"


def _cached_steps(pipe: Any, denoiser: Any, steps: int) -> list[str]:
    """How many of an image's denoising steps the row's cache skipped (genfast's block cache or
    cache-dit's), for its note: random weights decide it differently from a trained model."""
    from genfast.diffusion.block_cache import BlockCache

    if isinstance(denoiser, BlockCache) and denoiser.calls:
        skipped = round(denoiser.skipped * steps / denoiser.calls)
    elif "cache_dit" in sys.modules:  # the cache-dit row (each row is a process of its own)
        import cache_dit

        stats = cache_dit.summary(pipe, logging=False)
        skipped = len(stats[-1].cached_steps) if stats else 0
    else:
        return []
    return [f"cached {skipped} of {steps} steps an image (random weights: a trained model's differ)"]


def _diffusers_psnr(workdir: Path) -> dict[str, Any]:
    """The diffusers row's image (saved by its process) against the references just made."""
    from genfast.diffusion.quality import psnr

    path = workdir / f"{DIFFUSERS}.pt"
    if not path.exists():
        return {}
    image = torch.load(path)
    return {DIFFUSERS_PSNR: {key: psnr(image, torch.load(workdir / f"{ref}.pt")) for ref, key in REFERENCES.items()}}


def bench_command(args: argparse.Namespace) -> int:
    from genfast.bench.ladder import run

    return run(DiffusionLadder(), args)
