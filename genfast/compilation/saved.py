"""A module compiled ahead of time once and loaded by every later run: SAM's image encoder, a
diffusion pipeline's denoiser and VAE decoder. (The LLM's prefill and decode steps, which also
compile in the background: genfast/llm/decoding/precompiled.py.)

`compile_saved(module, ...)` compiles `module` in place (its forward; the module keeps its class,
attributes and state dict). Its first call with a new input signature
(tensor shapes, strides, dtypes and devices; the other arguments' values) loads the function
compiled for that signature from GENFAST_HOME/compiled/<key> (genfast/compilation/artifacts.py), or compiles
it ahead of time (`torch.compile(...).aot_compile`) with the wait shown (genfast/interface/progress.py), and
saves it. The key covers the module's structure (each submodule's class, settings and plain
attributes; each parameter's and buffer's name, shape and dtype), what the caller says the code
depends on, the input signature, the inductor options and the environment. The module must not
change after its first call (its structure is read once). Modules of one structure (a UNet's
repeated blocks) share one compiled function, loaded once per process.

The weights are inputs of the compiled code, not constants (no inductor `freezing`), so an
artifact does not depend on them: random weights and a checkpoint of one architecture share it
(and freezing did not make SAM's encoder faster on the CPU). Loading an artifact takes a fraction
of compiling it.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping
from itertools import chain
from typing import Any

import torch
from torch import Tensor, nn

from genfast.compilation import artifacts
from genfast.interface.progress import Ticker

_PLAIN = (str, int, float, bool, type(None))
Args = tuple[Any, ...]
Kwargs = Mapping[str, Any]


def call_module(module: nn.Module, method: str, *args: Any, **kwargs: Any) -> Any:
    """What is compiled: the module's own `method` (its forward, or another method compile_saved
    was given), with the module an argument, so that its weights are inputs (the instance's
    attribute of that name is the SavedForward that calls this). The class's method is reached
    through the instance (`_class_<method>`, set by compile_saved), not through `type(module)`:
    dynamo cannot trace an attribute of a class marked allow-in-graph, as diffusers marks its
    transformer blocks."""
    return getattr(module, f"_class_{method}")(*args, **kwargs)


def structure(module: nn.Module) -> list[Any]:
    """What the compiled code of `module` depends on in the module itself, as JSON-able lists."""
    modules = [
        [name, f"{type(m).__module__}.{type(m).__qualname__}", m.extra_repr(),
         {k: v for k, v in sorted(vars(m).items()) if not k.startswith("_") and isinstance(v, _PLAIN)}]
        for name, m in module.named_modules()
    ]  # fmt: skip
    named = chain(module.named_parameters(), module.named_buffers())
    tensors = [[name, list(t.shape), str(t.dtype)] for name, t in named]
    return [modules, tensors]


def signature(value: Any) -> Any:
    """A JSON-able description of call arguments: what the compiled code is specialized on."""
    if isinstance(value, Tensor):
        return ["tensor", list(value.shape), list(value.stride()), str(value.dtype), value.device.type]
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [signature(v) for v in value]]
    if isinstance(value, Mapping):
        return {str(k): signature(v) for k, v in sorted(value.items())}
    if isinstance(value, _PLAIN):
        return value
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _flatten(value: Any) -> list[Any]:
    """The tensor descriptions (and other leaves) inside a signature()."""
    if isinstance(value, list) and value[:1] == ["tensor"]:
        return [value]
    if isinstance(value, list):
        return [leaf for v in value for leaf in _flatten(v)]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _flatten(v)]
    return [value]


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# Compiled functions this process has loaded or compiled, by key: shared by modules of one structure.
_READY: dict[str, Callable[..., Any]] = {}


def compile_saved(module: nn.Module, what: str, depends_on: Mapping[str, Any], options: Mapping[str, Any],
                  log: Callable[[str], None] = _log, method: str = "forward") -> nn.Module:  # fmt: skip
    """Compile `module` in place, ahead of time per input signature, kept on disk (see the module
    docstring), and return it. `what` names it in messages ("SAM image encoder"); `depends_on`:
    JSON-able settings the code depends on beyond the module's structure; `options`: inductor's
    (`freezing` is dropped: the weights stay inputs). It runs with gradients off: for inference.
    The module must be savable (`unsavable_reason`). `method`: the method compiled, forward by
    default; another one (of a module whose forward mixes static-shaped parts with others) is
    compiled the same way, and several methods of one module can be."""
    reason = unsavable_reason(module)
    if reason is not None:
        raise ValueError(f"the {what} cannot be compiled ahead of time and saved: {reason}")
    setattr(module, f"_class_{method}", getattr(type(module), method).__get__(module))
    setattr(module, method, SavedForward(module, what, depends_on, options, log, method))
    return module


def unsavable_reason(module: nn.Module) -> str | None:
    """Why `module`'s compiled code cannot be saved, or None. Opaque tensors kept as attributes (oneDNN's
    prepacked weights) are guarded on by identity and shape, and dynamo cannot serialize such guards
    (it remakes each tensor on the meta device, which has no mkldnn layout). genfast's int8
    convolutions keep theirs outside the module for this reason (genfast/quant/conv.py)."""
    for name, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if isinstance(value, Tensor) and value.layout == torch._mkldnn:
                where = f"{name}.{attr}" if name else attr
                return f"oneDNN's opaque tensors (prepacked weights) cannot be saved ({where})"
    return None


class SavedForward:
    """The forward (or other method) `compile_saved` gives a module."""

    def __init__(self, module: nn.Module, what: str, depends_on: Mapping[str, Any], options: Mapping[str, Any],
                 log: Callable[[str], None], method: str = "forward") -> None:  # fmt: skip
        self.module = module
        self.method = method
        self.what = what
        self.depends_on = dict(depends_on)
        self.options = {k: v for k, v in options.items() if k != "freezing"}
        self.log = log
        self.events: list[str] = []  # what each new signature cost: "compiled in 14.2 s", "loaded in 1.2 s ..."
        self._structure: list[Any] | None = None
        self._stores: dict[str, artifacts.Artifacts] = {}  # by input signature (see __call__)

    def key_parts(self, args: Args, kwargs: Kwargs) -> dict[str, Any]:
        if self._structure is None:
            self._structure = structure(self.module)
        return {
            "what": self.what,
            "method": self.method,
            "structure": self._structure,
            "depends_on": self.depends_on,
            "options": {k: v for k, v in sorted(self.options.items())},
            "inputs": signature([list(args), dict(kwargs)]),
            "inference_mode": torch.is_inference_mode_enabled(),
        }

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            # The full key (the module's structure, the environment) is hashed once per input
            # signature, not at every call: a UNet's blocks are called hundreds of times an image.
            call = json.dumps([signature([list(args), dict(kwargs)]), torch.is_inference_mode_enabled()])
            store = self._stores.get(call)
            if store is None:
                parts = self.key_parts(args, kwargs)
                store = self._stores[call] = artifacts.Artifacts(artifacts.key(parts), self._description(parts))
            fn = _READY.get(store.key)
            if fn is None:
                fn = _READY[store.key] = self._prepare(store, args, kwargs)
            try:
                return fn(self.module, self.method, *args, **kwargs)
            except RuntimeError as e:  # guards: a saved function that does not fit after all
                if "GuardManager check failed" not in str(e):
                    raise
                why = f"the compiled {self.what} does not fit this module ({str(e)[:200]})"
                store.discard("forward", why, self.log)
                fn = _READY[store.key] = self._compile(store, args, kwargs)
                return fn(self.module, self.method, *args, **kwargs)

    def _description(self, parts: Mapping[str, Any]) -> dict[str, Any]:
        """What `genfast cache list` shows."""
        tensors = [v for v in _flatten(parts["inputs"]) if isinstance(v, list) and v[:1] == ["tensor"]]
        shapes = ", ".join(f"{'x'.join(map(str, t[1]))} {t[3].removeprefix('torch.')}" for t in tensors)
        return {"what": self.what, "summary": f"{self.what}: inputs {shapes or 'none'}", "inputs": parts["inputs"],
                "depends_on": self.depends_on}  # fmt: skip

    def _prepare(self, store: artifacts.Artifacts, args: Args, kwargs: Kwargs) -> Callable[..., Any]:
        start = time.perf_counter()
        fn = store.load("forward", vars(sys.modules[__name__]), self.log)
        if fn is None:
            return self._compile(store, args, kwargs)
        seconds = time.perf_counter() - start
        self.events.append(f"loaded in {seconds:.1f} s (compiled by an earlier run)")
        self.log(f"genfast: loaded the compiled {self.what} in {seconds:.1f} s")
        return fn

    def _compile(self, store: artifacts.Artifacts, args: Args, kwargs: Kwargs) -> Callable[..., Any]:
        options = {**self.options, "cpp.dynamic_threads": True, "guard_filter_fn": artifacts.saved_guards}
        with Ticker(f"genfast: compiling the {self.what} (first run only: it is saved for later runs)") as ticker:
            compiled = torch.compile(call_module, fullgraph=True, dynamic=False, options=options).aot_compile(
                ((self.module, self.method, *args), dict(kwargs))
            )
            store.try_save("forward", compiled, self.log)
        self.events.append(f"compiled in {ticker.seconds:.1f} s")
        return compiled


def compile_notes(root: nn.Module) -> list[str]:
    """What the saved compiled modules in `root` cost so far, e.g. for a benchmark row's note."""
    forwards = [f for m in root.modules() for f in vars(m).values() if isinstance(f, SavedForward)]
    return [f"{f.what} {event}" for f in forwards for event in f.events]
