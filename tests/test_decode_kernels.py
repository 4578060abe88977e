"""The Triton decode kernels of nanoserve/kernels (linear, norm, rotary, activation) against their torch twins.

CPU tests run tiny shapes in Triton's interpreter (conftest sets TRITON_INTERPRET=1 when no
GPU is present); shapes are chosen so that tiles are ragged in every dimension (N and M not
multiples of the block, K not a multiple of BLOCK_K, a head_dim whose half is not a power of
two). GPU tests (`pytest -m gpu tests/test_decode_kernels.py`) use the real decoder shapes of
qwen3-0.6b and llama-3.1-8b, several M and dtypes, every config the dispatch rule can return,
and a CUDA-graph replay.

Every check draws fresh random inputs and poisons the output buffer with NaN first, so an
element the kernel never wrote fails the check.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from nanoserve.kernels.norm import rms_norm_reference
from nanoserve.kernels.rotary import rope_reference
from nanoserve.models.layers import rope_inv_freq

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

interp = pytest.mark.skipif(
    not (HAS_TRITON and INTERPRET), reason="needs triton and TRITON_INTERPRET=1 (set by conftest without a GPU)"
)
gpu = pytest.mark.gpu

# qwen3-0.6b and llama-3.1-8b: (N, K) of qkv, o, gate_up, down and the LM head
QWEN3_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]
LLAMA_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check_linear(M, N, K, dtype, device, config, bias: bool, tol: float, seed: int = 0) -> None:
    from nanoserve.kernels import linear as klinear

    gen = torch.Generator(device=device).manual_seed(seed)  # drawn where they are used: LM heads are large
    x = torch.randn(M, K, generator=gen, device=device).to(dtype)
    w = (torch.randn(N, K, generator=gen, device=device) / K**0.5).to(dtype)
    b = torch.randn(N, generator=gen, device=device).to(dtype) if bias else None
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=device)
    got = klinear.small_m_linear(x, w, b, config, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert not torch.isnan(out).any(), f"unwritten element ({config})"
    err = rel_err(out, ref)
    assert err < tol, f"{config} M={M} N={N} K={K} {dtype}: relative error {err:.2e}"
    err = rel_err(out, klinear.linear_reference(x, w, b))  # the torch reference beside the kernel
    assert err < tol, f"{config} M={M} N={N} K={K} {dtype}: relative error {err:.2e} to linear_reference"


def make_qk(tokens, num_q, num_k, head_dim, dtype, device, seed, max_pos=64):
    """q, k as column views of one fused qkv projection, positions, cos/sin tables, norm weights."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    width = (num_q + 2 * num_k) * head_dim
    qkv = (3 * torch.randn(tokens, width, generator=gen)).to(device, dtype)
    q, k, _ = qkv.split([num_q * head_dim, num_k * head_dim, num_k * head_dim], dim=1)
    q, k = q.view(tokens, num_q, head_dim), k.view(tokens, num_k, head_dim)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(device)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), rope_inv_freq(head_dim, 10000.0, None))
    cos, sin = freqs.cos().to(device), freqs.sin().to(device)
    qw = (1 + 0.1 * torch.randn(head_dim, generator=gen)).to(device, dtype)
    kw = (1 + 0.1 * torch.randn(head_dim, generator=gen)).to(device, dtype)
    return q, k, positions, cos, sin, qw, kw


def check_qk_norm_rope(tokens, num_q, num_k, head_dim, dtype, device, norm: bool, tol: float, seed=0) -> None:
    from nanoserve.kernels import rotary as krotary

    eps = 1e-6
    q, k, pos, cos, sin, qw, kw = make_qk(tokens, num_q, num_k, head_dim, dtype, device, seed)

    def torch_twin(q, k, qw, kw, cos, sin):
        if norm:
            q, k = rms_norm_reference(q, qw, eps), rms_norm_reference(k, kw, eps)
        return rope_reference(pos, q, k, cos, sin)

    twin = torch_twin(q, k, qw, kw, cos, sin)
    exact = torch_twin(*(t.double() for t in (q, k, qw, kw, cos, sin)))
    got = krotary.qk_norm_rope(pos, q, k, cos, sin, *((qw, kw, eps) if norm else ()))
    for g, t, e in zip(got, twin, exact):
        assert g.shape == t.shape and g.dtype == dtype and g.is_contiguous()
        assert not torch.isnan(g).any()
        assert rel_err(g, e) < tol, f"relative error {rel_err(g, e):.2e} against float64"
        assert rel_err(g, t) < tol, f"relative error {rel_err(g, t):.2e} against the torch twin"


def check_qk_norm_rope_store(tokens, num_q, num_k, head_dim, dtype, device, cache_dtype, seed=0) -> None:
    """With kv_store the launch also writes the rotated k and v into their cache slots: q/k
    outputs unchanged, the slots hold exactly what attention's store (a cast of k and v)
    would write, a negative slot and every other slot untouched."""
    from nanoserve.kernels import rotary as krotary

    q, k, pos, cos, sin, qw, kw = make_qk(tokens, num_q, num_k, head_dim, dtype, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    rows = torch.randn(tokens, 2 * num_k * head_dim, generator=gen).to(device, dtype)
    v = rows[:, : num_k * head_dim].view(tokens, num_k, head_dim)  # a strided view, as qkv's slice
    page_size, pages = 4, tokens + 2
    k_cache = torch.full((pages, page_size, num_k, head_dim), 7.0, device=device).to(cache_dtype)
    v_cache = k_cache.clone()
    slots = torch.randperm(pages * page_size, generator=gen)[:tokens].to(device)
    slots[tokens // 2] = -1  # a token whose K/V must not be kept
    plain = krotary.qk_norm_rope(pos, q, k, cos, sin, qw, kw, 1e-6)
    got = krotary.qk_norm_rope(pos, q, k, cos, sin, qw, kw, 1e-6, kv_store=(v, k_cache, v_cache, slots))
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])
    kept = slots >= 0
    want_k, want_v = torch.full_like(k_cache, 7.0), torch.full_like(v_cache, 7.0)
    want_k.view(-1, num_k, head_dim)[slots[kept]] = plain[1][kept].to(cache_dtype)
    want_v.view(-1, num_k, head_dim)[slots[kept]] = v[kept].to(cache_dtype)
    assert torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))


# ------------------------------------------------------------------------------ CPU tests


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_gemv_ragged(dtype):
    from nanoserve.kernels.linear import LinearConfig

    # N = 10 over blocks of 4, K = 80 over blocks of 32 (masked tail), with a bias
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    check_linear(1, 10, 80, dtype, "cpu", LinearConfig("fma", 1, 4, 32), bias=True, tol=tol, seed=1)


@interp
def test_interp_fma_several_rows():
    from nanoserve.kernels.linear import LinearConfig

    # M = 3 in a block of 2 (two row blocks, the second half empty), even K
    check_linear(3, 12, 64, torch.float32, "cpu", LinearConfig("fma", 2, 8, 32), bias=False, tol=1e-5, seed=2)


@interp
@pytest.mark.parametrize("K", [64, 40])
def test_interp_dot_kernel(K):
    from nanoserve.kernels.linear import LinearConfig

    # M = 5 padded to 16, N = 20 over blocks of 16
    check_linear(5, 20, K, torch.float32, "cpu", LinearConfig("dot", 16, 16, 16), bias=True, tol=1e-5, seed=3)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_qk_norm_rope(dtype):
    # bf16: the interpreter truncates fp32 -> bf16 instead of rounding (twice the error of
    # the compiled kernel, which the GPU tests hold to 1e-2)
    tol = 1e-5 if dtype == torch.float32 else 2.5e-2
    check_qk_norm_rope(3, 6, 2, 16, dtype, "cpu", norm=True, tol=tol, seed=4)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_qk_norm_rope_stores_kv(dtype):
    check_qk_norm_rope_store(6, 6, 3, 16, dtype, "cpu", dtype, seed=3)


@interp
def test_interp_rope_only_odd_half():
    # head_dim 24: half 12 is not a power of two (masked lanes); 5 q heads over blocks of 4
    check_qk_norm_rope(2, 5, 1, 24, torch.float32, "cpu", norm=False, tol=1e-5, seed=5)


def test_pdl_decode_kernels_compile_for_hopper():
    """The rotary and decode attention kernels in their PDL variants (which read step inputs
    before the wait, on branches the interpreter never compiles) build for sm_90 on the host
    (tests/hopper_compile.py, in a process of its own: this one runs the interpreter). A v
    branch reading a slot loaded only under STORE_KV once passed every interpreter test and
    failed to compile on the GPU."""
    pytest.importorskip("triton.backends.nvidia")
    from hopper_compile import check_in_own_process

    check_in_own_process("decode")


def test_linear_rule_declines_what_it_cannot_run():
    from nanoserve.kernels.linear import MAX_M, linear_config

    assert linear_config(1, 4096, 1024, torch.float32) is None  # fp32: cuBLAS (exactness path)
    assert linear_config(MAX_M + 1, 4096, 1024, torch.bfloat16) is None  # prefill-sized M
    assert linear_config(0, 4096, 1024, torch.bfloat16) is None
    assert linear_config(1, 4096, 1001, torch.bfloat16) is None  # rows not 16-byte aligned
    assert linear_config(64, 1024, 2056, torch.bfloat16) is None  # K not a whole number of split blocks


def test_gemv_rule_pipelines_only_loops_of_several_steps():
    """M = 1 (bf16 and per-channel FP8): a K loop of one step is never pipelined; narrow outputs
    (1024-2048) and vocabulary projections take the deeper loops they were measured with; below
    1024 outputs the 2-row tiles stay."""
    from nanoserve.kernels.linear import fp8_linear_config, linear_config

    for n, k in QWEN3_SHAPES + LLAMA_SHAPES + [(5120, 2048), (2048, 4096), (128, 2048), (49152, 576), (2880, 4096)]:
        for c in (linear_config(1, n, k, torch.bfloat16), fp8_linear_config(1, n, k, torch.bfloat16)):
            assert c.kernel == "fma" and c.block_m == 1, (n, k, c)
            assert c.num_stages == 1 or k > c.block_k, (n, k, c)
    assert linear_config(1, 2048, 4096, torch.bfloat16).num_stages == 6  # qwen3-30b-a3b o_proj
    assert linear_config(1, 128, 2048, torch.bfloat16).block_n == 2  # its router
    assert linear_config(1, 128256, 4096, torch.bfloat16).block_n == 16  # llama's LM head
    assert linear_config(1, 6144, 4096, torch.bfloat16).num_stages == 3
    oss_o = linear_config(1, 2880, 4096, torch.bfloat16)  # gpt-oss's o_proj: 2-row tiles, 6 stages
    assert (oss_o.block_n, oss_o.block_k, oss_o.num_stages) == (2, 1024, 6)
    assert linear_config(1, 3840, 4096, torch.bfloat16).block_n == 4  # gemma-3-12b's keeps the 4-row rule


def test_linear_rule_above_eight_rows():
    """M = 9..256: split-K only on the narrow matrices it was measured faster on (qwen3 o_proj,
    down), the dot kernel on qwen3's LM head up to 32 rows, cuBLAS for the rest and for every
    llama-3.1-8b shape above 16 rows (not measured there); every split config divides K into
    whole blocks."""
    from nanoserve.kernels.linear import MAX_M, linear_config

    qkv, o_proj, gate_up, down, lm_head = QWEN3_SHAPES
    for M in range(17, MAX_M + 1):
        for n, k in LLAMA_SHAPES + SMOLLM2_SHAPES + [qkv, gate_up]:
            assert linear_config(M, n, k, torch.bfloat16) is None, (M, n, k)
    for M in range(9, MAX_M + 1):
        for n, k in [qkv, gate_up]:
            assert linear_config(M, n, k, torch.bfloat16) is None, (M, n, k)
        for n, k in (o_proj, down):
            c = linear_config(M, n, k, torch.float16)
            assert c is not None and c.kernel == "dot" and c.split_k > 1 and k % (c.split_k * c.block_k) == 0
        c = linear_config(M, *lm_head, torch.bfloat16)
        assert (c is not None and c.split_k == 1 and c.block_m >= 16) == (M <= 32)


def test_linear_rule_five_to_sixteen_rows():
    """M = 5..16 (verify steps' rows): split-K 16-row tiles on llama-3.1-8b's qkv, o_proj and
    down and on SmolLM2's narrow matrices, the unsplit tile on SmolLM2's gate_up, cuBLAS on
    llama's gate_up and both LM heads below 65536 columns' rule; splits divide K into whole
    blocks (K = 576: three of 192)."""
    from nanoserve.kernels.linear import linear_config

    for M in range(5, 17):
        for n, k in LLAMA_SHAPES[:2] + LLAMA_SHAPES[3:4] + SMOLLM2_SHAPES[:4]:
            c = linear_config(M, n, k, torch.bfloat16)
            assert c is not None and c.kernel == "dot" and c.block_m == 16, (M, n, k, c)
            assert k % (c.split_k * c.block_k) == 0 and (c.split_k > 1) == (n <= 1024 or k >= 4096), (M, n, k, c)
        assert linear_config(M, *LLAMA_SHAPES[2], torch.bfloat16) is None
        assert linear_config(M, *SMOLLM2_SHAPES[4], torch.bfloat16) is None
    assert linear_config(16, 576, 576, torch.bfloat16).split_k == 3
    assert linear_config(4, 576, 576, torch.bfloat16).kernel == "fma"  # M <= 4: the 2-row tiles stay


def split_k_case(M, N, K, dtype, seed, bias: bool):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    return x, w, b


@interp
@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("bias", [True, False])
def test_interp_split_k(split, bias):
    """The dot kernel split along K against the exact product (fp32 inputs: fp32 math): M = 20
    over blocks of 16, N = 20 over blocks of 16, K = 200 over 32-wide blocks (the last split is
    masked at K; with 4 splits of 64, the last holds 8 columns). Repeat runs are bit-identical
    and a row's result does not depend on the other rows of the batch."""
    from nanoserve.kernels import linear as klinear
    from nanoserve.kernels.linear import LinearConfig

    config = LinearConfig("dot", 16, 16, 32, split_k=split)
    x, w, b = split_k_case(20, 20, 200, torch.float32, seed=20 + split, bias=bias)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    out = torch.full((20, 20), float("nan"))
    klinear.small_m_linear(x, w, b, config, out=out)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < 1e-6, f"split {split}: relative error {rel_err(out, ref):.2e}"
    assert torch.equal(klinear.small_m_linear(x, w, b, config), out)
    assert torch.equal(klinear.small_m_linear(x[:5], w, b, config), out[:5])


@interp
def test_interp_split_k_bf16_sums_in_fp32():
    """bf16 inputs, 4 splits: with a bf16 output each element is rounded once (equal to the
    exact sum rounded, up to the interpreter truncating instead of rounding); with an fp32
    output the summed partials come back unrounded (the TP row-parallel path)."""
    from nanoserve.kernels import linear as klinear
    from nanoserve.kernels.linear import LinearConfig

    config = LinearConfig("dot", 16, 32, 64, split_k=4)
    x, w, b = split_k_case(7, 40, 512, torch.bfloat16, seed=30, bias=True)
    exact = x.double() @ w.double().T + b.double()
    fp32 = klinear.small_m_linear(x, w, b, config, out=torch.empty(7, 40))
    assert rel_err(fp32, exact) < 1e-6
    rounded = klinear.small_m_linear(x, w, b, config)
    assert rounded.dtype == torch.bfloat16
    assert ((rounded.double() - exact).abs() <= exact.abs() * 2**-7 + 1e-6).all()


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [2, 4])
def test_interp_split_k_partials_summed_by_rms_norm(dtype, split):
    """A split-K product's unsummed partials handed to rms_norm (which adds the planes in
    split order, rounds once, then adds the residual and normalises) give exactly what the
    product's own sum kernel followed by rms_norm gives: outputs and the residual sum."""
    from nanoserve.kernels import linear as klinear
    from nanoserve.kernels import norm as knorm
    from nanoserve.kernels.linear import LinearConfig

    config = LinearConfig("dot", 16, 16, 32, split_k=split)
    x, w, _ = split_k_case(5, 48, 256, dtype, seed=40 + split, bias=False)
    gen = torch.Generator().manual_seed(split)
    residual = torch.randn(5, 48, generator=gen).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(48, generator=gen)).to(dtype)
    planes = klinear.small_m_linear(x, w, None, config, partials_only=True)
    assert planes.shape == (split, 5, 48) and planes.dtype == torch.float32
    fused, fused_sum = knorm.rms_norm(planes, norm_w, 1e-6, residual)
    product = klinear.small_m_linear(x, w, None, config)
    twin, twin_sum = knorm.rms_norm(product, norm_w, 1e-6, residual)
    assert fused.dtype == dtype and torch.equal(fused, twin) and torch.equal(fused_sum, twin_sum)
    with pytest.raises(ValueError, match="partials_only"):
        klinear.small_m_linear(x, w, None, LinearConfig("dot", 16, 16, 32), partials_only=True)


def test_split_k_only_for_the_dot_kernel():
    from nanoserve.kernels import linear as klinear
    from nanoserve.kernels.linear import LinearConfig

    x, w, _ = split_k_case(2, 8, 64, torch.float32, seed=0, bias=False)
    for bad in (LinearConfig("fma", 2, 8, 32, split_k=2), LinearConfig("dot", 16, 16, 32, split_k=0)):
        with pytest.raises(ValueError, match="split_k"):
            klinear.small_m_linear(x, w, None, bad)


def capture(step):
    """`step` warmed up once (compiles), then captured in a CUDA graph: (graph, its outputs)."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    return graph, outs


def ulps(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|got - ref| in units of the last place of ref in ref's dtype (bf16: 8 significant bits)."""
    bits = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[ref.dtype]
    tiny = torch.finfo(ref.dtype).tiny
    unit = torch.exp2(torch.floor(torch.log2(ref.double().abs().clamp_min(tiny))) - (bits - 1))
    return (got.double() - ref.double()).abs() / unit


def check_silu_and_mul(M, inter, dtype, device, max_ulps: float, seed: int, strided: bool = False) -> torch.Tensor:
    """The Triton silu_and_mul against layers.silu_and_mul_reference; returns the fraction of
    elements that differ. `strided`: gate_up is a column slice of a wider tensor."""
    from nanoserve.kernels import activation as kact
    from nanoserve.kernels.activation import silu_and_mul_reference

    gen = torch.Generator(device=device).manual_seed(seed)
    wide = (3 * torch.randn(M, 2 * inter + (16 if strided else 0), generator=gen, device=device)).to(dtype)
    gate_up = wide[:, : 2 * inter]
    out = torch.full((M, inter), float("nan"), dtype=dtype, device=device)
    got = kact.silu_and_mul(gate_up, out=out)
    assert got.data_ptr() == out.data_ptr() and not torch.isnan(out).any()
    ref = silu_and_mul_reference(gate_up)
    worst = ulps(out, ref).max().item()
    assert worst <= max_ulps, f"M={M} I={inter} {dtype}: {worst} units in the last place"
    fresh = kact.silu_and_mul(gate_up)
    assert fresh.shape == (M, inter) and fresh.dtype == dtype and torch.equal(fresh, out)
    return (out != ref).float().mean().item()


@interp
@pytest.mark.parametrize(
    ("dtype", "max_ulps"),
    # fp32: exp may differ by an ulp; fp16: one rounding; bf16: the interpreter truncates
    # fp32 -> bf16 instead of rounding (compiled kernels round: the GPU test allows 2)
    [(torch.float32, 4), (torch.float16, 2), (torch.bfloat16, 4)],
)
@pytest.mark.parametrize(("M", "inter", "strided"), [(4, 200, False), (2, 64, True)])
def test_interp_silu_and_mul(dtype, max_ulps, M, inter, strided):
    differ = check_silu_and_mul(M, inter, dtype, "cpu", max_ulps, seed=M + inter, strided=strided)
    if dtype == torch.float16:
        # the interpreter rounds fp16 correctly: the same two roundings as the reference give
        # the same values (rounding once, after the product, changed 27% of them)
        assert differ <= 0.01, f"{differ:.1%} of the elements differ from the reference"


def test_silu_and_mul_rejects_bad_shapes():
    from nanoserve.kernels import activation as kact

    with pytest.raises(ValueError, match="dense last dim"):
        kact.silu_and_mul(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="out must be"):
        kact.silu_and_mul(torch.zeros(2, 8), out=torch.zeros(2, 8))


# ------------------------------------------------------------------------------ GPU tests


def rule_configs():
    from nanoserve.kernels.linear import MAX_M, linear_config

    seen = {}
    for n, k in QWEN3_SHAPES + LLAMA_SHAPES + SMOLLM2_SHAPES:
        for m in range(1, MAX_M + 1):
            c = linear_config(m, n, k, torch.bfloat16)
            if c is not None:
                seen.setdefault(c, (m, n, k))
    return seen


@gpu
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 9, 16, 32, 48, 64, 100, 128, 192, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_rule_on_model_shapes(M, dtype):
    from nanoserve.kernels.linear import linear_config

    for i, (n, k) in enumerate(QWEN3_SHAPES + LLAMA_SHAPES + SMOLLM2_SHAPES):
        config = linear_config(M, n, k, dtype)
        if config is not None:
            check_linear(M, n, k, dtype, "cuda", config, bias=(i % 2 == 0), tol=1e-2, seed=10 * M + i)


@gpu
def test_gpu_every_rule_config_and_both_kernels():
    from nanoserve.kernels.linear import LinearConfig

    configs = dict(rule_configs())
    configs[LinearConfig("fma", 4, 4, 256)] = (3, 1000, 1032)  # ragged N, K not a multiple of 256
    configs[LinearConfig("dot", 16, 64, 128, num_stages=3)] = (7, 999, 1000)
    # 3 splits of 384 over K = 1000: the last split masked at K
    configs[LinearConfig("dot", 16, 64, 128, num_stages=3, split_k=3)] = (37, 999, 1000)
    for j, (config, (m, n, k)) in enumerate(configs.items()):
        for M in sorted({1, m, m + 1}):  # a 1-row config on M > 1 runs a program per row
            check_linear(M, n, k, torch.bfloat16, "cuda", config, bias=True, tol=1e-2, seed=100 + j)


@gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_gemv_pipelined_loop_bit_equal(fp8):
    """A pipelined K loop (num_stages > 1: loads moved ahead through shared memory) computes the
    same products in the same order as the plain loop: bit-equal outputs, bf16 and per-channel
    FP8 weights, for whole and ragged last K steps and a loop of one step."""
    from nanoserve.kernels import linear as klinear
    from nanoserve.models.quantization import quantize_per_channel

    for j, (n, k, bn, bk) in enumerate(
        [(6144, 4096, 4, 1024), (2048, 4096, 4, 1024), (4099, 1000, 8, 256), (1024, 1024, 4, 1024)]
    ):
        gen = torch.Generator(device="cuda").manual_seed(j)
        x = torch.randn(1, k, generator=gen, device="cuda").bfloat16()
        w = (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).bfloat16()
        w, s = quantize_per_channel(w) if fp8 else (w, None)
        outs = [
            klinear.small_m_linear(x, w, None, klinear.LinearConfig("fma", 1, bn, bk, 2, stages), w_scale=s)
            for stages in (1, 3, 6)
        ]
        ref = x.float() @ (w.float() * s[:, None] if fp8 else w.float()).t()
        assert rel_err(outs[0], ref) < 1e-2
        assert all(torch.equal(o, outs[0]) for o in outs[1:]), (n, k)


@gpu
def test_gpu_split_k_deterministic_batch_invariant_fp32_out():
    """The rule's split-K configs on qwen3 o_proj and down: repeat runs bit-identical, the
    first rows of a batch equal to the same rows run alone with the same config, and with an
    fp32 output the unrounded sum (fp32 accuracy against the exact product)."""
    from nanoserve.kernels import linear as klinear

    for j, (n, k) in enumerate(QWEN3_SHAPES[1::2]):  # o_proj, down
        for M in (16, 64, 128, 256):
            config = klinear.linear_config(M, n, k, torch.bfloat16)
            assert config is not None and config.split_k > 1
            gen = torch.Generator(device="cuda").manual_seed(M + j)
            x = torch.randn(M, k, generator=gen, device="cuda").bfloat16()
            w = (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).bfloat16()
            out = klinear.small_m_linear(x, w, None, config)
            assert torch.equal(out, klinear.small_m_linear(x, w, None, config))
            assert torch.equal(out[:9], klinear.small_m_linear(x[:9], w, None, config))
            fp32 = klinear.small_m_linear(x, w, None, config, out=torch.empty(M, n, device="cuda"))
            assert rel_err(fp32, x.double() @ w.double().T) < 1e-5
            assert torch.equal(fp32.bfloat16(), out)  # one rounding of the same fp32 sum


@gpu
@pytest.mark.parametrize("M", [1, 16, 256, 3000])
@pytest.mark.parametrize("inter", [3072, 14336, 1000])
def test_gpu_silu_and_mul(M, inter):
    """bf16 against layers.silu_and_mul_reference (torch's CUDA silu, then the product): expf and
    division as torch computes them, so at most 1% of the elements may differ (by at most two
    units in the last place: one intermediate rounding the other way)."""
    differ = check_silu_and_mul(M, inter, torch.bfloat16, "cuda", 2, seed=M + inter, strided=M == 16)
    assert differ <= 0.01, f"{differ:.2%} of the elements differ from the reference"


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_silu_and_mul_other_dtypes(dtype):
    differ = check_silu_and_mul(64, 3072, dtype, "cuda", 2, seed=3)
    assert differ <= 0.01


@gpu
@pytest.mark.parametrize("pdl", [True, False])
def test_gpu_mlp_graph_replay(pdl):
    """qwen3's MLP at a decode batch of 64 rows, captured in a CUDA graph: gate_up (cuBLAS) ->
    SiLU-and-mul (Triton) -> down (the rule's split-K: product + ordered sum, both under PDL
    when on). Every replay on fresh inputs equals an eager call bit for bit and the torch
    reference within bf16 tolerance."""
    from nanoserve.kernels.activation import silu_and_mul_reference
    from nanoserve.kernels.linear import linear_config
    from nanoserve.models import layers
    from nanoserve.switches import KernelSwitches

    dev = "cuda"
    switches = KernelSwitches(pdl=pdl)
    M, hidden, inter = 64, 1024, 3072
    assert linear_config(M, hidden, inter, torch.bfloat16).split_k > 1
    x = torch.randn(M, hidden, device=dev).bfloat16()
    w_gate_up = (torch.randn(2 * inter, hidden, device=dev) / hidden**0.5).bfloat16()
    w_down = (torch.randn(hidden, inter, device=dev) / inter**0.5).bfloat16()

    def step():
        gate_up = layers.linear(x, w_gate_up, switches=switches)
        return layers.linear(layers.silu_and_mul(gate_up, switches), w_down, switches=switches)

    def reference():
        return F.linear(silu_and_mul_reference(F.linear(x, w_gate_up)), w_down)

    graph, out = capture(step)
    for trial in range(5):
        x.copy_(torch.randn_like(x))
        graph.replay()
        err = rel_err(out, reference())
        assert err < 1e-2, f"replay {trial}: relative error {err:.2e}"
        assert torch.equal(out, step()), f"replay {trial} differs from eager"


@gpu
@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("heads", [(16, 8), (32, 8)])
@pytest.mark.parametrize("norm", [True, False])
def test_gpu_qk_norm_rope(tokens, heads, norm):
    check_qk_norm_rope(tokens, *heads, 128, torch.bfloat16, "cuda", norm=norm, tol=1e-2, seed=tokens)


@gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("tokens", [1, 37, 256])
def test_gpu_qk_norm_rope_stores_kv(cache_dtype, tokens):
    check_qk_norm_rope_store(tokens, 16, 8, 128, torch.bfloat16, "cuda", cache_dtype, seed=tokens)


@gpu
def test_gpu_layers_dispatch_matches_torch_twins():
    """The layers' CUDA dispatch (Triton) against the same layers with the kernels off."""
    from nanoserve.models import layers
    from nanoserve.models.layers import RMSNorm, RotaryEmbedding
    from nanoserve.switches import KernelSwitches

    off = KernelSwitches(triton_ops=False)
    torch.manual_seed(0)
    dev = "cuda"
    w = (torch.randn(4096, 1024, device=dev) / 32).bfloat16()
    rot = RotaryEmbedding(128, 4096, 1e6, None).to(dev)
    qn, kn = RMSNorm(128, 1e-6).to(dev, torch.bfloat16), RMSNorm(128, 1e-6).to(dev, torch.bfloat16)
    with torch.no_grad():
        qn.weight.uniform_(0.8, 1.2), kn.weight.uniform_(0.8, 1.2)
    for M in (1, 4, 64):
        x = torch.randn(M, 1024, device=dev).bfloat16()
        qkv = layers.linear(x, w)
        assert rel_err(qkv, F.linear(x, w)) < 1e-2
        q, k = qkv[:, :2048].view(M, 16, 128), qkv[:, 2048:3072].view(M, 8, 128)
        pos = torch.randint(0, 4096, (M,), device=dev)
        fast = rot(pos, q, k, qn, kn)
        for module in (rot, qn, kn):
            module.switches = off
        slow = rot(pos, q, k, qn, kn)
        for module in (rot, qn, kn):
            del module.switches  # back to the class default (kernels on)
        for a, b in zip(fast, slow):
            assert rel_err(a, b) < 1e-2
        gate_up = torch.randn(M, 2 * 3072, device=dev).bfloat16()
        fast = layers.silu_and_mul(gate_up)
        slow = layers.silu_and_mul(gate_up, off)
        assert rel_err(fast, slow) < 1e-2
        assert rel_err(layers.silu_and_mul(gate_up.view(M, 1, -1)).view(M, -1), slow) < 1e-2  # 3-D: torch path


@gpu
def test_gpu_split_k_sum_in_norm_matches_sum_kernel():
    """On one GPU a split-K row-parallel product (qwen3 o_proj / down at 9..256 rows) hands its
    partials to the next RMSNorm: bit-identical to the sum kernel + norm, in a graph too."""
    from nanoserve.models.layers import RMSNorm, RowParallelLinear, SplitKPartials
    from nanoserve.switches import KernelSwitches

    in_norm, own_sum = KernelSwitches(split_sum_in_norm=True), KernelSwitches(split_sum_in_norm=False)
    torch.manual_seed(1)
    dev = "cuda"
    for K in (2048, 3072):
        lin = RowParallelLinear(K, 1024, bias=False).to(dev, torch.bfloat16)
        norm = RMSNorm(1024, 1e-6).to(dev, torch.bfloat16)
        with torch.no_grad():
            lin.weight.normal_(0, K**-0.5), norm.weight.uniform_(0.8, 1.2)
        for M in (9, 64, 200, 256):
            x = torch.randn(M, K, device=dev).bfloat16()
            residual = torch.randn(M, 1024, device=dev).bfloat16()
            lin.switches = in_norm
            partials = lin(x)
            assert isinstance(partials, SplitKPartials), (K, M)
            fused = norm(partials, residual)
            lin.switches = own_sum
            product = lin(x)
            assert isinstance(product, torch.Tensor)
            twin = norm(product, residual)
            assert torch.equal(fused[0], twin[0]) and torch.equal(fused[1], twin[1]), (K, M)
            lin.switches = in_norm
            graph = torch.cuda.CUDAGraph()
            lin(x), norm(lin(x), residual)  # compile outside the capture
            with torch.cuda.graph(graph):
                captured = norm(lin(x), residual)
            x.copy_(torch.randn_like(x))
            graph.replay()
            lin.switches = own_sum
            twin = norm(lin(x), residual)
            assert torch.equal(captured[0], twin[0]) and torch.equal(captured[1], twin[1]), (K, M)


@gpu
@pytest.mark.parametrize("pdl", [True, False])
def test_gpu_graph_replay_chain(pdl):
    """add + RMSNorm -> qkv GEMV -> q/k norm + rotary, captured in a CUDA graph (with PDL,
    each kernel starts before the previous one ends): every replay on fresh inputs equals
    the torch reference of those inputs (a kernel reading its input too early would see
    the previous replay's values) and an eager call bit for bit."""
    from nanoserve.kernels import linear as klinear
    from nanoserve.kernels import norm as knorm
    from nanoserve.kernels import rotary as krotary
    from nanoserve.kernels.norm import add_rms_norm_reference

    dev = "cuda"
    h = torch.randn(1, 1024, device=dev).bfloat16()
    res = torch.randn(1, 1024, device=dev).bfloat16()
    nw = (1 + 0.1 * torch.randn(1024, device=dev)).bfloat16()
    w = (torch.randn(4096, 1024, device=dev) / 32).bfloat16()
    _, _, pos, cos, sin, qw, kw = make_qk(1, 16, 8, 128, torch.bfloat16, dev, seed=7, max_pos=64)
    config = klinear.linear_config(1, 4096, 1024, torch.bfloat16)

    def step():
        normed, total = knorm.rms_norm(h, nw, 1e-6, res, pdl=pdl)
        qkv = klinear.small_m_linear(normed, w, None, config, pdl=pdl)
        q, k = qkv[:, :2048].view(1, 16, 128), qkv[:, 2048:3072].view(1, 8, 128)
        return (total, qkv, *krotary.qk_norm_rope(pos, q, k, cos, sin, qw, kw, pdl=pdl))

    def reference():
        normed, total = add_rms_norm_reference(h, res, nw, 1e-6)
        qkv = F.linear(normed, w)
        q, k = qkv[:, :2048].view(1, 16, 128), qkv[:, 2048:3072].view(1, 8, 128)
        q, k = rope_reference(pos, rms_norm_reference(q, qw, 1e-6), rms_norm_reference(k, kw, 1e-6), cos, sin)
        return total, qkv, q, k

    graph, outs = capture(step)
    for trial in range(5):
        h.copy_(torch.randn_like(h))
        res.copy_(torch.randn_like(res))
        pos.copy_(torch.randint(0, 64, pos.shape, device=dev))
        graph.replay()
        for a, b in zip(outs, reference()):
            assert rel_err(a, b) < 2e-2, f"replay {trial}: relative error {rel_err(a, b):.2e}"
        for a, b in zip(outs, step()):
            assert torch.equal(a, b), f"replay {trial} differs from eager"


@gpu
def test_gpu_engine_greedy_kernels_on_vs_off():
    """Dummy qwen3-0.6b in bf16, batch-1 decode (every linear a GEMV, q/k norm + rotary
    fused, SiLU in the gate_up GEMV), in batch-1 graphs (the same kernels as eager, bit for
    bit; graphs make 192 prompts affordable): greedy tokens with the Triton decode kernels on
    vs off. The two sum in different orders, so runs may part at a bf16 near-tie: each
    divergent token must be in the other run's top-5, and the kernels' run must stay as close
    to the fp32 output (kernels off) as the run without them (the bf16 bar of
    test_gpu_fastpath.py)."""
    from nanoserve import LLM, SamplingParams
    from nanoserve.switches import KernelSwitches
    from tests.test_gpu_fastpath import assert_as_close_to_fp32, compare, make_prompts

    # closeness to fp32 is a mean over prompts: 16 and 48 left it within noise (82% and 85%
    # of the twin's on an H200, 2026-11-27, where the bar is 90%); 192 gave 94% (H100)
    prompts = make_prompts(192, seed=7)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    runs = {}
    for ops, dtype in ((True, "bfloat16"), (False, "bfloat16"), (False, "float32")):
        llm = LLM(
            "qwen3-0.6b", load_format="dummy", dtype=dtype, max_model_len=512, kv_cache_tokens=16384,
            max_num_seqs=1, cuda_graph_max_bs=1, overlap_schedule=False, switches=KernelSwitches(triton_ops=ops),
        )  # fmt: skip
        with torch.inference_mode():
            outs = llm.generate(prompts, params, use_tqdm=False)
        runs[ops, dtype] = (
            [o.outputs[0].token_ids for o in outs],
            [[lp.top for lp in o.outputs[0].logprobs] for o in outs],
        )
        del llm
    on, off = runs[True, "bfloat16"], runs[False, "bfloat16"]
    compare(on, off, "Triton decode kernels on vs off", min_identical=0.0)
    assert_as_close_to_fp32(on, off, runs[False, "float32"], "Triton decode kernels on vs off")


def check_rms_norm(tokens, n, dtype, device, residual: bool, tol: float, seed=0) -> None:
    from nanoserve.kernels import norm as knorm
    from nanoserve.kernels.norm import add_rms_norm_reference

    gen = torch.Generator(device=device).manual_seed(seed)
    x = (3 * torch.randn(tokens, n, generator=gen, device=device)).to(dtype)
    r = torch.randn(tokens, n, generator=gen, device=device).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=gen, device=device)).to(dtype)
    eps = 1e-6
    if residual:
        got, got_sum = knorm.rms_norm(x, w, eps, r)
        twin, twin_sum = add_rms_norm_reference(x, r, w, eps)
        assert torch.equal(got_sum, twin_sum)  # one rounding of the same sum
        exact = rms_norm_reference((x.double() + r.double()), w.double(), eps)
    else:
        got = knorm.rms_norm(x, w, eps)
        twin = rms_norm_reference(x, w, eps)
        exact = rms_norm_reference(x.double(), w.double(), eps)
    assert got.shape == x.shape and got.dtype == dtype and not torch.isnan(got).any()
    assert rel_err(got, exact) < tol, f"relative error {rel_err(got, exact):.2e} against float64"
    assert rel_err(got, twin) < tol, f"relative error {rel_err(got, twin):.2e} against the torch twin"


@interp
@pytest.mark.parametrize("n", [64, 48])  # 48: masked lanes past the row
@pytest.mark.parametrize("residual", [True, False])
def test_interp_rms_norm(n, residual):
    check_rms_norm(3, n, torch.float32, "cpu", residual, tol=1e-5, seed=n)


@gpu
@pytest.mark.parametrize("tokens", [1, 8, 300])
@pytest.mark.parametrize("n", [1024, 4096, 896])
@pytest.mark.parametrize("residual", [True, False])
def test_gpu_rms_norm(tokens, n, residual):
    check_rms_norm(tokens, n, torch.bfloat16, "cuda", residual, tol=1e-2, seed=tokens + n)


def check_sandwich_norm(tokens, n, dtype, device, splits: int, seed=0) -> None:
    """A closing norm, the residual add and the next norm in one launch (`pre_norm`): bit-equal
    to the closing norm's own launch followed by the add-and-norm one, and to the torch twin
    within one rounding; from a dense x or from a split-K product's fp32 planes."""
    from nanoserve.kernels import norm as knorm
    from nanoserve.kernels.norm import sandwich_norm_reference

    gen = torch.Generator(device=device).manual_seed(seed)
    planes = 3 * torch.randn(max(splits, 1), tokens, n, generator=gen, device=device)
    r = torch.randn(tokens, n, generator=gen, device=device).to(dtype)
    w_pre, w = ((1 + 0.1 * torch.randn(n, generator=gen, device=device)).to(dtype) for _ in range(2))
    x = planes if splits else planes[0].to(dtype)
    got, got_sum = knorm.rms_norm(x, w, 1e-6, r, pre_norm=(w_pre, 1e-5))
    two, two_sum = knorm.rms_norm(knorm.rms_norm(x, w_pre, 1e-5), w, 1e-6, r)
    assert torch.equal(got, two) and torch.equal(got_sum, two_sum)
    dense = planes.sum(0).to(dtype)  # the planes' sum in another order: one rounding apart at most
    twin, twin_sum = sandwich_norm_reference(dense, w_pre, 1e-5, r, w, 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(got, twin) < tol and rel_err(got_sum, twin_sum) < tol
    with pytest.raises(ValueError, match="pre_norm"):
        knorm.rms_norm(x, w, 1e-6, pre_norm=(w_pre, 1e-5))


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [0, 3])
def test_interp_sandwich_norm(dtype, splits):
    check_sandwich_norm(3, 48, dtype, "cpu", splits, seed=splits)


@gpu
@pytest.mark.parametrize("tokens", [1, 8, 300])
@pytest.mark.parametrize("splits", [0, 4])
def test_gpu_sandwich_norm(tokens, splits):
    check_sandwich_norm(tokens, 3840, torch.bfloat16, "cuda", splits, seed=tokens)  # gemma-3-12b's hidden size


def test_pending_closing_norm_on_the_torch_path():
    """Where the one-launch kernel does not apply (here: the CPU), a PendingNorm given to the
    next norm is normed by its own norm first, then added and normed: the sandwich's formula."""
    from nanoserve.distributed import SINGLE
    from nanoserve.kernels.norm import sandwich_norm_reference
    from nanoserve.models.layers import PendingNorm, RMSNorm

    gen = torch.Generator().manual_seed(0)
    closing, opening = RMSNorm(16, 1e-5), RMSNorm(16, 1e-6)
    for layer in (closing, opening):
        layer.weight.data = 1 + 0.1 * torch.randn(16, generator=gen)
    x, r = torch.randn(2, 3, 16, generator=gen)
    normed, stream = opening(PendingNorm(x, closing, SINGLE), r)
    want, want_stream = sandwich_norm_reference(x, closing.weight, 1e-5, r, opening.weight, 1e-6)
    assert torch.equal(normed, want) and torch.equal(stream, want_stream)
    with pytest.raises(ValueError, match="residual"):
        opening(PendingNorm(x, closing, SINGLE))
