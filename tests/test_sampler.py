"""The sampler: exact masks on crafted logits, seeds, statistics, penalties; and
SamplingParams validation."""

from __future__ import annotations

import math

import pytest
import torch

from nanoserve.engine.sampler import SampleRow, Sampler, apply_penalties, mask_logits
from nanoserve.sampling_params import SamplingParams

CPU = torch.device("cpu")


def kept(masked: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row > float("-inf")).flatten().tolist()) for row in masked]


def masks(logits, top_k=None, top_p=None, min_p=None):
    n, v = logits.shape
    k = torch.tensor(top_k if top_k is not None else [v] * n)
    p = torch.tensor(top_p if top_p is not None else [1.0] * n)
    m = torch.tensor(min_p if min_p is not None else [0.0] * n)
    return kept(mask_logits(logits, k, p, m))


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 5.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    assert masks(logits, top_k=[2, 1]) == [{4, 1}, {4}]
    assert masks(logits, top_k=[5, 3]) == [{0, 1, 2, 3, 4}, {2, 3, 4}]


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    assert masks(logits, top_p=[0.5]) == [{0}]  # 0.5 alone reaches 0.5
    assert masks(logits, top_p=[0.6]) == [{0, 1}]
    assert masks(logits, top_p=[0.8]) == [{0, 1}]  # the mass before token 2 is 0.8: enough
    assert masks(logits, top_p=[0.81]) == [{0, 1, 2}]
    assert masks(logits, top_p=[1.0]) == [{0, 1, 2, 3}]
    assert masks(logits, top_p=[0.01]) == [{0}]  # the top token always survives


def test_min_p_is_relative_to_the_top_probability():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert masks(probs.log(), min_p=[0.5]) == [{0, 1}]  # floor 0.25
    assert masks(probs.log(), min_p=[0.2]) == [{0, 1, 2}]  # floor 0.1
    assert masks(probs.log(), min_p=[1.0]) == [{0}]


def test_masks_compose_top_k_then_top_p():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    # top-k 3 renormalises to 4/9, 3/9, 2/9; top-p 0.7 then keeps 4/9 + 3/9.
    assert masks(probs.log(), top_k=[3], top_p=[0.7]) == [{0, 1}]


def row(params: SamplingParams, gen=None, prompt=(), output=()) -> SampleRow:
    return SampleRow(params, gen, list(prompt), list(output))


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_rows_take_the_argmax():
    sampler = Sampler(CPU, seed=0)
    logits = torch.randn(4, 50)
    tokens, _ = sampler(logits, [row(SamplingParams(temperature=0))] * 4)
    assert tokens == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_batch_independent():
    params = SamplingParams(temperature=1.0, seed=123)
    logits = torch.randn(1, 1000)
    alone = [Sampler(CPU, seed=0)(logits, [row(params, seeded(123))])[0][0] for _ in range(1)]
    gen = seeded(123)
    sequence_alone = [Sampler(CPU, 0)(logits, [row(params, gen)])[0][0] for _ in range(20)]
    gen = seeded(123)
    others = SamplingParams(temperature=1.0)
    sequence_batched = []
    for step in range(20):
        batch = torch.cat([torch.randn(3, 1000), logits, torch.randn(2, 1000)])
        rows = [row(others)] * 3 + [row(params, gen)] + [row(others)] * 2
        sequence_batched.append(Sampler(CPU, seed=step)(batch, rows)[0][3])
    assert sequence_alone == sequence_batched
    assert alone[0] == sequence_alone[0]
    assert len(set(sequence_alone)) > 1  # it really samples


def test_temperature_sampling_follows_the_softmax():
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    temperature = 0.7
    expected = (logits / temperature).softmax(-1)
    n = 20000
    sampler = Sampler(CPU, seed=1)
    tokens, _ = sampler(logits.repeat(n, 1), [row(SamplingParams(temperature=temperature))] * n)
    counts = torch.bincount(torch.tensor(tokens), minlength=5).float()
    # Each count within 5 standard deviations of its binomial expectation.
    std = (n * expected * (1 - expected)).sqrt()
    assert torch.all((counts - n * expected).abs() < 5 * std), (counts / n, expected)


def test_top_k_sampling_never_leaves_the_top_k():
    sampler = Sampler(CPU, seed=3)
    logits = torch.randn(2000, 100)
    tokens, _ = sampler(logits, [row(SamplingParams(temperature=1.5, top_k=3))] * 2000)
    top3 = logits.topk(3, dim=-1).indices
    assert all(t in top3[i].tolist() for i, t in enumerate(tokens))


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    out = apply_penalties(logits.clone(), [row(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])])
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]
    out = apply_penalties(
        logits.clone(), [row(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt=[3], output=[2, 2, 0])]
    )
    assert out.tolist() == [[2.0 - 0.75, -2.0, 1.0 - 1.25, 0.5]]


def test_logprobs_are_the_raw_distribution():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    tokens, lps = Sampler(CPU, 0)(logits, [row(SamplingParams(temperature=0, logprobs=2, repetition_penalty=1.5), output=[2])])
    expected = logits.log_softmax(-1)[0]
    assert lps[0].token_id == tokens[0]
    assert math.isclose(lps[0].top[2], expected[2].item(), rel_tol=1e-6)
    assert list(lps[0].top) == [2, 1]


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("max_tokens", 0),
        ("n", 0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 2.5),
        ("logprobs", 21),
        ("logprobs", -1),
        ("min_tokens", -1),
        ("stop", [""]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("seed", 1.5),
        ("temperature", "hot"),
        ("ignore_eos", "yes"),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)
