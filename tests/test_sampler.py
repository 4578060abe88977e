"""The sampler: exact masks on crafted logits, seeds, statistics, penalties; and
SamplingParams validation."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

from nanoserve.engine.sampler import Sampler, SampleRow, apply_penalties, mask_logits, warm_up_row_counts
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
        logits.clone(),
        [row(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt=[3], output=[2, 2, 0])],
    )
    assert out.tolist() == [[2.0 - 0.75, -2.0, 1.0 - 1.25, 0.5]]


def test_logprobs_are_the_raw_distribution():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    tokens, lps = Sampler(CPU, 0)(
        logits, [row(SamplingParams(temperature=0, logprobs=2, repetition_penalty=1.5), output=[2])]
    )
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


# ------------------------------------------------------------------ the fused sampling kernel
# CPU: Triton's interpreter on tiny shapes (conftest sets TRITON_INTERPRET=1 without a GPU);
# GPU (`pytest -m gpu tests/test_sampler.py`): the LM head's real shape, 256 x 151,936 bf16.

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
interp = pytest.mark.skipif(not (HAS_TRITON and INTERPRET), reason="needs triton and TRITON_INTERPRET=1")
ON_CPU = pytest.param("cpu", marks=interp)
ON_GPU = pytest.param("cuda", marks=pytest.mark.gpu)


def kernels():
    from nanoserve.kernels import sampling as sample_kernels

    return sample_kernels


def tied_logits(rows: int, vocab: int, dtype, device, seed: int = 0) -> tuple[torch.Tensor, list[int]]:
    """Random logits whose first four rows hold ties, and those rows' first maximal index:
    a tie across distant words (other chunks), one between neighbours, a constant row and
    a row of -inf (torch.argmax gives 0 for both)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen)
    x[0, 5] = x[0, vocab - 1] = 9.0
    x[1, vocab // 2] = x[1, vocab // 2 + 1] = 9.0
    x[2] = 0.0
    x[3] = float("-inf")
    return x.to(dtype).to(device), [5, vocab // 2, 0, 0]


@pytest.mark.parametrize("device", [ON_CPU, ON_GPU])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_greedy_rows_are_torch_argmax(device, dtype):
    shapes = [(6, 203), (4, 37), (1, 203)] if device == "cpu" else [(256, 151936), (4, 151936), (1, 151936), (5, 997)]
    for rows, vocab in shapes:
        x, firsts = tied_logits(max(rows, 4), vocab, dtype, device)
        x = x[:rows]
        expected = x.argmax(dim=-1)
        assert expected[: min(rows, 4)].tolist() == firsts[:rows], "torch.argmax: not the first maximal index"
        for programs in (1, 16, 64) if device == "cpu" else (None, 1):  # different vocabulary splits
            got = kernels().fused_sample(x, torch.zeros(rows, device=device), 0, 0, programs=programs)
            assert got.dtype == torch.long and torch.equal(got, expected), (rows, vocab, programs)
    # Rows of a wider buffer (as the LM head's output sliced to the vocabulary).
    wide, _ = tied_logits(6, 300, dtype, device)
    x = wide[:, :250]
    got = kernels().fused_sample(x, torch.zeros(6, device=device), 0, 0)
    assert torch.equal(got, x.argmax(dim=-1))


@pytest.mark.parametrize("device", [ON_CPU, ON_GPU])
def test_fused_sample_stores_into_the_pool_and_leaves_tickets_zero(device):
    """With `pool`, row i's token also lands at pool[index[i]] (the engine's token pool) and
    nothing else in the pool changes; each row's last program resets its ticket, so repeated
    calls with other batch sizes and vocabulary splits keep drawing the argmax."""
    shapes = [(6, 203), (3, 37)] if device == "cpu" else [(256, 151936), (1, 151936), (7, 997)]
    for rows, vocab in shapes:
        for programs in (1, 16) if device == "cpu" else (None, 1, 4096):
            x, _ = tied_logits(max(rows, 4), vocab, torch.bfloat16, device)
            x = x[:rows]
            pool = torch.full((rows + 5,), -7, dtype=torch.long, device=device)
            index = torch.randperm(rows + 5)[:rows].to(device)
            got = kernels().fused_sample(x, torch.zeros(rows, device=device), 0, 0, programs, pool=(pool, index))
            assert torch.equal(got, x.argmax(dim=-1)), (rows, vocab, programs)
            want = torch.full_like(pool, -7).index_copy_(0, index, got)
            assert torch.equal(pool, want), (rows, vocab, programs)
            assert not kernels()._tickets(x.device, rows).any(), "a ticket was left non-zero"


def uniform_ks(u: torch.Tensor) -> float:
    """Kolmogorov-Smirnov statistic x sqrt(n) of samples against U(0, 1)."""
    u = u.double().flatten().sort().values
    n = u.numel()
    hi = torch.arange(1, n + 1, dtype=torch.float64, device=u.device) / n
    return torch.maximum(hi - u, u - (hi - 1 / n)).max().item() * math.sqrt(n)


@pytest.mark.parametrize("device", [ON_CPU, ON_GPU])
def test_fused_draw_is_the_inverse_cdf_of_its_uniform(device, monkeypatch):
    """A T > 0 row's token is the word where the row's fp64 softmax(logits / T) CDF passes
    its uniform (the kernel's test twin gives it): the target lies in the chosen word's CDF
    interval, up to the fp32 rounding of the kernel's per-word terms. Words of probability 0
    (-inf, NaN) are never drawn; the draws do not depend on how the vocabulary is split; the
    uniforms pass a Kolmogorov-Smirnov test."""
    if device == "cpu":
        monkeypatch.setattr(kernels(), "BLOCK", 64)  # more words per interpreted program
        rows, vocab = 8, 1000
    else:
        rows, vocab = 256, 151936
    gen = torch.Generator().manual_seed(1)
    x = 3 * torch.randn(rows, vocab, generator=gen)
    x[:, ::7] = float("-inf")  # probability 0
    x[0, 1::7] = float("nan")  # likewise
    x[1, : vocab // 2] = float("-inf")  # all of the mass in the second half
    x = x.bfloat16().to(device)
    temps = torch.linspace(0.3, 1.7, rows).to(device)
    uniforms = []
    for step in (0, 7):
        tokens = kernels().fused_sample(x, temps, seed=11, step=step)
        u = kernels().row_uniforms(rows, seed=11, step=step, device=device)
        uniforms.append(u)
        scaled = x.double() / temps.double()[:, None]
        p = torch.nan_to_num(scaled, nan=float("-inf")).softmax(dim=-1)
        assert torch.all(p.gather(1, tokens[:, None]) > 0), "drew a word of probability 0"
        cdf = p.cumsum(dim=-1)
        hi = cdf.gather(1, tokens[:, None])[:, 0]
        lo = hi - p.gather(1, tokens[:, None])[:, 0]
        target = u * cdf[:, -1]
        slack = 1e-5
        assert torch.all((lo - slack <= target) & (target <= hi + slack)), "token is not where the CDF passes u"
        exact = (lo <= target) & (target < hi)
        assert exact.double().mean() > 0.95
        reference = kernels().sample_reference(x, temps, u)
        assert (reference == tokens).double().mean() > 0.95
        assert torch.equal(tokens, kernels().fused_sample(x, temps, seed=11, step=step, programs=1))
    assert uniform_ks(torch.cat(uniforms)) < 2.5


def bucket_probs(logits: torch.Tensor, temperature: float, live: list[int]) -> torch.Tensor:
    """softmax(logits / T) of each `live` word, and of all the others together last."""
    p = (logits.double() / temperature).softmax(dim=-1)
    return torch.cat([p[live], (1 - p[live].sum()).reshape(1)]) if len(live) < len(logits) else p[live]


@pytest.mark.parametrize("device", [ON_CPU, ON_GPU])
def test_fused_temperature_draws_follow_the_softmax(device):
    """Draw frequencies against softmax(logits / T). Half of the rows are greedy and must
    always give the argmax. Pairs of words with equal logits (in one tile, and across
    tiles and chunks) must be drawn equally often. CPU: 8 words, 400 draws; GPU: 8 live
    words spread over a 151,936-word vocabulary (the rest, 35% of the mass, one bucket),
    51,200 draws."""
    temperature = 0.6
    live_logits = torch.tensor([3.0, 1.5, 0.0, -1.0, 3.0, 1.5, 2.0, 0.5])
    if device == "cpu":
        vocab, rows, calls, live = 8, 800, 1, list(range(8))
        logits = live_logits.clone()
    else:
        vocab, rows, calls = 151936, 256, 400
        live = [0, 1023, 50000, 151934, 256, 1024, 75967, 151935]
        logits = torch.full((vocab,), -4.0)
        logits[live] = live_logits
    expected = bucket_probs(logits, temperature, live)
    temps = torch.tensor([temperature, 0.0]).repeat(rows // 2).to(device)
    batch = logits.bfloat16().repeat(rows, 1).to(device)  # every value is exact in bf16
    bucket_of = torch.full((vocab,), len(live), dtype=torch.long, device=device)
    bucket_of[live] = torch.arange(len(live), device=device)
    counts = torch.zeros(len(expected), dtype=torch.long, device=device)
    for step in range(calls):
        tokens = kernels().fused_sample(batch, temps, seed=5, step=step)
        assert torch.all(tokens[1::2] == 0), "a greedy row did not take the argmax"
        counts += torch.bincount(bucket_of[tokens[0::2]], minlength=len(expected))
    n = rows // 2 * calls
    freq = counts.double().cpu() / n
    z = (freq - expected).abs() / (expected * (1 - expected) / n).sqrt()
    assert z.max() < 5, f"frequencies {freq.tolist()} vs softmax {expected.tolist()}: z {z.max():.1f}"


@pytest.mark.parametrize("device", [ON_CPU, ON_GPU])
def test_fused_draws_repeat_for_the_same_seed_and_step_only(device, monkeypatch):
    rows, vocab = (8, 100) if device == "cpu" else (64, 151936)
    x = torch.randn(rows, vocab).to(device)
    temps = torch.ones(rows, device=device)
    draw = kernels().fused_sample
    first = draw(x, temps, seed=3, step=0)
    assert torch.equal(first, draw(x, temps, seed=3, step=0))
    # The uniforms: distinct over rows, fresh for another step, another seed and a step
    # past 2^31, and uniform.
    n = 256 if device == "cpu" else 65536  # interpreted programs are slow
    base = kernels().row_uniforms(n, seed=3, step=0, device=device)
    assert base.unique().numel() == base.numel()
    assert uniform_ks(base) < 2.5
    for s, t in ((3, 1), (4, 0), (3, 2**31)):
        assert (kernels().row_uniforms(n, s, t, device) == base).double().mean() < 0.01
    differ = sum((draw(x, temps, seed=3, step=s) != first).sum().item() for s in (1, 2, 3))
    assert differ >= rows, f"only {differ} of {3 * rows} draws changed with the step"


def plain_rows(temps: list[float]) -> list[SampleRow]:
    return [row(SamplingParams(temperature=t)) for t in temps]


@pytest.mark.parametrize("device", [ON_CPU, ON_GPU])
def test_sampler_uses_the_kernel_only_where_it_applies(device):
    dev = torch.device(device)
    fused, slow = Sampler(dev, seed=0, fused=True), Sampler(dev, seed=0, fused=False)
    x = torch.randn(6, 301).to(dev)
    for n in (1, 6, 64):  # all-greedy batches of any size take the kernel
        greedy, logits = plain_rows([0.0] * n), torch.randn(n, 301).to(dev)
        assert torch.equal(fused.sample(logits, greedy).tokens, slow.sample(logits, greedy).tokens)
        assert fused._plan.fused and fused._plan.row_temperature.device.type == dev.type
    mixed = plain_rows([0.0, 0.8, 0.0, 1.3, 0.5, 0.0])
    calls = fused.calls
    drawn = fused.sample(x, mixed).tokens
    assert fused.calls == calls + 1  # each call draws fresh noise
    assert drawn[[0, 2, 5]].tolist() == x[[0, 2, 5]].argmax(-1).tolist()
    # Rows the kernel does not cover send the batch down the torch path: same tokens as the
    # slow sampler (seeded rows draw from their own generators; top-k keeps the argmax here).
    for special in (SamplingParams(temperature=0.7, seed=9), SamplingParams(temperature=0.7, top_k=1),
                    SamplingParams(temperature=0, repetition_penalty=1.3)):  # fmt: skip
        gen = (lambda: torch.Generator(dev).manual_seed(9)) if special.seed is not None else (lambda: None)
        rows_f = [row(special, gen(), prompt=[1, 2])] + plain_rows([0.0] * 5)
        rows_s = [row(special, gen(), prompt=[1, 2])] + plain_rows([0.0] * 5)
        got = fused.sample(x, rows_f).tokens
        assert not fused._plan.fused
        assert torch.equal(got, slow.sample(x, rows_s).tokens)
    # Log-probabilities read the raw logits on both paths.
    lp_rows = [row(SamplingParams(temperature=0, logprobs=3))] * 2
    tokens, lps = fused(x[:2], lp_rows)
    expected = x[:2].float().log_softmax(-1)
    assert tokens == x[:2].argmax(-1).tolist()
    assert [list(lp.top) for lp in lps] == expected.topk(3).indices.tolist()
    assert math.isclose(lps[1].logprob, expected[1, tokens[1]].item(), rel_tol=1e-5)


@pytest.mark.gpu
def test_sampler_on_cuda_is_fused_by_default_and_never_syncs(monkeypatch):
    assert Sampler(torch.device("cuda"), 0).fused
    assert not Sampler(torch.device("cuda"), 0, fused=False).fused  # KernelSwitches.fused_sampler off
    sampler = Sampler(torch.device("cuda"), 0, fused=True)
    logits = torch.randn(256, 151936, device="cuda").bfloat16()
    rows = plain_rows([0.6] * 200 + [0.0] * 56)
    sampler.sample(logits, rows)  # builds and caches the batch plan (its copies may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sampler.sample(logits, rows).tokens
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(tokens[200:], logits[200:].argmax(-1))


def test_row_count_warm_up_visits_every_count_largest_first_and_leaves_sampling_exact():
    """The engine's warm-up (CUDA only there) runs the lm_head and each sampling path at every
    row count, largest first (the allocator keeps the largest step's blocks); afterwards the
    sampler still samples as before."""
    seen = []

    def logits_of(rows):
        seen.append(rows)
        return torch.randn(rows, 40)

    sampler = Sampler(torch.device("cpu"), seed=0)
    pool = torch.full((4,), 7, dtype=torch.long)
    warm_up_row_counts(sampler, logits_of, 5, pool)
    assert seen == [5, 4, 3, 2, 1]
    assert not pool.any()  # its tokens were stored and then cleared
    logits = torch.randn(3, 40)
    greedy = [SampleRow(SamplingParams(temperature=0.0), None, [], [])] * 3
    assert sampler(logits, greedy)[0] == logits.argmax(dim=-1).tolist()
