"""Sampler: greedy, top-k/top-p/min-p supports and frequencies, seeded reproducibility."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.model.sampler import SamplingInputs, sample, sample_rows


def plan_for(n: int, *, temperature=1.0, top_p=1.0, top_k=4, min_p=0.0, seed=None, index=0) -> SamplingInputs:
    def col(value, dtype):
        return torch.full((n,), value, dtype=dtype)

    return SamplingInputs(col(temperature, torch.float32), col(top_p, torch.float32), col(top_k, torch.int64),
                          col(min_p, torch.float32), [seed] * n, [index] * n, [None] * n, temperature == 0)


PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1])
N = 4000


def draws(**kw) -> np.ndarray:
    logits = PROBS.log().expand(N, -1).contiguous()
    return sample(logits, plan_for(N, **kw)).numpy()


def test_greedy_and_top_k_one_take_the_argmax():
    assert set(draws(temperature=0)) == {0}
    assert set(draws(top_k=1)) == {0}


def test_plain_sampling_follows_the_distribution():
    freq = np.bincount(draws(), minlength=4) / N
    assert np.allclose(freq, PROBS.numpy(), atol=0.03), freq


@pytest.mark.parametrize("kw,support", [
    ({"top_k": 2}, {0, 1}),
    ({"top_p": 0.5}, {0, 1}),  # 0.4 < 0.5, so the second token is needed to reach p
    ({"top_p": 0.4}, {0}),
    ({"min_p": 0.45}, {0, 1, 2}),  # keeps p >= 0.45 * 0.4 = 0.18
    ({"min_p": 0.8}, {0}),
])
def test_filters_restrict_the_support(kw, support):
    got = draws(**kw)
    assert set(got) == support
    freq = np.bincount(got, minlength=4)[sorted(support)] / N
    expected = PROBS.numpy()[sorted(support)] / PROBS.numpy()[sorted(support)].sum()
    assert np.allclose(freq, expected, atol=0.04), (freq, expected)


def test_low_temperature_sharpens():
    freq = np.bincount(draws(temperature=0.25), minlength=4) / N
    assert freq[0] > 0.7


def test_seeded_rows_are_reproducible_and_independent_of_the_batch():
    logits = torch.randn(1, 1000)
    alone = sample(logits, plan_for(1, seed=42, index=3)).item()
    batched = sample(logits.expand(5, -1).contiguous(), plan_for(5, seed=42, index=3))
    assert batched.tolist() == [alone] * 5
    other = {sample(logits, plan_for(1, seed=42, index=i)).item() for i in range(20)}
    assert len(other) > 1, "the noise must change with the token index"


def test_a_row_that_breaks_fails_alone():
    """One request whose sampling raises gets an error; the others in its batch still get their tokens."""
    logits = torch.randn(3, 1000)
    s = plan_for(3, seed=7)
    s.seeds[1] = "not a seed"  # what a bug around one request's values looks like
    ids, logprobs, errors = sample_rows(logits, s)
    assert ids[1] is None and set(errors) == {1} and "Error" in errors[1]
    alone = [sample(logits[j : j + 1], plan_for(1, seed=7)).item() for j in (0, 2)]
    assert [ids[0], ids[2]] == alone and logprobs == {}
