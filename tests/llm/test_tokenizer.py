"""Tokenizers built by genfast tokenize exactly like transformers' on the real SmolLM2 vocabulary."""

import pytest

from genfast.llm.tokenizer import load_tokenizer

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
    return load_tokenizer(smollm2_gguf), smollm2_hf[1]


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
    ours = load_tokenizer(tmp_path)
    for text in TEXTS:
        assert ours.encode(text) == ref(text).input_ids
    assert ours.chat_template
    assert ref.convert_tokens_to_ids("<|im_end|>") in ours.stop_ids
