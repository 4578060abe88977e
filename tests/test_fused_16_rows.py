"""The 2..16-row decode fusions (speculative verify steps, `KernelSwitches.fused_16_rows`)
against their slow twins:
- `qkv_rope.qkv_rope_rows`: the split-K qkv product's partials summed, rounded, rotated and
  stored (q|k|v and the K/V cache rows) by one epilogue kernel, against the same product
  through `small_m_linear` (its sum kernel) followed by the rotary kernel with its store
  (`rotary.qk_norm_rope`), and against the torch reference (`qkv_rope_reference`);
- the gated dot kernel (`small_m_linear(gated=True)` with a "dot" config): gate_up with
  SiLU-and-mul in the epilogue, against the plain dot product with the same config over all
  2I rows followed by `activation.silu_and_mul`, and against the fp64 reference.

Both fused kernels round as their twins do (the product once, then the rotation or the SiLU
with the same expressions), so in Triton's interpreter (numpy, no FMA contraction) they equal
the twins bit for bit; compiled, the rotation may differ by one rounding step (its fp32
contraction), the gated product not at all (same tiles, same K order). CPU tests run tiny
ragged shapes in the interpreter (conftest sets TRITON_INTERPRET=1 without a GPU); GPU tests
(`pytest -m gpu tests/test_fused_16_rows.py`) run llama-3.1-8b's and SmolLM2-135M's shapes at
5, 8, 13 and 16 rows, in CUDA graphs, and the layers' dispatch with the switch on and off.
"""

from __future__ import annotations

import os

import pytest
import torch

from nanoserve.kernels import linear as klinear
from nanoserve.kernels import qkv_rope, rotary
from nanoserve.kernels.activation import silu_and_mul, silu_and_mul_reference
from nanoserve.kernels.fp8 import dequantize_weight
from nanoserve.kernels.linear import LinearConfig, gated_dot_config
from nanoserve.models.layers import RotaryEmbedding
from nanoserve.models.quantization import quantize_per_channel
from nanoserve.switches import KernelSwitches

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
interp = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (set by conftest without a GPU)")
gpu = pytest.mark.gpu

SENTINEL = 7.0  # what the caches hold before a check: slots not written keep it

# (q heads, kv heads, head_dim, hidden) of the qkv products, and (I, hidden) of the MLPs
LLAMA_QKV, SMOLLM2_QKV = (32, 8, 128, 4096), (9, 3, 64, 576)
LLAMA_MLP, SMOLLM2_MLP = (14336, 4096), (1536, 576)


def ulps(dtype: torch.dtype) -> float:
    return {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}.get(dtype, 2.0**-20)


def check_qkv_rows(
    M, hq, hk, d, K, dtype, device, config, fp8=False, bias=False, cache_dtype=None, exact=True, seed=0
) -> None:
    """`qkv_rope_rows` on M rows (positions drawn in 0..1023, distinct slots, rows 1 and M - 1
    with negative slots) against the unfused pair (bit for bit where `exact`, else within one
    rounding step) and the torch reference; the caches hold the rotated k and v at the kept
    slots and the sentinel everywhere else."""
    cache_dtype = cache_dtype or dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = (hq + 2 * hk) * d
    x = torch.randn(M, K, generator=gen, device=device).to(dtype)
    w = torch.randn(rows, K, generator=gen, device=device) / K**0.5
    b = torch.randn(rows, generator=gen, device=device).to(dtype) if bias else None
    w, s = quantize_per_channel(w) if fp8 else (w.to(dtype), None)
    tables = RotaryEmbedding(d, 1024, 10000.0, None)
    cos, sin = tables.cos.to(device), tables.sin.to(device)
    positions = torch.randint(0, 1024, (M,), generator=gen, device=device)
    pages, page_size = M + 3, 4
    slots = torch.randperm(pages * page_size, generator=gen, device=device)[:M]
    slots[1] = slots[M - 1] = -1  # tokens whose K/V must not be kept (graph padding)
    kc, vc = (torch.full((pages, page_size, hk, d), SENTINEL, device=device).to(cache_dtype) for _ in range(2))
    kc2, vc2 = kc.clone(), vc.clone()

    got = qkv_rope.qkv_rope_rows(x, w, b, config, positions, cos, sin, hq, hk, d, (kc, vc, slots), w_scale=s)
    plain = klinear.small_m_linear(x, w, b, config, w_scale=s)
    q, k, v = plain.view(M, hq + 2 * hk, d).split([hq, hk, hk], 1)
    q2, k2 = rotary.qk_norm_rope(positions, q, k, cos, sin, kv_store=(v, kc2, vc2, slots))
    twin = torch.cat([q2.reshape(M, -1), k2.reshape(M, -1), v.reshape(M, -1)], 1)
    what = f"{config} M={M} {dtype} fp8={fp8} bias={bias} cache={cache_dtype}"
    if exact:
        assert torch.equal(got, twin), f"{what}: not the product + rotary kernel's output"
        assert torch.equal(kc.view(torch.uint8), kc2.view(torch.uint8)), f"{what}: k cache differs"
        assert torch.equal(vc.view(torch.uint8), vc2.view(torch.uint8)), f"{what}: v cache differs"
    else:
        tol = ulps(dtype)
        assert ((got.float() - twin.float()).abs() <= twin.float().abs() * tol + 1e-6).all(), what
        loose = 2 * tol if cache_dtype == dtype else 2.0**-3
        for a, c in ((kc, kc2), (vc, vc2)):
            assert ((a.float() - c.float()).abs() <= c.float().abs() * loose + 1e-3).all(), f"{what}: cache"
    # the cache rows: the kept slots hold row t's k and v (cast to the cache), the rest the sentinel
    kept = slots >= 0
    heads = got.view(M, hq + 2 * hk, d)
    for cache, part in ((kc, heads[:, hq : hq + hk]), (vc, heads[:, hq + hk :])):
        want = torch.full_like(cache, SENTINEL).view(-1, hk, d)
        want[slots[kept]] = part[kept].to(cache_dtype)
        if cache_dtype == dtype:
            assert torch.equal(cache.view(-1, hk, d), want), f"{what}: cache rows"
        elif not INTERPRET:  # fp8 within a step of torch's cast (the interpreter's cast can lose a carry
            # into the exponent, halving a value that rounds up to a power of two; the pair agrees)
            assert ((cache.view(-1, hk, d).float() - want.float()).abs() <= want.float().abs() / 8 + 1e-2).all()
    w_ref = dequantize_weight(w, s, False, torch.float32) if fp8 else w.float()
    ref = qkv_rope.qkv_rope_reference(x, w_ref, b, positions, cos, sin, hq, hk, d)
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    # x_fp8 configs (FP8 weights at 2..8 rows) round x to e4m3 too: cuBLASLt's precision class
    tol = 1e-5 if dtype == torch.float32 else 6e-2 if config.x_fp8 else 2e-2
    assert err < tol, f"{what}: relative error {err:.2e} to the reference"


def check_gated_dot(M, inter, K, dtype, device, config, bias=False, seed=0) -> None:
    """The gated dot kernel against the plain dot product (same config, all 2I rows) + the
    SiLU-and-mul kernel, bit for bit, and the fp64 reference within bf16's roundings."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, generator=gen, device=device).to(dtype)
    w = (torch.randn(2 * inter, K, generator=gen, device=device) / K**0.5).to(dtype)
    b = torch.randn(2 * inter, generator=gen, device=device).to(dtype) if bias else None
    out = torch.full((M, inter), float("nan"), dtype=dtype, device=device)
    got = klinear.small_m_linear(x, w, b, config, out=out, gated=True)
    assert got.data_ptr() == out.data_ptr() and not torch.isnan(out).any(), f"unwritten element ({config})"
    plain = klinear.small_m_linear(x, w, b, config)
    assert torch.equal(out, silu_and_mul(plain)), f"{config} M={M} I={inter} K={K}: not the plain product's"
    ref = silu_and_mul_reference(x.double() @ w.double().T + (0 if b is None else b.double()))
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-6 if dtype == torch.float32 else 2e-2), f"{config} M={M}: relative error {err:.2e}"


# ------------------------------------------------------------------------------ CPU tests


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_qkv_rows_split_k_with_bias(dtype):
    # 5 rows in a 16-row tile; 4 q / 2 kv heads of 16; K = 96 in 2 splits of 64 (the second
    # masked at K); N = 128 over 16-wide tiles
    check_qkv_rows(5, 4, 2, 16, 96, dtype, "cpu", LinearConfig("dot", 16, 16, 32, split_k=2), bias=True, seed=1)


@interp
@pytest.mark.parametrize("cache", ["same", "fp8"])
def test_interp_qkv_rows_three_splits_and_caches(cache):
    # 13 rows, head_dim 32, 3 splits of 32; a bf16 or an fp8 cache
    cache_dtype = torch.float8_e4m3fn if cache == "fp8" else None
    config = LinearConfig("dot", 16, 32, 32, split_k=3)
    check_qkv_rows(13, 4, 2, 32, 96, torch.bfloat16, "cpu", config, cache_dtype=cache_dtype, seed=2)


@interp
def test_interp_qkv_rows_fp8_weights():
    check_qkv_rows(7, 2, 1, 16, 128, torch.bfloat16, "cpu", LinearConfig("dot", 16, 16, 64, split_k=2), fp8=True)


@interp
@pytest.mark.parametrize(
    ("dtype", "M", "inter", "K", "bias"), [(torch.float32, 5, 40, 80, True), (torch.bfloat16, 13, 48, 64, False)]
)
def test_interp_gated_dot(dtype, M, inter, K, bias):
    # I = 40 over 16-wide tiles: the last tile half past I (its up rows must not be read as the
    # next gate rows); K = 80 over 32-deep steps (a masked tail)
    check_gated_dot(M, inter, K, dtype, "cpu", LinearConfig("dot", 16, 16, 32), bias=bias, seed=M)


def test_rules_for_five_to_sixteen_rows():
    """Where the fusions apply: the rule's qkv configs at 5..16 rows are split-K for llama-3.1-8b
    and SmolLM2 (bf16; per-channel FP8 too), so the sum carries the rotation; the gated dot
    kernel takes llama's and SmolLM2's gate_up there, and nothing outside 5..16 rows, in fp32
    or on a short-K product that cuBLAS keeps."""
    bf16 = torch.bfloat16
    for M in range(5, 17):
        for hq, hk, d, k in (LLAMA_QKV, SMOLLM2_QKV):
            assert qkv_rope.fuses_rope_in_sum(klinear.linear_config(M, (hq + 2 * hk) * d, k, bf16)), (M, k)
        assert qkv_rope.fuses_rope_in_sum(klinear.fp8_linear_config(M, 6144, 4096, bf16)), M
        assert gated_dot_config(M, 2 * 14336, 4096, bf16) == LinearConfig("dot", 16, 64, 128, 4, 4)
        assert gated_dot_config(M, 2 * 1536, 576, bf16) == LinearConfig("dot", 16, 16, 64, 4, 4)
        assert gated_dot_config(M, 2 * 3072, 1024, bf16) is None  # qwen3-0.6b: cuBLAS
    for M in (1, 4, 17, 32):
        assert gated_dot_config(M, 2 * 14336, 4096, bf16) is None
    assert gated_dot_config(8, 2 * 14336, 4096, torch.float32) is None
    assert not qkv_rope.fuses_rope_in_sum(None)
    assert not qkv_rope.fuses_rope_in_sum(LinearConfig("dot", 16, 32, 64))  # unsplit: no launch to save
    assert not qkv_rope.fuses_rope_in_sum(klinear.linear_config(1, 6144, 4096, bf16))  # the one-row GEMV's
    assert KernelSwitches().fused_16_rows  # on by default (switches.py gives the measurement)
    assert not KernelSwitches.from_env({"NANOSERVE_FUSED_16_ROWS": "0"}).fused_16_rows


def test_fused_rows_refuse_what_they_cannot_run():
    x, w = torch.zeros(5, 64), torch.zeros(32, 64)  # 2 q / 1 kv heads of 8
    cos = sin = torch.zeros(8, 4)
    split = LinearConfig("dot", 16, 16, 32, split_k=2)
    with pytest.raises(ValueError, match="split-K"):
        qkv_rope.qkv_rope_rows(x, w, None, LinearConfig("dot", 16, 16, 32), torch.zeros(5), cos, sin, 2, 1, 8)
    with pytest.raises(ValueError, match="position per row"):
        qkv_rope.qkv_rope_rows(x, w, None, split, torch.zeros(4), cos, sin, 2, 1, 8)
    with pytest.raises(ValueError, match="unsplit"):
        klinear.small_m_linear(x, w, None, split, gated=True)


def test_fused_kernels_compile_for_hopper():
    """The epilogue and gated dot kernels in their PDL variants at llama-3.1-8b's shapes build
    for sm_90 on the host (tests/hopper_compile.py, in a process of its own): the interpreter
    never compiles them."""
    pytest.importorskip("triton.backends.nvidia")
    from hopper_compile import check_in_own_process

    check_in_own_process("rows16")


@interp
def test_interp_verify_steps_take_the_fused_kernels(tmp_path, monkeypatch):
    """The decoder's path through both fused kernels (forced on the CPU: the interpreter runs
    them; on CUDA the rule's configs decide): speculative verify steps (a draft model, 4 drafts:
    5 rows per request, 15 with three requests) rotate in the qkv product's sum and run
    the gated dot kernel at every layer, and their greedy tokens (fp32) equal those of the
    unfused path (NANOSERVE_FUSED_16_ROWS=0 turns both off; on by default). (The draft model's steps of 2..16
    rows take the qkv fusion too: any forward of that many rows does.)"""
    from nanoserve import LLM, SamplingParams
    from nanoserve.models import layers
    from tests.tiny import first_layer_draft, make_tiny_model, random_prompts

    target = make_tiny_model(tmp_path / "target", "llama")
    draft = first_layer_draft(target, tmp_path / "draft")
    prompts = random_prompts(3, seed=7)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    spec = {"speculative_algorithm": "draft", "speculative_draft_model": str(draft)}
    spec |= {"speculative_num_draft_tokens": 4, "speculative_cost_gate": False}

    def generate():
        llm = LLM(str(target), device="cpu", dtype="float32", enable_prefix_caching=False, **spec)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats()
        assert stats["kv_pages_free"] == stats["kv_pages_total"]
        llm.shutdown()
        return out

    monkeypatch.setenv("NANOSERVE_FUSED_16_ROWS", "1")
    plain = generate()
    rows: dict[str, list[int]] = {"qkv": [], "gated": []}
    real_rows, real_linear = qkv_rope.qkv_rope_rows, klinear.small_m_linear

    def spy_rows(x, *args, **kw):
        rows["qkv"].append(x.shape[0])
        return real_rows(x, *args, **kw)

    def spy_linear(x, weight, bias, config, *args, **kw):
        if kw.get("gated"):
            rows["gated"].append(x.shape[0])
        return real_linear(x, weight, bias, config, *args, **kw)

    def qkv_config(self, x):  # the qkv product's: split-K (K = 64 in 2 splits of 32)
        few = 2 <= x.shape[0] <= 16 and [p.name for p in self.parts] == ["q", "k", "v"]
        return LinearConfig("dot", 16, 16, 32, split_k=2) if few else None

    monkeypatch.setattr(layers.ColumnParallelLinear, "small_m_config", qkv_config)
    monkeypatch.setattr(
        layers.ColumnParallelLinear,
        "_gated_dot_config",
        lambda self, x: LinearConfig("dot", 16, 16, 32) if 5 <= x.shape[0] <= 16 else None,
    )
    monkeypatch.setattr(qkv_rope, "qkv_rope_rows", spy_rows)
    monkeypatch.setattr(layers.linear_kernels, "small_m_linear", spy_linear)
    assert generate() == plain
    for kind, seen in rows.items():  # verify steps of 5..8 rows (graph batch 8) and of 9..16
        assert any(5 <= m <= 8 for m in seen) and any(9 <= m <= 16 for m in seen), (kind, seen)
    rows["qkv"].clear()
    rows["gated"].clear()
    monkeypatch.setenv("NANOSERVE_FUSED_16_ROWS", "0")
    assert generate() == plain
    assert rows == {"qkv": [], "gated": []}


# ------------------------------------------------------------------------------ GPU tests


@gpu
@pytest.mark.parametrize("M", [5, 8, 13, 16])
@pytest.mark.parametrize("shape", ["llama", "smollm2"])
@pytest.mark.parametrize("cache", ["same", "fp8"])
def test_gpu_qkv_rows_model_shapes(M, shape, cache):
    """The rule's split-K qkv config at M rows, bf16 (and llama's per-channel FP8 weights)."""
    hq, hk, d, k = LLAMA_QKV if shape == "llama" else SMOLLM2_QKV
    cache_dtype = torch.float8_e4m3fn if cache == "fp8" else None
    config = klinear.linear_config(M, (hq + 2 * hk) * d, k, torch.bfloat16)
    assert qkv_rope.fuses_rope_in_sum(config), config
    check_qkv_rows(M, hq, hk, d, k, torch.bfloat16, "cuda", config, cache_dtype=cache_dtype, exact=False, seed=M)
    if shape == "llama":
        config = klinear.fp8_linear_config(M, (hq + 2 * hk) * d, k, torch.bfloat16)
        check_qkv_rows(M, hq, hk, d, k, torch.bfloat16, "cuda", config, fp8=True, exact=False, seed=M + 1)


@gpu
@pytest.mark.parametrize("M", [5, 8, 13, 16])
@pytest.mark.parametrize("shape", ["llama", "smollm2"])
def test_gpu_gated_dot_model_shapes(M, shape):
    inter, k = LLAMA_MLP if shape == "llama" else SMOLLM2_MLP
    config = gated_dot_config(M, 2 * inter, k, torch.bfloat16)
    assert config is not None
    check_gated_dot(M, inter, k, torch.bfloat16, "cuda", config, seed=M)


@gpu
@pytest.mark.parametrize("shape", ["llama", "smollm2"])
def test_gpu_layers_in_cuda_graph_switch_on_and_off(shape):
    """A verify-sized batch (8 rows) through the layers as the decoder runs them, captured in a
    CUDA graph under PDL: the attention inputs (rotated in the qkv sum, K/V stored) and the
    MLP's gated product replay equal to eager calls bit for bit, and with NANOSERVE_FUSED_16_ROWS
    off (the sum, rotary and SiLU-and-mul kernels apart) within one bf16 rounding step."""
    from nanoserve.attention.base import KVSink
    from nanoserve.distributed import SINGLE
    from nanoserve.models import layers
    from nanoserve.models.decoder import Attention
    from nanoserve.models.model_config import ModelConfig

    hq, hk, d, hidden = LLAMA_QKV if shape == "llama" else SMOLLM2_QKV
    inter = (LLAMA_MLP if shape == "llama" else SMOLLM2_MLP)[0]
    M, dt, dev = 8, torch.bfloat16, "cuda"
    hf = {"model_type": "llama", "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": 1}
    hf |= {"num_attention_heads": hq, "num_key_value_heads": hk, "head_dim": d, "vocab_size": 256}
    attn = Attention(ModelConfig.from_hf_dict(hf), 0, SINGLE)
    parts = [layers.RowSlice("gate", 0, inter), layers.RowSlice("up", 0, inter)]
    gate_up = layers.ColumnParallelLinear(hidden, parts, bias=False)
    for lin in (attn.qkv_proj, gate_up):
        torch.nn.init.normal_(lin.weight, std=hidden**-0.5)
    attn, gate_up = attn.to(dev, dt), gate_up.to(dev, dt)
    rope = RotaryEmbedding(d, 4096, 500000.0, None).to(dev)
    pages = 64
    kc, vc = (torch.zeros(pages, 16, hk, d, device=dev, dtype=dt) for _ in range(2))
    x = torch.randn(M, hidden, device=dev).to(dt)
    positions = torch.arange(100, 100 + M, device=dev)
    slots = torch.arange(200, 200 + M, device=dev)
    slots[-1] = -1
    sink = KVSink(kc, vc, slots, backend=None)
    assert attn._rotating_qkv(positions, x, rope, sink) is not None and gate_up._gated_config(x) is not None

    def step():
        q, k, v = attn.before_attention(positions, x, rope, sink)
        return q, k, v, gate_up.silu_and_mul(x)

    eager = [t.clone() for t in step()]
    caches = (kc.clone(), vc.clone())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    kc.zero_()
    vc.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(outs, eager)), "replay differs from eager"
    assert torch.equal(kc, caches[0]) and torch.equal(vc, caches[1]), "replayed cache rows differ"
    off = KernelSwitches(fused_16_rows=False)
    layers.apply_switches(attn, off)
    layers.apply_switches(gate_up, off)
    rope.switches = off
    assert attn._rotating_qkv(positions, x, rope, sink) is None and gate_up._gated_config(x) is None
    kc.zero_()
    vc.zero_()
    *apart, mlp = step()
    for a, b in zip(apart, eager):  # the same product; only the rotation's contraction may differ
        assert ((a.float() - b.float()).abs() <= b.float().abs() * 2**-7 + 1e-6).all()
    for a, b in ((kc, caches[0]), (vc, caches[1])):
        assert ((a.float() - b.float()).abs() <= b.float().abs() * 2**-7 + 1e-6).all()
    # the MLP apart: cuBLAS (llama) or the dot kernel (SmolLM2), then SiLU-and-mul; cuBLAS sums
    # in its own order, so a product may round the other way (amplified by the SiLU's slope)
    err = ((mlp.float() - eager[3].float()).norm() / eager[3].float().norm()).item()
    assert err < 1e-2, err
