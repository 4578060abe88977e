"""fla-core's chunked Gated DeltaNet kernels (nanoserve/kernels/gated_delta_fla.py) against
the torch twin on the GPU: `pytest -m gpu -s -rs tests/test_gpu_fla.py`. Needs fla-core and
einops (the `gpu` extra, or their wheels in .whl/: benchmarks/gpu_session.sh says how); where
fla does not import, every test here skips with the reason. Each comparison prints its
difference, so one run shows how close the paths are, not only pass or fail.

- The kernel: sequences packed one after another (1 to 150 tokens: within, at and across
  fla's 64-token chunks), raw q and k (fla normalises them), twice as many value heads as key
  heads, nonzero initial states but one; the tiny model's head dims and Qwen3.5's; bf16 (the
  serving path) and fp32 (fla's fp32 products are TF32: a looser match than fp32 usually
  gets, which is why the engine keeps fp32 on the twin). Errors relative to the largest
  reference value; a layout mistake (transposed state, key heads tiled instead of repeated,
  states of the wrong sequence) is off by O(1).
- The engine: the tiny Qwen3.5's first token after each prompt (the prefill's output alone),
  fla vs the twin (NANOSERVE_FLA=0) on the same GPU, whole prompts and chunks of 48 (states
  carried into later extends): top-20 logprobs within a tolerance, in bf16 and in fp32 with
  fla forced on. Calibrated on CPU (tiny model, fp32, 2026-11-28): noise of 1e-3 relative on
  the rule's outputs and states moves these logprobs by 0.005, a whole bf16 model by 0.13,
  the layout mistakes above by 0.75 and more. Greedy 24-token runs are printed, not asserted:
  in fp32 the same 1e-3 noise already changed 2 of 11 greedy continuations.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.kernels import gated_delta, gated_delta_fla
from nanoserve.switches import KernelSwitches
from tests.tiny import make_tiny_model, random_prompts

WHY_NOT = gated_delta_fla.unusable_reason("cuda", torch.bfloat16) if torch.cuda.is_available() else "no CUDA GPU"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY_NOT is not None, reason=f"fla path unavailable: {WHY_NOT}")]

LENGTHS = [1, 17, 64, 65, 150, 3, 128, 40]
# Largest |fla - twin| over the largest |twin| value, per dtype.
KERNEL_TOL = {torch.float32: 1e-2, torch.bfloat16: 4e-2}


def packed_inputs(dtype, hk, hv, dk, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t, n = sum(LENGTHS), len(LENGTHS)
    q = torch.randn(t, hk, dk, generator=gen) * 2
    k = torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, generator=gen) * 0.5  # decays down to exp(-0.5) per token: states carry far
    beta = torch.rand(t, hv, generator=gen)
    states = torch.randn(n, hv, dk, dv, generator=gen) * 0.3
    states[2] = 0  # a request starting at position 0
    return [x.to("cuda", dtype) for x in (q, k, v)] + [x.cuda() for x in (g, beta, states)]


def relative_error(name: str, got: torch.Tensor, want: torch.Tensor) -> float:
    err = (got.float() - want.float()).abs()
    scale = want.abs().max().item()
    print(f"  {name}: max abs diff {err.max().item():.3e}, mean {err.mean().item():.3e} (max |twin| {scale:.3f})")
    assert scale > 1e-3, "reference too small to compare against"
    return err.max().item() / scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("hk", "hv", "dk", "dv"), [(2, 4, 16, 16), (16, 32, 128, 128)], ids=["tiny", "qwen3.5"])
def test_fla_kernel_matches_the_twin(dtype, hk, hv, dk, dv):
    q, k, v, g, beta, states = packed_inputs(dtype, hk, hv, dk, dv)
    before = states.clone()
    o, final = gated_delta_fla.fla_varlen(q, k, v, g, beta, states, LENGTHS)
    want_o, want_s = gated_delta.delta_rule_varlen(q.float(), k.float(), v.float(), g, beta, states, LENGTHS)
    assert o.shape == want_o.shape and o.dtype == dtype and final.shape == want_s.shape and final.dtype == torch.float32
    assert torch.equal(states, before)
    print(f"\nfla vs twin, {str(dtype).removeprefix('torch.')}, Hk {hk} Hv {hv} Dk {dk} Dv {dv}, lengths {LENGTHS}:")
    o_err, s_err = relative_error("outputs", o, want_o), relative_error("final states", final, want_s)
    tol = KERNEL_TOL[dtype]
    print(f"  relative: outputs {o_err:.2e}, states {s_err:.2e} (tolerance {tol:.0e})")
    assert o_err <= tol and s_err <= tol
    for i, length in enumerate(LENGTHS):  # each sequence on its own (cu_seqlens cut where they should)
        start = sum(LENGTHS[:i])
        alone_o, alone_s = gated_delta_fla.fla_varlen(*(x[start : start + length] for x in (q, k, v, g, beta)),
                                                      states[i : i + 1], [length])  # fmt: skip
        assert (
            alone_o.float() - o[start : start + length].float()
        ).abs().max().item() <= tol * want_o.abs().max().item()
        assert (alone_s - final[i : i + 1]).abs().max().item() <= tol * want_s.abs().max().item()


def test_entry_takes_fla_in_16_bit_only():
    """`delta_rule_varlen` on CUDA: bf16 through fla (its outputs in bf16), fp32 through the
    twin (fp32, exactly the twin's)."""
    q, k, v, g, beta, states = packed_inputs(torch.bfloat16, 2, 4, 16, 16)
    assert gated_delta_fla.delta_rule_varlen(q, k, v, g, beta, states, LENGTHS)[0].dtype == torch.bfloat16
    q, k, v = q.float(), k.float(), v.float()
    o, s = gated_delta_fla.delta_rule_varlen(q, k, v, g, beta, states, LENGTHS)
    want_o, want_s = gated_delta.delta_rule_varlen(q, k, v, g, beta, states, LENGTHS)
    assert o.dtype == torch.float32 and torch.equal(o, want_o) and torch.equal(s, want_s)
    assert gated_delta_fla.delta_rule_varlen(q.bfloat16(), k, v, g, beta, states, LENGTHS, use_fla=False)[0].dtype == (
        torch.float32
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("q35") / "qwen3.5", "qwen3.5", seed=1)
    return path, random_prompts(11, seed=5, min_len=4, max_len=150)


def run(llm: LLM, prompts, params: SamplingParams):
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_invariants()
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"], stats
    assert stats["request_slots_free"] == stats["request_slots_total"], stats
    return [o.outputs[0] for o in outs]


FIRST = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ENGINE_TOL = {"bfloat16": 0.25, "float32": 0.05}  # |logprob difference|, see the module docstring


@pytest.mark.parametrize("chunk", [None, 48], ids=["whole", "chunks48"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_prefill_through_fla_matches_the_twin(model, monkeypatch, dtype, chunk):
    path, prompts = model
    calls = []
    real = gated_delta_fla.fla_varlen
    monkeypatch.setattr(gated_delta_fla, "fla_varlen", lambda *a: calls.append(len(a[-1])) or real(*a))
    if dtype == "float32":  # forced: the engine keeps fp32 on the twin
        monkeypatch.setattr(gated_delta_fla, "FLA_DTYPES", (torch.float32,))
    args = {"device": "cuda", "dtype": dtype, "enforce_eager": True, "kv_cache_tokens": 8192}  # two engines at once
    if chunk:
        args["chunked_prefill_size"] = chunk
    fla_llm = LLM(str(path), **args)
    fla_first = run(fla_llm, prompts, FIRST)
    assert calls and max(calls) > 1, "the engine did not run its extends through fla"
    fla_calls = len(calls)
    twin_llm = LLM(str(path), switches=KernelSwitches(fla=False), **args)
    twin_first = run(twin_llm, prompts, FIRST)
    assert len(calls) == fla_calls, "NANOSERVE_FLA=0 still reached fla"

    tol, worst, same = ENGINE_TOL[dtype], 0.0, 0
    for i, (a, b) in enumerate(zip(fla_first, twin_first)):
        fa, fb = a.logprobs[0], b.logprobs[0]
        common = set(fa.top) & set(fb.top)
        assert len(common) >= 10, f"prompt {i}: top-20 sets share only {len(common)} tokens"
        worst = max(worst, max(abs(fa.top[t] - fb.top[t]) for t in common))
        ranked = sorted(fb.top.values(), reverse=True)
        same += fa.token_id == fb.token_id
        if ranked[0] - ranked[1] > 2 * tol:  # a clear winner must stay the winner
            assert fa.token_id == fb.token_id, f"prompt {i}: first token {fa.token_id} vs the twin's {fb.token_id}"
    greedy = [a.token_ids == b.token_ids for a, b in zip(run(fla_llm, prompts, GREEDY), run(twin_llm, prompts, GREEDY))]
    print(
        f"\nengine {dtype}, chunked_prefill_size {chunk or 'default'}: {fla_calls} fla calls; first-token top-20 "
        f"logprobs max |diff| {worst:.4f} (tolerance {tol}); first tokens equal {same}/{len(prompts)}; "
        f"greedy 24-token runs identical {sum(greedy)}/{len(prompts)} (not asserted)"
    )
    assert worst <= tol
