"""FP8-weight products (nanoserve/kernels/fp8.py, the FP8 modes of kernels/linear.py and
`layers.fp8_linear`) against a dequantized fp32 reference.

CPU tests run tiny ragged shapes in Triton's interpreter. GPU tests (`pytest -m gpu -s
tests/test_fp8_kernels.py`) run decode sizes M = 1..256 and prefill sizes on llama-3.1-8b's
and qwen3-8b's shapes and their TP=2 shards, per-channel and 128x128 block scales, print the
relative errors they measure (`-s`), and replay the products inside CUDA graphs.

Error measure: ||y - ref|| / ||ref|| with ref = x W_deq^T in fp64, W_deq the FP8 weight
times its scales (the weight's own rounding is not error). The Triton paths only round the
output (bf16: ~2^-9); cuBLASLt's path also rounds the activations to e4m3 per token (~2^-4
per element, averaging out over K). The GPU bounds are first guesses, to be set from the
printed measurements.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from nanoserve.kernels import fp8 as kfp8
from nanoserve.kernels import linear as klinear
from nanoserve.kernels.fp8 import FP8_DTYPE, dequantize_weight
from nanoserve.kernels.linear import LinearConfig
from nanoserve.models.layers import Fp8Weight, fp8_linear
from nanoserve.models.quantization import quantize_per_channel

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
interp = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (set by conftest without a GPU)")
gpu = pytest.mark.gpu


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, fp32 scales [ceil(N/128), ceil(K/128)]): each 128x128 block's absmax -> 448."""
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    padded = torch.zeros(nb * 128, kb * 128, device=w.device)
    padded[:n, :k] = w.float()
    s = (padded.reshape(nb, 128, kb, 128).abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return (w.float() / full).clamp(-448, 448).to(FP8_DTYPE), s


def make(M, N, K, block: bool, device, dtype, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, generator=gen, device=device).to(dtype)
    w = torch.randn(N, K, generator=gen, device=device) / K**0.5
    q, s = block_quantize(w) if block else quantize_per_channel(w)
    ref = x.double() @ dequantize_weight(q, s, block, torch.float64).T
    return x, q, s, ref


def check_kernel(M, N, K, block, config, dtype=torch.float32, tol=1e-5, bias=False, seed=0):
    x, q, s, ref = make(M, N, K, block, "cpu", dtype, seed)
    b = torch.randn(N).to(dtype) if bias else None
    if bias:
        ref = ref + b.double()
    out = torch.full((M, N), float("nan"), dtype=dtype)
    klinear.small_m_linear(x, q, b, config, out=out, w_scale=s, block_scale=block)
    assert not torch.isnan(out).any(), f"unwritten element ({config})"
    err = rel_err(out, ref)
    assert err < tol, f"{config} M={M} N={N} K={K} block={block}: relative error {err:.2e}"


# ------------------------------------------------------------------------------ CPU tests


@interp
@pytest.mark.parametrize("block", [False, True])
def test_interp_fp8_gemv(block):
    # N = 10 over blocks of 4, K = 200 over blocks of 64 (masked tail; a ragged 128-block)
    check_kernel(1, 10, 200, block, LinearConfig("fma", 1, 4, 64), bias=True)


@interp
@pytest.mark.parametrize("block", [False, True])
def test_interp_fp8_fma_rows(block):
    check_kernel(3, 12, 256, block, LinearConfig("fma", 2, 8, 128))


@interp
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("block", [False, True])
def test_interp_fp8_dot(block, split):
    # M = 5 padded to 16; N = 140 (two 128-row scale blocks, ragged tiles); K = 256 (two K blocks)
    check_kernel(5, 140, 256, block, LinearConfig("dot", 16, 16, 128, split_k=split), bias=split == 1)


@interp
def test_interp_fp8_dot_ragged_k_block():
    # K = 200: the last 128-block is partial and masked
    check_kernel(4, 20, 200, True, LinearConfig("dot", 16, 16, 128))


# The "fp8" kernel's variants (kernels/linear.py `_fp8_decode_kernel`): row-at-a-time FMAs,
# the late-reduced FMA accumulator, tensor cores; with and without prefetching the next K step.
# With bit_cvt the FMA variants' integer conversion runs in the interpreter too; the
# tensor-core variant's is PTX (GPU tests only).
FP8_VARIANTS = {
    "rows": LinearConfig("fp8", 4, 8, 64),
    "rows_bits_prefetch": LinearConfig("fp8", 4, 8, 64, bit_cvt=True, prefetch=True),
    "late": LinearConfig("fp8", 4, 8, 64, reduce_late=True),
    "late_bits_prefetch": LinearConfig("fp8", 4, 8, 64, reduce_late=True, bit_cvt=True, prefetch=True),
    "mma": LinearConfig("fp8", 16, 16, 64, mma=True),
    "mma_prefetch": LinearConfig("fp8", 16, 16, 64, mma=True, prefetch=True),
    "mma_x_fp8": LinearConfig("fp8", 16, 16, 64, mma=True, x_fp8=True),
}
# x_fp8 quantizes x to e4m3 per (row, K step): its error is the activations' rounding (on a GPU
# ~2.6e-2 here, as torch rounds; the interpreter's fp32 -> e4m3 cast truncates: ~5.5e-2).
TOL_X_FP8_INTERP = 8e-2


def interp_tol(config):
    return TOL_X_FP8_INTERP if config.x_fp8 else 1e-5


def make_scaled(M, N, K, scales, device, dtype, seed=0):
    """`make` with `scales` "channel", "tensor" (one scale, held per row as the layers hold it)
    or "block"."""
    if scales != "tensor":
        return make(M, N, K, scales == "block", device, dtype, seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, generator=gen, device=device).to(dtype)
    w = torch.randn(N, K, generator=gen, device=device) / K**0.5
    scale = w.abs().max() / 448
    q = (w / scale).to(FP8_DTYPE)
    s = scale.expand(N).contiguous()
    return x, q, s, x.double() @ dequantize_weight(q, s, False, torch.float64).T


@interp
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("scales", ["channel", "tensor", "block"])
@pytest.mark.parametrize("variant", list(FP8_VARIANTS))
def test_interp_fp8_decode_kernel(variant, scales, split):
    """M = 1..8 (one or two row tiles of 4 for the FMA variants), ragged N, K a multiple of the
    K step (320: two and a half scale blocks) and not (200), split-K ragged at K."""
    config = dataclasses.replace(FP8_VARIANTS[variant], split_k=split)
    for N, K in ((20, 320), (12, 200)):
        for M in range(1, 9):
            x, q, s, ref = make_scaled(M, N, K, scales, "cpu", torch.float32, seed=M)
            out = torch.full((M, N), float("nan"))
            klinear.small_m_linear(x, q, None, config, out=out, w_scale=s, block_scale=scales == "block")
            assert not torch.isnan(out).any(), f"unwritten element ({config}, M={M})"
            err = rel_err(out, ref)
            assert err < interp_tol(config), f"{config} M={M} N={N} K={K} {scales}: relative error {err:.2e}"


@interp
@pytest.mark.parametrize("variant", list(FP8_VARIANTS))
def test_interp_fp8_decode_kernel_bias_bf16_repeatable(variant):
    """bf16 activations and output with a bias (one rounding: within one bf16 ulp of the fp32
    result, as the interpreter's fp32 -> bf16 cast truncates), and repeat runs bit-identical,
    split or not."""
    for split in (1, 2):
        config = dataclasses.replace(FP8_VARIANTS[variant], split_k=split)
        x, q, s, ref = make(5, 24, 256, False, "cpu", torch.bfloat16)
        b = torch.randn(24).to(torch.bfloat16)
        ref = ref + b.double()
        out = klinear.small_m_linear(x, q, b, config, w_scale=s)
        again = klinear.small_m_linear(x, q, b, config, w_scale=s)
        assert out.dtype == torch.bfloat16 and torch.equal(out, again)
        if config.x_fp8:
            assert rel_err(out, ref) < TOL_X_FP8_INTERP
        else:
            assert ((out.double() - ref).abs() <= ref.abs() * 2**-7 + 1e-6).all(), config


@interp
@pytest.mark.parametrize("variant", [v for v, c in FP8_VARIANTS.items() if not c.x_fp8])
def test_interp_fp8_decode_kernel_every_e4m3_value_exact(variant):
    """W holds every finite e4m3 code (subnormals included), each row of x picks one column:
    the fp32 output is that weight times its row's scale exactly (the bit conversion and the
    2^120 it leaves to the scales included)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE)
    codes = codes[~codes.float().isnan()]  # 254 values
    N, K = 16, 256
    q = codes[torch.arange(N * K) % codes.numel()].reshape(N, K)
    s = torch.linspace(0.5, 2.0, N) / 448
    picks = [0, 1, 7, 100, 127, 128, 200, 255]
    x = torch.zeros(len(picks), K)
    x[torch.arange(len(picks)), picks] = 1.0
    out = torch.empty(len(picks), N)
    klinear.small_m_linear(x, q, None, FP8_VARIANTS[variant], out=out, w_scale=s)
    assert torch.equal(out, (q.float()[:, picks] * s[:, None]).T)


def test_fp8_decode_kernel_rejects_bad_configs():
    x, q, s, _ = make(2, 8, 256, False, "cpu", torch.float32)
    with pytest.raises(ValueError, match="FP8 weights"):
        klinear.small_m_linear(x, q.float(), None, LinearConfig("fp8", 2, 8, 64))
    with pytest.raises(ValueError, match=">= 16"):
        klinear.small_m_linear(x, q, None, LinearConfig("fp8", 2, 16, 64, mma=True), w_scale=s)
    with pytest.raises(ValueError, match="x_fp8"):
        klinear.small_m_linear(x, q, None, LinearConfig("fp8", 2, 8, 64, x_fp8=True), w_scale=s)
    xb, qb, sb, _ = make(2, 8, 256, True, "cpu", torch.float32)
    with pytest.raises(ValueError, match="dividing 128"):
        klinear.small_m_linear(xb, qb, None, LinearConfig("fp8", 2, 8, 256), w_scale=sb, block_scale=True)


@interp
@pytest.mark.parametrize("k", [300, kfp8.ROW_BLOCK_MAX + 300])  # the row from registers, and in two passes
def test_interp_quantize_rows_equals_reference(k):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, k, generator=gen) * torch.tensor([1.0, 10.0, 0.01, 0.0, 3.0])[:, None]
    q, s = kfp8.quantize_rows(x)
    rq, rs = kfp8.quantize_rows_reference(x)
    assert torch.equal(s, rs)
    # Triton 3.9's interpreter rounds fp32 -> e4m3 without the mantissa's carry into the
    # exponent (127.98 becomes 64, not 128), and may round a subnormal (below 2^-6) one step
    # of 2^-9 the other way; every other element must be equal. The GPU test holds the
    # compiled kernel to the reference.
    differ = q.float() != rq.float()
    carry = rq.float().abs().log2().frac().eq(0) & q.float().eq(rq.float() / 2)
    subnormal = rq.float().abs().le(2**-6) & (q.float() - rq.float()).abs().le(2**-9)
    assert torch.equal(differ, differ & (carry | subnormal))
    assert differ.float().mean() < 0.1


def test_fp8_rejects_mismatched_scales():
    x, q, s, _ = make(2, 8, 32, False, "cpu", torch.float32)
    with pytest.raises(ValueError, match="w_scale"):
        klinear.small_m_linear(x, q, None, LinearConfig("fma", 2, 4, 32))
    with pytest.raises(ValueError, match="w_scale"):
        klinear.small_m_linear(x, q.float(), None, LinearConfig("fma", 2, 4, 32), w_scale=s)


@pytest.mark.parametrize("block", [False, True])
def test_fp8_linear_slow_twin(block):
    """On CPU fp8_linear is the dequantized weight's matmul."""
    x, q, s, ref = make(3, 130, 140, block, "cpu", torch.float32)
    got = fp8_linear(x, q, Fp8Weight(s, block))
    assert rel_err(got, ref) < 1e-6


# ------------------------------------------------------------------------------ GPU tests

# (N, K): llama-3.1-8b qkv, o, gate_up, down; their TP=2 shards; qwen3-8b qkv, gate_up, down
SHAPES = [
    (6144, 4096),
    (4096, 4096),
    (28672, 4096),
    (4096, 14336),
    (3072, 4096),
    (4096, 2048),
    (14336, 4096),
    (4096, 7168),
    (6144, 4096),
    (24576, 4096),
    (4096, 12288),
]
DECODE_M = [1, 2, 3, 4, 8, 16, 32, 64, 128, 200, 256]
PREFILL_M = [257, 512, 2048, 8192]
# First guesses (to be set from the measurements `-s` prints): Triton paths round the output
# only; the cuBLASLt path rounds the activations to e4m3 too.
TOL_TRITON = 8e-3
TOL_SCALED_MM = 6e-2


def _gpu_case(M, N, K, block, seed=0):
    x, q, s, ref = make(M, N, K, block, "cuda", torch.bfloat16, seed)
    got = fp8_linear(x, q, Fp8Weight(s, block))
    torch.cuda.synchronize()
    err = rel_err(got, ref)
    config = klinear.fp8_linear_config(M, N, K, torch.bfloat16, block)
    triton_path = block or config is not None
    x_quantized = not triton_path or (config is not None and config.x_fp8)  # scaled_mm and x_fp8 round x to e4m3
    path = ("triton, x in e4m3" if x_quantized else "triton") if triton_path else "scaled_mm"
    print(f"fp8 {'block' if block else 'channel'} M={M} N={N} K={K} {path}: rel err {err:.3e}")
    assert err < (TOL_SCALED_MM if x_quantized else TOL_TRITON), f"M={M} N={N} K={K} {path}: {err:.3e}"


def test_fp8_rule_takes_the_e4m3_tensor_core_kernel_for_two_to_eight_rows():
    """The measured FP8 rule: M = 2..8 per-channel on llama/qwen3-8b shapes take the x_fp8
    tensor-core configs; M = 1 the fma GEMV with its FP8 tiles (8 x 256 on wide outputs, 16 x
    512 at 4 stages on qkv, else 4 x 1024, 3 stages); block scales keep the bf16 rule's configs."""
    for N, K in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        for M in (2, 5, 8):
            config = klinear.fp8_linear_config(M, N, K, torch.bfloat16)
            assert config.kernel == "fp8" and config.mma and config.x_fp8, (M, N, K, config)
            assert K % (config.split_k * config.block_k) == 0
            assert klinear.fp8_linear_config(M, N, K, torch.bfloat16, block=True) == klinear.linear_config(
                M, N, K, torch.bfloat16
            )
        gemv = klinear.fp8_linear_config(1, N, K, torch.bfloat16)
        tile = (8, 256, 3) if N >= 4 * K else (16, 512, 4) if N > K else (4, 1024, 3)
        assert (gemv.kernel, gemv.block_m) == ("fma", 1)
        assert (gemv.block_n, gemv.block_k, gemv.num_stages) == tile
        assert klinear.fp8_linear_config(1, N, K, torch.bfloat16, block=True) == klinear.linear_config(
            1, N, K, torch.bfloat16
        )
        assert klinear.fp8_linear_config(16, N, K, torch.bfloat16) == klinear.linear_config(16, N, K, torch.bfloat16)


@gpu
@pytest.mark.parametrize("M", DECODE_M + PREFILL_M)
@pytest.mark.parametrize("block", [False, True])
def test_gpu_fp8_linear_on_model_shapes(M, block):
    for N, K in SHAPES:
        _gpu_case(M, N, K, block)


@gpu
@pytest.mark.parametrize("M", [1, 7, 33, 300, 1000])
def test_gpu_fp8_random_shapes(M):
    gen = torch.Generator().manual_seed(M)
    for _ in range(3):
        N = 16 * int(torch.randint(8, 400, (1,), generator=gen))
        K = 128 * int(torch.randint(1, 40, (1,), generator=gen))
        for block in (False, True):
            _gpu_case(M, N, K, block, seed=N + K)


# One config per variant of the "fp8" kernel, with and without the PTX conversion.
GPU_FP8_CONFIGS = [
    LinearConfig("fp8", 8, 16, 256, num_warps=4),
    LinearConfig("fp8", 8, 16, 512, num_warps=4, bit_cvt=True, split_k=2, prefetch=True),
    LinearConfig("fp8", 1, 4, 1024, num_warps=2, reduce_late=True, bit_cvt=True, prefetch=True),
    LinearConfig("fp8", 16, 64, 128, num_warps=4, mma=True),
    LinearConfig("fp8", 16, 64, 128, num_warps=4, mma=True, bit_cvt=True, split_k=4, prefetch=True),
    LinearConfig("fp8", 16, 64, 128, num_warps=4, num_stages=3, mma=True, x_fp8=True, split_k=4),
]


@gpu
@pytest.mark.parametrize("M", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("block", [False, True])
def test_gpu_fp8_decode_kernel_variants(M, block):
    for config in GPU_FP8_CONFIGS:
        if block:  # a K step within one 128-wide scale block
            config = dataclasses.replace(config, block_k=min(config.block_k, 128))
        for N, K in [(6144, 4096), (4096, 14336), (3072, 4096), (4096, 7168)]:
            x, q, s, ref = make(M, N, K, block, "cuda", torch.bfloat16)
            out = klinear.small_m_linear(x, q, None, config, w_scale=s, block_scale=block)
            err = rel_err(out, ref)
            print(f"fp8 kernel {config} {'block' if block else 'channel'} M={M} N={N} K={K}: rel err {err:.3e}")
            tol = TOL_SCALED_MM if config.x_fp8 else TOL_TRITON  # x_fp8 rounds x to e4m3 as cuBLASLt's path
            assert err < tol, f"{config} M={M} N={N} K={K}: {err:.3e}"


@gpu
@pytest.mark.parametrize("config", [c for c in GPU_FP8_CONFIGS if not c.x_fp8], ids=str)
def test_gpu_fp8_decode_kernel_every_e4m3_value(config):
    """W holds every finite e4m3 code, subnormals included (so the PTX conversion and the
    products are exact), bf16 x; the fp32 output (unrounded) against the fp64 reference."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE)
    codes = codes[~codes.float().isnan()]
    N, K = 256, 4096
    gen = torch.Generator().manual_seed(1)
    picks = torch.randint(0, codes.numel(), (N, K), generator=gen)
    q = codes[picks].cuda()
    s = torch.rand(N, generator=gen).add(0.5).cuda() / 448
    x = torch.randn(3, K, generator=gen).to(torch.bfloat16).cuda()
    ref = x.double() @ dequantize_weight(q, s, False, torch.float64).T
    out = torch.empty(3, N, dtype=torch.float32, device="cuda")
    klinear.small_m_linear(x, q, None, config, out=out, w_scale=s)
    err = rel_err(out, ref)
    print(f"every e4m3 value, {config}: rel err {err:.3e}")
    assert err < 1e-5


@gpu
@pytest.mark.parametrize("config", GPU_FP8_CONFIGS, ids=str)
def test_gpu_fp8_decode_kernel_in_cuda_graph(config):
    """Captured and replayed (PDL on): equal to the eager result bit for bit, and repeatable."""
    x, q, s, _ = make(4, 4096, 4096, False, "cuda", torch.bfloat16)
    eager = klinear.small_m_linear(x, q, None, config, w_scale=s)
    assert torch.equal(eager, klinear.small_m_linear(x, q, None, config, w_scale=s))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = klinear.small_m_linear(x, q, None, config, w_scale=s)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@gpu
@pytest.mark.parametrize("k", [4096, 14336, kfp8.ROW_BLOCK_MAX + 300])  # from registers (two), two passes
def test_gpu_quantize_rows_equals_reference(k):
    x = torch.randn(300, k, device="cuda", dtype=torch.bfloat16)
    q, s = kfp8.quantize_rows(x)
    rq, rs = kfp8.quantize_rows_reference(x)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    mismatch = (q.float() != rq.float()).float().mean().item()
    print(f"quantize_rows: {mismatch:.2e} of elements differ from the reference")
    assert mismatch < 1e-3


@gpu
def test_gpu_scaled_mm_accepts_rowwise_scales():
    """torch._scaled_mm with fp32 [M, 1] x [1, N] scales and bf16 output (cuBLASLt row-wise)."""
    x, q, s, ref = make(512, 4096, 4096, False, "cuda", torch.bfloat16)
    assert kfp8.rowwise_scaled_mm_ok(x, q)
    y = kfp8.scaled_mm(x, q, s)
    err = rel_err(y, ref)
    print(f"scaled_mm 512x4096x4096: rel err {err:.3e}")
    assert y.dtype == torch.bfloat16 and err < TOL_SCALED_MM


@gpu
@pytest.mark.parametrize("M", [1, 64, 512])
@pytest.mark.parametrize("block", [False, True])
def test_gpu_fp8_linear_in_cuda_graph(M, block):
    """Captured and replayed: no host sync, and the replay equals the eager result bit for bit."""
    x, q, s, _ = make(M, 4096, 4096, block, "cuda", torch.bfloat16)
    fp8 = Fp8Weight(s, block)
    eager = fp8_linear(x, q, fp8)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp8_linear(x, q, fp8)  # warm-up (Triton compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, q, fp8)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fp8_linear(x, q, fp8))
    assert not torch.equal(out, eager)


@gpu
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_gpu_engine_fp8_graphs_equal_eager(kv):
    """--quantization fp8 on dummy qwen3-0.6b: CUDA graphs (decode and piecewise prefill)
    give the eager run's greedy tokens; with the fp8 KV cache too."""
    from nanoserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [[(i * 37 + j * 11) % 1000 + 10 for j in range(20 + 9 * i)] for i in range(8)]
    runs = []
    for eager in (False, True):
        llm = LLM("qwen3-0.6b", load_format="dummy", quantization="fp8", kv_cache_dtype=kv, enforce_eager=eager)
        assert llm.engine.runner.model.layers[0].mlp.down_proj.weight.dtype == FP8_DTYPE
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        stats = llm.stats()
        assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
        del llm
        torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(*runs))
    print(f"fp8 weights, kv {kv}: graphs vs eager identical on {same}/{len(prompts)} prompts")
    assert same == len(prompts)
