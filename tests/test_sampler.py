"""Sampling: counter-based draws, filters, greedy rows, independence from batch neighbours."""

from __future__ import annotations

import pytest
import torch

from npu_worker.sampler import SamplingRows, filtered_probs, sample, uniform, uniform_reference

pytestmark = pytest.mark.fast


def rows(n: int, **overrides: list) -> SamplingRows:
    values = {
        "temperature": [1.0] * n,
        "top_k": [0] * n,
        "top_p": [1.0] * n,
        "min_p": [0.0] * n,
        "seed": [7] * n,
        "index": list(range(n)),
    } | overrides
    dtypes = {"top_k": torch.long, "seed": torch.long, "index": torch.long}
    return SamplingRows(
        **{k: torch.tensor(v, dtype=dtypes.get(k, torch.float32)) for k, v in values.items()},
        all_greedy=all(t == 0 for t in values["temperature"]),
    )


def test_tensor_uniform_equals_the_plain_integer_splitmix() -> None:
    seeds = [0, 1, 2**62 + 12345, 2**63 - 1, 987654321]
    indices = [0, 1, 5, 1000, 2**40]
    got = uniform(torch.tensor(seeds), torch.tensor(indices)).tolist()
    want = [uniform_reference(s, i) for s, i in zip(seeds, indices)]
    assert got == want
    assert all(0.0 <= u < 1.0 for u in got)


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 1.0, 4.0]])
    assert sample(logits, rows(2, temperature=[0.0, 0.0])).tolist() == [1, 0]


def test_top_k_one_is_greedy_whatever_the_temperature() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    picked = sample(logits, rows(4, top_k=[1] * 4, temperature=[2.0] * 4))
    assert picked.tolist() == logits.argmax(-1).tolist()


def test_filters_zero_what_they_drop_and_renormalise() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top_p = filtered_probs(logits, rows(1, top_p=[0.7]))
    assert torch.allclose(top_p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    min_p = filtered_probs(logits, rows(1, min_p=[0.25]))
    assert torch.allclose(min_p, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    top_k = filtered_probs(logits, rows(1, top_k=[3]))
    assert top_k[0, 3] == 0 and torch.isclose(top_k.sum(), torch.tensor(1.0))


def test_a_seeded_row_draws_the_same_token_whatever_its_neighbours() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 100, generator=gen)
    alone = sample(logits[2:3], rows(1, seed=[42], index=[5]))
    mixed = rows(
        8,
        seed=[1, 2, 42, 4, 5, 6, 7, 8],
        index=[0, 9, 5, 3, 3, 3, 3, 3],
        temperature=[0.0, 0.7, 1.0, 1.3, 0.0, 1.0, 1.0, 1.0],
    )
    assert sample(logits, mixed)[2] == alone[0]


def test_draws_follow_the_filtered_distribution() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.25, 0.1, 0.05]])).repeat(4000, 1)
    draws = sample(logits, rows(4000, seed=[11] * 4000, index=list(range(4000))))
    freq = torch.bincount(draws, minlength=4).double() / 4000
    # 4000 draws: each frequency's standard error is at most 0.008; allow 4 of them.
    assert torch.allclose(
        freq, torch.tensor([0.6, 0.25, 0.1, 0.05], dtype=torch.float64), atol=0.032
    )
