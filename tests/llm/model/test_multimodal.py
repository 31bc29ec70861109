"""The text part of multimodal checkpoints (genfast/llm/model/families/multimodal.py) on tiny random
transformers wrappers with tiny vision towers: Gemma3ForConditionalGeneration,
Mistral3ForConditionalGeneration (untied, and tied as transformers 5 saves it by default; Ministral
3's text model),
LlavaForConditionalGeneration (a Qwen2 text model) and LlavaNextForConditionalGeneration. Logits equal
the wrapper's on text (fp32, 1e-4) in both tensor layouts (transformers 5's
`model.language_model.*`, the hub's older `language_model.model.*`); greedy text through the CLI
equals the wrapper's generate and says only the text part is loaded; the image encoder's tensors
are never read; hub-style sparse configs read as transformers reads them; refusals name why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from genfast import cli
from genfast.errors import UserError
from genfast.llm.checkpoints.checkpoint import Checkpoint
from genfast.llm.checkpoints.weights import load_model
from genfast.llm.model import families
from genfast.llm.model.families import multimodal
from genfast.llm.model.reading import args_from_hf_config
from tests.llm.decoding.test_generate import check_compiled_matches_eager
from tests.llm.gguf_fixtures import write_gguf_from_hf
from tests.llm.hf_fixtures import TINY_CONFIGS, randomize_norms, save_hf_model, word_tokenizer
from tests.llm.model.test_families import check_cli_greedy_equals_transformers

ATOL = 1e-4
VOCAB = 256
IMAGE_TOKENS = dict(image_token_index=VOCAB - 1)  # text prompts stay below VOCAB - 4


def _text(name: str, **changes) -> dict:
    cfg = {**TINY_CONFIGS[name], **changes}
    cfg.pop("architectures")
    return cfg


# (wrapper class, config class, config kwargs) per tiny model; vision towers of one or two layers.
_SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
               patch_size=14)  # fmt: skip
_CLIP = dict(_SIGLIP, model_type="clip_vision_model", projection_dim=16)
WRAPPED = {
    # Gemma 3's text (six layers: five local with their own rope base, one global with linear
    # scaling), tied.
    "gemma3": ("Gemma3ForConditionalGeneration", "Gemma3Config", dict(
        text_config=_text("gemma3"), vision_config=_SIGLIP, mm_tokens_per_image=4, boi_token_index=VOCAB - 3,
        eoi_token_index=VOCAB - 2, **IMAGE_TOKENS)),
    # Mistral Small 3.1's shape in small: Mistral text, untied head, no window.
    "mistral3": ("Mistral3ForConditionalGeneration", "Mistral3Config", dict(
        text_config=_text("mistral_window", sliding_window=None, rope_theta=1e9), tie_word_embeddings=False,
        vision_config=dict(_SIGLIP, model_type="pixtral", head_dim=16), **IMAGE_TOKENS)),
    # transformers 5's default for Mistral3Config: tied at the top level, untied in text_config;
    # it saves no lm_head, and the stored tensors decide.
    "mistral3_tied": ("Mistral3ForConditionalGeneration", "Mistral3Config", dict(
        text_config=_text("mistral_window", sliding_window=None),
        vision_config=dict(_SIGLIP, model_type="pixtral", head_dim=16), **IMAGE_TOKENS)),
    # Ministral 3: YaRN and Llama 4's attention temperature, its steps every 8 positions here (the
    # original context) so that the test's sequences take three.
    "ministral3": ("Mistral3ForConditionalGeneration", "Mistral3Config", dict(
        text_config=_text("mistral_window", model_type="ministral3", sliding_window=None, head_dim=16,
                          tie_word_embeddings=True, rope_parameters=dict(
                              type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=8,
                              beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                              llama_4_scaling_beta=0.5)),
        vision_config=dict(_SIGLIP, model_type="pixtral", head_dim=16), **IMAGE_TOKENS)),
    # LLaVA with a Qwen2 text model (q/k/v biases; tied in its text_config, as LLaVA-OneVision's).
    "llava_qwen2": ("LlavaForConditionalGeneration", "LlavaConfig", dict(
        text_config=_text("qwen2"), vision_config=_CLIP, **IMAGE_TOKENS)),
    # LLaVA 1.6 (a Llama text model, Llama 3.1 rope scaling, untied).
    "llava_next": ("LlavaNextForConditionalGeneration", "LlavaNextConfig", dict(
        text_config=_text("llama3", vocab_size=VOCAB), vision_config=_CLIP, image_grid_pinpoints=[[28, 28]],
        **IMAGE_TOKENS)),
}  # fmt: skip


def make_wrapper(name: str, seed: int = 0, **text_changes):
    """One of WRAPPED with random weights (`text_changes`: text_config fields that differ)."""
    import transformers

    model_class, config_class, kwargs = WRAPPED[name]
    kwargs = dict(kwargs, text_config={**kwargs["text_config"], **text_changes})
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**kwargs)
    return randomize_norms(getattr(transformers, model_class)(config).float())


def relayout(directory: Path, layout: str) -> None:
    """Rename the saved tensors to one layout: "new" (transformers 5: model.language_model.*,
    lm_head.*, model.vision_tower.*) or "legacy" (the hub's: language_model.model.*,
    language_model.lm_head.*, vision_tower.*), index included."""
    to_legacy = [("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                 ("model.", "")]  # fmt: skip
    to_new = [("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
              ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."),
              ("image_newline", "model.image_newline")]  # fmt: skip

    def rename(name: str) -> str:
        for old, new in to_new if layout == "new" else to_legacy:
            if name.startswith(old) and not (layout == "new" and name.startswith("model.")):
                return new + name[len(old) :]
        return name

    for file in directory.glob("*.safetensors"):
        save_file({rename(k): v for k, v in load_file(file).items()}, file, metadata={"format": "pt"})
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {rename(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data))


def saved_wrapper(name: str, directory: Path, layout: str, max_shard_size: str | None = None):
    hf = make_wrapper(name)
    save_hf_model(hf, directory, max_shard_size)
    relayout(directory, layout)
    word_tokenizer(VOCAB).save(directory)
    return hf, directory


@pytest.fixture(scope="module", params=list(WRAPPED))
def wrapper(request, tmp_path_factory):
    name = request.param
    hf, directory = saved_wrapper(name, tmp_path_factory.mktemp(name), "new")
    return name, hf, directory


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB - 4, (1, n), generator=torch.Generator().manual_seed(seed))


def _check_logits(hf, directory: Path) -> None:
    tokens = _tokens(23)
    model = load_model(Checkpoint.open(directory))
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens, torch.arange(23), all_logits=True), hf(input_ids=tokens).logits, atol=ATOL, rtol=0
        )


def test_text_logits_equal_the_wrappers_in_both_layouts(wrapper, tmp_path):
    _, hf, directory = wrapper
    _check_logits(hf, directory)
    legacy = tmp_path / "legacy"
    save_hf_model(hf, legacy)
    relayout(legacy, "legacy")
    assert any(k.startswith("language_model.model.") for k in Checkpoint.open(legacy).hf_weight_map)
    _check_logits(hf, legacy)


def test_text_config_and_tied_head_read_as_transformers_does(wrapper):
    name, hf, directory = wrapper
    checkpoint = Checkpoint.open(directory)
    args, text = checkpoint.args, hf.config.text_config
    assert checkpoint.multimodal_architecture == WRAPPED[name][0]
    assert families.family(args.family) is families.family(text.model_type)
    assert (args.n_layers, args.dim, args.vocab_size) == (text.num_hidden_layers, text.hidden_size, text.vocab_size)
    # Tied exactly where transformers shares one tensor between the embedding and the head.
    embed, head = hf.get_input_embeddings().weight, hf.get_output_embeddings().weight
    assert args.tie_embeddings == (embed.data_ptr() == head.data_ptr())


def test_greedy_text_through_the_cli_equals_the_wrapper_and_says_text_only(wrapper, capsys):
    name, hf, directory = wrapper
    err = check_cli_greedy_equals_transformers(hf, directory, _tokens(7, seed=1)[0].tolist(), 8, capsys)
    assert f"text only: {WRAPPED[name][0]}'s language model is loaded, not its image encoder" in err


class ReadSpy:
    """Stands in for safetensors.safe_open: records the files opened and the tensors read."""

    def __init__(self, real) -> None:
        self.real, self.files, self.tensors = real, set(), []

    def __call__(self, filename: str, framework: str, **kwargs):
        self.files.add(Path(filename).name)
        handle, spy = self.real(filename, framework=framework, **kwargs), self

        class Handle:
            def keys(self):
                return handle.keys()

            def get_tensor(self, name: str) -> torch.Tensor:
                spy.tensors.append(name)
                return handle.get_tensor(name)

            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                handle.__exit__(*exc)

        return Handle()


@pytest.mark.parametrize("layout", ["new", "legacy"])
def test_the_image_encoder_is_never_read(layout, tmp_path, monkeypatch):
    """Sharded so that the vision tower's tensors fill shards of their own: those files are never
    opened, and no tensor outside the language model is read."""
    import safetensors

    _, directory = saved_wrapper("gemma3", tmp_path / "g", layout, max_shard_size="20KB")
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    decoder, head = multimodal.TEXT_PREFIXES[0 if layout == "new" else 1]
    text_files = {f for n, f in weight_map.items() if n.startswith(decoder) or n.startswith(head + "lm_head")}
    vision_only = set(weight_map.values()) - text_files
    assert vision_only, "the test needs shards holding only the image encoder"
    spy = ReadSpy(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", spy)
    load_model(Checkpoint.open(directory))
    assert spy.tensors and all(n.startswith(decoder) for n in spy.tensors)
    assert not spy.files & vision_only


def test_hub_configs_that_list_only_what_differs_read_as_transformers_reads_them():
    """Gemma 3 4B and 27B's published configs (transformers 4.50: the text_config gives only what
    differs from Gemma3TextConfig), LLaVA 1.5's and a Mistral Small 3.1-like one: genfast's reading
    of the sparse config equals its reading of transformers' completed one."""
    import transformers

    gemma3_4b = dict(hidden_size=2560, intermediate_size=10240, model_type="gemma3_text", num_hidden_layers=34,
                     rope_scaling=dict(factor=8.0, rope_type="linear"), sliding_window=1024)  # fmt: skip
    gemma3_27b = dict(gemma3_4b, head_dim=128, hidden_size=5376, intermediate_size=21504, num_attention_heads=32,
                      num_hidden_layers=62, num_key_value_heads=16, query_pre_attn_scalar=168)  # fmt: skip
    llava_15 = dict(max_position_embeddings=4096, model_type="llama", rms_norm_eps=1e-5, vocab_size=32064)
    mistral_small = dict(model_type="mistral", hidden_size=5120, num_hidden_layers=40, head_dim=128, rope_theta=1e9,
                         sliding_window=None, vocab_size=131072)  # fmt: skip
    cases = [
        ("gemma3", "Gemma3Config", gemma3_4b),
        ("gemma3", "Gemma3Config", gemma3_27b),
        ("llava", "LlavaConfig", llava_15),
        ("mistral3", "Mistral3Config", mistral_small),
    ]
    for model_type, config_class, text in cases:
        sparse = {"architectures": ["X"], "model_type": model_type, "text_config": text}
        full = getattr(transformers, config_class)(text_config=dict(text)).to_dict()
        assert args_from_hf_config(sparse) == args_from_hf_config(full), (model_type, text)
    args = args_from_hf_config({"model_type": "gemma3", "text_config": gemma3_4b})
    assert (args.vocab_size, args.n_heads, args.n_kv_heads, args.head_dim) == (262208, 8, 4, 256)
    assert args.rope_theta == 1e6 and args.rope_scaling.kind == "linear" and args.rope_scaling.factor == 8.0
    assert (args.family_args.local_rope_theta, args.family_args.sliding_window) == (1e4, 1024)


@pytest.mark.parametrize("text_type", list(multimodal.TEXT_DEFAULTS))
def test_text_defaults_are_transformers_defaults(text_type):
    import transformers

    reference = transformers.AutoConfig.for_model(text_type).to_dict()
    for key, value in multimodal.TEXT_DEFAULTS[text_type].items():
        assert reference[key] == value, (text_type, key)
    assert set(multimodal.WRAPPERS.values()) <= set(multimodal.TEXT_DEFAULTS)


@pytest.mark.parametrize(
    "cfg,match",
    [
        ({"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
          "text_config": {"model_type": "qwen2_5_vl_text"}}, r"Qwen2_5_VLForConditionalGeneration .*M-RoPE"),
        ({"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"], "text_config": {}},
         "mixture of experts with chunked attention"),
        ({"model_type": "idefics3", "architectures": ["Idefics3ForConditionalGeneration"], "text_config": {}},
         "unsupported multimodal architecture 'idefics3'.*text part of model_type gemma3, llava"),
        ({"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
          "text_config": {"model_type": "cohere"}}, "language model of this LlavaForConditionalGeneration .*'cohere'"),
    ],
)  # fmt: skip
def test_wrappers_of_other_text_models_are_refused_saying_why(cfg, match):
    with pytest.raises(UserError, match=match):
        args_from_hf_config(cfg)


def test_a_wrapper_without_a_language_model_is_a_clear_error(tmp_path):
    _, directory = saved_wrapper("mistral3", tmp_path / "m", "new")
    tensors = load_file(directory / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if "language_model" not in k}, directory / "model.safetensors")
    with pytest.raises(UserError, match="holds no language model"):
        load_model(Checkpoint.open(directory))


def _text_model_of(hf):
    """The wrapper's language model as a text-only transformers model (what llama.cpp converts)."""
    import transformers

    text = transformers.AutoModelForCausalLM.from_config(hf.config.text_config, dtype=torch.float32).eval()
    text.model.load_state_dict(hf.model.language_model.state_dict())
    text.lm_head.load_state_dict(hf.lm_head.state_dict())
    return text


def _mmproj(path: Path) -> Path:
    """A tiny GGUF in the layout of llama.cpp's vision projectors (architecture "clip")."""
    import gguf

    w = gguf.GGUFWriter(str(path), "clip")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "gemma3")
    w.add_tensor("v.patch_embd.weight", torch.randn(4, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gemma3_gguf_of_the_text_part_loads_and_an_mmproj_is_a_clear_error(tmp_path, capsys):
    hf = make_wrapper("gemma3")
    directory = tmp_path / "gguf"
    directory.mkdir()
    write_gguf_from_hf(_text_model_of(hf), directory / "gemma-3-tiny.gguf", arch="gemma3")
    mmproj = _mmproj(directory / "mmproj-gemma-3-tiny-f32.gguf")
    tokens = _tokens(23)
    # The directory, as a download of Gemma 3's GGUF holds both files: the language model loads.
    model = load_model(Checkpoint.open(directory))
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens, torch.arange(23), all_logits=True), hf(input_ids=tokens).logits, atol=ATOL, rtol=0
        )
    with pytest.raises(UserError, match=r"multimodal projector .*pass the model's own GGUF"):
        _ = Checkpoint.open(mmproj).args
    assert cli.main(["generate", "w1 w2", "--model", str(mmproj), "--no-compile", "-n", "2"]) == 2
    assert "is a multimodal projector (mmproj" in capsys.readouterr().err


def test_known_text_model_types_include_the_wrappers_defaults():
    assert set(multimodal.WRAPPERS.values()) <= set(families.hf_model_types())
    assert not set(multimodal.WRAPPERS) & set(families.hf_model_types())


def test_ministral3_scales_its_queries_past_the_original_context(tmp_path):
    """Without the temperature (beta 0) the logits differ from the reference (by ~3e-3 on this
    random model, 30x the tolerance) past position 8 only."""
    hf, directory = saved_wrapper("ministral3", tmp_path / "m", "new")
    checkpoint = Checkpoint.open(directory)
    model = load_model(checkpoint)
    for layer in model.layers:
        layer.attention.beta = 0.0
    tokens = _tokens(23)
    with torch.no_grad():
        got, want = model(tokens, torch.arange(23), all_logits=True), hf(input_ids=tokens).logits
    torch.testing.assert_close(got[:, :8], want[:, :8], atol=ATOL, rtol=0)
    assert (got[:, 8:] - want[:, 8:]).abs().max() > 10 * ATOL


def test_ministral3_compiled_equals_eager_without_recompiling(tmp_path):
    """Its attention is the one new module here: one layer, sequences past the original context (8)."""
    directory = save_hf_model(make_wrapper("ministral3", num_hidden_layers=1), tmp_path / "m")
    try:
        check_compiled_matches_eager(load_model(Checkpoint.open(directory)), word_tokenizer(VOCAB))
    finally:
        torch._dynamo.reset()  # as test_families' fresh_dynamo: its graphs count towards dynamo's limits


def test_chat_template_beside_processor_files_is_used(tmp_path, capsys):
    """As Gemma 3's repositories: the template in chat_template.jinja (and the processor's
    chat_template.json), processor configs beside it; `--chat` wraps the prompt in it."""
    hf, directory = saved_wrapper("gemma3", tmp_path / "g", "legacy")
    template = "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}"
    (directory / "chat_template.jinja").write_text(template)
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    (directory / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "Gemma3ImageProcessor"}))
    (directory / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma3Processor"}))
    prompt = [3, 10, 11, 12, 4]  # the template around "w10 w11 w12"
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                       pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()  # fmt: skip
    argv = ["generate", "w10 w11 w12", "--chat", "--model", str(directory), "--dtype", "float32", "-n", "6",
            "--no-compile", "--quiet"]  # fmt: skip
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.split() == [f"w{i}" for i in want]


def test_mistral_small_gguf_of_architecture_mistral3_loads_and_ministral3s_is_refused(tmp_path):
    """llama.cpp writes Mistral3ForConditionalGeneration's text part as architecture "mistral3" in
    Llama's layout (q/k rows permuted): Mistral Small's loads as plain Mistral; Ministral 3's (YaRN,
    a temperature) is refused, saying to use its Hugging Face checkpoint."""
    hf = make_wrapper("mistral3")
    path = write_gguf_from_hf(_text_model_of(hf), tmp_path / "mistral-small.gguf", arch="mistral3")
    tokens = _tokens(23)
    with torch.no_grad():
        torch.testing.assert_close(
            load_model(Checkpoint.open(path))(tokens, torch.arange(23), all_logits=True),
            hf(input_ids=tokens).logits,
            atol=ATOL,
            rtol=0,
        )
    ministral = write_gguf_from_hf(_text_model_of(make_wrapper("ministral3")), tmp_path / "m3.gguf", arch="mistral3")
    with pytest.raises(UserError, match=r"Ministral 3 .*Hugging Face checkpoint only"):
        _ = Checkpoint.open(ministral).args
