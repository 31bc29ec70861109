"""Recipes: each workload's optimizations as named, ordered, cumulative steps, one mechanism for all.

A workload declares its recipe once, in genfast/<workload>/recipe.py: a `Recipe` of `Step`s in
ladder order and the frozen settings dataclass the steps fill in. Each step states its contract:
what it changes, its accuracy budget against the baseline (enforced by the workload's tests), the
settings it sets and, where it cannot run everywhere, what it needs. Steps shared by several
workloads are declared once in genfast/steps.py.

`Recipe.plan(step, target)` applies every step up to and including `step`, in order. One rule for
a step that cannot run on the target (`Step.needs` gives the reason) or that the user's flags
decline (`Step.declined`, e.g. the bf16 step under --dtype float32):
- the step asked for by name: a UserError that says why;
- an earlier step of the same plan: left out, with its reason in `Plan.skipped` (commands print
  it) or, when declined, in `Plan.declined` (the user knows);
- a row of `genfast bench`: the row says "skipped: <reason>".
A step that runs in a lesser form here (`Step.fallback`, e.g. without its native kernel) runs, and
its note goes into `Plan.notes` and the bench row.

A step's parameters (`Step.tunes`: settings fields it reads but does not set, e.g. the feature
cache's threshold) keep their dataclass defaults unless a plan is made with values for them
(`Recipe.plan(..., tuned=)`, e.g. from a bench flag): then they change in the plans that apply
their step only, and each change is a note of that step in `Plan.notes`. A plan may also be
made `without` some earlier steps (e.g. a bench's --without): they are declined, as the user chose.

A step sets fields of the settings; what realizes them is the step's `transforms`: each a function
of one model part and the settings, with the parts it applies to (`on`) and its `Stage`. One rule
decides which run: a step's transforms run when the settings hold what the step sets (so settings
built by hand run as the same settings from a plan), in stage order, then ladder order. Transforms
read the settings, so a step may carry none and only change what another step's transform does
(bf16 sets the dtype that the baseline's cast reads; regional-compile the mode that compile reads).
`Recipe.apply(settings, parts, target)` is every workload's one way to apply its recipe: it refuses a
step held by the settings that cannot run on `target`, then runs the transforms.

A step shared by all workloads is one function in genfast/steps.py (the step and its transforms)
plus one line in each workload's recipe; the field it sets goes in the settings base there
(`steps.StepSettings`), which every workload's settings extend.

This module imports no torch: the CLI lists step names without loading it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from enum import IntEnum
from typing import Any, Generic, TypeVar

from genfast.errors import UserError

Settings = TypeVar("Settings")  # a workload's frozen settings dataclass


@dataclass(frozen=True)
class Target:
    """Where a recipe runs: the resolved device (a torch.device) and the user's --dtype, which
    decides what the low-precision ("bf16") step does there."""

    device: Any
    dtype: str = "auto"


def target(device: str = "auto", dtype: str = "auto") -> Target:
    """A Target from --device and --dtype values (resolved by genfast.platform.hardware: imports torch)."""
    from genfast.platform.hardware import dtype_name, resolve_device

    return Target(resolve_device(device), dtype_name(dtype))


class Stage(IntEnum):
    """When a transform runs, whichever step brings it: every workload applies its steps in this
    order (then in ladder order within a stage), because e.g. quantizing must precede compiling
    while the ladder may list compile first."""

    PRECISION = 0  # the dtype of weights and activations
    KERNELS = 1  # which implementation computes an op (attention processors, native kernels)
    LAYOUT = 2  # memory formats
    REWRITE = 3  # modules replaced by equivalent ones (fused projections, 1x1 convs as linears)
    PRODUCTS = 4  # what the final floating-point layers multiply in (bf16 in fp32 where that is faster)
    QUANTIZE = 5  # fewer bits or fewer weights
    COMPILE = 6  # torch.compile
    WRAP = 7  # wrappers around the finished model (feature caches)


@dataclass(frozen=True)
class Transform:
    """What a step does to a workload's model parts: `apply(part, settings)` changes the part in
    place, for each part named in `on` (the names a workload's `apply_recipe` gives its parts)."""

    apply: Callable[[Any, Any], None]
    on: tuple[str, ...]
    stage: Stage


Requirement = Callable[[Target], "str | None"]  # why a step cannot run (or is degraded) on a target; None: fine


def no_requirement(target: Target) -> str | None:
    return None


@dataclass(frozen=True)
class Step:
    """One optimization and its contract. `sets`: the settings fields it sets (a mapping, or a
    function of the target); `needs`: why it cannot run on a target; `declined`: why the target's
    own choices leave it out; `fallback`: how it runs in a lesser form there; `replaces`: earlier
    steps whose settings it takes back (e.g. 2:4 sparsity instead of dynamic int8); `tunes`: the
    settings fields that parameterize it without being what it sets (Recipe.plan's `tuned`)."""

    name: str
    changes: str
    budget: str
    sets: Mapping[str, Any] | Callable[[Target], Mapping[str, Any]] = field(default_factory=dict)
    needs: Requirement = no_requirement
    declined: Requirement = no_requirement
    fallback: Requirement = no_requirement
    replaces: tuple[str, ...] = ()
    transforms: tuple[Transform, ...] = ()
    tunes: tuple[str, ...] = ()

    def settings_on(self, target: Target) -> Mapping[str, Any]:
        return self.sets(target) if callable(self.sets) else self.sets

    def held_by(self, settings: Any) -> bool:
        """Whether `settings` hold what this step sets (a step that sets by target never is: it
        carries no transforms, Recipe checks). A recipe's baseline is always held (Recipe.held)."""
        if callable(self.sets):
            return False
        return all(getattr(settings, name) == value for name, value in self.sets.items())

    def unavailable(self, target: Target) -> str | None:
        """Why the step does not run on `target` (declined or impossible), or None."""
        return self.declined(target) or self.needs(target)


@dataclass(frozen=True)
class Plan(Generic[Settings]):
    """The settings of a recipe up to `step` on one target, and what was left out or degraded."""

    step: str
    settings: Settings
    applied: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...] = ()  # (step, why it cannot run here)
    notes: tuple[tuple[str, str], ...] = ()  # (step, how it runs here instead)
    declined: tuple[tuple[str, str], ...] = ()  # (step, which of the user's choices leaves it out)

    def messages(self) -> list[str]:
        """One line per step that was left out or runs in a lesser form, for stderr."""
        return [f"step {name} left out: {why}" for name, why in self.skipped] + [
            f"step {name}: {note}" for name, note in self.notes
        ]


class Recipe(Generic[Settings]):
    """A workload's steps in ladder order; the first is the baseline."""

    def __init__(self, workload: str, settings: type[Settings], steps: Sequence[Step]) -> None:
        names = [s.name for s in steps]
        if len(set(names)) != len(names):
            raise ValueError(f"{workload} recipe: duplicate step names in {names}")
        known = {f.name for f in fields(settings)}  # type: ignore[arg-type]
        set_by_steps = {name for step in steps if not callable(step.sets) for name in step.sets}
        for step in steps:
            if step.transforms and callable(step.sets):
                raise ValueError(f"{workload} step {step.name} sets by target: its transforms could not be matched")
            if step.transforms and not step.sets and step is not steps[0]:
                raise ValueError(f"{workload} step {step.name} has transforms but sets nothing (only the baseline may)")
            if not callable(step.sets) and set(step.sets) - known:
                raise ValueError(f"{workload} step {step.name} sets unknown fields {set(step.sets) - known}")
            if any(r not in names[: names.index(step.name)] for r in step.replaces):
                raise ValueError(f"{workload} step {step.name} replaces a step that does not come before it")
            if set(step.tunes) - known or set(step.tunes) & set_by_steps:
                raise ValueError(f"{workload} step {step.name} tunes {step.tunes}: unknown fields or set by a step")
        self.workload = workload
        self.settings_type = settings
        self.steps = tuple(steps)
        self.names = tuple(names)

    @property
    def baseline(self) -> str:
        return self.names[0]

    def step(self, name: str) -> Step:
        if name not in self.names:
            raise UserError(
                f"unknown step {name!r} of the {self.workload} recipe; its steps, in order: {', '.join(self.names)}"
            )
        return self.steps[self.names.index(name)]

    def ordered(self, names: Iterable[str]) -> list[str]:
        """`names` checked and sorted into ladder order (duplicates dropped)."""
        return sorted({self.step(n).name for n in names}, key=self.names.index)

    def unavailable(self, name: str, target: Target) -> str | None:
        """Why step `name` cannot run on `target`, or None."""
        return self.step(name).unavailable(target)

    def plan(
        self, name: str, target: Target, tuned: Mapping[str, Any] | None = None, without: Iterable[str] = ()
    ) -> Plan[Settings]:
        """Every step up to and including `name`, cumulatively, on `target`. Raises UserError when
        `name` itself cannot run there; earlier steps that cannot are left out (Plan.skipped).
        `tuned`: values for steps' parameters (Step.tunes), set where the plan applies their step;
        `without`: earlier steps left out (Plan.declined)."""
        tuned = dict(tuned or {})
        if unknown := set(tuned) - {key for step in self.steps for key in step.tunes}:
            raise ValueError(f"no step of the {self.workload} recipe tunes {', '.join(sorted(unknown))}")
        without = set(self.ordered(without))
        last = self.step(name)
        reason = last.unavailable(target)
        if reason:
            raise UserError(f"the {self.workload} step {name} cannot run here: {reason}")
        if name in without:
            raise UserError(f"the {self.workload} step {name} cannot be both planned and left out")
        active: list[Step] = []
        skipped, declined, notes = [], [], []
        for step in self.steps[: self.names.index(name) + 1]:
            if step.name in without:
                declined.append((step.name, "left out as asked"))
            elif reason := step.declined(target):
                declined.append((step.name, reason))
            elif reason := step.needs(target):
                skipped.append((step.name, reason))
            else:
                active = [s for s in active if s.name not in step.replaces] + [step]
        settings = self.settings_type()
        for step in active:
            settings = replace(settings, **step.settings_on(target))  # type: ignore[type-var]
            note = step.fallback(target)
            if note:
                notes.append((step.name, note))
        for step in active:
            changed = {
                key: value for key, value in tuned.items() if key in step.tunes and getattr(settings, key) != value
            }
            if changed:
                told = (f"{key} {value} (the recipe's: {getattr(settings, key)})" for key, value in changed.items())
                notes.append((step.name, ", ".join(told)))
                settings = replace(settings, **changed)  # type: ignore[type-var]
        return Plan(name, settings, tuple(s.name for s in active), tuple(skipped), tuple(notes), tuple(declined))

    def settings(self, name: str, on: Target | None = None) -> Settings:
        """The settings of every step up to `name` on `on` (default: this machine, --dtype auto),
        e.g. `apply_recipe(model, RECIPE.settings("compile"))`."""
        return self.plan(name, on or target()).settings

    def describe(self, target: Target | None = None) -> str:
        """The steps as a markdown table: name, what changes, accuracy budget and, for a target,
        how each runs there."""

        def here(step: Step) -> str:
            assert target is not None
            reason = step.unavailable(target)
            return f"left out: {reason}" if reason else step.fallback(target) or "runs"

        lines = [
            "| step | what changes | accuracy budget |" + (" here |" if target else ""),
            "|---|---|---|" + ("---|" if target else ""),
        ]
        lines += [f"| {s.name} | {s.changes} | {s.budget} |" + (f" {here(s)} |" if target else "") for s in self.steps]
        return "\n".join(lines)

    def held(self, settings: Settings) -> list[Step]:
        """The steps whose settings `settings` hold (Step.held_by), in ladder order."""
        return [self.steps[0]] + [step for step in self.steps[1:] if step.held_by(settings)]

    def apply(self, settings: Settings, parts: Mapping[str, Any], target: Target) -> tuple[str, ...]:
        """Make the model `parts` (the workload's parts by name) run as `settings` say, in place:
        a held step that cannot run on `target` is refused with the reason, then the held steps'
        transforms run by stage, then in ladder order. Returns the steps whose transforms ran."""
        held = self.held(settings)
        for step in held:
            if reason := step.needs(target):
                raise UserError(f"the {self.workload} step {step.name} cannot run here: {reason}")
        ordered = sorted(
            ((transform, step, i) for i, step in enumerate(held) for transform in step.transforms),
            key=lambda item: (item[0].stage, item[2]),
        )
        for transform, step, _ in ordered:
            for name in transform.on:
                if name not in parts:
                    raise ValueError(
                        f"step {step.name} transforms {name!r}, which this model has not ({', '.join(parts)})"
                    )
                transform.apply(parts[name], settings)
        return tuple(step.name for step in held if step.transforms)


def settings_key(settings: Any) -> dict[str, Any]:
    """`settings` (a recipe's settings dataclass) as JSON-able values, for the key of compiled code
    saved for it (genfast/compilation/saved.py)."""
    return {f.name: getattr(settings, f.name) for f in fields(settings)}
