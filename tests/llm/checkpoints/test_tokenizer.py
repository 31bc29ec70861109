"""Tokenizers built by genfast tokenize exactly like transformers' on the real SmolLM2 vocabulary."""

import pytest

from genfast.llm.checkpoints.checkpoint import Checkpoint
from genfast.llm.checkpoints.tokenizer import load_tokenizer

TEXTS = [
    "The capital of France is",
    "Hello, world!  How's it going?\n\n\tTabs\tand  double  spaces ",
    "12345 + 67.89 = 2024; 3.14159e-10, 1,000,000",
    "naïve café — 東京 🤖 Ελληνικά Привет мир",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "   leading spaces and trailing   ",
    "x=1;y=22;z=333 // code\ndef f(a, b):\n    return a**b\n",
    "don't I'll WE'RE they've",
    "",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
]


@pytest.fixture(scope="module")
def tokenizers_pair(smollm2_gguf, smollm2_hf):
    return load_tokenizer(Checkpoint.open(smollm2_gguf)), smollm2_hf[1]


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_transformers(tokenizers_pair, text):
    ours, ref = tokenizers_pair
    ids = ours.encode(text)
    assert ids == ref(text, add_special_tokens=True).input_ids
    assert ours.decode(ids, skip_special=False) == text


def test_chat_template_matches_transformers(tokenizers_pair):
    ours, ref = tokenizers_pair
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    for messages in (conversation, conversation[1:]):
        want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages) == want


def test_hf_directory_tokenizer_matches(tokenizers_pair, tmp_path):
    """A tokenizer.json + tokenizer_config.json directory (what the hub serves) loads identically."""
    _, ref = tokenizers_pair
    ref.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")  # marks the directory as a HF model directory
    ours = load_tokenizer(Checkpoint.open(tmp_path))
    for text in TEXTS:
        assert ours.encode(text) == ref(text).input_ids
    assert ours.chat_template
    assert ref.convert_tokens_to_ids("<|im_end|>") in ours.stop_ids


def _write_spm_gguf(path):
    """A small SentencePiece-style (tokenizer.ggml.model = 'llama') vocabulary, as Llama 2 GGUFs carry."""
    import gguf

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    words = [
        "▁",
        "a",
        "b",
        "c",
        "d",
        "e",
        "h",
        "l",
        "o",
        "r",
        "w",
        "t",
        "s",
        "▁t",
        "he",
        "▁the",
        "▁a",
        "ll",
        "llo",
        "▁he",
        "▁hello",
        "or",
        "▁w",
        "▁wor",
        "ld",
        "▁world",
        "at",
        "▁c",
        "▁cat",
        "s▁",
    ]
    pieces += words
    types += [1] * len(words)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(words))]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_sentencepiece_gguf_tokenizer_matches_transformers(tmp_path):
    import transformers

    from genfast.llm.checkpoints.gguf_file import GGUFFile
    from genfast.llm.checkpoints.tokenizer import gguf_tokenizer

    path = _write_spm_gguf(tmp_path / "spm.gguf")
    ours = gguf_tokenizer(GGUFFile(path).metadata)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    # Text that starts with a space is left out: llama.cpp (which genfast follows) always adds the
    # leading "▁", transformers' GGUF conversion does not when the text already starts with one.
    for text in ["hello world", "the cat", "the  cat sat ", "héllo wörld", "a\nb", "hello"]:
        assert ours.encode(text) == ref(text).input_ids, text
        assert ours.decode(ours.encode(text)) == ref.decode(ref(text).input_ids, skip_special_tokens=True)
    assert ours.add_bos and ours.bos_id == 1 and 2 in ours.stop_ids


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_a_damaged_tokenizer_file_is_a_clear_error_naming_it(tmp_path, name):
    """A truncated download or a hand-edited file: the error names the file (a JSON traceback, or
    tokenizers' bare "expected value at line 1 column 1", before)."""
    from genfast.errors import UserError
    from tests.llm.hf_fixtures import word_tokenizer

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    word_tokenizer(64).save(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 1}')
    text = (tmp_path / name).read_text() if (tmp_path / name).is_file() else "{}"
    (tmp_path / name).write_text(text[: len(text) // 2])
    with pytest.raises(UserError, match=f"cannot read {tmp_path / name}"):
        load_tokenizer(Checkpoint.open(tmp_path))
