"""The GPU fast path end to end (run on a GPU with `pytest -m gpu tests/test_gpu_fastpath.py`).

Dummy qwen3-0.6b in bf16, greedy, 96 prompts x 64 tokens: {decode CUDA graphs + overlap
loop} vs {eager, simple loop} vs {torch attention backend} vs Hugging Face transformers on
the same weights, in fp32 and bf16. fp32 is the sharp check: the fast path's greedy tokens
equal transformers'. bf16 rounding differs between kernels, so runs part ways at near ties:
the same kernels (graphs vs eager) must be identical; across kernels a bf16 run must stay as
close to the fp32 output as its slow twin's bf16 does (mean common prefix within 10%), where
two runs diverge each one's token must be within the other's top-5 at that position (top-5
from the engine's logprobs, or transformers' logits), and up to the first divergence the
top-5 logprobs agree within measured bounds. Padding to captured sizes (bs 3, 9,
the largest graph, one more) equals eager; nothing leaks; the fused elementwise ops equal
their plain versions; an fp8 KV cache gives the same tokens through the fast path as
through the torch backend.
"""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu

MODEL = "qwen3-0.6b"
NEW = 64
GRAPH_MAX_BS = 32
LENGTHS = (17, 50, 100, 200)


def make_prompts(num: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(20000) for _ in range(LENGTHS[i % len(LENGTHS)])] for i in range(num)]


PROMPTS = make_prompts(96)  # closeness to fp32 is a mean over prompts: 32 left it within noise


def make_llm(dtype: str = "bfloat16", **kw) -> LLM:
    return LLM(
        MODEL, load_format="dummy", dtype=dtype, max_model_len=1024, kv_cache_tokens=131072, max_num_seqs=64, **kw
    )


def assert_idle(llm: LLM) -> None:
    s = llm.stats()
    assert s["kv_pages_free"] + s["kv_pages_cached"] == s["kv_pages_total"], s
    assert s["requests_running"] == 0 and s["requests_waiting"] == 0, s
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_invariants()


def run(llm: LLM, prompts, new=NEW):
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_idle(llm)
    tokens = [o.outputs[0].token_ids for o in outs]
    top5 = [[lp.top for lp in o.outputs[0].logprobs] for o in outs]  # token -> logprob
    assert all(len(t) == new for t in tokens)
    return tokens, top5


# Equal tokens alone would miss a wrong decode step that keeps the argmax, so runs must also
# agree on the top-5 logprobs up to their first divergence: a bug moves logits by their
# spread (about 8 with today's dummy weights, tests/test_dummy_weights.py). The bounds below
# were measured on an H200 on 2026-11-21 (benchmarks/results/2026-11-21.md) with the earlier dummy weights, whose
# greedy outputs repeated one token after their first at wide margins, logits near 85 (bf16
# steps of 0.5): the same kernels (graphs vs eager, any padding) bit-equal; across kernels
# (either cache) 3.0 at most; an fp8 cache against the bf16 one 4.0. Since 2026-11-25 the
# outputs change at every step and the largest logits are near 35 (bf16 steps of 0.25), so
# near ties come more often; `pytest -m gpu -s` prints, per comparison, the identical prompts
# and the largest top-5 difference: re-measure the bounds from those before changing them.
LOGPROB_TOL = 4.0
SAME_KERNELS_TOL = 0.5
FP8_VS_BF16_TOL = 8.0
FP32_TOL = 0.1  # fp32 against transformers: summation order only


def compare(a, b, what: str, min_identical: float = 0.95, logprob_tol: float = LOGPROB_TOL) -> float:
    """Greedy runs a and b: at every divergence each token is in the other's top-5 (the
    logprob gap is printed: logits are bf16, whose step is 0.25 at the dummy model's
    largest logits); at least `min_identical` of the prompts identical (0 across kernels,
    whose bar is `assert_as_close_to_fp32`); up to the first divergence, the logprobs of
    tokens in both top-5s within `logprob_tol`."""
    (ta, ka), (tb, kb) = a, b
    same, worst, compared = 0, 0.0, 0
    for i, (x, y) in enumerate(zip(ta, tb)):
        j = common_prefix(x, y)
        compared += j
        for pos in range(min(j + 1, len(x))):
            worst = max([worst] + [abs(ka[i][pos][t] - kb[i][pos][t]) for t in ka[i][pos].keys() & kb[i][pos].keys()])
        if j == len(x):
            same += 1
            continue
        gap = ka[i][j][x[j]] - ka[i][j].get(y[j], float("-inf"))
        print(f"{what}: prompt {i} diverges at token {j} (first run's logprob gap between the two tokens {gap:.4f})")
        assert x[j] in kb[i][j] and y[j] in ka[i][j], f"{what}: prompt {i} diverges at {j}: {x[j]} vs {y[j]}"
    frac = same / len(ta)
    print(
        f"{what}: {same}/{len(ta)} identical; {compared}/{sum(map(len, ta))} tokens before the first divergences; "
        f"top-5 logprobs differ by {worst:.3f} at most"
    )
    assert frac >= min_identical, f"{what}: only {same}/{len(ta)} prompts identical"
    assert worst <= logprob_tol, f"{what}: top-5 logprobs differ by {worst:.3f} before any divergence"
    return frac


def common_prefix(x: list[int], y: list[int]) -> int:
    return next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))


def mean_common_prefix(ta: list[list[int]], tb: list[list[int]]) -> float:
    return sum(common_prefix(x, y) for x, y in zip(ta, tb)) / len(ta)


CLOSENESS_MARGIN = 0.9


def assert_as_close_to_fp32(run, twin, fp32, what: str) -> None:
    """The project's bf16 bar: `run` (a fast path in bf16) stays as close to the fp32 output
    as `twin` (its slow twin, or transformers, in bf16) does: mean common prefix with fp32
    at least 90% of the twin's."""
    got, ref = mean_common_prefix(run[0], fp32[0]), mean_common_prefix(twin[0], fp32[0])
    print(f"{what}: mean common prefix with fp32 {got:.2f} tokens, its twin's {ref:.2f} ({got / max(ref, 1e-9):.0%})")
    assert got >= CLOSENESS_MARGIN * ref, f"{what}: {got:.2f} tokens of common prefix with fp32, twin {ref:.2f}"


@pytest.fixture(scope="module")
def fast():
    llm = make_llm(cuda_graph_max_bs=GRAPH_MAX_BS)
    assert llm.engine.runner.backend.name == "triton"
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.max_bs == GRAPH_MAX_BS
    assert llm.engine.overlap
    return llm


@pytest.fixture(scope="module")
def eager():
    llm = make_llm(enforce_eager=True, overlap_schedule=False)
    assert llm.engine.runner.graphs is None and not llm.engine.overlap
    return llm


@pytest.fixture(scope="module")
def results(fast, eager):
    out = {"fast": run(fast, PROMPTS), "eager": run(eager, PROMPTS)}
    torch_llm = make_llm(attention_backend="torch", enforce_eager=True, overlap_schedule=False)
    out["torch"] = run(torch_llm, PROMPTS)
    del torch_llm
    out["hf"] = hf_reference(PROMPTS)
    out["hf32"] = hf_reference(PROMPTS, torch.float32)
    fast32 = make_llm(cuda_graph_max_bs=GRAPH_MAX_BS, dtype="float32")
    out["fast32"] = run(fast32, PROMPTS)
    del fast32
    return out


def hf_reference(prompts, dtype=torch.bfloat16):
    from nanoserve.models.hf_reference import hf_dummy_model

    model = hf_dummy_model(MODEL, 0, "cuda", dtype)
    model.generation_config.eos_token_id = None  # ignore_eos, as the engine runs
    tokens, top5 = [None] * len(prompts), [None] * len(prompts)
    with torch.no_grad():
        for length in LENGTHS:  # equal lengths per batch: no padding in transformers
            idx = [i for i, p in enumerate(prompts) if len(p) == length]
            ids = torch.tensor([prompts[i] for i in idx], device="cuda")
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW,
                do_sample=False,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            logprobs = torch.stack(out.logits, dim=1).float().log_softmax(-1)
            values, indices = logprobs.topk(5, dim=-1)  # [b, NEW, 5]
            for row, i in enumerate(idx):
                tokens[i] = out.sequences[row, length:].tolist()
                top5[i] = [dict(zip(t, v)) for t, v in zip(indices[row].tolist(), values[row].tolist())]
    del model
    torch.cuda.empty_cache()
    return tokens, top5


def test_graphs_overlap_vs_eager_simple(results):
    compare(results["fast"], results["eager"], "graphs+overlap vs eager+simple", logprob_tol=SAME_KERNELS_TOL)


# Across different kernels (Triton vs SDPA vs transformers) bf16 logits tie exactly or within
# one bf16 step at some positions, and greedy then follows either token. With the dummy
# weights before 2026-11-25 (outputs repeating one token) 26-30/32 prompts stayed identical;
# with today's, whose outputs change at every step, near ties come at most prompts (on an
# H200, 2026-11-25: triton vs torch attention 0/32 identical, vs transformers 1/32, every
# divergence within the top-5), as transformers' own bf16 against its fp32 on real SmolLM2
# weights (identical on 31% of prompts, ../shared/gpu/README.md). So across kernels the bar
# is closeness to fp32, not identity: `assert_as_close_to_fp32`, plus the top-5 rule.


def test_fp32_fast_path_equals_transformers(results):
    compare(results["fast32"], results["hf32"], "fp32: graphs+overlap vs transformers", 1.0, FP32_TOL)


def test_triton_vs_torch_backend(results):
    compare(results["eager"], results["torch"], "triton vs torch attention", 0.0)
    compare(results["fast"], results["torch"], "graphs+overlap vs torch attention", 0.0)
    assert_as_close_to_fp32(results["fast"], results["torch"], results["hf32"], "graphs+overlap vs torch attention")


def test_vs_transformers(results):
    compare(results["fast"], results["hf"], "graphs+overlap vs transformers", 0.0)
    compare(results["torch"], results["hf"], "torch attention vs transformers", 0.0)
    assert_as_close_to_fp32(results["fast"], results["hf"], results["hf32"], "graphs+overlap vs transformers")


def test_fp8_kv_cache(results):
    # The fp8 cache through the fast path (Triton, graphs, overlap) vs the torch backend over
    # the same fp8 cache: the cross-kernel criterion. Against the bf16 cache the tokens part
    # where the rounding moves a near tie: each token must stay in the other's top-5.
    fp8 = make_llm(cuda_graph_max_bs=GRAPH_MAX_BS, kv_cache_dtype="fp8")
    assert fp8.engine.runner.kv_cache.k[0].dtype == torch.float8_e4m3fn
    fast = run(fp8, PROMPTS)
    del fp8
    fp8_torch = make_llm(attention_backend="torch", enforce_eager=True, overlap_schedule=False, kv_cache_dtype="fp8")
    reference = run(fp8_torch, PROMPTS)
    del fp8_torch
    compare(fast, reference, "fp8 cache: graphs+overlap vs torch attention", 0.0)
    assert_as_close_to_fp32(fast, reference, results["hf32"], "fp8 cache: graphs+overlap vs torch attention")
    compare(fast, results["fast"], "fp8 vs bf16 cache", 0.0, FP8_VS_BF16_TOL)


@pytest.mark.parametrize("bs", [3, 9, GRAPH_MAX_BS, GRAPH_MAX_BS + 1])
def test_padding_near_captured_sizes(fast, eager, bs):
    prompts = make_prompts(bs, seed=100 + bs)
    graphs = fast.engine.runner.graphs
    assert (graphs.padded_size(bs) is None) == (bs > GRAPH_MAX_BS)
    compare(run(fast, prompts, 24), run(eager, prompts, 24), f"bs {bs}: graphs vs eager", logprob_tol=SAME_KERNELS_TOL)


def test_fused_ops_equal_plain():
    from nanoserve.models import layers

    torch.manual_seed(0)
    for tokens in (1, 7, 300):
        x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        w = 1 + 0.1 * torch.randn(1024, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(layers.rms_norm(x, w, 1e-6), layers.rms_norm.plain(x, w, 1e-6), atol=2e-2, rtol=2e-2)
        got, got_sum = layers.add_rms_norm(x, r, w, 1e-6)
        ref, ref_sum = layers.add_rms_norm.plain(x, r, w, 1e-6)
        torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got_sum, ref_sum)
        gu = torch.randn(tokens, 2 * 3072, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(layers.silu_and_mul(gu), layers.silu_and_mul.plain(gu), atol=2e-2, rtol=2e-2)
        rot = layers.RotaryEmbedding(128, 4096, 1e6, None).cuda()
        pos = torch.randint(0, 4096, (tokens,), device="cuda")
        q = torch.randn(tokens, 16, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(tokens, 8, 128, device="cuda", dtype=torch.bfloat16)
        for a, b in zip(layers.rope(pos, q, k, rot.cos, rot.sin), layers.rope.plain(pos, q, k, rot.cos, rot.sin)):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
