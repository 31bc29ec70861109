"""Block residual caching across denoising steps for diffusion transformers (FLUX.1, SD 3/3.5,
PixArt-α): the idea of ParaAttention's First Block Cache, diffusers' FirstBlockCache and cache-dit's
DBCache (dual block cache), with `front` blocks computed before the decision and `back` blocks
computed after the cached ones (FnBn in cache-dit's terms; the default F1B0 is First Block Cache).

The blocks are taken in the order forward runs them (FLUX.1's double-stream, then its
single-stream ones). Every step runs the `front` blocks. Their residual (output minus input, image
stream) is compared with the one of the last step that ran every block: relative mean absolute
change `mean|r - r_full| / mean|r_full|`. Below `threshold`, the middle blocks are skipped and the
residuals they added on that full step (to the image stream, and to the text stream where the
blocks carry one) are added to the front blocks' output instead; otherwise they run and the
residuals are kept. The `back` blocks run on every step, so that a cached step ends on computed
blocks (better images, more work a step). The first `warmup` steps of a run always run every
block, and at most `interval - 1` steps in a row are cached (a full step at least every `interval`
steps, as DeepCache's interval: genfast/diffusion/feature_cache.py). Quality cost: the images
drift from the uncached ones (PSNR measured in tests/diffusion); threshold 0 never skips.

The decision reads one scalar on the host per step (the relative change, `.item()`): which blocks
run is decided in Python, which is what saves their work. On a CPU this read costs nothing (the
value is computed when the reduction returns); on CUDA it waits once per step for the queued
kernels (the first block and the reduction), which a step of the skipped or run blocks dwarfs.
The alternatives do not save work: torch.where computes both branches, and torch.cond outside
CUDA graphs reads its predicate on the host too. diffusers' FirstBlockCache and cache-dit read it
the same way. Where the threshold is 0 or the step is a warm-up or forced-full one, nothing is read.

The blocks are wrapped in place (`CachedBlock`, in the transformer's block lists): they stay as
they were (regionally compiled, int8, fused QKV), the decision runs eagerly between them. A
denoising run starts when the pipeline calls `scheduler.set_timesteps` (DenoisingRuns). Calls
under diffusers' `cache_context(name)` (FluxPipeline's true-CFG "cond" and "uncond" calls) keep
a cache each. SD3's skip-layer guidance calls (`skip_layers`) run uncached and leave the cache as
it is; ControlNet residuals are refused (they are added between blocks the cache skips).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from genfast.diffusion.feature_cache import DenoisingRuns
from genfast.diffusion.pipelines import DenoiserWrapper

# The transformers whose blocks follow diffusers' conventions the cache relies on: a block takes
# the image stream as `hidden_states` (first positional or by name) and returns it, alone or as
# the second of (encoder_hidden_states, hidden_states); nothing but ControlNet residuals happens
# between blocks; only the image stream is read after the last one.
TRANSFORMERS = ("FluxTransformer2DModel", "SD3Transformer2DModel", "PixArtTransformer2DModel")
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")  # in the order forward runs them
# Inputs that add residuals between blocks: the cached path would add them on top of a cached sum.
_CONTROLNET = ("controlnet_block_samples", "controlnet_single_block_samples", "block_controlnet_hidden_states")


@dataclass
class _Cache:
    """One cache context's state (diffusers' `cache_context` name; None outside any)."""

    step: int = 0  # steps of this run (calls in this context)
    in_a_row: int = 0  # cached steps since the last full one
    front: Tensor | None = None  # the front blocks' image-stream residual on the last full step
    head: Tensor | None = None  # the front blocks' image-stream output on the last full step
    head_text: Tensor | None = None  # and their text-stream output (kept only when back blocks follow)
    rest: Tensor | None = None  # what the middle blocks added to the image stream on that step
    rest_text: Tensor | None = None  # and to the text stream (kept only when back blocks follow)


class _Shared:
    """The settings, and what the blocks of one transformer read and write during a call."""

    def __init__(self, threshold: float, warmup: int, interval: int, back: int) -> None:
        self.threshold, self.warmup, self.interval, self.back = threshold, warmup, interval, back
        self.cache = _Cache()
        self.bypass = False  # this call runs every block and leaves the cache alone
        self.skip = False  # this step's middle blocks are skipped
        self.pairs = False  # the blocks return (encoder_hidden_states, hidden_states), not hidden_states
        self.start: Tensor | None = None  # this call's image stream before the first block

    def may_skip(self, residual: Tensor) -> bool:
        """Whether this step may skip the middle blocks (one host read, when it gets there)."""
        cache = self.cache
        if self.threshold <= 0 or cache.step < self.warmup or cache.in_a_row >= self.interval - 1:
            return False
        full = cache.front
        if full is None or cache.rest is None or full.shape != residual.shape or full.dtype != residual.dtype:
            return False
        change = (residual - full).abs().mean() / full.abs().mean()
        return change.item() < self.threshold


def _hidden_states(args: tuple, kwargs: dict) -> Tensor:
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def _image_stream(output: Any) -> Tensor:
    return output[1] if isinstance(output, tuple) else output


def _text_stream(output: Any) -> Tensor | None:
    return output[0] if isinstance(output, tuple) else None


def _difference(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    return None if a is None or b is None else a - b


class CachedBlock(DenoiserWrapper):
    """A transformer block in its list, wrapped, with its role in the cache: the front blocks run
    on every step and the last of them decides; the middle ones are skipped when it says so, the
    last of them keeping what they added on a full step; the back ones run on every step. (A
    DenoiserWrapper for its attribute passing: a transformer's forward may read its blocks'
    attributes.)"""

    def __init__(self, block: nn.Module, shared: _Shared, role: str, first: bool = False) -> None:
        super().__init__(block)
        self._shared = shared
        self._role = role  # "front", "decide", "middle", "last middle" or "back"
        self._first = first  # the first block of all: keeps the call's input image stream

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        shared = self._shared
        if shared.bypass or self._role == "back":
            return self.denoiser(*args, **kwargs)
        if self._first:
            shared.start = _hidden_states(args, kwargs)
        if self._role == "front":
            return self.denoiser(*args, **kwargs)
        if self._role == "decide":
            return self._decide(self.denoiser(*args, **kwargs))
        if shared.skip:  # the block's inputs, as it would return them
            hidden = _hidden_states(args, kwargs)
            if not shared.pairs:
                return hidden
            return (kwargs["encoder_hidden_states"] if "encoder_hidden_states" in kwargs else args[1], hidden)
        output = self.denoiser(*args, **kwargs)
        if self._role == "last middle":
            cache = shared.cache
            cache.rest = _image_stream(output) - cache.head
            if shared.back:  # only back blocks read the text stream after the middle ones
                cache.rest_text = _difference(_text_stream(output), cache.head_text)
        return output

    def _decide(self, output: Any) -> Any:
        shared, cache = self._shared, self._shared.cache
        shared.pairs = isinstance(output, tuple)
        out, text = _image_stream(output), _text_stream(output)
        residual = out - shared.start
        shared.start = None
        shared.skip = shared.may_skip(residual)
        cache.step += 1
        if shared.skip:
            cache.in_a_row += 1
            if cache.rest_text is not None and text is not None:
                text = text + cache.rest_text
            return (text, out + cache.rest) if shared.pairs else out + cache.rest
        cache.in_a_row, cache.front, cache.head = 0, residual, out
        cache.head_text = text if shared.back else None
        return output


def _role(k: int, blocks: int, front: int, back: int) -> str:
    """The role of the k-th of `blocks` blocks, in the order they run."""
    if k < front - 1:
        return "front"
    if k == front - 1:
        return "decide"
    if k >= blocks - back:
        return "back"
    return "last middle" if k == blocks - back - 1 else "middle"


class BlockCache(DenoiserWrapper):
    """Wraps a FLUX.1, SD 3/3.5 or PixArt transformer; a pipeline uses it in place of its
    `transformer`. `front` blocks run before the decision and `back` blocks after the cached
    ones, on every step. `skipped` counts the calls whose middle blocks were skipped, `calls` all
    calls (both since it was made)."""

    def __init__(
        self,
        transformer: nn.Module,
        scheduler: Any,
        threshold: float,
        warmup: int = 1,
        interval: int = 2,
        front: int = 1,
        back: int = 0,
    ) -> None:
        super().__init__(transformer)
        name = type(transformer).__name__
        if name not in TRANSFORMERS:
            raise ValueError(f"the block cache is implemented for {', '.join(TRANSFORMERS)}, not {name}")
        if threshold < 0 or warmup < 1 or interval < 1 or front < 1 or back < 0:
            raise ValueError(
                "block cache: threshold >= 0, warmup >= 1, interval >= 1, front >= 1 and back >= 0, got "
                f"{threshold}, {warmup}, {interval}, {front} and {back}"
            )
        self._runs = DenoisingRuns(scheduler)
        self._shared = _Shared(threshold, warmup, interval, back)
        self._caches: dict[str | None, _Cache] = {}
        self._context: str | None = None
        self.calls = self.skipped = 0
        lists = [getattr(transformer, n, None) for n in BLOCK_LISTS]
        places = [(blocks, i) for blocks in lists if isinstance(blocks, nn.ModuleList) for i in range(len(blocks))]
        if front + back >= len(places):
            raise ValueError(
                f"the block cache needs a block to skip between its {front} front and {back} back blocks: "
                f"{name} has {len(places)}"
            )
        for k, (blocks, i) in enumerate(places):  # each block wrapped in its place, in the order they run
            blocks[i] = CachedBlock(blocks[i], self._shared, _role(k, len(places), front, back), first=k == 0)

    @contextmanager
    def cache_context(self, name: str, **kwargs: Any) -> Iterator[None]:
        """diffusers' pipelines name their denoising calls ("cond", "uncond"): one cache each."""
        previous, self._context = self._context, name
        try:
            yield
        finally:
            self._context = previous

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        used = [name for name in _CONTROLNET if kwargs.get(name) is not None]
        if used:
            raise ValueError(f"the block cache does not support the transformer inputs {', '.join(used)}")
        shared = self._shared
        if kwargs.get("skip_layers") is not None:  # SD3's skip-layer guidance: another forward
            shared.bypass = True
            try:
                return self.denoiser(*args, **kwargs)
            finally:
                shared.bypass = False
        if self._runs.new_run():
            self._caches.clear()
        shared.cache = self._caches.setdefault(self._context, _Cache())
        shared.skip = False
        output = self.denoiser(*args, **kwargs)
        self.calls += 1
        self.skipped += shared.skip
        return output
