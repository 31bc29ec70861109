"""The recipe mechanism every workload uses (genfast/recipe.py): order, the one rule for steps that
cannot run, fallbacks, replacement; and that each workload's recipe is well formed."""

from __future__ import annotations

from dataclasses import dataclass, make_dataclass, replace

import pytest
import torch

from genfast import steps
from genfast.diffusion.recipe import RECIPE as DIFFUSION
from genfast.errors import UserError
from genfast.llm.recipe import RECIPE as LLM
from genfast.recipe import Recipe, Stage, Step, Target, Transform
from genfast.sam.recipe import RECIPE as SAM

CPU = Target(torch.device("cpu"), "auto")


@dataclass(frozen=True)
class Toy:
    fast: bool = False
    faster: bool = False
    fastest: bool = False
    level: int = 0


def toy(needs_gpu: bool = True) -> Recipe[Toy]:
    gpu_only = (lambda t: "needs a GPU" if t.device.type != "cuda" else None) if needs_gpu else (lambda t: None)
    return Recipe(
        "toy",
        Toy,
        [
            steps.baseline("plain"),
            Step("fast", "faster", "exact", {"fast": True, "level": 1}),
            Step("faster", "on a GPU", "exact", {"faster": True, "level": 2}, needs=gpu_only),
            Step("declined", "what the user said no to", "exact", {"level": 9}, declined=lambda t: "--no-declined"),
            Step(
                "fastest",
                "instead of fast",
                "exact",
                {"fastest": True},
                replaces=("fast",),
                fallback=lambda t: "runs slowly here",
            ),
        ],
    )


def test_steps_are_cumulative_and_ordered():
    recipe = toy(needs_gpu=False)
    assert recipe.names == ("baseline", "fast", "faster", "declined", "fastest") and recipe.baseline == "baseline"
    assert recipe.plan("baseline", CPU).settings == Toy()
    assert recipe.plan("faster", CPU).settings == Toy(fast=True, faster=True, level=2)
    assert recipe.ordered(["fastest", "baseline", "fast", "fast"]) == ["baseline", "fast", "fastest"]


def test_a_later_step_takes_back_what_it_replaces():
    plan = toy(needs_gpu=False).plan("fastest", CPU)
    assert plan.settings == Toy(fast=False, faster=True, fastest=True, level=2)
    assert plan.applied == ("baseline", "faster", "fastest")
    assert plan.notes == (("fastest", "runs slowly here"),)


def test_one_rule_for_a_step_that_cannot_run():
    recipe = toy()
    plan = recipe.plan("fastest", CPU)  # an earlier step that cannot run is left out, with why
    assert plan.skipped == (("faster", "needs a GPU"),) and plan.declined == (("declined", "--no-declined"),)
    assert plan.settings == Toy(fastest=True)  # fast was replaced, faster left out
    assert plan.messages() == ["step faster left out: needs a GPU", "step fastest: runs slowly here"]
    with pytest.raises(UserError, match="the toy step faster cannot run here: needs a GPU"):
        recipe.plan("faster", CPU)  # asked for by name
    with pytest.raises(UserError, match="--no-declined"):
        recipe.plan("declined", CPU)
    assert recipe.unavailable("faster", CPU) == "needs a GPU" and recipe.unavailable("fast", CPU) is None
    with pytest.raises(UserError, match="unknown step 'warp' of the toy recipe; its steps, in order: baseline, fast"):
        recipe.step("warp")


def test_a_malformed_recipe_is_refused():
    with pytest.raises(ValueError, match="duplicate"):
        Recipe("toy", Toy, [steps.baseline("a"), steps.baseline("b")])
    with pytest.raises(ValueError, match="unknown fields"):
        Recipe("toy", Toy, [steps.baseline("a"), Step("x", "", "", {"speed": 1})])
    with pytest.raises(ValueError, match="replaces a step that does not come before it"):
        Recipe("toy", Toy, [steps.baseline("a"), Step("x", "", "", replaces=("y",)), Step("y", "", "")])


@dataclass(frozen=True)
class Cached:
    cache: bool = False
    threshold: float = 0.1


def test_a_steps_parameter_is_tuned_only_in_plans_that_apply_the_step():
    """Step.tunes: a value given to the plan replaces the default where the step is applied and
    says so in a note; elsewhere the settings stay the recipe's (e.g. a compiled row's key)."""
    cache = Step("cache", "caches", "approximate", {"cache": True}, tunes=("threshold",))
    recipe = Recipe("toy", Cached, [steps.baseline("plain"), cache])
    plan = recipe.plan("cache", CPU, {"threshold": 0.5})
    assert plan.settings == Cached(cache=True, threshold=0.5)
    assert plan.notes == (("cache", "threshold 0.5 (the recipe's: 0.1)"),)
    assert recipe.plan("baseline", CPU, {"threshold": 0.5}).settings == Cached()
    assert recipe.plan("cache", CPU, {"threshold": 0.1}).notes == ()  # the recipe's own value: nothing to say
    assert recipe.plan("cache", CPU).settings == recipe.plan("cache", CPU, {}).settings == Cached(cache=True)
    with pytest.raises(ValueError, match="no step of the toy recipe tunes speed"):
        recipe.plan("cache", CPU, {"speed": 1.0})
    with pytest.raises(ValueError, match="tunes"):  # a field a step sets is not a parameter
        Recipe("toy", Cached, [steps.baseline("plain"), replace(cache, tunes=("cache",))])
    with pytest.raises(ValueError, match="tunes"):
        Recipe("toy", Cached, [steps.baseline("plain"), replace(cache, tunes=("speed",))])


def test_a_plan_without_steps_declines_them():
    """`without`: the named earlier steps are left out as the user chose (Plan.declined); the
    planned step itself cannot be, and an unknown name is refused."""
    recipe = toy(needs_gpu=False)
    plan = recipe.plan("fastest", CPU, without=["faster"])
    assert "faster" not in plan.applied and ("faster", "left out as asked") in plan.declined
    assert plan.settings == Toy(fastest=True)  # fast replaced by fastest, faster left out: level stays 0
    assert recipe.plan("fastest", CPU, without=()) == recipe.plan("fastest", CPU)
    with pytest.raises(UserError, match="both planned and left out"):
        recipe.plan("fastest", CPU, without=["fastest"])
    with pytest.raises(UserError, match="unknown step 'warp'"):
        recipe.plan("fastest", CPU, without=["warp"])


def test_describe_says_how_each_step_runs_here():
    table = toy().describe(CPU).splitlines()
    assert table[0] == "| step | what changes | accuracy budget | here |"
    assert table[4] == "| faster | on a GPU | exact | left out: needs a GPU |"
    assert table[6].endswith("| runs slowly here |") and table[3].endswith("| runs |")


@pytest.mark.parametrize("recipe", [LLM, SAM, DIFFUSION], ids=lambda r: r.workload)
def test_every_workload_recipe_starts_at_the_baseline_and_names_steps_alike(recipe):
    """One name per idea: the shared steps keep their names, step names are lowercase with dashes,
    and every step states what it changes and its accuracy budget."""
    assert recipe.names[0] == "baseline" and "bf16" in recipe.names and "compile" in recipe.names
    for step in recipe.steps:
        assert step.name == step.name.lower() and "_" not in step.name and " " not in step.name
        assert step.changes and step.budget
    assert recipe.names.index("bf16") < recipe.names.index("compile")


def test_a_step_shared_by_all_workloads_is_one_function_and_one_line_per_recipe(tmp_path, monkeypatch):
    """A new shared step: one function (the step and its transform, as in genfast/steps.py) and one
    line in each workload's recipe naming the parts it applies to; its settings field goes in the
    shared settings base (steps.StepSettings; stood in for here by a subclass of each workload's
    settings). Each workload's apply_recipe then runs it on those parts, in its stage's turn."""
    import genfast.diffusion.recipe
    import genfast.llm.recipe
    import genfast.sam.recipe
    from genfast.diffusion.pipelines import tiny_pipeline
    from genfast.sam.build import build_random_sam
    from tests.llm.hf_fixtures import make_hf_model, save_hf_model, word_tokenizer
    from tests.sam.test_recipe import SMALL

    seen: list[tuple[str, str]] = []

    def mark(part, settings) -> None:  # the shared step's transform: here it records what it got
        seen.append((type(part).__name__, settings.dtype))

    def marked(on: tuple[str, ...]) -> Step:  # the one function
        return Step("marked", "records the parts it gets", "exact", {"marked": True},
                    transforms=(Transform(mark, on, Stage.WRAP),))  # fmt: skip

    def with_the_step(module, on: tuple[str, ...]):  # the one line in the workload's recipe
        recipe = module.RECIPE
        settings_type = make_dataclass(
            recipe.settings_type.__name__, [("marked", bool, False)], bases=(recipe.settings_type,), frozen=True
        )
        extended = Recipe(recipe.workload, settings_type, [*recipe.steps, marked(on)])
        monkeypatch.setattr(module, "RECIPE", extended)
        return extended

    cpu = Target(torch.device("cpu"), "float32")
    sam = with_the_step(genfast.sam.recipe, ("image_encoder",))
    diffusion = with_the_step(genfast.diffusion.recipe, ("denoiser", "vae"))
    llm = with_the_step(genfast.llm.recipe, ("model",))
    for recipe in (sam, diffusion, llm):
        plan = recipe.plan("marked", cpu)
        assert plan.applied[-1] == "marked" and plan.settings.marked
    sam_settings = replace(sam.settings_type(), attention="sdpa", marked=True)
    genfast.sam.recipe.apply_recipe(build_random_sam(SMALL), sam_settings)
    genfast.diffusion.recipe.apply_recipe(tiny_pipeline("sd15"), replace(diffusion.settings_type(), marked=True))
    hf = make_hf_model("smollm")
    directory = save_hf_model(hf, tmp_path / "llm")
    word_tokenizer(hf.config.vocab_size).save(directory)
    loaded = genfast.llm.recipe.apply_recipe(str(directory), replace(llm.settings_type(), marked=True), "cpu")
    assert seen == [("ImageEncoderViT", "float32"), ("UNet2DConditionModel", "float32"), ("AutoencoderKL", "float32"),
                    ("Transformer", "float32")]  # fmt: skip
    assert loaded.transforms == ("marked",)  # (a background compile could not redo it)
    with pytest.raises(ValueError, match="transforms 'unet', which this model has not"):
        Recipe("toy", llm.settings_type, [steps.baseline("a"), marked(("unet",))]).apply(
            llm.settings_type(marked=True), {"model": None}, cpu
        )


def test_transforms_run_by_stage_then_ladder_order_when_the_settings_hold_their_step():
    """The stage, not the ladder, orders the transforms (a ladder may list compile before a
    quantization that must precede it); a step runs when the settings hold what it sets, so
    settings built by hand apply as the same settings from a plan."""
    ran: list[str] = []

    def record(name: str) -> Transform:
        return Transform(lambda part, settings: ran.append(name), ("model",), STAGES[name])

    STAGES = {"cast": Stage.PRECISION, "compile": Stage.COMPILE, "quantize": Stage.QUANTIZE}
    recipe = Recipe(
        "toy",
        Toy,
        [
            steps.baseline("plain", [record("cast")]),
            Step("fast", "compiles", "exact", {"fast": True}, transforms=(record("compile"),)),
            Step("faster", "quantizes", "exact", {"faster": True, "level": 2}, transforms=(record("quantize"),)),
        ],
    )
    assert recipe.apply(recipe.plan("faster", CPU).settings, {"model": None}, CPU) == ("baseline", "fast", "faster")
    assert ran == ["cast", "quantize", "compile"]
    ran.clear()
    recipe.apply(Toy(faster=True), {"model": None}, CPU)  # by hand, and `level` is not what faster sets
    assert ran == ["cast"]
    recipe.apply(Toy(faster=True, level=2), {"model": None}, CPU)
    assert ran == ["cast", "cast", "quantize"]
    gpu_only = Step("gpu", "", "", {"fastest": True}, needs=lambda t: "needs a GPU")
    with pytest.raises(UserError, match="the toy step gpu cannot run here: needs a GPU"):
        Recipe("toy", Toy, [steps.baseline("plain"), gpu_only]).apply(Toy(fastest=True), {}, CPU)
    with pytest.raises(ValueError, match="has transforms but sets nothing"):
        Recipe("toy", Toy, [steps.baseline("a"), Step("x", "", "", transforms=(record("cast"),))])
