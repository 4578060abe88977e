"""The gated GEMV: an MLP's gate_up product with SiLU-and-mul in its epilogue
(`small_m_linear(gated=True)`, `ColumnParallelLinear.silu_and_mul`), against its slow twin,
the plain product followed by the SiLU-and-mul kernel.

The gated program streams the gate rows rn and the up rows N + rn with the same tile shape as
the plain kernel streaming rows rn, so each output's sum is formed in the same order; it rounds
both halves to the output dtype before the SiLU as the plain product's store does. Compiled or
interpreted alike, the gated result must therefore equal the plain product (its config, over
all 2N rows) followed by `activation.silu_and_mul`, bit for bit, and the fp64 reference (x W^T,
then `silu_and_mul_reference`) within the output rounding.

CPU tests run tiny ragged shapes in Triton's interpreter (conftest sets TRITON_INTERPRET=1 when
no GPU is present); GPU tests (`pytest -m gpu tests/test_gated_gemv.py`) run the gate_up shapes
of qwen3-0.6b, llama-3.1-8b and qwen3-8b in bf16 and FP8, in CUDA graphs, and the layer's
dispatch against the switch turned off.
"""

from __future__ import annotations

import os

import pytest
import torch

from nanoserve.kernels import linear as klinear
from nanoserve.kernels.activation import silu_and_mul, silu_and_mul_reference
from nanoserve.kernels.fp8 import FP8_DTYPE, dequantize_weight
from nanoserve.kernels.linear import LinearConfig, gated_config
from nanoserve.models.quantization import quantize_per_channel

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
interp = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (set by conftest without a GPU)")
gpu = pytest.mark.gpu


def block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, fp32 128x128 block scales); rows and columns multiples of 128."""
    n, k = w.shape
    s = (w.float().reshape(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return (w.float() / full).clamp(-448, 448).to(FP8_DTYPE), s


def make(M, inter, K, dtype, device, scales: str, bias: bool, seed: int):
    """x [M, K], gate_up weight [2 inter, K] (plain, or FP8 with "channel" / "block" scales),
    its scales or None, a bias or None, and the weight as the reference multiplies it (fp64)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, generator=gen, device=device).to(dtype)
    w = torch.randn(2 * inter, K, generator=gen, device=device) / K**0.5
    b = torch.randn(2 * inter, generator=gen, device=device).to(dtype) if bias else None
    if scales == "none":
        w = w.to(dtype)
        return x, w, None, b, w.double()
    q, s = block_quantize(w) if scales == "block" else quantize_per_channel(w)
    return x, q, s, b, dequantize_weight(q, s, scales == "block", torch.float64)


def check_gated(M, inter, K, dtype, device, config, scales="none", bias=False, seed=0, tol=None) -> None:
    """The gated product against the plain one + SiLU kernel (bit for bit) and the fp64
    reference within `tol` (default: bf16's three roundings; the interpreter truncates them)."""
    if tol is None:
        tol = 2e-2 if device == "cpu" else 1e-2
    x, w, s, b, w_ref = make(M, inter, K, dtype, device, scales, bias, seed)
    block = scales == "block"
    out = torch.full((M, inter), float("nan"), dtype=dtype, device=device)
    got = klinear.small_m_linear(x, w, b, config, out=out, w_scale=s, block_scale=block, gated=True)
    assert got.data_ptr() == out.data_ptr() and not torch.isnan(out).any(), f"unwritten element ({config})"
    plain = klinear.small_m_linear(x, w, b, config, w_scale=s, block_scale=block)
    assert torch.equal(out, silu_and_mul(plain)), f"{config} M={M} I={inter} K={K} {scales}: not the plain product's"
    ref = silu_and_mul_reference(x.double() @ w_ref.T + (0 if b is None else b.double()))
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < tol, f"{config} M={M} I={inter} K={K} {scales}: relative error {err:.2e} to the reference"


# ------------------------------------------------------------------------------ CPU tests


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_interp_gated_gemv_ragged(dtype, bias):
    # 10 outputs over blocks of 4 (the last block half past N: its up rows must not be read
    # as the next gate rows), K = 80 over blocks of 32 (masked tail)
    config = LinearConfig("fma", 1, 4, 32, num_stages=2)
    check_gated(1, 10, 80, dtype, "cpu", config, bias=bias, seed=1, tol=1e-5 if dtype == torch.float32 else None)


@interp
def test_interp_gated_fma_several_rows():
    check_gated(3, 12, 64, torch.float32, "cpu", LinearConfig("fma", 2, 4, 32), seed=2, tol=1e-5)


@interp
@pytest.mark.parametrize("scales", ["channel", "block"])
def test_interp_gated_fp8(scales):
    # block scales: I = 128, so the up rows start on a block of their own
    check_gated(1, 128, 256, torch.bfloat16, "cpu", LinearConfig("fma", 1, 8, 64, num_stages=3), scales, seed=3)


def test_gated_config_halves_the_rule_tile_and_declines_other_kernels():
    rule = klinear.linear_config(1, 28672, 4096, torch.bfloat16)
    gated = gated_config(rule)
    assert rule.kernel == "fma" and gated.block_n == rule.block_n // 2
    assert (gated.block_k, gated.num_warps, gated.num_stages) == (rule.block_k, rule.num_warps, rule.num_stages)
    assert gated_config(LinearConfig("fma", 1, 1, 256)).block_n == 1
    assert gated_config(None) is None  # cuBLAS
    assert gated_config(LinearConfig("dot", 16, 64, 128)) is None
    assert gated_config(klinear.fp8_linear_config(4, 28672, 4096, torch.bfloat16)) is None  # the "fp8" kernel


def test_gated_product_refuses_what_it_cannot_run():
    x, w = torch.zeros(1, 64), torch.zeros(9, 64)
    with pytest.raises(ValueError, match="even number"):
        klinear.small_m_linear(x, w, None, LinearConfig("fma", 1, 4, 32), gated=True)
    with pytest.raises(ValueError, match="even number"):
        klinear.small_m_linear(x, torch.zeros(8, 64), None, LinearConfig("fp8", 16, 32, 32), gated=True)
    with pytest.raises(ValueError, match="unsplit"):  # the gated dot kernel (tests/test_fused_16_rows.py)
        klinear.small_m_linear(x, torch.zeros(8, 64), None, LinearConfig("dot", 16, 32, 32, split_k=2), gated=True)


def test_mlp_layer_on_cpu_is_the_slow_twin():
    """On CPU the layer's silu_and_mul is the product, then the reference SiLU-and-mul."""
    from nanoserve.models.layers import ColumnParallelLinear, RowSlice

    layer = ColumnParallelLinear(32, [RowSlice("gate", 0, 24), RowSlice("up", 0, 24)], bias=False)
    torch.nn.init.normal_(layer.weight)
    x = torch.randn(3, 32)
    assert torch.equal(layer.silu_and_mul(x), silu_and_mul_reference(layer(x)))


# ------------------------------------------------------------------------------ GPU tests

# (M, I, K): the gate_up products of qwen3-0.6b, llama-3.1-8b and qwen3-8b at one row, and a
# small MLP whose products the rule gives the fma kernel at 3 rows
GATE_UP_CASES = [(1, 3072, 1024), (1, 14336, 4096), (1, 12288, 4096), (1, 512, 1024), (3, 512, 1024)]


@gpu
@pytest.mark.parametrize("scales", ["none", "channel", "block"])
@pytest.mark.parametrize(("M", "inter", "K"), GATE_UP_CASES)
def test_gpu_gated_gemv_on_model_shapes(M, inter, K, scales):
    """Whatever fma config the rule gives the gate_up product (and the 1-row fp8 tiles), the
    gated kernel equals the plain product + SiLU kernel bit for bit; shapes where the rule
    leaves the product to another kernel are skipped (the layer then runs them apart)."""
    if scales == "none":
        rule = klinear.linear_config(M, 2 * inter, K, torch.bfloat16)
    else:
        rule = klinear.fp8_linear_config(M, 2 * inter, K, torch.bfloat16, scales == "block")
    config = gated_config(rule)
    if config is None:
        pytest.skip(f"the rule gives {rule}: not fused")
    check_gated(M, inter, K, torch.bfloat16, "cuda", config, scales, seed=M + inter)


@gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_gated_gemv_in_cuda_graph_under_pdl(fp8):
    """llama-3.1-8b's gate_up at one row through the layer, captured under PDL: every replay on
    fresh inputs equals an eager call bit for bit, and the switch turned off (the product,
    then the compiled SiLU-and-mul: one rounding may differ) within one bf16 step."""
    from nanoserve.models.layers import ColumnParallelLinear, RowSlice
    from nanoserve.switches import KernelSwitches

    inter, hidden = 14336, 4096
    layer = ColumnParallelLinear(hidden, [RowSlice("gate", 0, inter), RowSlice("up", 0, inter)], bias=False)
    w = torch.randn(2 * inter, hidden, device="cuda") / hidden**0.5
    if fp8:
        layer.use_fp8(block=False, static_input=False)
        q, s = quantize_per_channel(w)
        layer.weight.data, layer.weight_scale.data = q, s
    else:
        layer.weight.data = w.bfloat16()
    layer = layer.cuda()
    x = torch.randn(1, hidden, device="cuda").bfloat16()
    assert layer._gated_config(x) is not None
    step = lambda: layer.silu_and_mul(x)
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    off = KernelSwitches(gemv_silu=False)
    for trial in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(out, step()), f"replay {trial} differs from eager"
        layer.switches = off
        apart = layer.silu_and_mul(x)
        layer.switches = KernelSwitches()
        assert ((out.float() - apart.float()).abs() <= apart.float().abs() * 2**-7 + 1e-6).all()
