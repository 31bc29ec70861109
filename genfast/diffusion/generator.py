"""`genfast.ImageGenerator`: text to image from Python, many prompts at a time.

Build it once (load the pipeline, apply the recipe), then `generate(prompts)` returns one PIL image
per prompt, in order. Prompts go through the pipeline `batch_size` at a time (consecutive prompts
with and without a negative prompt are not mixed: SDXL treats "no negative prompt" otherwise than
an empty one). Each prompt's noise comes from its own seed (`initial_latents`), so a prompt gives the
image `genfast imagine` gives for it with that seed; in a batch of several, up to float rounding
(a batched matrix product may add in another order: at most a level or two of 255 on the tiny
test pipelines; batch_size=1 gives exactly the single-prompt image).

An `ImageGenerator` pickles as the arguments it was built with and is rebuilt from them where it
is unpickled, and it is a Ray Data callable class as it is: `__call__(batch)` takes a `prompt`
column (optionally `seed` and `negative_prompt`) and returns the batch with `image` and `error`.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from genfast.errors import UserError

log = logging.getLogger("genfast")

RANDOM_ARCHS = {
    "tiny-sd15": "sd15",
    "tiny-sdxl": "sdxl",
    "tiny-pixart": "pixart",
    "tiny-flux": "flux",
    "tiny-sd3": "sd3",
}
RANDOM_WEIGHTS_WARNING = "random weights (--random-weights): for smoke tests and timing only; the image is noise"
MAX_SEED = 2**63 - 1  # torch's generators take a signed 64-bit seed
MAX_SIDE = 4096
DEFAULT_PIXELS = 1024 * 1024  # the memory check's image size where none is given: the largest native one


def parse_size(text: str) -> tuple[int, int]:
    """'WxH' -> (width, height), each a positive multiple of 8 (the VAE's downscale factor)."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not match:
        raise UserError(f"--size takes WIDTHxHEIGHT in pixels, e.g. 512x512; got {text!r}")
    width, height = int(match.group(1)), int(match.group(2))
    if not (8 <= width <= MAX_SIDE and 8 <= height <= MAX_SIDE) or width % 8 or height % 8:
        raise UserError(f"--size {width}x{height}: both sides must be multiples of 8 between 8 and {MAX_SIDE}")
    return width, height


def pipeline_source(model: str, random_weights: bool) -> str:
    """What `load` and the checks before it read: `model` itself (a local directory, a random
    pipeline's name), or a hub id's directory in the hub cache, downloaded first where missing."""
    from genfast.diffusion.pipelines import REAL_ARCHS, download_pipeline, is_local

    if random_weights or is_local(model) or model in RANDOM_ARCHS or model in REAL_ARCHS:
        return model
    return str(download_pipeline(model))


def declared_denoiser(model: str) -> str | None:
    """The denoiser class (`unet` or `transformer`) a local pipeline directory's model_index.json
    declares, or None (a hub id, or no readable index): lets the recipe be checked against the
    pipeline before the slow load."""
    index = Path(model).expanduser() / "model_index.json"
    try:
        components = json.loads(index.read_text())
    except (OSError, ValueError):
        return None
    for name in ("unet", "transformer"):
        entry = components.get(name) if isinstance(components, dict) else None
        if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str):
            return entry[1]
    return None


def load(
    model: str, random_weights: bool, dtype: torch.dtype, device: torch.device, quant: str = "none",
    min_features: int = 320, seed: int = 0,
) -> tuple[Any, str]:  # fmt: skip
    """The pipeline and how to describe it: a random one (`random_weights`: a tiny one, or
    FLUX.1 / SD 3.5 / SD 1.5 / SDXL at the real size), else a diffusers directory or hub id.
    `quant` "int8": the text encoders are loaded and quantized first, then the transformer is
    loaded (or drawn) in parts, each quantized as the dynamic-int8 step does with `min_features`
    (genfast/diffusion/loading.py): its whole float weights never exist."""
    from genfast.diffusion.loading import QUANTS, int8_prepare, quantize_text_encoders
    from genfast.diffusion.pipelines import DIT_ARCHS, REAL_ARCHS, load_pipeline, random_pipeline, tiny_pipeline
    from genfast.platform.heap import release_freed_memory

    if quant not in QUANTS:
        raise UserError(f"unknown --quant {quant!r}; use one of {', '.join(QUANTS)}")
    int8 = quant == "int8"
    if random_weights:
        if model not in RANDOM_ARCHS and model not in REAL_ARCHS:
            raise UserError(f"--random-weights builds one of {', '.join([*RANDOM_ARCHS, *REAL_ARCHS])}, not {model!r}")
        description = f"{model} with RANDOM weights"
        if model in RANDOM_ARCHS:  # tiny: built whole, then quantized as --quant would load it
            pipe = tiny_pipeline(RANDOM_ARCHS[model], seed).to(device)
            if int8:
                _unet_refused(pipe)
                quantize_text_encoders(pipe)
                int8_prepare(min_features)("", pipe.transformer)
            return pipe, description
        if model not in DIT_ARCHS:
            if int8:
                raise UserError(UNET_QUANT)
            return random_pipeline(model, seed, device, dtype=dtype), description
        if not int8:
            return random_pipeline(model, seed, device, dtype=dtype), description
        from genfast.diffusion.loading import random_transformer
        from genfast.diffusion.pipelines import _tiny_tokenizer
        from genfast.diffusion.transformer_archs import build_pipeline, transformer_spec

        pipe = build_pipeline(model, None, seed, device, dtype, tokenizer=_tiny_tokenizer(), transformer=False)
        quantize_text_encoders(pipe)
        release_freed_memory()  # the encoders' float weights, before the transformer's turn
        cls, config = transformer_spec(model)
        transformer = random_transformer(cls, config, dtype, device, seed, int8_prepare(min_features))
        pipe.register_modules(transformer=transformer)
        release_freed_memory()
        return pipe, description
    if model in RANDOM_ARCHS or model in REAL_ARCHS:
        raise UserError(f"{model} exists only with random weights: add --random-weights")
    if not int8:
        return load_pipeline(model, dtype=dtype, device=device), model
    directory = Path(model).expanduser()
    if not (directory / "model_index.json").is_file():
        raise UserError(
            f"--quant int8 loads a diffusers pipeline directory in parts; {model} is none (no model_index.json)"
        )
    if (directory / "unet").is_dir():
        raise UserError(UNET_QUANT)
    from genfast.diffusion.loading import load_transformer

    pipe = load_pipeline(model, dtype=dtype, device=device, without=("transformer",))
    quantize_text_encoders(pipe)
    release_freed_memory()  # the encoders' float weights, before the transformer's turn
    pipe.register_modules(transformer=load_transformer(directory, dtype, device, int8_prepare(min_features)))
    release_freed_memory()
    return pipe, model


UNET_QUANT = (
    "--quant int8 loads a transformer pipeline's transformer in parts (FLUX.1, SD 3/3.5); UNet "
    "pipelines (SD 1.5, SDXL) fit in memory without it: use --recipe dynamic-int8 for their int8 linears"
)


def _unet_refused(pipe: Any) -> None:
    if getattr(pipe, "transformer", None) is None:
        raise UserError(UNET_QUANT)


def check_memory(
    model: str, random_weights: bool, dtype: torch.dtype, device: torch.device, quant: str, min_features: int,
    pixels: int, available: int | None = None,
) -> None:  # fmt: skip
    """UserError before anything is loaded where the pipeline would not fit in the device's
    available memory (`available`: bytes; None: what the device reports), with the number it
    needs and what to try (genfast/diffusion/memory.py). Pipelines whose configs are not at hand
    (tiny random ones, directories without readable configs) are not checked; a hub id is checked
    by its downloaded directory (pipeline_source)."""
    from genfast.diffusion.memory import check_fits, directory_models, estimate
    from genfast.diffusion.pipelines import DIT_ARCHS
    from genfast.platform.hardware import available_memory_bytes

    if random_weights:
        if model not in DIT_ARCHS:
            return
        from genfast.diffusion.transformer_archs import empty_models

        models = empty_models(model)
    else:
        models = directory_models(Path(model).expanduser())
        if models is None:
            return
    need = estimate(models, dtype, quant, min_features, pixels)
    available = available_memory_bytes(device) if available is None else available
    check_fits(need, available, model)


def guidance_kwargs(pipe: Any, guidance: float | None, negative: Any) -> dict[str, Any]:
    """The pipeline call's guidance scale (the user's, else the pipeline's own default) and
    negative prompt (only when given: pipelines differ in their default, PixArt's is "").
    Guidance-distilled pipelines (Flux: the scale is an input of the model, `true_cfg_scale` a
    separate, doubled-cost option) take no negative prompt from genfast."""
    parameters = inspect.signature(pipe.__call__).parameters
    kwargs: dict[str, Any] = {}
    if "guidance_scale" in parameters:
        kwargs["guidance_scale"] = parameters["guidance_scale"].default if guidance is None else guidance
    elif guidance is not None:
        raise UserError(f"{type(pipe).__name__} takes no guidance scale: leave out --guidance")
    if negative is not None:
        if not takes_negative(pipe):
            raise UserError(
                f"{type(pipe).__name__}'s guidance is distilled into the model (--guidance sets it): "
                "it takes no --negative prompt"
            )
        kwargs["negative_prompt"] = negative
    return kwargs


def takes_negative(pipe: Any) -> bool:
    return "true_cfg_scale" not in inspect.signature(pipe.__call__).parameters


def check_size(pipe: Any, width: int, height: int) -> None:
    """A --size the pipeline cannot generate at exactly is an error, not a silently other size."""
    from genfast.diffusion.pipelines import size_multiple

    multiple = size_multiple(pipe)
    if width % multiple or height % multiple:
        raise UserError(
            f"--size {width}x{height}: {type(pipe).__name__} with this VAE and denoiser takes sides that "
            f"are multiples of {multiple}"
        )


def check_prompt(prompt: Any) -> str:
    if prompt is None:
        raise ValueError("no prompt")
    if not isinstance(prompt, str):
        raise ValueError(f"the prompt must be text, not {type(prompt).__name__}")
    if not prompt.strip():
        raise ValueError("the prompt is empty: nothing to draw")
    return prompt


def check_seed(seed: Any) -> int:
    """A seed as an int 0..2^63-1; whole floats (a column with gaps is float) and numpy ints taken."""
    if isinstance(seed, (float, np.floating)) and float(seed).is_integer():
        seed = int(seed)
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"the seed must be a whole number from 0 to {MAX_SEED}, not {seed!r}")
    return int(seed)


def random_seed() -> int:
    return secrets.randbelow(2**31)


class ImageGenerator:
    """A loaded diffusion pipeline that draws lists of prompts.

    `model`, `recipe`, `device`, `dtype`, `threads`, `random_weights` and `quant` mean what
    `genfast imagine`'s flags do; `size` ("WxH" or (width, height); None: the model's own), `steps` and
    `guidance` (None: the pipeline's default) fix every image; `batch_size` prompts go through the
    pipeline in one call (more is faster on a GPU; 1 draws exactly the image `genfast imagine` does)."""

    def __init__(
        self,
        model: str,
        *,
        recipe: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        threads: int | None = None,
        random_weights: bool = False,
        size: str | tuple[int, int] | None = None,
        steps: int = 30,
        guidance: float | None = None,
        batch_size: int = 1,
        quant: str = "none",
    ) -> None:
        from genfast.diffusion.pipelines import native_size
        from genfast.diffusion.recipe import DEFAULT_STEP, RECIPE, PipelineTarget, apply_recipe, pipeline_target
        from genfast.platform.hardware import DTYPES, dtype_name, resolve_device

        self._arguments = dict(
            model=model, recipe=recipe, device=device, dtype=dtype, threads=threads, random_weights=random_weights,
            size=size, steps=steps, guidance=guidance, batch_size=batch_size, quant=quant,
        )  # fmt: skip
        if steps < 1 or batch_size < 1:
            raise UserError(f"steps and batch_size must be at least 1, not {steps} and {batch_size}")
        if guidance is not None and not guidance >= 0:
            raise UserError(f"guidance must be >= 0, not {guidance}")
        requested = parse_size(size) if isinstance(size, str) else size
        self.recipe = recipe or DEFAULT_STEP
        self.steps, self.batch_size, self.random_weights = steps, batch_size, random_weights
        if threads is not None:
            torch.set_num_threads(threads)
        self.device = resolve_device(device)
        dtype = dtype_name(dtype)
        source = pipeline_source(model, random_weights)
        # Checked now, before the slow load, against what a local directory declares; planned again
        # (and reported) for the loaded pipeline.
        quantized = quant != "none"
        target = PipelineTarget(self.device, dtype, declared_denoiser(source), quantized)
        planned = RECIPE.plan(self.recipe, target).settings
        self.quant = quant
        pixels = requested[0] * requested[1] if requested else DEFAULT_PIXELS
        load_dtype = DTYPES[planned.dtype]
        check_memory(source, random_weights, load_dtype, self.device, quant, planned.int8_min_features, pixels)
        self.pipe, self.description = load(
            source, random_weights, load_dtype, self.device, quant, planned.int8_min_features
        )
        if source != model:  # a hub id: named as the user gave it, not by its cache directory
            self.description = model
        plan = RECIPE.plan(self.recipe, pipeline_target(self.pipe, dtype, quantized))
        self.settings = plan.settings
        self.messages = list(plan.messages())  # what the plan left out and why, for the caller to show
        self.width, self.height = requested or native_size(self.pipe)
        check_size(self.pipe, self.width, self.height)
        self.guidance_scale = guidance_kwargs(self.pipe, guidance, None).get("guidance_scale")
        apply_recipe(self.pipe, self.settings)

    def generate(
        self,
        prompts: str | Sequence[str],
        *,
        seed: int | Sequence[int] | None = None,
        negative: str | Sequence[str | None] | None = None,
    ) -> list[Image.Image]:
        """One image per prompt, in order. `seed`: an int (prompt i gets seed + i), one per prompt,
        or None (random). `negative`: a negative prompt for all, one per prompt (None: none), or
        None. Every input is checked before any runs: a bad one raises UserError naming it."""
        batch = [prompts] if isinstance(prompts, str) else list(prompts)
        count = len(batch)
        if seed is None:
            seeds = [random_seed() for _ in batch]
        elif isinstance(seed, (int, np.integer)):
            seeds = [int(seed) + i for i in range(count)]
        else:
            seeds = list(seed)
        negatives = [negative] * count if negative is None or isinstance(negative, str) else list(negative)
        if len(seeds) != count or len(negatives) != count:
            raise UserError(f"{count} prompts, {len(seeds)} seeds and {len(negatives)} negative prompts: give one each")
        for index, (prompt, one_seed, one_negative) in enumerate(zip(batch, seeds, negatives, strict=True)):
            try:
                self.check(prompt, one_seed, one_negative)
            except ValueError as e:
                raise UserError(f"prompt {index}: {e}") from e
        return self.draw(batch, [int(s) for s in seeds], negatives)

    def check(self, prompt: Any, seed: Any, negative: Any) -> None:
        """ValueError where this pipeline cannot draw the item: no prompt text, a bad seed, a
        negative prompt that is not text or that the pipeline takes none of."""
        check_prompt(prompt)
        check_seed(seed)
        if negative is not None:
            if not isinstance(negative, str):
                raise ValueError(f"the negative prompt must be text, not {type(negative).__name__}")
            if not takes_negative(self.pipe):
                raise ValueError(f"{type(self.pipe).__name__} takes no negative prompt (its guidance is distilled)")

    def truncation(self, prompt: str) -> str | None:
        """What the text encoders leave out of a long prompt, or None. diffusers cuts a prompt at
        each encoder's length (CLIP: 77 tokens) and draws the rest: so does genfast, and says so."""
        cut = []
        for tokenizer, limit in self._token_limits():
            tokens = len(tokenizer(prompt, truncation=False, verbose=False).input_ids)
            if tokens > limit:
                cut.append(f"{tokens} tokens, of which the text encoder reads {limit}")
        return "; ".join(cut) + " (the rest is left out, as diffusers does)" if cut else None

    def _token_limits(self) -> list[tuple[Any, int]]:
        """Each (tokenizer, tokens its encoder reads): CLIP's model_max_length, a T5's the
        pipeline's max_sequence_length (PixArt's only tokenizer, Flux's second, SD3's third)."""
        parameters = inspect.signature(self.pipe.__call__).parameters
        sequence = parameters["max_sequence_length"].default if "max_sequence_length" in parameters else None
        names = [n for n in ("tokenizer", "tokenizer_2", "tokenizer_3") if getattr(self.pipe, n, None) is not None]
        limits = []
        for name in names:
            encoder = getattr(self.pipe, name.replace("tokenizer", "text_encoder"), None)
            is_t5 = encoder is not None and "T5" in type(encoder).__name__
            tokenizer = getattr(self.pipe, name)
            limits.append((tokenizer, sequence if is_t5 and sequence else tokenizer.model_max_length))
        return limits

    def draw(self, prompts: list[str], seeds: list[int], negatives: list[str | None]) -> list[Image.Image]:
        """Checked items through the pipeline, `batch_size` at a time."""
        images: list[Image.Image] = []
        start = 0
        while start < len(prompts):
            end = start + 1
            while (
                end < len(prompts)
                and end - start < self.batch_size
                and (negatives[end] is None) == (negatives[start] is None)
            ):
                end += 1
            images += self._call(prompts[start:end], seeds[start:end], negatives[start:end])
            start = end
        return images

    def _call(self, prompts: list[str], seeds: list[int], negatives: list[str | None]) -> list[Image.Image]:
        from genfast.diffusion.pipelines import call_kwargs, initial_latents

        latents = torch.cat([initial_latents(self.pipe, self.height, self.width, s) for s in seeds])
        # One generator per image (a stochastic scheduler's noise); a single one where there is one
        # image, as diffusers takes it.
        generators = [torch.Generator("cpu").manual_seed(s) for s in seeds]
        negative = None if negatives[0] is None else (negatives[0] if len(negatives) == 1 else negatives)
        with torch.inference_mode():
            return self.pipe(
                prompts[0] if len(prompts) == 1 else prompts,
                height=self.height,
                width=self.width,
                num_inference_steps=self.steps,
                latents=latents,
                generator=generators[0] if len(generators) == 1 else generators,
                **guidance_kwargs(self.pipe, self.guidance_scale, negative),
                **call_kwargs(self.pipe),
            ).images

    def png_text(self, prompt: str, seed: int, negative: str | None = None) -> dict[str, str]:
        """The settings of an image, as its PNG's text metadata."""
        text = {
            "genfast:prompt": prompt,
            "genfast:seed": str(seed),
            "genfast:steps": str(self.steps),
            "genfast:size": f"{self.width}x{self.height}",
            "genfast:guidance": str(self.guidance_scale if self.guidance_scale is not None else "none"),
            "genfast:model": self.description,
            "genfast:recipe": self.recipe,
            "genfast:random-weights": str(bool(self.random_weights)).lower(),
        }
        if negative is not None:
            text["genfast:negative"] = negative
        if self.random_weights:
            text["Warning"] = RANDOM_WEIGHTS_WARNING
        return text

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Ray Data's `map_batches` protocol: rows with a `prompt` and optionally a `seed` (else a
        random one) and a `negative_prompt` (or `negative`, the prompts file's name); other columns
        pass through. Out: the batch with `seed` (the one used), `image` (height x width x 3 uint8),
        `settings` (the image's settings as JSON: what genfast writes into its PNG), `warning` (a
        prompt cut to what the text encoder reads, else None) and `error` added. A row that cannot
        run (no prompt, a bad seed) gets its reason in `error` and a black image: one bad row does
        not fail the batch."""
        count = len(next(iter(batch.values()))) if batch else 0
        column = {key: list(batch[key]) if key in batch else [None] * count for key in
                  ("prompt", "seed", "negative_prompt", "negative")}  # fmt: skip
        errors: list[str | None] = [None] * count
        seeds = [0] * count
        runnable: list[int] = []
        items: list[tuple[str, int, str | None]] = []
        for row in range(count):
            prompt, seed = _plain(column["prompt"][row]), _plain(column["seed"][row])
            negative, alias = _plain(column["negative_prompt"][row]), _plain(column["negative"][row])
            try:
                if negative is not None and alias is not None:
                    raise ValueError('give "negative_prompt" or "negative", not both')
                negative = negative if negative is not None else alias
                seed = random_seed() if seed is None else check_seed(seed)
                self.check(prompt, seed, negative)
            except ValueError as e:
                errors[row] = f"row {row}: {e}"
                continue
            seeds[row] = seed
            runnable.append(row)
            items.append((prompt, seed, negative))
        images = np.zeros((count, self.height, self.width, 3), dtype=np.uint8)
        settings: list[str | None] = [None] * count
        warnings: list[str | None] = [None] * count
        for row, (prompt, seed, negative) in zip(runnable, items, strict=True):
            settings[row] = json.dumps(self.png_text(prompt, seed, negative), ensure_ascii=False)
            warnings[row] = self.truncation(prompt)
        if items:
            drawn = self.draw(*(list(values) for values in zip(*items, strict=True)))
            for row, image in zip(runnable, drawn, strict=True):
                images[row] = np.asarray(image.convert("RGB"))
        return {
            **batch,
            "seed": np.array(seeds, dtype=np.int64),
            "image": images,
            "settings": _objects(settings),
            "warning": _objects(warnings),
            "error": _objects(errors),
        }

    def __getstate__(self) -> dict[str, Any]:
        return dict(self._arguments)

    def __setstate__(self, arguments: dict[str, Any]) -> None:
        self.__init__(**arguments)  # type: ignore[misc]


def _objects(values: list[Any]) -> np.ndarray:
    return np.array([*values, None], dtype=object)[:-1]  # the extra None keeps it 1-D whatever the values


def _plain(value: Any) -> Any:
    """A numpy scalar as its Python value; NaN (Arrow's missing value, through pandas) as None."""
    if hasattr(value, "item") and not isinstance(value, np.ndarray):
        value = value.item()
    if isinstance(value, float) and value != value:
        return None
    return value
