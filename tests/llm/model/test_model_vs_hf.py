"""genfast's decoder reproduces transformers' logits on tiny random checkpoints (fp32, 1e-4)."""

import pytest
import torch

from genfast.llm.checkpoints.checkpoint import Checkpoint
from genfast.llm.checkpoints.weights import load_model
from genfast.llm.model.transformer import attention_mask
from tests.llm.hf_fixtures import TINY_CONFIGS, make_hf_model, save_hf_model

ATOL = 1e-4


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_full_sequence_logits_match_transformers(name, tmp_path):
    hf = make_hf_model(name)
    model = load_model(Checkpoint.open(save_hf_model(hf, tmp_path / name)))
    tokens = torch.randint(0, hf.config.vocab_size, (2, 37))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = model(tokens, torch.arange(37), all_logits=True)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3"])
def test_cached_decode_matches_transformers(name, tmp_path):
    """Prefill then token-by-token decode through the static cache gives the same logits."""
    hf = make_hf_model(name)
    model = load_model(Checkpoint.open(save_hf_model(hf, tmp_path / name)))
    tokens = torch.randint(0, hf.config.vocab_size, (1, 24))
    with torch.no_grad():
        expected = hf(tokens).logits[0]
        model.setup_caches(1, 64)
        pos = torch.arange(10)
        got = [model(tokens[:, :10], pos, attention_mask(pos, 10), all_logits=True)[0]]
        for pos in range(10, 24):
            p = torch.tensor([pos])
            got.append(model(tokens[:, pos : pos + 1], p, attention_mask(p, pos + 1)))
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


def test_left_padded_batch_matches_single_sequences(tmp_path):
    hf = make_hf_model("llama3")
    model = load_model(Checkpoint.open(save_hf_model(hf, tmp_path / "m")))
    short, long = torch.randint(0, 320, (1, 5)), torch.randint(0, 320, (1, 9))
    with torch.no_grad():
        want_short, want_long = hf(short).logits[0, -1], hf(long).logits[0, -1]
        model.setup_caches(2, 32)
        batch = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1), long])
        pos = torch.arange(9)
        got = model(batch, pos, attention_mask(pos, 9, torch.tensor([4, 0])))
    torch.testing.assert_close(got[0], want_short, atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], want_long, atol=ATOL, rtol=0)


def test_sharded_checkpoint_loads_identically(tmp_path):
    hf = make_hf_model("smollm")
    whole = load_model(Checkpoint.open(save_hf_model(hf, tmp_path / "whole")))
    sharded_dir = save_hf_model(hf, tmp_path / "sharded", max_shard_size="50KB")
    assert (sharded_dir / "model.safetensors.index.json").exists()
    sharded = load_model(Checkpoint.open(sharded_dir))
    for (n, a), (_, b) in zip(whole.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), n
