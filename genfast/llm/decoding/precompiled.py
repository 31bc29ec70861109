"""Prefill and decode compiled ahead of time and kept on disk, so generation starts at once.

A run that finds the compiled steps for its model's shape (genfast/compilation/artifacts.py) loads them
(~1.8 s on a 2-core Xeon, against ~45 s to compile) and runs them from the first token. A run
that finds none decodes eagerly and has a background process compile and save them, on one
thread at the lowest CPU priority (`lower_priority`): when the command ends (`generate`: its
eager run keeps the whole CPU), or at once (`chat`, which switches to the steps between turns
when they appear). Loading them in a thread while decoding eagerly was measured and dropped: on
two cores the two fight over the CPU and the GIL, and eager decoding slows several times while
they load. Benchmarks and tests call `wait()`, which compiles here and now when nothing
is saved.

The steps take the model as an argument: its weights are inputs of the compiled code, not
constants in it, so the artifacts depend on the architecture, dtypes, quantization scheme, batch
size, KV-cache length and sampling settings (the key), not on the weights: every model of one
shape shares them. Inductor's `freezing` (weights as constants) is therefore off here.

Eager and compiled steps compute the same function (within rounding), so switching mid-generation
changes no greedy token in fp32. A one-token prompt (a one-slot mask, which the compiled code
does not take) runs eagerly.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from genfast.compilation import artifacts
from genfast.compilation.inductor import inductor_options
from genfast.llm.decoding.sampling import SamplingParams, sample
from genfast.llm.model.transformer import Transformer, attention_mask


@dataclass(frozen=True)
class StepSet:
    """A family of step functions compiled together (`generate`'s, `serve`'s): each takes the model
    and then its inputs; `examples(name, batch, device)` gives inputs of the runtime shapes with
    the varying lengths marked dynamic; `extra` arguments after the inputs are Python values
    compiled in (the sampling settings)."""

    name: str
    functions: dict[str, Callable[..., Any]]
    examples: Callable[[str, int, torch.device], tuple[Any, ...]]

    @property
    def names(self) -> list[str]:
        return list(self.functions)

    @property
    def reference(self) -> str:
        """Where a background process finds this set again: 'module:ATTRIBUTE'."""
        module = next(iter(self.functions.values())).__module__
        attribute = next(k for k, v in vars(sys.modules[module]).items() if v is self)
        return f"{module}:{attribute}"


# Two functions, not one: dynamo keeps compiled code per code object.
def prefill_step(model: Transformer, tokens: Tensor, input_pos: Tensor, mask: Tensor, params: SamplingParams) -> Tensor:
    return sample(model(tokens, input_pos, mask), params)


def decode_step(model: Transformer, tokens: Tensor, input_pos: Tensor, mask: Tensor, params: SamplingParams) -> Tensor:
    return sample(model(tokens, input_pos, mask), params)


def example_inputs(name: str, batch: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Inputs of the shapes generate() passes, with the lengths that vary marked dynamic: the
    prompt length (prefill) and the valid cache length (both)."""
    if name == "prefill":
        tokens = torch.zeros(batch, 2, dtype=torch.long, device=device)
        input_pos = torch.arange(2, device=device)
        mask = attention_mask(input_pos, 2, torch.zeros(batch, dtype=torch.long, device=device))
        torch._dynamo.mark_dynamic(tokens, 1)
        torch._dynamo.mark_dynamic(input_pos, 0)
        torch._dynamo.mark_dynamic(mask, 2)
    else:
        tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        input_pos = torch.tensor([1], device=device)
        mask = attention_mask(input_pos, 2, torch.zeros(batch, dtype=torch.long, device=device)).contiguous()
    torch._dynamo.mark_dynamic(mask, 3)
    return tokens, input_pos, mask


GENERATE = StepSet("generate", {"prefill": prefill_step, "decode": decode_step}, example_inputs)


def key_parts(model: Transformer, dtype_label: str, quant: str, batch: int, cache_len: int,
              params: SamplingParams | None, steps: StepSet = GENERATE) -> dict[str, Any]:  # fmt: skip
    """What the compiled steps depend on besides the environment (artifacts.environment)."""
    from genfast.llm.model.invariance import is_batch_invariant
    from genfast.quant.linear import uses_native_kernels

    return {
        "what": f"llm {steps.name}: {' and '.join(steps.names)}",
        "model_args": model.args.to_dict(),
        "dtype": dtype_label,
        "quant": quant,
        "native_kernels": uses_native_kernels(model),
        "batch_invariant": is_batch_invariant(model),
        "batch": batch,
        "cache_len": cache_len,
        "sampling": asdict(params) if params is not None else None,
        "device": model.norm.weight.device.type,
    }


class PrecompiledSteps:
    """One StepSet for one model: loaded, compiled or being made by a background process.
    `params`: the sampling settings the steps take after their inputs (None: no such argument)."""

    def __init__(self, model: Transformer, parts: dict[str, Any], params: SamplingParams | None,
                 load_args: dict[str, Any], log: Callable[[str], None], steps: StepSet = GENERATE) -> None:  # fmt: skip
        self.model, self.params, self.log, self.steps = model, params, log, steps
        self.extra = () if params is None else (params,)
        self.parts, self.load_args = parts, load_args
        self.artifacts = artifacts.Artifacts(artifacts.key(parts), parts)
        self.ready: dict[str, Any] = {}  # name -> loaded or compiled function
        self.wanted: tuple[str, ...] = tuple(steps.names)  # what poll() loads
        self.notes: list[str] = []  # what poll() did (take_notes)
        self._checked: set[str] = set()
        self.worker: subprocess.Popen | None = None
        self._compile_after = False  # start("after"): finish() starts the compile

    def start(self, compile_missing: str = "after", defer: bool = False) -> str:
        """Begin making the steps available without blocking; returns what happens, for the user.

        compile_missing: when no steps are saved, start the background compile "now" (a
        long-lived process: chat, serve, which switch to the steps when it is done), "after"
        (a one-shot command: its own eager run keeps the whole CPU, `finish()` starts the compile
        once the run has succeeded, and the next run finds the steps) or "never".
        defer (a one-shot command): saved steps are not loaded now; the prompt is prefilled
        eagerly (as fast as the compiled prefill for a prompt of hundreds of tokens) and only
        the decode step is loaded, by `poll()` after the
        first token (loading takes ~1 s, mostly importing inductor's runtime)."""
        if self.artifacts.complete(self.steps.names):
            if defer:
                self.wanted = ("decode",)
                return "compiled decode step saved: it loads after the first token"
            return self._wait_and_say(self.steps.names, "loaded the compiled steps")
        if self.artifacts.compiling():
            return "another genfast process is compiling for this model; eager until it is done"
        if compile_missing == "never":
            return "no compiled steps saved for this model; eager"
        try:
            self.artifacts.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # e.g. a read-only home
            return self._cannot_save(exc)
        log = self.artifacts.dir / "compile.log"
        if compile_missing == "now":
            self.worker = self._spawn_worker()
            if self.worker is None:
                return "the background compile could not start; eager"
            return f"compiling in the background (log: {log}); eager until it is done"
        self._compile_after = True
        return f"no compiled steps saved yet: eager now, compiled in the background when this run ends (log: {log})"

    def finish(self) -> None:
        """The one-shot command has succeeded: start the compile that start("after") put off. A run
        that fails (a prompt too long for the cache, say) or is interrupted starts none: minutes of
        compiling should not follow a mistake or Ctrl-C."""
        if self._compile_after:
            self._compile_after = False
            self._spawn_worker()

    def poll(self) -> None:
        """Load the wanted steps if they are saved and not loaded yet: deferred ones (see start),
        or ones a background compile has just finished (chat and serve switch to them between
        requests). Generation calls it after each prompt's first token, so it writes nothing
        (that would land inside the streamed text): `take_notes()` says what it did."""
        missing = [n for n in self.wanted if n not in self.ready]
        if missing and self.worker_done() and self.artifacts.complete(self.steps.names):
            self.notes.append(self._wait_and_say(self.wanted, f"compiled {' and '.join(missing)} loaded"))

    def take_notes(self) -> list[str]:
        """What poll() did since the last call, for the caller to report."""
        notes, self.notes = self.notes, []
        return notes

    def worker_done(self) -> bool:
        return self.worker is None or self.worker.poll() is not None

    def wait(self, names: tuple[str, ...] | None = None) -> None:
        """Block until the steps `names` (default: all) are usable: load them, or compile them here
        when none are saved."""
        self._make_ready(names or self.steps.names)

    def _wait_and_say(self, names: tuple[str, ...], loaded: str) -> str:
        """wait(names), and what it did for the user: `loaded` in X s, or which saved steps could
        not be loaded (the loader's log says why) and were compiled again."""
        start = time.perf_counter()
        again = self._make_ready(names)
        seconds = time.perf_counter() - start
        if again:
            return f"compiled {' and '.join(again)} again in {seconds:.1f} s"
        return f"{loaded} in {seconds:.1f} s"

    def _make_ready(self, names: tuple[str, ...]) -> list[str]:
        """Load each of `names` not ready yet, or compile it here when it cannot be loaded; returns
        the names compiled."""
        compiled = []
        for name in names:
            if name not in self.ready:
                loaded = self.artifacts_load(name)
                if loaded is None:
                    loaded = self.compile(name)
                    compiled.append(name)
                self.ready[name] = loaded
        return compiled

    def step(self, name: str, *inputs: Tensor) -> Tensor | None:
        """Run the compiled step `name`, or return None (then the caller runs it eagerly). The
        inputs are those of its function after the model; the third is the attention mask."""
        fn = self.ready.get(name)
        if fn is None or inputs[2].shape[3] < 2:
            return None
        if name not in self._checked:
            try:
                out = fn(self.model, *inputs, *self.extra)
            except RuntimeError as e:
                if "GuardManager check failed" not in str(e):
                    raise
                self.ready.pop(name)
                self.artifacts.discard(
                    name, f"the compiled {name} step does not fit this model ({str(e)[:200]})", self.log
                )
                return None
            fn.disable_guard_check()  # checked once: later calls differ only in the dynamic lengths
            self._checked.add(name)
            return out
        return fn(self.model, *inputs, *self.extra)

    def artifacts_load(self, name: str) -> Any:
        # Loaded as compiled: in inference mode, which the tensors' guards record.
        with torch.inference_mode():
            module = sys.modules[self.steps.functions[name].__module__]
            return self.artifacts.load(name, vars(module), self.log)

    def compile(self, name: str) -> Any:
        """Compile step `name` ahead of time here, save it and return it."""
        device = self.model.norm.weight.device
        options = inductor_options(device, decode=name == "decode", native_kernels=self.parts["native_kernels"])
        options.pop("freezing", None)  # the weights stay inputs: one artifact serves every model of this shape
        options["cpp.dynamic_threads"] = True  # the thread count is read at run time, not compiled in
        options["guard_filter_fn"] = artifacts.saved_guards
        self._load_kernels()
        with torch.inference_mode():
            example = self.steps.examples(name, self.parts["batch"], device)
            compiled = torch.compile(
                self.steps.functions[name], fullgraph=True, dynamic=False, options=options
            ).aot_compile(((self.model, *example, *self.extra), {}))
        self.artifacts.try_save(name, compiled, self.log)
        return compiled

    def _load_kernels(self) -> None:
        # The traced code calls genfast's native ops: their libraries must be loaded first.
        from genfast.kernels.linear_few_rows.ops import kernel_available as few_rows_kernel_available

        few_rows_kernel_available()

    def _cannot_save(self, exc: OSError) -> str:
        return (
            f"cannot save compiled steps in {self.artifacts.dir} ({exc.strerror or exc}), so none are compiled: "
            "eager (GENFAST_HOME names another folder)"
        )

    def _spawn_worker(self) -> subprocess.Popen | None:
        """`python -m genfast.llm.decoding.precompiled SPEC`, detached: it outlives this process. None where
        the steps cannot be saved (a read-only GENFAST_HOME): runs stay eager, and it says so."""
        params = asdict(self.params) if self.params is not None else None
        spec = {"load_args": self.load_args, "parts": self.parts, "key": self.artifacts.key, "params": params,
                "steps": self.steps.reference}  # fmt: skip
        try:
            self.artifacts.dir.mkdir(parents=True, exist_ok=True)
            fd, spec_path = tempfile.mkstemp(prefix="spec-", suffix=".json", dir=self.artifacts.dir)
            with os.fdopen(fd, "w") as f:
                json.dump(spec, f)
            log = open(self.artifacts.dir / "compile.log", "ab")  # noqa: SIM115 (the child writes to it)
        except OSError as exc:  # e.g. a full disk
            print(f"genfast: {self._cannot_save(exc)}", file=sys.stderr)
            return None
        # One thread that sleeps when idle: a spinning OpenMP team beside an eager run on the same
        # cores slows its decode by an order of magnitude.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        worker = subprocess.Popen(
            [sys.executable, "-m", "genfast.llm.decoding.precompiled", spec_path],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, env=env,
        )  # fmt: skip
        # Here, not in the worker once it gets there: its imports alone take seconds of CPU, and a
        # foreground run may decode eagerly meanwhile.
        lower_priority(worker.pid)
        return worker


def lower_priority(pid: int) -> None:
    """Give process `pid` (its own session: `_spawn_worker` starts one) the lowest CPU priority
    against every other process.

    Its nice value alone is not that where the kernel groups processes per session (autogroup:
    Linux's default on most desktops and servers): CPU time is shared between sessions first,
    each session's group at its own nice value, 0 unless set. A nice-19 CPU hog in a session of
    its own slows an eager decode beside it by an order of magnitude (its OpenMP threads wait for
    the slowest one); with the group's nice at 19 too, the decode runs at full speed."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, 19)
    except ProcessLookupError:  # it has ended already
        return
    autogroup = Path(f"/proc/{pid}/autogroup")
    for _ in range(10):
        try:
            autogroup.write_text("19")
            return
        except BlockingIOError:  # the kernel takes one such change per 0.1 s from all processes
            time.sleep(0.11)
        except OSError:  # no autogroups here (another kernel or OS): the nice value is what counts
            return


def compile_for(spec_path: Path) -> int:
    """The background process: load the model as the spec says and compile both steps."""
    from genfast.compilation.inductor import use_persistent_cache
    from genfast.llm.loading import load

    use_persistent_cache()
    spec = json.loads(spec_path.read_text())
    spec_path.unlink(missing_ok=True)
    args = spec["load_args"]
    params = SamplingParams(**spec["params"]) if spec["params"] is not None else None
    module, _, attribute = spec["steps"].partition(":")
    step_set = getattr(importlib.import_module(module), attribute)
    loaded = load(args["model"], args["device"], args["dtype"], None, args["quant"], args["group_size"],
                  batch_invariant=args["batch_invariant"])  # fmt: skip
    batch, cache_len = spec["parts"]["batch"], spec["parts"]["cache_len"]
    loaded.model.setup_caches(batch, cache_len)
    parts = key_parts(loaded.model, loaded.dtype_label(), loaded.quant, batch, cache_len, params, step_set)
    steps = PrecompiledSteps(loaded.model, parts, params, args, lambda m: print(m, file=sys.stderr), step_set)
    if steps.artifacts.key != spec["key"]:  # the model changed on disk since, or the environment differs
        print(f"genfast: the model loaded here keys to {steps.artifacts.key}, not {spec['key']}", file=sys.stderr)
        return 1
    if not steps.artifacts.try_lock():
        return 0  # another process is compiling it
    try:
        for name in step_set.names:
            if not steps.artifacts.path(name).is_file():
                steps.compile(name)
    finally:
        steps.artifacts.unlock()
    print(f"genfast: compiled {', '.join(step_set.names)} into {steps.artifacts.dir}", file=sys.stderr)
    return 0


def attach(generator: Any, loaded: Any, params: SamplingParams, log: Callable[[str], None]) -> PrecompiledSteps | None:
    """Give `generator` (a plain Generator of `loaded`, a loading.LoadedModel) precompiled steps
    for `params`, where they apply: on the CPU, one process (no tensor parallelism), not
    speculative, and no recipe step transformed the model (a background process could not redo
    it). None elsewhere: there the generator compiles when first called, as before."""
    from genfast.llm.decoding.generate import Generator

    plain = type(generator) is Generator and generator.compiled and not loaded.transforms
    if not plain or loaded.device.type != "cpu" or loaded.tp > 1:
        return None
    parts = key_parts(loaded.model, loaded.dtype_label(), loaded.quant, generator.max_batch_size,
                      generator.max_seq_len, params)  # fmt: skip
    generator.precompiled = PrecompiledSteps(loaded.model, parts, params, loaded.load_args, log)
    return generator.precompiled


if __name__ == "__main__":
    sys.exit(compile_for(Path(sys.argv[1])))
