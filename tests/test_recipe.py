"""The recipe mechanism every workload uses (genfast/recipe.py): order, the one rule for steps that
cannot run, fallbacks, replacement; and that each workload's recipe is well formed."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from genfast import steps
from genfast.diffusion.recipe import RECIPE as DIFFUSION
from genfast.errors import UserError
from genfast.llm.recipe import RECIPE as LLM
from genfast.recipe import Recipe, Step, Target
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


def test_a_step_with_its_own_transform_is_one_line_per_workload_recipe(tmp_path):
    """A new step shared by all workloads: one transform function, and one line in each recipe
    naming the parts it applies to; each workload's apply runs it on those parts, in order."""
    from genfast.diffusion.pipelines import tiny_pipeline
    from genfast.diffusion.recipe import apply_recipe as apply_diffusion
    from genfast.llm.session import apply_recipe as apply_llm
    from genfast.llm.session import load
    from genfast.recipe import apply_transforms
    from genfast.sam.build import build_random_sam
    from genfast.sam.recipe import apply_recipe as apply_sam
    from tests.llm.hf_fixtures import make_hf_model, save_hf_model, word_tokenizer
    from tests.sam.test_recipe import SMALL

    seen: list[tuple[str, str]] = []

    def mark(part, settings) -> None:  # the shared step's transform: here it records what it got
        seen.append((type(part).__name__, settings.dtype))

    def shared(on: tuple[str, ...]) -> Step:
        return Step("marked", "records the parts it gets", "exact", transform=mark, on=on)

    cpu = Target(torch.device("cpu"), "float32")
    for recipe, on in ((SAM, ("image_encoder",)), (DIFFUSION, ("denoiser", "vae")), (LLM, ("model",))):
        extended = Recipe(recipe.workload, recipe.settings_type, [*recipe.steps, shared(on)])
        settings = extended.plan("marked", cpu).settings
        assert [s.name for s in settings.transforms] == ["marked"]
        plan = extended.plan("marked", cpu)
        runnable = [n for n in recipe.names if not recipe.unavailable(n, cpu)]
        assert plan.applied[-1] == "marked" and len(plan.applied) <= len(runnable) + 1
    sam_settings = Recipe("sam", SAM.settings_type, [*SAM.steps[:3], shared(("image_encoder",))]).plan("marked", cpu)
    apply_sam(build_random_sam(SMALL), sam_settings.settings)
    diffusion = Recipe("diffusion", DIFFUSION.settings_type, [*DIFFUSION.steps[:3], shared(("denoiser", "vae"))])
    apply_diffusion(tiny_pipeline("sd15"), diffusion.plan("marked", cpu).settings)
    hf = make_hf_model("smollm")
    directory = save_hf_model(hf, tmp_path / "llm")
    word_tokenizer(hf.config.vocab_size).save(directory)
    llm = Recipe("llm", LLM.settings_type, [*LLM.steps[:2], shared(("model",))])
    loaded = apply_llm(load(str(directory), "cpu", "float32"), llm.plan("marked", cpu).settings)
    assert seen == [("ImageEncoderViT", "float32"), ("UNet2DConditionModel", "float32"), ("AutoencoderKL", "float32"),
                    ("Transformer", "float32")]  # fmt: skip
    assert loaded.transforms == ("marked",)
    with pytest.raises(ValueError, match="transforms 'unet', which this model has not"):
        apply_transforms(replace(llm.plan("marked", cpu).settings, transforms=(shared(("unet",)),)), {"model": None})
    with pytest.raises(ValueError, match="no `transforms` field"):
        Recipe("toy", Toy, [steps.baseline("a"), shared(("x",))])
