"""ModelArgs as configs give it and as genfast saves it: a family's own values are typed
(ModelArgs.family_args, the family's args_type), survive the JSON that quantized checkpoints and
compiled steps' keys store, and configs saved with the older untyped `extra` dict still load."""

from __future__ import annotations

import json

import pytest
import torch

from genfast.errors import UserError
from genfast.llm.model import families
from genfast.llm.model.config import ModelArgs
from genfast.llm.model.families.gemma2 import GemmaArgs
from genfast.llm.model.families.gemma3 import Gemma3Args
from genfast.llm.model.reading import LEGACY_EXTRA, args_from_dict, args_from_hf_config
from tests.llm.hf_fixtures import TINY_CONFIGS


def _saved(args: ModelArgs) -> dict:
    return json.loads(json.dumps(args.to_dict()))


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_saved_config_reads_back_equal(name):
    args = args_from_hf_config(TINY_CONFIGS[name])
    again = args_from_dict(_saved(args))
    assert again == args and hash(again) == hash(args)
    kind = families.family(args.family).args_type
    assert again.family_args is None if kind is None else type(again.family_args) is kind


def test_gemma_values_are_typed():
    gemma2 = args_from_hf_config(TINY_CONFIGS["gemma2"])
    assert gemma2.family_args == GemmaArgs(
        query_pre_attn_scalar=16, sliding_window=6, sliding_layers=(0, 2), attn_logit_softcap=5.0,
        final_logit_softcap=3.0,
    )  # fmt: skip
    gemma3 = args_from_hf_config(TINY_CONFIGS["gemma3"])
    assert isinstance(gemma3.family_args, Gemma3Args)
    assert gemma3.family_args.sliding_layers == (0, 1, 2, 3, 4) and gemma3.family_args.local_rope_theta == 10000.0
    assert args_from_hf_config(TINY_CONFIGS["llama3"]).family_args is None


def test_family_values_are_part_of_equality():
    """Two Gemmas that differ only in a soft-cap are different models (compiled steps key on args)."""
    cfg = TINY_CONFIGS["gemma2"]
    assert args_from_hf_config(cfg) != args_from_hf_config({**cfg, "final_logit_softcapping": 30.0})


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_config_saved_with_the_untyped_extra_dict_still_loads(name):
    args = args_from_hf_config(TINY_CONFIGS[name])
    legacy = _saved(args)
    own = legacy.pop("family_args")
    if name == "gemma3":
        del own["local_rope_theta"]  # GGUF-read configs left it out: the default applied
    legacy[LEGACY_EXTRA] = {**own, "embedding_scale": args.dim**0.5}
    assert args_from_dict(legacy) == args
    plain = _saved(args_from_hf_config(TINY_CONFIGS["llama3"]))
    del plain["family_args"]
    assert args_from_dict({**plain, LEGACY_EXTRA: {}}) == args_from_dict(plain)


def test_family_args_that_do_not_fit_the_family_are_refused():
    llama = _saved(args_from_hf_config(TINY_CONFIGS["llama3"]))
    with pytest.raises(UserError, match="takes none"):
        args_from_dict({**llama, "family_args": {"sliding_window": 4}})
    gemma = _saved(args_from_hf_config(TINY_CONFIGS["gemma2"]))
    with pytest.raises(UserError, match="lacks its family_args"):
        args_from_dict({**gemma, "family_args": None})
    with pytest.raises(UserError, match="incomplete"):
        args_from_dict({**gemma, "family_args": {"sliding_window": 4}})


def test_hooks_are_the_identity_unless_a_family_sets_them():
    x = torch.randn(2, 3, 64)
    llama = args_from_hf_config(TINY_CONFIGS["llama3"])
    family = families.family(llama.family)
    assert family.scale_embeddings(llama, x) is x and family.final_logits(llama, x) is x
    gemma2 = args_from_hf_config(TINY_CONFIGS["gemma2"])
    family = families.family(gemma2.family)
    torch.testing.assert_close(family.scale_embeddings(gemma2, x), x * 8.0)
    torch.testing.assert_close(family.final_logits(gemma2, x), torch.tanh(x / 3.0) * 3.0)
    gemma3 = args_from_hf_config(TINY_CONFIGS["gemma3"])  # no final soft-cap
    assert families.family(gemma3.family).final_logits(gemma3, x) is x


def test_a_quantized_gemma_directory_loads_back_with_its_family_args(tmp_path):
    """`genfast quantize` stores the config as JSON in its header: the Gemma read back from it is
    the model quantized on load, logit for logit."""
    from genfast.cli import main
    from genfast.llm.loading import load
    from tests.llm.hf_fixtures import make_hf_model, save_hf_model, word_tokenizer

    directory = save_hf_model(make_hf_model("gemma2"), tmp_path / "gemma2")
    word_tokenizer(256).save(directory)
    out = tmp_path / "q"
    assert main(["quantize", "-m", str(directory), "--mode", "int8", "-o", str(out), "--dtype", "float32"]) == 0
    saved, on_load = load(str(out), "cpu", "float32"), load(str(directory), "cpu", "float32", quant="int8")
    assert saved.model.args == on_load.model.args and isinstance(saved.model.args.family_args, GemmaArgs)
    tokens = torch.arange(3, 20)[None]
    with torch.no_grad():
        want = on_load.model(tokens, torch.arange(17), all_logits=True)
        torch.testing.assert_close(saved.model(tokens, torch.arange(17), all_logits=True), want, atol=0, rtol=0)


@pytest.mark.parametrize(
    "name, changes",
    [("llama3", {"mlp_bias": True}), ("granite", {"mlp_bias": True}), ("ernie4_5", {"use_bias": True})],
)
def test_biases_genfast_does_not_read_are_refused(name, changes):
    """MLP biases would be left unread (and the logits wrong): such configs are refused."""
    with pytest.raises(UserError, match="not supported"):
        args_from_hf_config({**TINY_CONFIGS[name], **changes})
