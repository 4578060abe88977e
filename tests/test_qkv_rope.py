"""The one-row qkv GEMV with the rotation and the K/V store in its epilogue
(`kernels.qkv_rope.qkv_rope_gemv`) against its slow twins: the same GEMV config through
`small_m_linear` followed by the rotary kernel with its store (`rotary.qk_norm_rope`), and
the torch reference (`qkv_rope_reference` + the backend-style store).

The fused kernel rounds the product and the rotated values to the dtype as the pair does and
computes the rotation with the same expressions: in Triton's interpreter (numpy, no FMA
contraction) it equals the pair bit for bit; compiled, within one rounding step.

CPU tests run tiny ragged shapes in the interpreter (conftest sets TRITON_INTERPRET=1 when no
GPU is present); GPU tests (`pytest -m gpu tests/test_qkv_rope.py`) run llama-3.1-8b's qkv in
bf16 and FP8 with bf16 and fp8 caches, and in a CUDA graph.
"""

from __future__ import annotations

import os

import pytest
import torch

from nanoserve.kernels import linear as klinear
from nanoserve.kernels import qkv_rope, rotary
from nanoserve.kernels.fp8 import dequantize_weight
from nanoserve.kernels.linear import LinearConfig
from nanoserve.models.layers import RotaryEmbedding
from nanoserve.models.quantization import quantize_per_channel

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
interp = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (set by conftest without a GPU)")
gpu = pytest.mark.gpu


def tables(head_dim: int, max_pos: int, device):
    """The model's cos/sin tables [max_pos, head_dim / 2] (fp32)."""
    rotary = RotaryEmbedding(head_dim, max_pos, 10000.0, None)
    return rotary.cos.to(device), rotary.sin.to(device)


def setup(hq, hk, d, K, dtype, device, fp8, bias, cache_dtype, pages=4, page_size=4, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = (hq + 2 * hk) * d
    x = torch.randn(1, K, generator=gen, device=device).to(dtype)
    w = torch.randn(rows, K, generator=gen, device=device) / K**0.5
    b = torch.randn(rows, generator=gen, device=device).to(dtype) if bias else None
    if fp8:
        w, s = quantize_per_channel(w)
    else:
        w, s = w.to(dtype), None
    caches = [torch.zeros(pages, page_size, hk, d, device=device).to(cache_dtype) for _ in range(2)]
    return x, w, s, b, caches


def check(hq, hk, d, K, dtype, device, config, fp8=False, bias=False, cache_dtype=None, slot=5, pos=7, exact=True):
    """Cache slots 0..31, positions 0..1023."""
    cache_dtype = cache_dtype or dtype
    x, w, s, b, (kc, vc) = setup(hq, hk, d, K, dtype, device, fp8, bias, cache_dtype, pages=8, page_size=4)
    cos, sin = tables(d, 1024, device)
    positions = torch.tensor([pos], device=device)
    slots = torch.tensor([slot], device=device)
    got = qkv_rope.qkv_rope_gemv(x, w, b, config, positions, cos, sin, hq, hk, d, (kc, vc, slots), w_scale=s)
    # the unfused pair: the GEMV (same config), then the rotary kernel with its store
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    plain = klinear.small_m_linear(x, w, b, config, w_scale=s)
    q, k, v = plain.view(1, hq + 2 * hk, d).split([hq, hk, hk], 1)
    q2, k2 = rotary.qk_norm_rope(positions, q, k, cos, sin, kv_store=(v, kc2, vc2, slots))
    twin = torch.cat([q2.reshape(1, -1), k2.reshape(1, -1), v.reshape(1, -1)], 1)
    if exact:
        assert torch.equal(got, twin), f"{config}: not the GEMV + rotary kernel's output"
        assert torch.equal(kc.float(), kc2.float()) and torch.equal(vc.float(), vc2.float()), "cache differs"
    else:
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
        assert ((got.float() - twin.float()).abs() <= twin.float().abs() * ulp + 1e-6).all(), config
        tol = 2 * ulp if cache_dtype == dtype else 2.0**-3
        for a, c in ((kc, kc2), (vc, vc2)):
            assert ((a.float() - c.float()).abs() <= c.float().abs() * tol + 1e-3).all(), config
    if slot >= 0:  # the slot's rows hold the rotated k and v (an fp8 cache: as the pair rounds them)
        if cache_dtype == dtype:
            assert torch.equal(kc.view(-1, hk, d)[slot], got[0, hq * d : (hq + hk) * d].view(hk, d))
            assert torch.equal(vc.view(-1, hk, d)[slot], got[0, (hq + hk) * d :].view(hk, d))
        assert kc.float().count_nonzero() <= hk * d and vc.float().count_nonzero() <= hk * d, "written elsewhere"
    else:
        assert not kc.float().any() and not vc.float().any(), "a negative slot must be skipped"
    # the torch reference
    w_ref = dequantize_weight(w, s, False, torch.float32) if fp8 else w.float()
    ref = qkv_rope.qkv_rope_reference(x, w_ref, b, positions, cos, sin, hq, hk, d)
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), err


# ------------------------------------------------------------------------------ CPU tests


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_interp_qkv_rope_ragged_k(dtype, bias):
    # 4 q heads, 2 kv heads, head_dim 16 (pairs of 2 per program), K = 80 over blocks of 32
    check(4, 2, 16, 80, dtype, "cpu", LinearConfig("fma", 1, 4, 32, num_stages=2), bias=bias)


@interp
@pytest.mark.parametrize("cache", ["same", "fp8"])
def test_interp_qkv_rope_fp8_weights_and_caches(cache):
    cache_dtype = torch.float8_e4m3fn if cache == "fp8" else None
    check(4, 2, 16, 64, torch.bfloat16, "cpu", LinearConfig("fma", 1, 8, 32), fp8=True, cache_dtype=cache_dtype)


@interp
def test_interp_qkv_rope_negative_slot_stores_nothing():
    check(2, 1, 8, 32, torch.float32, "cpu", LinearConfig("fma", 1, 2, 32), slot=-1)


def test_qkv_rope_takes_only_tiles_of_whole_pairs():
    assert qkv_rope.fuses_rope(LinearConfig("fma", 1, 16, 512), 128)
    assert qkv_rope.fuses_rope(LinearConfig("fma", 1, 4, 1024), 128)
    assert not qkv_rope.fuses_rope(LinearConfig("fma", 1, 6, 512), 128)  # 3 pairs do not divide 64
    assert not qkv_rope.fuses_rope(LinearConfig("fma", 2, 4, 512), 128)
    assert not qkv_rope.fuses_rope(LinearConfig("dot", 16, 64, 128), 128)
    assert not qkv_rope.fuses_rope(None, 128)
    with pytest.raises(ValueError, match="cannot carry"):
        x, w = torch.randn(1, 32), torch.randn(4 * 8, 32)
        cos, sin = tables(8, 4, "cpu")
        qkv_rope.qkv_rope_gemv(x, w, None, LinearConfig("fma", 1, 16, 32), torch.zeros(1), cos, sin, 2, 1, 8)


# ------------------------------------------------------------------------------ GPU tests


@gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("cache", ["same", "fp8"])
def test_gpu_qkv_rope_llama_shape(fp8, cache):
    dt = torch.bfloat16
    N, K = 6144, 4096
    config = klinear.fp8_linear_config(1, N, K, dt) if fp8 else klinear.linear_config(1, N, K, dt)
    assert qkv_rope.fuses_rope(config, 128), config
    cache_dtype = torch.float8_e4m3fn if cache == "fp8" else None
    for slot, pos in ((5, 7), (31, 1000), (-1, 3)):
        check(32, 8, 128, K, dt, "cuda", config, fp8=fp8, cache_dtype=cache_dtype, slot=slot, pos=pos, exact=False)


@gpu
def test_gpu_qkv_rope_graph_replay_bit_equal():
    dt = torch.bfloat16
    x, w, s, _, (kc, vc) = setup(32, 8, 128, 4096, dt, "cuda", True, False, dt, pages=8, page_size=16)
    cos, sin = tables(128, 64, "cuda")
    positions, slots = torch.tensor([9], device="cuda"), torch.tensor([17], device="cuda")
    config = klinear.fp8_linear_config(1, 6144, 4096, dt)
    run = lambda: qkv_rope.qkv_rope_gemv(
        x, w, None, config, positions, cos, sin, 32, 8, 128, (kc, vc, slots), w_scale=s
    )
    eager = run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@interp
@pytest.mark.parametrize("arch", ["llama3-rope", "qwen2"])
def test_interp_decoder_rotates_in_the_qkv_gemv_at_one_row(tmp_path, monkeypatch, arch):
    """The decoder's path through the fused kernel (forced on the CPU: the interpreter runs it;
    on CUDA the rule's config decides): a request decoding alone takes it at every layer of
    every decode step, and its greedy tokens (fp32) equal those of the unfused path. llama3
    rope scaling: the tables carry it; Qwen2: a bias on qkv."""
    from nanoserve import LLM, SamplingParams
    from nanoserve.models import layers
    from tests.tiny import make_tiny_model, random_prompts

    path = make_tiny_model(tmp_path / arch, arch)
    prompts = random_prompts(2, seed=5)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def generate():
        llm = LLM(str(path), device="cpu", enable_prefix_caching=False)
        out = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        stats = llm.stats()
        assert stats["kv_pages_free"] == stats["kv_pages_total"]
        llm.shutdown()
        return out

    plain = generate()
    calls = []
    real = qkv_rope.qkv_rope_gemv

    def spy(*args, **kw):
        calls.append(args[4].tolist())  # the position
        return real(*args, **kw)

    monkeypatch.setattr(
        layers.ColumnParallelLinear,
        "small_m_config",
        lambda self, x: LinearConfig("fma", 1, 8, 64) if x.shape[0] == 1 else None,  # 2 tiles a half head
    )
    monkeypatch.setattr(qkv_rope, "qkv_rope_gemv", spy)
    assert generate() == plain
    assert len(calls) == 2 * 7 * 2  # requests x decode steps x layers
