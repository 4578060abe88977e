"""Qwen3.5's Gated DeltaNet layers: the torch kernels against a token-by-token loop written
from the rule's definition, and the engine on tiny random checkpoints against transformers
(fp32, CPU) through what a per-request state must survive: batches, chunked prefill,
preemption, parallel sampling, a second pass with the prefix cache asked for. The plain
greedy comparison is tests/test_models_vs_hf.py's. The fla-core prefill path
(nanoserve/kernels/gated_delta_fla.py) on CPU: left alone off CUDA and when fla is missing,
and its packing run through a stand-in for fla's kernel (tests/test_gpu_fla.py runs the real
one)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from nanoserve import LLM, SamplingParams
from nanoserve.kernels import gated_delta, gated_delta_fla
from nanoserve.kvcache.linear_state import LinearStatePool
from nanoserve.models.loader import hf_parameter_shapes
from nanoserve.models.model_config import ModelConfig
from nanoserve.models.qwen3_5 import prefill_path
from nanoserve.models.registry import resolve_model
from nanoserve.switches import KernelSwitches
from tests.tiny import hf_greedy, make_tiny_model, random_prompts, tiny_config

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def delta_rule_by_definition(q, k, v, g, beta, state):
    """The gated delta rule token by token, in float64: (outputs [T, Hv, Dv], final state)."""
    hv, dk = v.shape[1], q.shape[2]
    rep = hv // q.shape[1]
    s = state.double().clone()
    outs = []
    for t in range(q.shape[0]):
        o = torch.empty(hv, v.shape[2], dtype=torch.float64)
        for h in range(hv):
            qh = F.normalize(q[t, h // rep].double(), dim=0, eps=0) * dk**-0.5
            kh = F.normalize(k[t, h // rep].double(), dim=0, eps=0)
            s[h] *= torch.exp(g[t, h].double())
            s[h] += torch.outer(kh, beta[t, h].double() * (v[t, h].double() - s[h].T @ kh))
            o[h] = s[h].T @ qh
        outs.append(o)
    return torch.stack(outs), s


def random_rule_inputs(t, hk=2, hv=4, dk=8, dv=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, hk, dk, generator=gen), torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, generator=gen)  # decays down to exp(-1) per token
    beta = torch.rand(t, hv, generator=gen)
    state = torch.randn(hv, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, state


@pytest.mark.parametrize(("length", "chunk"), [(1, 64), (7, 4), (20, 8), (70, 64)])
def test_chunked_rule_matches_the_definition(length, chunk):
    q, k, v, g, beta, state = random_rule_inputs(length)
    want_o, want_s = delta_rule_by_definition(q, k, v, g, beta, state)
    o, s = gated_delta.delta_rule_chunked(q, k, v, g, beta, state, chunk=chunk)
    torch.testing.assert_close(o.double(), want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s.double(), want_s, atol=1e-5, rtol=1e-5)


def test_step_rule_matches_the_definition_per_sequence():
    """Three sequences one token at a time, each with its own state, in one batch."""
    seqs = [random_rule_inputs(5, seed=i) for i in range(3)]
    states = torch.stack([s[5] for s in seqs]).clone()
    outs = []
    for t in range(5):
        parts = [torch.stack([s[j][t] for s in seqs]) for j in range(5)]
        outs.append(gated_delta.delta_rule_step(*parts, states))
    for i, seq in enumerate(seqs):
        want_o, want_s = delta_rule_by_definition(*seq)
        torch.testing.assert_close(torch.stack([o[i] for o in outs]).double(), want_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(states[i].double(), want_s, atol=1e-5, rtol=1e-5)


def test_convolution_in_pieces_equals_whole():
    """A sequence convolved whole, in two calls carrying the state (the first right-padded in a
    batch with a longer one), and token by token agree; the state is the last W-1 inputs."""
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(9, 6, generator=gen), torch.randn(6, 4, generator=gen)
    zero = torch.zeros(1, 6, 3)
    whole, state = gated_delta.causal_conv(x[None], weight, zero, torch.tensor([9]))
    padded = torch.cat([zero[0], x.t()], dim=1)
    by_hand = torch.stack([(padded[:, t : t + 4] * weight).sum(1) for t in range(9)])
    torch.testing.assert_close(whole[0], F.silu(by_hand))
    assert torch.equal(state[0], x[-3:].t())
    other = torch.randn(7, 6, generator=gen)
    batch = torch.stack([torch.cat([x[:4], torch.full((3, 6), 99.0)]), other])  # row 0: 4 real, 3 padding
    first, mid = gated_delta.causal_conv(batch, weight, zero.expand(2, -1, -1), torch.tensor([4, 7]))
    second, _ = gated_delta.causal_conv(x[None, 4:], weight, mid[:1], torch.tensor([5]))
    torch.testing.assert_close(torch.cat([first[0, :4], second[0]]), whole[0])
    torch.testing.assert_close(first[1], gated_delta.causal_conv(other[None], weight, zero, torch.tensor([7]))[0][0])
    states = zero.clone()
    steps = [gated_delta.causal_conv_step(x[t : t + 1], weight, states)[0] for t in range(9)]
    torch.testing.assert_close(torch.stack(steps), whole[0])


def test_padded_sequences_side_by_side_equal_each_alone():
    """Two sequences of different lengths as extra heads of one chunked rule (the shorter one
    right-padded with g = 0, beta = 0) give each one's outputs and final state alone."""
    a, b = random_rule_inputs(70, seed=1), random_rule_inputs(23, seed=2)
    pad = 70 - 23
    b_pad = [torch.cat([t, torch.zeros(pad, *t.shape[1:])]) for t in b[:5]]
    both = [torch.cat([x, y], dim=1) for x, y in zip(a[:5], b_pad)]  # heads side by side
    o, s = gated_delta.delta_rule_chunked(*both, torch.cat([a[5], b[5]]), chunk=16)
    for seq, heads, length in ((a, slice(0, 4), 70), (b, slice(4, 8), 23)):
        want_o, want_s = gated_delta.delta_rule_chunked(*seq, chunk=16)
        torch.testing.assert_close(o[:length, heads], want_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s[heads], want_s, atol=1e-5, rtol=1e-5)


def packed_rule_inputs(lengths, seed=0, **dims):
    """Sequences of `lengths` tokens each: (each alone, their five inputs packed one after
    another, their states before them [R, Hv, Dk, Dv], nonzero)."""
    seqs = [random_rule_inputs(n, seed=seed + i, **dims) for i, n in enumerate(lengths)]
    return seqs, [torch.cat([s[j] for s in seqs]) for j in range(5)], torch.stack([s[5] for s in seqs])


def test_varlen_rule_equals_each_sequence_alone():
    """The twin's packed entry: sequences packed one after another (longer and shorter than a
    64-token chunk, one of a single token) give each one's outputs and final state alone."""
    lengths = [70, 23, 1, 64]
    seqs, packed, states = packed_rule_inputs(lengths)
    o, s = gated_delta.delta_rule_varlen(*packed, states, lengths)
    starts = [0, 70, 93, 94]
    for seq, start, n, final in zip(seqs, starts, lengths, s):
        want_o, want_s = gated_delta.delta_rule_chunked(*seq)
        torch.testing.assert_close(o[start : start + n], want_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final, want_s, atol=1e-5, rtol=1e-5)


def test_varlen_convolution_equals_the_padded_batch():
    """`causal_conv_varlen` over sequences packed without padding equals `causal_conv` over
    the right-padded batch: outputs and new states (a sequence shorter than W-1 keeps some of
    its old state's inputs in the new one)."""
    gen = torch.Generator().manual_seed(4)
    lengths, channels, width = [5, 1, 2, 9], 6, 4
    x = torch.randn(sum(lengths), channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    states = torch.randn(len(lengths), channels, width - 1, generator=gen)
    got, got_states = gated_delta.causal_conv_varlen(x, weight, states, lengths)
    where, longest = gated_delta.packed_to_padded(lengths, x.device)
    padded = x.new_zeros(len(lengths) * longest, channels)
    padded[where] = x
    want, want_states = gated_delta.causal_conv(
        padded.view(len(lengths), longest, -1), weight, states, torch.tensor(lengths)
    )
    torch.testing.assert_close(got, want.reshape(-1, channels)[where])
    torch.testing.assert_close(got_states, want_states)
    assert torch.equal(got_states[1], torch.cat([states[1, :, 1:], x[5:6].t()], dim=1))


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels: a GPU, or the interpreter (conftest sets it without a GPU)",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_convolution_kernel_matches_the_twin(dtype):
    """`causal_conv_packed` (one Triton launch) against `causal_conv_varlen`: sequences longer
    than a token block and shorter than W-1 (their new state keeps old inputs), the input a
    view with a row stride as the projection's split hands it, channels not a whole block."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(11)
    lengths, channels, width = [9, 1, 2, 37, 4], 13, 4
    proj = torch.randn(sum(lengths), channels + 5, generator=gen).to(dev, dtype)
    x = proj[:, :channels]
    weight = torch.randn(channels, width, generator=gen).to(dev, dtype)
    states = torch.randn(len(lengths), channels, width - 1, generator=gen).to(dev, dtype)
    got, got_states = gated_delta.causal_conv_packed(x, weight, states, lengths)
    want, want_states = gated_delta.causal_conv_varlen(x, weight, states, lengths)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(got_states, want_states)  # copies of inputs: exact


def test_linear_kernels_compile_for_hopper():
    """The Gated DeltaNet kernels built for sm_90 on the host (tests/hopper_compile.py, in a
    process of its own: this one may run the interpreter, which ran the packed convolution's
    first version that the compiler refused)."""
    pytest.importorskip("triton.backends.nvidia")
    from hopper_compile import check_in_own_process

    check_in_own_process("linear")


def fla_stand_in(calls: list):
    """fla's `chunk_gated_delta_rule` as its docstring and its reference (fla/ops/
    gated_delta_rule/naive.py) define it, for what the wrapper asks of it: varlen inputs
    [1, T, H, D] cut by cu_seqlens, value head h reading key head h // (HV / H), the state
    [N, HV, K, V] read as S^T q, g the natural-log decay, q and k L2-normalised by the caller (the
    in-kernel norm off), q times `scale`; token by token in float64 (`delta_rule_by_definition`,
    whose own normalisation of unit vectors changes nothing). Records each call."""

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, **rest):  # fmt: skip
        calls.append(len(cu_seqlens_cpu) - 1)
        n, (_, _, hk, dk), hv = len(cu_seqlens_cpu) - 1, q.shape, v.shape[2]
        assert q.shape[0] == 1 and k.shape == q.shape and v.shape[:2] == q.shape[:2] and hv % hk == 0
        assert g.shape == beta.shape == (1, q.shape[1], hv) and g.dtype == beta.dtype == torch.float32
        assert cu_seqlens.dtype == cu_seqlens_cpu.dtype == torch.long and torch.equal(cu_seqlens.cpu(), cu_seqlens_cpu)
        assert int(cu_seqlens_cpu[-1]) == q.shape[1] and not use_qk_l2norm_in_kernel and output_final_state and not rest
        for x in (q, k):  # normalised already
            torch.testing.assert_close(
                x.double().norm(dim=-1), torch.ones(x.shape[:-1], dtype=torch.float64), atol=1e-2, rtol=0
            )
        assert initial_state.shape == (n, hv, dk, v.shape[3]) and initial_state.dtype == torch.float32
        o, finals = torch.zeros(v.shape[1:], dtype=torch.float64), []
        for i in range(n):
            t = slice(int(cu_seqlens_cpu[i]), int(cu_seqlens_cpu[i + 1]))
            o_i, s_i = delta_rule_by_definition(q[0, t], k[0, t], v[0, t], g[0, t], beta[0, t], initial_state[i])
            o[t] = o_i * scale * dk**0.5  # the definition scales by Dk^-1/2
            finals.append(s_i)
        return o[None].to(q.dtype), torch.stack(finals).float()

    return chunk_gated_delta_rule


def test_fla_left_alone_on_cpu_and_when_missing(monkeypatch):
    """Off CUDA the fla entry is the twin and never imports fla; on CUDA fp32 stays on the
    twin, and an fla that does not import leaves the twin in place, the reason in words."""

    def no_import():
        raise AssertionError("fla imported")

    monkeypatch.setattr(gated_delta_fla, "_load", no_import)
    lengths = [70, 5]
    _, packed, states = packed_rule_inputs(lengths)
    for dtype in (torch.float32, torch.bfloat16):
        args = [t.to(dtype) for t in packed[:3]] + packed[3:]
        o, s = gated_delta_fla.delta_rule_varlen(*args, states, lengths)
        want_o, want_s = gated_delta.delta_rule_varlen(*args, states, lengths)
        assert o.dtype == torch.float32 and torch.equal(o, want_o) and torch.equal(s, want_s)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    assert gated_delta_fla.unusable_reason("cpu", bf16) == "not on CUDA"
    assert "TF32" in gated_delta_fla.unusable_reason(cuda, torch.float32)
    assert prefill_path(torch.device("cpu"), bf16, KernelSwitches()).startswith("torch chunked rule")
    monkeypatch.setattr(gated_delta_fla, "_load", lambda: (None, "ModuleNotFoundError: No module named 'fla'"))
    assert (
        gated_delta_fla.unusable_reason(cuda, bf16)
        == "fla-core is not importable (ModuleNotFoundError: No module named 'fla')"
    )
    assert "not importable" in prefill_path(cuda, bf16, KernelSwitches())
    with pytest.raises(RuntimeError, match="not importable"):
        gated_delta_fla.fla_varlen(*packed, states, lengths)
    monkeypatch.setattr(gated_delta_fla, "_load", lambda: (fla_stand_in([]), "0.5.2"))
    assert gated_delta_fla.unusable_reason(cuda, bf16) is None
    assert prefill_path(cuda, bf16, KernelSwitches()) == "fla-core 0.5.2 chunked kernels, requests packed (cu_seqlens)"
    assert "NANOSERVE_FLA=0" in prefill_path(cuda, bf16, KernelSwitches(fla=False))


def test_fla_wrapper_maps_layouts_onto_its_contract(monkeypatch):
    """`fla_varlen` hands fla one varlen batch in fla's layout (through the stand-in, on CPU):
    outputs and final states equal the twin's; the states passed in are left as they were."""
    calls = []
    monkeypatch.setattr(gated_delta_fla, "_load", lambda: (fla_stand_in(calls), "stand-in"))
    lengths = [70, 23, 1, 64]
    _, packed, states = packed_rule_inputs(lengths, dk=16, dv=8)
    before = states.clone()
    o, s = gated_delta_fla.fla_varlen(*packed, states, lengths)
    want_o, want_s = gated_delta.delta_rule_varlen(*packed, states, lengths)
    assert calls == [4] and torch.equal(states, before)
    torch.testing.assert_close(o, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, want_s, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("engine_args", [{}, {"chunked_prefill_size": 16, "page_size": 4}])
def test_engine_fast_prefill_path_through_the_stand_in(qwen35, monkeypatch, engine_args):
    """The engine's fast extend path on CPU (the packed convolution, the fla wrapper, the
    state rows gathered and written back), fla's kernel replaced by the stand-in: greedy tokens
    equal transformers'. Whole prompts (up to 150 tokens: several fla chunks) and chunks of
    16 (states carried into later extends, mixed steps)."""
    calls = []
    monkeypatch.setattr(gated_delta_fla, "_load", lambda: (fla_stand_in(calls), "stand-in"))
    monkeypatch.setattr(gated_delta_fla, "usable", lambda x: True)
    path, prompts, reference = qwen35
    assert tokens_of(LLM(str(path), device="cpu", **engine_args), prompts) == reference
    assert calls and max(calls) > 1  # the fast path ran, with several requests in one extend


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels: a GPU, or the interpreter (conftest sets it without a GPU)",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("batch", "dv"), [(3, 8), (1, 32)])
def test_decode_kernels_match_the_torch_step(dtype, batch, dv):
    """`decode_step` (three Triton launches) against the torch step on the same pools: three
    sequences at scattered rows, one starting at position 0 over a row of garbage (NaN), the
    inputs as views of one projection; a value head dim below the kernel's block (masks); one
    sequence alone (its narrower tile: several column blocks a head)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(7)
    hk, hv, dk, width = 2, 4, 16, 4
    channels, vdim = 2 * hk * dk + hv * dv, hv * dv
    proj = torch.randn(batch, channels + vdim + 2 * hv, generator=gen).to(dev, dtype)
    qkv, z, ba = proj.split([channels, vdim, 2 * hv], dim=-1)
    weight = (torch.randn(channels, width, generator=gen) * 0.5).to(dev, dtype)
    a_log, dt_bias = torch.randn(hv, generator=gen).to(dev), torch.randn(hv, generator=gen).to(dev)
    norm_w = (1 + 0.1 * torch.randn(dv, generator=gen)).to(dev, dtype)
    conv = torch.randn(5, channels, width - 1, generator=gen).to(dev, dtype)
    rec = torch.randn(5, hv, dk, dv, generator=gen).to(dev) * 0.3
    rows = torch.tensor([2, 0, 3][:batch], device=dev)
    prefix = torch.tensor([5, 0, 7][:batch], dtype=torch.int32, device=dev)
    conv[0], rec[0] = float("nan"), float("nan")  # a new request's row holds anything
    conv_ref, rec_ref = conv.clone(), rec.clone()
    out = gated_delta.decode_step(qkv, z, ba, weight, a_log, dt_bias, norm_w, 1e-6, conv, rec, rows, prefix, hk, dk)

    fresh = (prefix == 0)[:, None, None]
    c = conv_ref[rows].masked_fill(fresh, 0)
    x = gated_delta.causal_conv_step(qkv, weight, c)
    q, k, v = x.split([hk * dk, hk * dk, vdim], dim=-1)
    b, a = ba.split(hv, dim=-1)
    g = -a_log.exp() * F.softplus(a.float() + dt_bias)
    r = rec_ref[rows].masked_fill(fresh[..., None], 0)
    o = gated_delta.delta_rule_step(
        q.view(batch, hk, dk), k.view(batch, hk, dk), v.view(batch, hv, dv), g, b.float().sigmoid(), r
    )
    want = gated_delta.gated_rms_norm(o.to(dtype).view(-1, dv), z.reshape(-1, dv), norm_w, 1e-6).view(batch, vdim)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.05}
    torch.testing.assert_close(out, want, **tol)
    torch.testing.assert_close(conv[rows], c, **tol)
    torch.testing.assert_close(rec[rows], r, **tol)
    assert torch.equal(conv[[1, 4]], conv_ref[[1, 4]]) and torch.equal(rec[[1, 4]], rec_ref[[1, 4]])


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    """(model directory, prompts, transformers' greedy tokens); prompts up to 150 tokens cross
    the delta rule's 64-token chunks."""
    path = make_tiny_model(tmp_path_factory.mktemp("q35") / "qwen3.5", "qwen3.5", seed=1)
    prompts = random_prompts(6, seed=5, min_len=4, max_len=150)
    return path, prompts, hf_greedy(path, prompts, GREEDY.max_tokens)


def tokens_of(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_invariants()
    stats = llm.stats()
    assert (
        stats["kv_pages_free"] == stats["kv_pages_total"]
        and stats["request_slots_free"] == stats["request_slots_total"]
    )
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "engine_args",
    [
        {"chunked_prefill_size": 16, "page_size": 4},  # states carried across chunks, mixed steps
        {"max_num_seqs": 2},  # slots (and state rows) change hands between requests
        {"kv_cache_tokens": 192, "page_size": 16, "chunked_prefill_size": 64},  # preemption: recomputed from zero
    ],
)
def test_engine_paths_keep_the_state(qwen35, engine_args):
    path, prompts, reference = qwen35
    llm = LLM(str(path), device="cpu", **engine_args)
    assert tokens_of(llm, prompts) == reference
    if "kv_cache_tokens" in engine_args:
        assert llm.stats()["num_preemptions"] > 0


def test_one_at_a_time_and_a_second_pass(qwen35):
    """Requests alone, then all again with the prefix cache asked for: it is off for such
    models (nothing restored, nothing wrong)."""
    path, prompts, reference = qwen35
    llm = LLM(str(path), device="cpu", enable_prefix_caching=True)
    assert [tokens_of(llm, [p])[0] for p in prompts] == reference
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert llm.stats()["prefix_caching"] is False


def test_parallel_samples_fork_the_state(qwen35):
    """n = 2 greedy samples: the fork copies the parent's state row, so both follow it."""
    path, prompts, reference = qwen35
    llm = LLM(str(path), device="cpu")
    params = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True, n=2)
    outs = llm.generate(prompts[:3], params, use_tqdm=False)
    for out, want in zip(outs, reference):
        assert [c.token_ids for c in out.outputs] == [want, want]
    llm.engine.check_invariants()


def test_multimodal_config_serves_its_text_part():
    text = tiny_config("qwen3.5")
    text.pop("model_type")
    text.pop("tie_word_embeddings")  # the outer config's applies
    cfg = ModelConfig.from_hf_dict({"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": True})
    assert cfg.model_type == "qwen3_5_text" and cfg.tie_word_embeddings
    assert [cfg.is_linear_layer(i) for i in range(5)] == [True, True, True, False, True]
    assert cfg.rope_dim == 8 and cfg.num_kv_layers == 1


def test_refusals(tmp_path):
    bad = {**tiny_config("qwen3.5"), "layer_types": ["linear_attention"] * 4 + ["sliding_attention"]}
    with pytest.raises(ValueError, match="sliding_attention"):
        ModelConfig.from_hf_dict(bad)
    gemma = {**tiny_config("gemma3"), "layer_types": ["linear_attention"] * 4}
    with pytest.raises(ValueError, match="linear_attention"):
        ModelConfig.from_hf_dict(gemma)
    path = make_tiny_model(tmp_path / "q", "qwen3.5")
    with pytest.raises(ValueError, match="speculative decoding is not supported"):
        LLM(str(path), device="cpu", speculative_algorithm="ngram")


@pytest.mark.parametrize(
    ("name", "params", "active", "kv_layers"),
    [
        # transformers' Qwen3.5 defaults, which its docs name the 9B and 35B-A3B shapes
        ("qwen3.5-9b", 8.95e9, 8.95e9, 8),
        ("qwen3.5-35b-a3b", 34.66e9, 3.45e9, 10),
    ],
)
def test_bundled_configs(name, params, active, kv_layers):
    cfg = resolve_model(name).config
    shapes = hf_parameter_shapes(cfg)
    total = sum(torch.Size(s).numel() for s in shapes.values())
    experts = sum(torch.Size(s).numel() for n, s in shapes.items() if ".mlp.experts." in n)
    routed = experts * cfg.moe.top_k / cfg.moe.num_experts if cfg.moe else 0
    assert abs(total - params) / params < 0.01 and abs(total - experts + routed - active) / active < 0.01
    assert cfg.num_kv_layers == kv_layers and cfg.rope_dim == 64


def test_kv_capacity_against_a_full_layout(qwen35):
    """The states come out of the KV budget first; the rest holds num_layers / num_kv_layers
    times the tokens of a layout where every layer keeps K/V (the tiny model: 1 of 5)."""
    llm = LLM(str(qwen35[0]), device="cpu", kv_cache_gib=0.01, max_num_seqs=4, page_size=16)
    cfg = llm.engine.model_config
    state = LinearStatePool.bytes_needed(cfg.linear_state_shape, 4, torch.float32)
    lin = cfg.linear
    assert state == 4 * 5 * (lin.conv_dim * 3 * 4 + 4 * 16 * 16 * 4)  # 4 linear layers, 4 + 1 rows
    assert LinearStatePool.bytes_per_request(cfg.linear_state_shape, torch.float32) == state // 5
    moe35 = resolve_model("qwen3.5-35b-a3b").config  # the offline floor's state term: 30 layers, bf16 conv
    assert LinearStatePool.bytes_per_request(moe35.linear_state_shape, torch.bfloat16) == 30 * (
        8192 * 3 * 2 + 32 * 128 * 128 * 4
    )
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * 4  # K and V of the one full-attention layer
    tokens = (int(0.01 * 2**30) - state) // per_token
    assert llm.engine.runner.kv_cache.num_pages == tokens // 16 + 1
    assert llm.stats()["kv_tokens_full_layout"] == (tokens // 16) * 16 // 5
    full = resolve_model("qwen3.5-9b").config
    assert full.num_layers / full.num_kv_layers == 4  # Qwen3.5: 4x the tokens of an all-full layout
