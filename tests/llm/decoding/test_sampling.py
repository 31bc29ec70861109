"""The sampler draws from the (filtered) softmax distribution."""

import torch

from genfast.llm.decoding.sampling import SamplingParams, sample

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def frequencies(params: SamplingParams, n: int = 40_000) -> torch.Tensor:
    torch.manual_seed(0)
    draws = sample(LOGITS.expand(n, -1), params)
    return torch.bincount(draws, minlength=LOGITS.numel()).float() / n


def test_temperature_sampling_matches_softmax():
    want = (LOGITS / 0.8).softmax(-1)
    torch.testing.assert_close(frequencies(SamplingParams(temperature=0.8)), want, atol=0.01, rtol=0)


def test_top_k_renormalizes_over_the_k_best():
    want = torch.zeros(6)
    want[:3] = LOGITS[:3].softmax(-1)
    torch.testing.assert_close(frequencies(SamplingParams(1.0, top_k=3)), want, atol=0.01, rtol=0)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = LOGITS.softmax(-1)  # cumulative: 0.57, 0.78, 0.91, ...
    want = torch.zeros(6)
    want[:3] = probs[:3] / probs[:3].sum()
    torch.testing.assert_close(frequencies(SamplingParams(1.0, top_p=0.85)), want, atol=0.01, rtol=0)


def test_greedy_is_argmax():
    assert sample(LOGITS[None], SamplingParams()).tolist() == [0]
