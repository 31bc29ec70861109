"""torch.compile of a pipeline's denoiser and VAE decoder, options passed per call.

No global inductor or dynamo config is changed: each `torch.compile` call gets its options dict.
- CUDA: diffusion-fast's flags (conv_1x1_as_mm, coordinate_descent_tuning, epilogue_fusion off,
  coordinate_descent_check_all_directions) with max-autotune; CUDA graphs only for whole-model
  static-shape compiles (regional/dynamic graphs would each need their own pools).
- CPU: `freezing` (weights become constants: conv weights are pre-packed for oneDNN), as for the
  LLM and SAM compiles in genfast/compilation/inductor.py.
Modules are compiled in place, so the pipeline keeps its own objects (state dicts, `config`,
attribute access are unchanged). On a CPU, static-shape compiles (whole model or regions) are
compiled ahead of time and kept on disk for later runs (genfast/compilation/saved.py): the caller
passes `saved`, what the code depends on beyond the module (the recipe's settings). Dynamic-shape
compiles and CUDA (not yet run) compile when first called, with inductor's own cache.
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch._dynamo.config as dynamo_config
import torch.fx.experimental._config as fx_config
from torch import nn

from genfast.compilation.saved import compile_saved, unsavable_reason


def diffusion_inductor_options(
    device: torch.device | str, *, whole_model: bool = True, dynamic: bool = False, max_autotune: bool = True
) -> dict[str, Any]:
    """`max_autotune` (CUDA): diffusion-fast's tuning at compile time, max-autotune's GEMM and
    convolution templates and coordinate-descent tuning of every generated kernel (minutes more
    compile); off, the same graphs with inductor's default kernel choices. The CPU ignores it."""
    device = torch.device(device)
    if device.type == "cuda":
        options = {
            "conv_1x1_as_mm": True,
            "epilogue_fusion": False,
            "triton.cudagraphs": whole_model and not dynamic,
        }
        if max_autotune:
            options.update(
                coordinate_descent_tuning=True, coordinate_descent_check_all_directions=True, max_autotune=True
            )
        return options
    return {"freezing": True}


def _device_of(module: nn.Module) -> torch.device:
    return next(itertools.chain(module.parameters(), module.buffers())).device


def _traced_with(compiled: Callable[..., Any], *, duck_sizing: bool, graphs: int) -> Callable[..., Any]:
    """`compiled` with two tracing settings, scoped to its calls (they are read when a graph is
    traced), not set globally:
    - duck_sizing False: every size its own symbol. By default dynamo merges sizes that are equal
      on the first call: a square first image ties height to width, and the first non-square one
      recompiles (measured on SD 1.5's VAE decoder: 512x512, then 448x384).
    - graphs: how many graphs one code object may hold. Dynamo's default (8) is per function, not
      per module: all of a UNet's residual blocks share `ResnetBlock2D.forward`, and their
      parameter shapes (static by design) need one graph each."""

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        with fx_config.patch(use_duck_shape=duck_sizing), dynamo_config.patch(recompile_limit=graphs):
            return compiled(*args, **kwargs)

    return call


def compile_module(
    module: nn.Module,
    *,
    dynamic: bool = False,
    whole_model: bool = True,
    graphs: int | None = None,
    saved: Mapping[str, Any] | None = None,
    what: str | None = None,
    max_autotune: bool = True,
) -> nn.Module:
    """Compile `module`'s forward in place (fullgraph: a graph break is an error, not a slowdown).
    With `dynamic`, sizes are symbolic and independent of each other; `graphs`: the most graphs
    its forward's code may compile (see _traced_with); `saved`: see the module docstring; `what`
    names it in messages (default: its class); `max_autotune`: see diffusion_inductor_options."""
    device = _device_of(module)
    options = diffusion_inductor_options(device, whole_model=whole_model, dynamic=dynamic, max_autotune=max_autotune)
    what = what or type(module).__name__
    if saved is not None and not dynamic and device.type == "cpu":
        reason = unsavable_reason(module)
        if reason is None:
            return compile_saved(module, what, saved, options)
        _not_saved_note(what, reason)
    if not dynamic and graphs is None:
        module.compile(fullgraph=True, options=options)
        return module
    # An instance attribute: nn.Module.__call__ runs it; parameters and state dict are untouched.
    compiled = torch.compile(module.forward, fullgraph=True, dynamic=dynamic, options=options)
    module.forward = _traced_with(
        compiled, duck_sizing=not dynamic, graphs=max(graphs or 0, dynamo_config.recompile_limit)
    )
    return module


@functools.cache  # once per kind of module (a UNet's residual blocks are many)
def _not_saved_note(what: str, reason: str) -> None:
    print(f"genfast: the {what} is compiled for this run only: {reason}", file=sys.stderr)


def compile_vae_decoder(
    vae: nn.Module, *, dynamic: bool = False, saved: Mapping[str, Any] | None = None, max_autotune: bool = True
) -> None:
    """Compile the VAE's `decoder` (the work of `vae.decode`; the 1x1 post-quant conv stays eager)."""
    decoder = getattr(vae, "decoder", None)
    if not isinstance(decoder, nn.Module):
        raise ValueError(f"{type(vae).__name__} has no `decoder` module to compile")
    compile_module(decoder, dynamic=dynamic, saved=saved, what="VAE decoder", max_autotune=max_autotune)


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks to compile one by one: those diffusers marks as repeated (`_repeated_blocks`:
    the transformer blocks of UNets and DiTs), plus the entries of every ModuleList of two or
    more modules of one class that neither are nor contain such a block (a UNet's residual
    blocks, where its convolutions are; a DiT's blocks when it declares none). Same-class blocks
    share their compiled graphs: one per distinct shape, not per instance."""
    names = set(getattr(model, "_repeated_blocks", None) or ())
    declared = [m for m in model.modules() if type(m).__name__ in names]
    in_declared = {id(sub) for block in declared for sub in block.modules()}
    listed: list[nn.Module] = []
    taken: list[str] = []  # outermost lists only: a block is not compiled inside another
    for name, module in model.named_modules():
        if any(name.startswith(t + ".") for t in taken):
            continue
        if not (isinstance(module, nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1):
            continue
        if any(id(m) in in_declared or any(type(sub).__name__ in names for sub in m.modules()) for m in module):
            continue
        taken.append(name)
        listed.extend(module)
    blocks = declared + listed
    if not blocks:
        raise ValueError(f"{type(model).__name__} declares no repeated blocks: regional compilation does not apply")
    return blocks


def compile_regions(
    model: nn.Module, *, dynamic: bool = False, saved: Mapping[str, Any] | None = None, max_autotune: bool = True
) -> int:
    """Regional compilation: compile each repeated block in place, the rest stays eager. Compile
    time is that of one block per distinct shape instead of the whole model; speed is close to
    whole-model compile when the blocks dominate. Returns the number of blocks compiled."""
    blocks = repeated_blocks(model)
    # One graph per distinct parameter shape per class (twice that, for a second resolution).
    shapes = {(type(b), tuple(p.shape for p in b.parameters())) for b in blocks}
    for block in blocks:
        compile_module(
            block, dynamic=dynamic, whole_model=False, graphs=2 * len(shapes), saved=saved, max_autotune=max_autotune
        )
    return len(blocks)
