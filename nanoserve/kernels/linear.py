"""Small-M matmul for decode batches: y = x W^T (+ b) for M = 1..256 rows, and the measured
rule that decides when it runs instead of cuBLAS.

cuBLAS picks tiles made for large M and, on small matrices, spends >= 5 us per call whatever
M; these kernels stream W once with wide loads:
- "fma": products and sums on the CUDA cores, a [BLOCK_M, BLOCK_N, BLOCK_K] fp32 accumulator
  reduced over K once at the end (BLOCK_M = 1 is the GEMV). At one row it can also store its
  outputs straight into the tensor-parallel peers' receive buffers as LL words (`ll_words`).
  Gated (`gated=True`): an MLP's gate_up product with SiLU-and-mul in the epilogue, one launch
  (`gated_config`).
- "dot": tensor-core tiles with M padded to BLOCK_M (rows past M are masked, never stored),
  optionally split along K (`split_k` programs per output tile, each storing its fp32
  partial to a workspace [split_k, M, N]; a second kernel adds the partials in split order
  and rounds once, or `norm.rms_norm` adds them when it is the product's only consumer).
  Gated (`gated=True`, unsplit, dense weights: `_gated_dot_kernel`): a gate tile and the
  matching up tile per program, SiLU-and-mul in the epilogue (`gated_dot_config`: 5..16 rows).
- "fp8": FP8 weights at few rows (`_fp8_decode_kernel`): each W tile converted once for all
  rows, then CUDA-core FMAs (row at a time, or the "fma" scheme) or tensor cores, the
  conversion by bit operations or Triton's cast, split-K as "dot" (config knobs `mma`,
  `reduce_late`, `bit_cvt`, `prefetch`, `split_k`); `x_fp8` rounds x to e4m3 per (row, K
  step) for FP8 tensor-core products instead (cuBLASLt's precision class, not exact in x).
`linear_config(M, N, K, dtype)` is the rule: a config, or None where cuBLAS is as fast;
`fp8_linear_config` the FP8 weights' (with per-channel scales: the fma GEMV's FP8 tiles at
M = 1, the "fp8" kernel's `x_fp8` configs at M = 2..8; else the bf16 rule).
`linear_reference` is the torch reference the tests compare with.

Invariants:
- fp32 accumulation; each output element rounded once to the output dtype; a bias is added in
  fp32 before that rounding (as cuBLAS's epilogue); x enters exactly (except "fp8" with
  `x_fp8`, which says so);
- the split-K product is deterministic: the partials of an output element are added in split
  order, each partial's K order fixed by the config, so repeat runs are bit-identical and a
  row's result does not depend on the other rows of the batch (for a given config);
- launchers read no device data on the host and allocate only outputs and workspaces whose
  shapes come from the inputs' shapes, so they can be captured in CUDA graphs;
- under PDL (`launch.py`) a kernel reads only weights before its `gdc_wait`;
- x needs a dense last dim and W dense rows ([N, K], as nn.Linear stores it); `linear_config`
  returns None otherwise, so callers fall back to cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from nanoserve.kernels.activation import silu_mul_rounded
from nanoserve.kernels.launch import INTERPRET, launch_options, pdl_start
from nanoserve.kernels.ll_words import _ll_push_row

FP8_WEIGHT = torch.float8_e4m3fn

# Triton's interpreter computes bf16 tl.dot wrongly (see attention.py): under the interpreter
# the dot kernel upcasts its operands to fp32. Compiled kernels never do.
DOT_F32 = INTERPRET


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The slow twin: x W^T (+ b) in fp32, rounded once to x's dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@dataclass(frozen=True)
class LinearConfig:
    kernel: str  # "fma", "dot" or "fp8"
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1  # software pipelining of the K loop (1: none); "fma" and "fp8" loops name it themselves
    split_k: int = 1  # "dot" and "fp8": programs along K, their fp32 partials summed by a second kernel
    # "fp8" only (FP8 weights, `_fp8_decode_kernel`'s variants):
    mma: bool = False  # tensor-core products W tile x x^T (rows padded to block_m >= 16); else CUDA-core FMAs
    bit_cvt: bool = False  # e4m3 by bit operations (see `_fp8_decode_kernel`); else Triton's cast
    reduce_late: bool = False  # FMA: one [block_m, block_n, block_k] accumulator reduced after the K loop
    prefetch: bool = False  # load the next K step's W (and x tile) before computing this one's
    x_fp8: bool = False  # mma: x quantized to e4m3 per (row, K step), FP8 tensor-core products


SUM_BLOCK = 1024  # columns per program of the split-K sum


@triton.jit
def _tile_ranges(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's output rows (M), output columns (N) and the K offsets of one tile;
    program axis 0 walks N, axis 1 walks M."""
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rm, rn, tl.arange(0, BLOCK_K)


@triton.jit
def _linear_fma_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, s_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym, stride_sn,
    push_addrs, epoch_ptr, rank,
    W_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, LINE: tl.constexpr, PUSH_WORLD: tl.constexpr, LOOP_STAGES: tl.constexpr,
    GATED: tl.constexpr, PRECISE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """PUSH_WORLD > 0 (one row, 2-byte y): each program also stores its outputs into every
    peer's LL receive buffer (`_ll_push_row`), so the sum's kernel does not send them.
    LOOP_STAGES > 1: the K loop's loads are software-pipelined (cp.async into shared memory,
    LOOP_STAGES - 1 steps ahead): bytes in flight without holding registers. Triton pipelines a
    loop without a dot only when the loop itself names its stages.
    GATED (an MLP's merged gate_up weight [2N, K], gate rows first): the program also streams
    the up rows N + rn and stores silu(gate) * up [M, N], each half rounded to y's dtype first
    as the unfused product would be, then `activation.silu_mul_rounded` (PRECISE as there)."""
    rm, rn, rk = _tile_ranges(BLOCK_M, BLOCK_N, BLOCK_K)
    # Rows past M or N re-read the last valid row (results never stored): loads stay unmasked
    # along M and N, so full tiles keep 16-byte vector loads.
    rm_in = tl.minimum(rm, M - 1).to(tl.int64)
    rn_in = tl.minimum(rn, N - 1).to(tl.int64)
    x_ptrs = x_ptr + rm_in[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn_in[:, None] * stride_wn + rk[None, :]
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    if GATED:
        ru_in = rn_in + N  # the up rows
        u_ptrs = w_ptrs + N * stride_wn
        acc_up = tl.zeros_like(acc)
    if USE_PDL:
        # Under PDL this program may start while the previous kernel still runs: pull the first
        # weight tile into L2 meanwhile (weights are never written), then wait before reading x.
        # (More than one tile was slower: 2 x H200, benchmarks/results/2026-11-21.md, series 7.)
        lines = tl.minimum(tl.arange(0, BLOCK_K // LINE) * LINE, K - 1)  # within the rows
        _prefetch_l2(w_ptr + rn_in[:, None] * stride_wn + lines[None, :])
        if GATED:
            _prefetch_l2(w_ptr + ru_in[:, None] * stride_wn + lines[None, :])
        pdl_start(USE_PDL)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=LOOP_STAGES):
        x = _x_step(x_ptrs, k0, rk, K, EVEN_K)
        acc = _fma_step(acc, x, w_ptrs, s_ptr, rn_in, k0, rk, K, stride_sn, W_SCALE, BLOCK_M, EVEN_K)
        if GATED:
            acc_up = _fma_step(acc_up, x, u_ptrs, s_ptr, ru_in, k0, rk, K, stride_sn, W_SCALE, BLOCK_M, EVEN_K)
            u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = _fma_outputs(acc, s_ptr, b_ptr, rn_in, W_SCALE, HAS_BIAS, BLOCK_M)
    if GATED:
        dtype = y_ptr.dtype.element_ty
        up = _fma_outputs(acc_up, s_ptr, b_ptr, ru_in, W_SCALE, HAS_BIAS, BLOCK_M)
        y = silu_mul_rounded(y.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype, PRECISE)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if PUSH_WORLD > 0:
        _ll_push_row(y, N, push_addrs, epoch_ptr, rank, y_ptr.dtype.element_ty, BLOCK_N, PUSH_WORLD)


@triton.jit
def _x_step(x_ptrs, k0, rk, K, EVEN_K: tl.constexpr):
    """One K step of x's rows at x_ptrs [rows, BLOCK_K] in fp32 (zeros past K unless EVEN_K)."""
    if EVEN_K:
        x = tl.load(x_ptrs)
    else:
        x = tl.load(x_ptrs, mask=((k0 + rk) < K)[None, :], other=0.0)
    return x.to(tl.float32)


@triton.jit
def _fma_step(acc, x, w_ptrs, s_ptr, rn_in, k0, rk, K, stride_sn, W_SCALE: tl.constexpr, BLOCK_M: tl.constexpr,
              EVEN_K: tl.constexpr):  # fmt: skip
    """One K step of `_linear_fma_kernel`: acc plus the products of x's tile (fp32) with the
    weight tile at w_ptrs (rows rn_in; block scales applied to each weight)."""
    if EVEN_K:
        w = tl.load(w_ptrs).to(tl.float32)
    else:
        w = tl.load(w_ptrs, mask=((k0 + rk) < K)[None, :], other=0.0).to(tl.float32)
    if W_SCALE == 2:  # FP8 with 128x128 block scales: each weight times its block's scale
        kb = tl.minimum(k0 + rk, K - 1) // 128
        w *= tl.load(s_ptr + (rn_in // 128)[:, None] * stride_sn + kb[None, :])
    if BLOCK_M == 1:  # (one return: Triton types every return of a function alike)
        acc += w * x
    else:
        acc += x[:, None, :] * w[None, :, :]
    return acc


@triton.jit
def _fma_outputs(acc, s_ptr, b_ptr, rn_in, W_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr):
    """`_linear_fma_kernel`'s fp32 outputs [BLOCK_M, BLOCK_N] of rows rn_in: the accumulator
    reduced over K, times the per-channel scales (W_SCALE 1), plus the bias."""
    if BLOCK_M == 1:
        y = tl.sum(acc, axis=1)[None, :]
    else:
        y = tl.sum(acc, axis=2)
    if W_SCALE == 1:  # FP8 with per-channel scales: once per output
        y *= tl.load(s_ptr + rn_in)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn_in).to(tl.float32)[None, :]
    return y


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the lines at `ptrs` (one pointer per 128-byte line); nothing waits for them."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _linear_dot_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, s_ptr,
    M, N, K, K_SPLIT, stride_xm, stride_wn, stride_ym, stride_sn,
    W_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program (n, m, s): output tile (m, n) over K[s * K_SPLIT, (s + 1) * K_SPLIT) (K_SPLIT a
    multiple of BLOCK_K; the last split is masked at K). SPLIT_K == 1: adds the bias and stores
    the tile in y's dtype. SPLIT_K > 1: y is the fp32 workspace [SPLIT_K, M, N] (dense) and the
    unrounded partial goes to plane s; `_sum_splits_kernel` adds the planes."""
    pdl_start(USE_PDL)
    rm, rn, rk = _tile_ranges(BLOCK_M, BLOCK_N, BLOCK_K)
    if SPLIT_K > 1:
        rk += tl.program_id(2) * K_SPLIT
    rn_in = tl.minimum(rn, N - 1).to(tl.int64)
    m_mask = rm < M
    x_ptrs = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn_in[None, :] * stride_wn + rk[:, None]  # [BLOCK_K, BLOCK_N] view of W^T
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K_SPLIT, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_mask = (k0 + rk) < K
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        if W_SCALE == 2:
            # FP8 with 128x128 block scales (BLOCK_K == 128, splits 128-aligned): this K tile
            # is one scale block, so its product is scaled once per output column.
            if UPCAST:
                part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(x, w.to(x.dtype))
            kb = tl.minimum(k0 + tl.min(rk, axis=0), K - 1) // 128
            acc += part * tl.load(s_ptr + (rn_in // 128) * stride_sn + kb)[None, :]
        elif UPCAST:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        elif x.dtype == tl.float32:
            acc = tl.dot(x, w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)  # FP8 weights: e4m3 -> bf16/fp16 is exact
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if W_SCALE == 1:  # FP8 with per-channel scales: once per output (per partial under split-K)
        acc *= tl.load(s_ptr + rn_in)[None, :]
    mask = m_mask[:, None] & (rn[None, :] < N)
    if SPLIT_K > 1:
        plane = y_ptr + tl.program_id(2).to(tl.int64) * M * N
        tl.store(plane + rm.to(tl.int64)[:, None] * N + rn[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn_in).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_dot_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """An MLP's merged gate_up weight [2N, K] (gate rows first) on tensor cores: program (n, m)
    holds output tile (m, n) of silu(x Wg^T) * (x Wu^T) [M, N], two accumulators over the gate
    rows rn and the up rows N + rn, each the tile `_linear_dot_kernel` would form for those
    rows (same K loop and order), each rounded to y's dtype (+ bias first) as that kernel's
    store does, then `activation.silu_mul_rounded` (PRECISE as there)."""
    pdl_start(USE_PDL)
    rm, rn, rk = _tile_ranges(BLOCK_M, BLOCK_N, BLOCK_K)
    rn_in = tl.minimum(rn, N - 1).to(tl.int64)  # columns past N re-read the last one (never stored)
    m_mask = rm < M
    x_ptrs = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
    g_ptrs = w_ptr + rn_in[None, :] * stride_wn + rk[:, None]  # [BLOCK_K, BLOCK_N] views of W^T
    u_ptrs = w_ptr + (rn_in + N)[None, :] * stride_wn + rk[:, None]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            k_mask = (k0 + rk) < K
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_mask[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=k_mask[:, None], other=0.0)
        if UPCAST:
            x, g, u = x.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        acc_g = _dot(x, g, acc_g)
        acc_u = _dot(x, u, acc_u)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + rn_in).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptr + N + rn_in).to(tl.float32)[None, :]
    dtype = y_ptr.dtype.element_ty
    y = silu_mul_rounded(acc_g.to(dtype).to(tl.float32), acc_u.to(dtype).to(tl.float32), dtype, PRECISE)
    mask = m_mask[:, None] & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=mask)


@triton.jit
def _e4m3_to_bf16(w):
    """FP8 e4m3 values as bf16, exactly (every e4m3 value is a bf16 value), in inline PTX: per
    4 bytes, two byte permutes put each byte in the high byte of a 16-bit half, a shift and masks
    move its exponent and mantissa into bf16's fields (which reads the value times 2^-120: e4m3's
    exponent bias is 7, bf16's 127; e4m3 subnormals become bf16 subnormals), and one bf16x2 FMA
    by 2^120 (plus -0) restores it, exactly. (e4m3's NaN encodings would read as 480; weights
    hold none.) Triton's own cast goes through fp16 and fp32 conversions, slower per element."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 a, b, t, c, z, zero;
        mov.b32 zero, 0;
        mov.b32 c, 0x7B807B80;
        mov.b32 z, 0x80008000;
        prmt.b32 a, $2, zero, 0x1404;
        prmt.b32 b, $2, zero, 0x3424;
        shr.b32 t, a, 4;
        and.b32 t, t, 0x07F007F0;
        and.b32 a, a, 0x80008000;
        or.b32 a, a, t;
        fma.rn.bf16x2 $0, a, c, z;
        shr.b32 t, b, 4;
        and.b32 t, t, 0x07F007F0;
        and.b32 b, b, 0x80008000;
        or.b32 b, b, t;
        fma.rn.bf16x2 $1, b, c, z;
        }""",
        "=r,=r,r",
        [w.to(tl.uint8, bitcast=True)],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _e4m3_bits_as_f32(w):
    """e4m3 values times 2^-120 as fp32, by integer operations: the byte's sign to fp32's sign
    bit, its exponent and mantissa to the low bits of fp32's exponent and the top of its mantissa
    (e4m3's exponent bias is 7, fp32's 127: a factor 2^-120; e4m3 subnormals become fp32
    subnormals, exactly). An arithmetic shift right by 4 of the byte placed in the top 8 bits
    puts both in place at once; -0x78100000 is the mask 0x87F00000 as an int32."""
    t = w.to(tl.uint8, bitcast=True).to(tl.int32) << 24
    return ((t >> 4) & -0x78100000).to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, acc):
    """acc + a b on tensor cores; fp32 operands (the interpreter's upcast) in IEEE fp32."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _fp8_decode_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, s_ptr,
    M, N, K, K_SPLIT, stride_xm, stride_wn, stride_ym, stride_sn,
    W_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, MMA: tl.constexpr, BITS: tl.constexpr,
    REDUCE_LATE: tl.constexpr, PREFETCH: tl.constexpr, X_FP8: tl.constexpr, UPCAST: tl.constexpr,
    LINE: tl.constexpr, LOOP_STAGES: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """FP8 weights, few rows. Program (n, m, s): outputs rn of rows rm over K[s * K_SPLIT,
    (s + 1) * K_SPLIT) (as `_linear_dot_kernel`: K_SPLIT a multiple of BLOCK_K, and of 128 under
    block scales; SPLIT_K > 1 stores unrounded fp32 partials into plane s of the workspace y).
    Each K step loads a [BLOCK_N, BLOCK_K] tile of FP8 W (16-byte loads along K), converts it
    once for all rows, then:
    - MMA: tensor cores, the converted tile (as x's dtype) times x^T [BLOCK_K, BLOCK_M] (rows
      past M zero) into a [BLOCK_N, BLOCK_M] fp32 accumulator;
    - REDUCE_LATE: fp32 FMAs into a [BLOCK_M, BLOCK_N, BLOCK_K] accumulator, reduced over K once
      after the loop (the "fma" kernel's scheme);
    - otherwise fp32 FMAs one row at a time (a static loop over ROWS rows), each row's products
      reduced over the K step into column m of a [BLOCK_N, BLOCK_M] accumulator (registers
      ~ one tile, whatever the row count).
    BITS (Triton's cast otherwise: fp8 -> fp16 -> fp32, per-element conversions are the FMA
    GEMV's bottleneck): MMA converts to bf16 in PTX (`_e4m3_to_bf16`, exact); the FMA variants
    multiply x by the weights read as fp32 times 2^-120 (`_e4m3_bits_as_f32`, integer ops) and
    scale the sums by 2^120 once (with the per-channel scale; block scales carry it). Products
    and sums stay fp32 FMAs (subnormal weights are fp32 subnormals, exact); a partial sum below
    2^-6 (in FP8 units) is an fp32 subnormal and keeps fewer bits, far below the output rounding.
    X_FP8 (MMA): no weight conversion: each K step quantizes x's [BLOCK_M, BLOCK_K] tile to e4m3
    per row (absmax -> 448, as `fp8.quantize_rows` per token but per K step: finer), multiplies
    e4m3 by e4m3 on the tensor cores and adds the step's products times each row's scale to the
    fp32 accumulator (one promotion per K step, as FP8 GEMMs keep precision on Hopper). Not
    exact in x: the precision class of cuBLASLt's FP8 path (`fp8.scaled_mm`), not the others'.
    PREFETCH: the next step's W tile (and the MMA / REDUCE_LATE x tile) is loaded before this
    step computes (twice the bytes in flight per program; FP8 tiles carry half the bytes of
    bf16 ones); the first W tile before the PDL wait (weights only), masked past the split.
    Block scales (W_SCALE 2; 128 % BLOCK_K == 0, so a K step lies in one scale block) multiply
    each step's per-output sums (REDUCE_LATE: the weights); per-channel scales (W_SCALE 1) the
    final sums, once per output (per partial under split-K)."""
    rm, rn, rk = _tile_ranges(BLOCK_M, BLOCK_N, BLOCK_K)
    k_lo = 0
    if SPLIT_K > 1:
        k_lo = tl.program_id(2) * K_SPLIT
        rk += k_lo
    rm_in = tl.minimum(rm, M - 1).to(tl.int64)
    rn_in = tl.minimum(rn, N - 1).to(tl.int64)
    w_ptrs = w_ptr + rn_in[:, None] * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm_in[:, None] * stride_xm + rk[None, :]
    cols = tl.arange(0, BLOCK_M)  # the accumulator's column of each row (MMA and row-at-a-time)
    if REDUCE_LATE and not MMA and BLOCK_M == 1:  # the GEMV: products of one row, [BLOCK_N, BLOCK_K]
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    elif REDUCE_LATE and not MMA:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # MMA: x^T's columns past M are zeros (masked: no loads), never stored. FMA (REDUCE_LATE):
    # rows past M re-read row M - 1 (loads unmasked along M), never stored.
    x_rows = (rm < M)[:, None]
    if PREFETCH:  # the first W tile: weights, so before the PDL wait
        w_next = tl.load(w_ptrs, mask=(rk < K)[None, :], other=0.0)
    elif USE_PDL:  # pull the first weight tile into L2 while the previous kernel finishes
        lines = tl.minimum(k_lo + tl.arange(0, BLOCK_K // LINE) * LINE, K - 1)
        _prefetch_l2(w_ptr + rn_in[:, None] * stride_wn + lines[None, :])
    pdl_start(USE_PDL)
    if PREFETCH and MMA:
        x_next = tl.load(x_ptrs, mask=x_rows & (rk < K)[None, :], other=0.0)
    elif PREFETCH and REDUCE_LATE:
        x_next = tl.load(x_ptrs, mask=(rk < K)[None, :], other=0.0)
    for k0 in tl.range(0, K_SPLIT, BLOCK_K, num_stages=LOOP_STAGES):
        k_mask = (k0 + rk) < K
        if PREFETCH:
            w = w_next
            more = (k0 + BLOCK_K + rk) < tl.minimum(K, k_lo + K_SPLIT)  # the next step, within the split
            w_next = tl.load(w_ptrs + BLOCK_K, mask=more[None, :], other=0.0)
            if MMA:
                x = x_next
                x_next = tl.load(x_ptrs + BLOCK_K, mask=x_rows & more[None, :], other=0.0)
            elif REDUCE_LATE:
                x = x_next
                x_next = tl.load(x_ptrs + BLOCK_K, mask=more[None, :], other=0.0)
        elif EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
        if W_SCALE == 2:
            kb = tl.minimum(k_lo + k0, K - 1) // 128
            s_blk = tl.load(s_ptr + (rn_in // 128) * stride_sn + kb)
            if BITS and not MMA:
                s_blk *= 1.329227995784916e36  # 2^120: the weights' factor 2^-120 undone with the scale
        if MMA:
            if PREFETCH:
                pass  # x loaded above
            elif EVEN_K:
                x = tl.load(x_ptrs, mask=x_rows, other=0.0)
            else:
                x = tl.load(x_ptrs, mask=x_rows & k_mask[None, :], other=0.0)
            if X_FP8:
                xf = x.to(tl.float32)
                sx = tl.maximum(tl.max(tl.abs(xf), axis=1) / 448.0, 1e-12)  # [BLOCK_M]
                xq = (xf / sx[:, None]).to(w.dtype)
                if UPCAST:
                    part = _dot(w.to(tl.float32), tl.trans(xq.to(tl.float32)), tl.zeros_like(acc))
                else:
                    part = tl.dot(w, tl.trans(xq))
                part *= sx[None, :]
                if W_SCALE == 2:
                    part *= s_blk[:, None]
                acc += part
            else:
                if BITS:
                    wc = _e4m3_to_bf16(w)
                else:
                    wc = w.to(x.dtype)  # exact: e4m3 values are bf16, fp16 and fp32 values
                if UPCAST or x.dtype == tl.float32:
                    wc = wc.to(tl.float32)
                    x = x.to(tl.float32)
                if W_SCALE == 2:  # this step's products, scaled once per output
                    acc += _dot(wc, tl.trans(x), tl.zeros_like(acc)) * s_blk[:, None]
                else:
                    acc = _dot(wc, tl.trans(x), acc)
        else:
            if BITS:
                wf = _e4m3_bits_as_f32(w)  # times 2^-120
            else:
                wf = w.to(tl.float32)
            if REDUCE_LATE:
                if PREFETCH:
                    pass  # x loaded above
                elif EVEN_K:
                    x = tl.load(x_ptrs)
                else:
                    x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
                if W_SCALE == 2:
                    wf *= s_blk[:, None]
                if BLOCK_M == 1:
                    acc += wf * x.to(tl.float32)
                else:
                    acc += x.to(tl.float32)[:, None, :] * wf[None, :, :]
            else:
                for m in tl.static_range(ROWS):
                    row = tl.minimum(tl.program_id(1) * BLOCK_M + m, M - 1).to(tl.int64)
                    xm_ptrs = x_ptr + row * stride_xm + (k0 + rk)[None, :]  # [1, BLOCK_K]
                    if EVEN_K:
                        xm = tl.load(xm_ptrs)
                    else:
                        xm = tl.load(xm_ptrs, mask=k_mask[None, :], other=0.0)
                    pm = tl.sum(wf * xm.to(tl.float32), axis=1)
                    if W_SCALE == 2:
                        pm *= s_blk
                    acc = tl.where((cols == m)[None, :], acc + pm[:, None], acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if REDUCE_LATE and not MMA and BLOCK_M == 1:
        y = tl.sum(acc, axis=1)[None, :]
    elif REDUCE_LATE and not MMA:
        y = tl.sum(acc, axis=2)
    else:
        y = tl.trans(acc)
    if W_SCALE == 1:  # per-channel scales: once per output (per partial under split-K)
        if BITS and not MMA:
            y *= 1.329227995784916e36  # 2^120 (exact)
        y *= tl.load(s_ptr + rn_in)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K > 1:
        plane = y_ptr + tl.program_id(2).to(tl.int64) * M * N
        tl.store(plane + rm.to(tl.int64)[:, None] * N + rn[None, :], y, mask=mask)
    else:
        if HAS_BIAS:
            y += tl.load(b_ptr + rn_in).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_planes(ptrs, plane, mask, SPLITS: tl.constexpr):
    """The split-K partials at `ptrs` in planes `plane` elements apart, added in split order
    in fp32 (the one order every reader of a split-K workspace uses)."""
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(ptrs + s * plane, mask=mask, other=0.0)
    return acc


@triton.jit
def _sum_splits_kernel(
    ws_ptr, b_ptr, y_ptr, M, N, stride_ym,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program (n, m): y[m, cols] = ((ws[0, m] + ws[1, m]) + ...) + b over a block of columns,
    planes added in split order in fp32 and rounded once to y's dtype."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = tl.program_id(1).to(tl.int64)
    mask = cols < N
    if HAS_BIAS:  # a weight: read before the wait
        b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_start(USE_PDL)
    plane = tl.num_programs(1).to(tl.int64) * N  # M (an M of 1 arrives as a constexpr)
    acc = _sum_planes(ws_ptr + row * N + cols, plane, mask, SPLIT_K)
    if HAS_BIAS:
        acc += b
    tl.store(y_ptr + row * stride_ym + cols, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _sum_launch(planes: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, launch: dict) -> tuple:
    """The launch of `_sum_splits_kernel` adding the fp32 planes [S, M, N] (dense) into out."""
    S, M, N = planes.shape
    block = min(SUM_BLOCK, triton.next_power_of_2(N))
    b = bias if bias is not None else planes  # never read without HAS_BIAS
    options = {"HAS_BIAS": bias is not None, "SPLIT_K": S, "BLOCK": block, "num_warps": 4, **launch}
    return _sum_splits_kernel, (triton.cdiv(N, block), M), (planes, b, out, M, N, out.stride(0)), options


def sum_planes(planes: torch.Tensor, out: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """out [M, N] = the fp32 planes [S, M, N] (dense) added in plane order and rounded once to
    out's dtype: the split-K sum, for products that leave their terms in planes (the MoE's)."""
    M, N = planes.shape[1:]
    if not planes.is_contiguous() or planes.dtype != torch.float32 or out.shape != (M, N) or out.stride(1) != 1:
        raise ValueError(
            f"sum_planes needs dense fp32 planes [S, M, N] and out [M, N], got {tuple(planes.shape)}, {tuple(out.shape)}"
        )
    if M and N:
        kernel, grid, args, options = _sum_launch(planes, None, out, launch_options(out.device, pdl))
        kernel[grid](*args, **options)
    return out


def small_m_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: LinearConfig,
    out: torch.Tensor | None = None,
    partials_only: bool = False,
    push: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    pdl: bool = True,
    w_scale: torch.Tensor | None = None,
    block_scale: bool = False,
    gated: bool = False,
) -> torch.Tensor:
    """y = x W^T (+ b) for x [M, K] (dense last dim), weight [N, K] (dense rows). With `gated`
    (an "fma" config, or an unsplit "dot" config over a dense weight; N even: an MLP's gate_up
    weight, gate rows first) y is silu(gate) * up [M, N/2] instead, in one launch (see
    `_linear_fma_kernel`, `_gated_dot_kernel`; `gated_config`, `gated_dot_config`). An FP8
    weight comes with `w_scale`: per-channel fp32 [N], or with `block_scale` the 128x128
    block scales fp32 [ceil(N/128), ceil(K/128)] (dense rows; a "dot" config then needs
    block_k 128 and 128-aligned splits: `block_fp8_config` and the rule's split configs are). `out` is an
    optional [M, N] result buffer with dense rows, in x's dtype or fp32 (then the fp32
    accumulator is stored unrounded); without it the result is a new [M, N] in x's dtype.
    A split-K config (`config.split_k` > 1) also allocates its fp32 workspace
    [split_k, M, N] here, from the caching allocator (a CUDA graph's pool under capture).
    With `partials_only` (a split-K config, no bias) the sum is left out and the workspace
    returned: `rms_norm` adds its planes as the sum kernel would. `push` = (dst_addrs,
    epochs, rank) of an LL sum (where `can_push` allows): the row also goes to the peers."""
    if partials_only and (config.split_k < 2 or bias is not None):
        raise ValueError("partials_only needs a split-K config and no bias")
    if gated and (push is not None or partials_only):
        raise ValueError("a gated product is stored whole: no push, no partials")
    if out is None:
        out = torch.empty(x.shape[0], weight.shape[0] // (2 if gated else 1), dtype=x.dtype, device=x.device)
    if push is not None and not can_push(config, x.shape[0], out.dtype):
        raise ValueError("only the one-row fma kernel with 2-byte outputs pushes to the peers")
    launches = _linear_launches(x, weight, bias, config, out, push, pdl, w_scale, block_scale, gated)
    if partials_only:
        launches = launches[:1]
    for kernel, grid, args, options in launches:
        kernel[grid](*args, **options)
    if partials_only:
        _, _, dot_args, _ = launches[0]
        return dot_args[3]  # the dot kernel's output: the fp32 workspace [split_k, M, N]
    return out


def compile_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: LinearConfig,
    out: torch.Tensor,
    pdl: bool = True,
    w_scale: torch.Tensor | None = None,
    block_scale: bool = False,
    gated: bool = False,
) -> None:
    """Compile (without running) the kernels `small_m_linear` launches for these arguments: the
    same launch arguments, so the same compile-cache keys (benchmarks compile ahead in threads)."""
    launches = _linear_launches(x, weight, bias, config, out, None, pdl, w_scale, block_scale, gated)
    for kernel, grid, args, options in launches:
        kernel.warmup(*args, grid=grid, **options)


def can_push(config: LinearConfig, M: int, out_dtype: torch.dtype) -> bool:
    """Whether `small_m_linear` can send its result to the peers of an LL sum itself: one row
    through the fma kernel (whole LL words per program), 2-byte outputs."""
    return M == 1 and config.kernel == "fma" and config.block_n % 2 == 0 and out_dtype.itemsize == 2


def _linear_launches(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: LinearConfig,
    out: torch.Tensor,
    push: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    pdl: bool = True,
    w_scale: torch.Tensor | None = None,
    block_scale: bool = False,
    gated: bool = False,
) -> list[tuple]:
    """(kernel, grid, args, options) of each launch of the product, in launch order."""
    M, K = x.shape
    N = weight.shape[0] // (2 if gated else 1)  # gated: the outputs, one per (gate, up) row pair
    if x.stride(1) != 1 or weight.stride(1) != 1 or weight.shape[1] != K:
        raise ValueError("small_m_linear needs x [M, K] and weight [N, K] with dense last dims")
    c = config
    if gated and (c.kernel not in ("fma", "dot") or weight.shape[0] % 2):
        raise ValueError("a gated product runs the fma or dot kernel on an even number of weight rows")
    if gated and c.kernel == "dot" and (c.split_k != 1 or w_scale is not None):
        raise ValueError("a gated dot product is unsplit (split_k 1) over a dense weight")
    if c.split_k < 1 or (c.split_k > 1 and c.kernel == "fma"):
        raise ValueError(f"split_k={c.split_k}: only the dot and fp8 kernels split K (split_k >= 1)")
    if (w_scale is not None) != (weight.dtype == FP8_WEIGHT):
        raise ValueError("an FP8 weight needs its w_scale, and only an FP8 weight takes one")
    if block_scale and c.kernel == "dot" and c.block_k != 128:  # then every split starts on a block
        raise ValueError("block-scaled FP8 through the dot kernel needs block_k 128")
    w_mode = 0 if w_scale is None else 2 if block_scale else 1
    s = w_scale if w_scale is not None else weight
    stride_s = s.stride(0) if block_scale else 0
    launch = launch_options(x.device, pdl)
    b = bias if bias is not None else weight
    common = {
        "BLOCK_M": c.block_m,
        "BLOCK_N": c.block_n,
        "BLOCK_K": c.block_k,
        "num_warps": c.num_warps,
        "num_stages": c.num_stages,
        **launch,
    }
    grid = (triton.cdiv(N, c.block_n), triton.cdiv(M, c.block_m), c.split_k)
    if c.kernel == "fma":
        line = min(c.block_k, 128 // weight.element_size())  # elements per 128-byte line
        dst, epochs, rank = push if push is not None else (weight, weight, 0)  # unused without a push
        args = (
            x,
            weight,
            b,
            out,
            s,
            M,
            N,
            K,
            x.stride(0),
            weight.stride(0),
            out.stride(0),
            stride_s,
            dst,
            epochs,
            rank,
        )
        world = 0 if push is None else dst.numel()
        options = {
            "W_SCALE": w_mode,
            "HAS_BIAS": bias is not None,
            "EVEN_K": K % c.block_k == 0,
            "LINE": line,
            "PUSH_WORLD": world,
            "LOOP_STAGES": c.num_stages,
            "GATED": gated,
            "PRECISE": not INTERPRET,
        }
        options.update(common)
        return [(_linear_fma_kernel, grid[:2], args, options)]
    if c.kernel == "fp8":
        return _fp8_launches(x, weight, bias, c, out, s, stride_s, block_scale, common, launch, grid)
    if gated:
        args = (x, weight, b, out, M, N, K, x.stride(0), weight.stride(0), out.stride(0))
        options = {"HAS_BIAS": bias is not None, "EVEN_K": K % c.block_k == 0, "UPCAST": DOT_F32}
        return [(_gated_dot_kernel, grid[:2], args, {**options, "PRECISE": not INTERPRET, **common})]
    # Each split covers a whole number of K blocks; EVEN_K: every split's blocks lie within K.
    k_split = triton.cdiv(triton.cdiv(K, c.split_k), c.block_k) * c.block_k
    even_k = K % (c.block_k * c.split_k) == 0
    dot = {"W_SCALE": w_mode, "SPLIT_K": c.split_k, "EVEN_K": even_k, "UPCAST": DOT_F32, **common}
    return _split_launches(_linear_dot_kernel, grid, x, weight, bias, out, s, stride_s, k_split, c.split_k, dot, launch)


def _split_launches(kernel, grid, x, weight, bias, out, s, stride_s, k_split, split_k, options, launch) -> list[tuple]:
    """`kernel` (dot or fp8) storing y at split_k 1; else storing its fp32 partials to a
    workspace [split_k, M, N], then `_sum_splits_kernel` adding them in split order."""
    M, K = x.shape
    N = weight.shape[0]
    b = bias if bias is not None else weight  # never read without HAS_BIAS
    if split_k == 1:
        args = (x, weight, b, out, s, M, N, K, k_split, x.stride(0), weight.stride(0), out.stride(0), stride_s)
        return [(kernel, grid, args, {"HAS_BIAS": bias is not None, **options})]
    ws = torch.empty(split_k, M, N, dtype=torch.float32, device=x.device)
    args = (x, weight, b, ws, s, M, N, K, k_split, x.stride(0), weight.stride(0), N, stride_s)
    return [(kernel, grid, args, {"HAS_BIAS": False, **options}), _sum_launch(ws, bias, out, launch)]


def _fp8_launches(x, weight, bias, c, out, s, stride_s, block_scale, common, launch, grid) -> list[tuple]:
    """The launches of the "fp8" kernel (`_linear_launches`' arguments, checked there)."""
    M, K = x.shape
    if weight.dtype != FP8_WEIGHT:
        raise ValueError("the fp8 kernel takes FP8 weights (with their w_scale) only")
    if block_scale and 128 % c.block_k:
        raise ValueError("block-scaled FP8 through the fp8 kernel needs block_k dividing 128")
    if c.mma and min(c.block_m, c.block_n, c.block_k) < 16:
        raise ValueError("the fp8 kernel's mma variant needs block_m, block_n and block_k >= 16")
    if c.x_fp8 and (not c.mma or c.block_k < 32):
        raise ValueError("x_fp8 is an mma variant (block_k >= 32: FP8 tensor-core steps)")
    # Each split covers a whole number of K steps (of scale blocks under block scales).
    unit = 128 if block_scale and c.split_k > 1 else c.block_k
    k_split = triton.cdiv(triton.cdiv(K, c.split_k), unit) * unit
    options = {
        "W_SCALE": 2 if block_scale else 1,
        "ROWS": min(M, c.block_m) if not (c.mma or c.reduce_late) else 1,  # (one compile for every M)
        "SPLIT_K": c.split_k,
        "EVEN_K": k_split * c.split_k == K,
        "MMA": c.mma,
        # MMA's bit conversion is PTX (bf16 x; the interpreter runs Triton's cast instead)
        "BITS": c.bit_cvt and (not c.mma or (not INTERPRET and x.dtype == torch.bfloat16)),
        "REDUCE_LATE": c.reduce_late,
        "PREFETCH": c.prefetch,
        "X_FP8": c.x_fp8,
        "UPCAST": DOT_F32,
        "LINE": min(c.block_k, 128),  # FP8: one element per byte, 128 per L2 line
        "LOOP_STAGES": c.num_stages,  # the loop names its stages: pipelined with or without a dot
        **common,
    }
    return _split_launches(
        _fp8_decode_kernel, grid, x, weight, bias, out, s, stride_s, k_split, c.split_k, options, launch
    )


# The rule, from `python benchmarks/probes/profile_decode.py --gemv` on an H200 (2026-11-21): for the
# decoder shapes of qwen3-0.6b and llama-3.1-8b at M = 1, 2, 4, 8 it timed cuBLAS (F.linear)
# and a sweep of configs, each inside a CUDA graph of back-to-back calls over weight copies
# larger than L2 (as decode streams each layer's weights from memory). What it showed:
# - M = 1: the fma GEMV beat cuBLAS on all ten shapes, 1.03x (large: LM heads, llama
#   gate_up) to 4x (qwen3 o_proj 1024x2048, where cuBLAS reached 0.33 TB/s). Few rows
#   (N <= 2048) are latency-bound: 2-row tiles over long K spread the matrix over the most
#   programs (0.96-1.04x of the best config there); otherwise 4 x 1024 tiles on 2 warps were
#   within 9% of the best config of every shape (mostly 0-5%).
# - M = 2..4: cuBLAS matched or beat every Triton config except on small matrices (N*K <= 2M
#   elements: qwen3 o_proj), where it is 2.3x slower than the fma kernel with 2-row tiles.
# - M = 2..8 on vocabulary projections (N >= 65536): the dot kernel beat cuBLAS by 2-4%.
# - everything else (M = 5..8, M = 2..4 on larger matrices): cuBLAS, by up to 1.25x.
# M = 9..256, from `python benchmarks/probes/gemm_decode.py --model qwen3` on an H200 (2026-11-21,
# the same timing method; a config sweep at M = 16, 32, 64, 128, 192, 256, then this rule
# against cuBLAS at M = 16..256 in a second run; cuBLAS takes >= 5.3 us per call however small
# the matrix). Taken where a config beat cuBLAS by >= 5% in the sweep, generalised by shape:
# - narrow matrices (N <= 1024 outputs, K >= 2048, N*K <= 4M elements: qwen3 o_proj 1024x2048
#   and down 1024x3072) give cuBLAS too few output tiles; split-K (2 or 4 programs along K),
#   with the sweep's best config per M range. Rule / cuBLAS in the second run: down 0.63-0.71
#   at M <= 128, 0.89-0.93 at 192-256; o_proj 0.69-0.99 (0.93-0.95 at 192-256) except 1.055
#   at M = 32, where the sweep had measured 0.81 with the same config (run-to-run noise of
#   these 4-6 us timings is up to ~20%: kept, to be re-measured).
# - the LM head at hidden <= 1024 (qwen3 151936x1024): the unsplit dot kernel, 0.94 of
#   cuBLAS at M = 16 and 32 in both runs; cuBLAS from 48 rows.
# - not taken: qwen3 qkv 4096x1024 at M = 16 (split-2: 0.92 of cuBLAS in the sweep, 0.99 in
#   the second run), gate_up 6144x1024 (cuBLAS as fast or faster at every M).
# Llama-3.1-8b's shapes were not swept at M > 8: no rule above matches them, so cuBLAS.
# Split-K configs are only returned where each split is a whole number of K blocks
# (K % (split_k * block_k) == 0): no masked tail, every split the same length.
# FP8 weights (`small_m_linear(w_scale=...)`) take the same rule as bf16 for now: the same
# kernels stream half the bytes. Measured on an H200 (benchmarks/results/2026-11-25.md) that is 1.67x
# faster than bf16 per llama layer at M = 1, but slower than bf16 at M = 2 and 4, where the
# rule leaves llama's shapes to cuBLASLt's FP8 GEMM (1.0-1.2 TB/s). The "fp8" kernel enters
# through `fp8_linear_config` once benchmarks/probes/fp8_decode_sweep.py has measured it.
# Block-scaled FP8 has no cuBLAS path: `block_fp8_config` gives its Triton tiles at every M the
# rule leaves to cuBLAS.
MAX_M = 256
_FAST_DTYPES = (torch.bfloat16, torch.float16)
_rule_cache: dict[tuple[int, int, int, torch.dtype], LinearConfig | None] = {}


def linear_config(M: int, N: int, K: int, dtype: torch.dtype) -> LinearConfig | None:
    """The launch config for an [M, K] x [N, K]^T product on CUDA, or None for cuBLAS."""
    key = (M, N, K, dtype)
    if key not in _rule_cache:
        _rule_cache[key] = _choose(M, N, K, dtype)
    return _rule_cache[key]


def _choose(M: int, N: int, K: int, dtype: torch.dtype) -> LinearConfig | None:
    if dtype not in _FAST_DTYPES or not 1 <= M <= MAX_M or K % 8:  # K % 8: 16-byte rows
        return None
    if M <= 8:
        config = _choose_few_rows(M, N, K)
        return config if config is not None or M < 5 else _choose_up_to_16_rows(N, K)
    if N >= 65536 and K <= 1024 and M <= 32:
        return LinearConfig("dot", 16 if M <= 16 else 32, 128, 128, num_warps=4, num_stages=3)
    config = None
    if N <= 1024 and K >= 2048 and N * K <= 2**22:
        if M <= 16:
            config = LinearConfig("dot", 16, 32, 128, num_warps=4, num_stages=4, split_k=4)
        elif M <= 32:
            config = LinearConfig("dot", 16, 64, 128, num_warps=4, num_stages=4, split_k=4)
        elif M <= 64:
            config = LinearConfig("dot", 64, 32, 128, num_warps=4, num_stages=4, split_k=4)
        elif M <= 128 and K >= 3072:  # down: 4 splits of 768, 64-wide tiles
            config = LinearConfig("dot", 64, 64, 128, num_warps=4, num_stages=4, split_k=4)
        elif M <= 128:  # o_proj: 2 splits of 1024, 32-wide tiles
            config = LinearConfig("dot", 64, 32, 128, num_warps=4, num_stages=4, split_k=2)
        else:
            config = LinearConfig("dot", 64, 64, 128, num_warps=4, num_stages=4, split_k=2)
    if config is None and M <= 16:
        config = _choose_up_to_16_rows(N, K)
    if config is None or K % (config.split_k * config.block_k):
        return None
    return config


# M = 5..16 where the rules above leave cuBLAS (speculative verify steps: 1 + K drafts rows per
# request, padded to the decode graphs' 8 or 16), from `python benchmarks/probes/gemm_decode.py
# --model smollm2 --ms 8 16` and `--model llama --ms 8` on an H200 (benchmarks/results/2026-12-01.md):
# - llama-3.1-8b at M = 8: split-K 16 x 128 tiles beat cuBLAS on qkv (split 2: 15.2 against
#   16.1 us), o_proj (split 4: 11.2 against 13.5) and down (split 4: 31.0 against 32.9); gate_up
#   (N = 7K) stays with cuBLAS (57.4 against 60.9). Taken for K >= 4096 and N <= 2K (at most 8192).
#   The tile pads M to 16 rows, so its work is the same at M = 9..16 (timed at 8 only).
# - small matrices (N*K <= 2M elements, K < 2048: SmolLM2-135M's layers, where cuBLAS spends
#   3.4-5.2 us a call): 16 x 32 tiles 64 deep, split along K where N <= 1024 (qkv 3.3 against
#   3.8 us, o_proj 3.0 against 3.5, down 3.8 against 5.1; the sweep's split 4 of K = 576 runs
#   three 192-deep splits, as split 3 does), unsplit otherwise (gate_up 3.9 against 4.2).
def _choose_up_to_16_rows(N: int, K: int) -> LinearConfig | None:
    if K >= 4096 and N <= min(2 * K, 8192):
        return LinearConfig("dot", 16, 128, 128, num_warps=4, num_stages=4, split_k=2 if N > K else 4)
    if N * K <= 2**21 and K < 2048:
        if N > 1024:
            return LinearConfig("dot", 16, 32, 64, num_warps=4, num_stages=4)
        split = next((s for s in (4, 3, 2) if K % (s * 64) == 0), 1)
        return LinearConfig("dot", 16, 32, 64, num_warps=4, num_stages=4, split_k=split)
    return None


def _choose_few_rows(M: int, N: int, K: int) -> LinearConfig | None:
    """M = 1..8 (see the rule above)."""
    if M == 1:
        return _choose_gemv(N, K)
    if M <= 4 and N * K <= 2**21:
        return LinearConfig("fma", triton.next_power_of_2(M), 2, 512, num_warps=4)
    if N >= 65536:
        return LinearConfig("dot", 16, 64, 128, num_warps=4, num_stages=3)
    return None


# One row (the GEMV), from `python benchmarks/probes/gemv_stages.py` on an H200 (benchmarks/results/2026-11-27.md; bf16 and per-channel FP8 weights, llama-3.1-8b, qwen3-8b, qwen3-30b-a3b and
# qwen3-0.6b shapes, 12 tiles x loop stages 1-6). A pipelined K loop (LOOP_STAGES: cp.async
# into shared memory) keeps bytes in flight without registers; it pays wherever K takes more
# than one step:
# - bf16: 4 x 1024 tiles on 2 warps as before, 3 stages (llama-3.1-8b's four GEMVs 113.9 us
#   per layer against 115.2; qwen3-30b-a3b's qkv 6.9 against 8.1 us); narrow outputs
#   (1024-2048) take the same tile at 6 stages instead of 2-row tiles (qwen3-0.6b's down 3.4
#   against 4.4 us, qwen3-30b-a3b's o_proj 5.7 against 7.3); vocabulary projections 16 x 128
#   tiles at 6 stages (llama's LM head 234 against 244 us, qwen3-0.6b's 74 against 83).
# - FP8 (half the bytes per element, so more steps in flight matter more): wide outputs
#   (N >= 4K: gate_up) 8 x 256 tiles on 2 warps at 3 stages (llama 31.3 against 36.6 us, qwen3
#   28.8 against 32.2), the rest 4 x 1024 at 3 stages (down 16.7 against 18.2): a llama-3.1-8b
#   layer 63.7 us against 71.7. Outputs between K and 4K wide (qkv, 6144 x 4096) take 16 x 512
#   tiles on 8 warps at 4 stages: 8.7 against 9.5 us there, and 8.8 against 9.4 in a second
#   sweep (2026-11-27, `gemv_stages.py --bits`), where every other shape kept its tile.
# Below 1024 outputs or with K in one step (K <= 1024), the rule of 2026-11-21 stands.
# - Outputs of 2049-3072 with K >= 4096 (gpt-oss's o_proj, 2880 x 4096): 2 x 1024 tiles at 6
#   stages, 7.6 us against 9.0 for the 4 x 1024 rule (`gemv_stages.py --shapes oss_o`, H200,
#   2026-12-04; its qkv, 5120 x 2880, kept its tile: 9.2 against the best 9.0).
def _choose_gemv(N: int, K: int) -> LinearConfig:
    """M = 1 with bf16/fp16 weights (see the rule above)."""
    if N >= 65536:  # vocabulary projections
        return LinearConfig("fma", 1, 16, 128, num_warps=2, num_stages=6)
    block_k = min(1024, triton.next_power_of_2(K))
    if N <= 2048 and (N < 1024 or K <= 1024):
        return LinearConfig("fma", 1, 2, min(2048, triton.next_power_of_2(K)), num_warps=8)
    if 2048 < N <= 3072 and K >= 4096:
        return LinearConfig("fma", 1, 2, 1024, num_warps=2, num_stages=6)
    stages = 1 if K <= block_k else 6 if N <= 2048 else 3
    return LinearConfig("fma", 1, 4, block_k, num_warps=2, num_stages=stages)


def _choose_fp8_gemv(N: int, K: int) -> LinearConfig | None:
    """M = 1 with per-channel FP8 weights (see the rule above), None for the bf16 rule's."""
    if K <= 1024:
        return None
    if N >= 4 * K:
        return LinearConfig("fma", 1, 8, 256, num_warps=2, num_stages=3)
    if N > K:  # qkv: 16 x 512 tiles on 8 warps (see the rule above)
        return LinearConfig("fma", 1, 16, 512, num_warps=8, num_stages=4)
    return LinearConfig("fma", 1, 4, 1024, num_warps=2, num_stages=3)


def gated_config(config: LinearConfig | None) -> LinearConfig | None:
    """The config of the gated product (`small_m_linear(gated=True)`: an MLP's gate_up GEMV with
    SiLU-and-mul in its epilogue) from the one the rule gives the plain gate_up product at that
    M, or None where that is not the fma kernel (then the product and the SiLU-and-mul run
    apart). A gated program streams a gate and an up tile of half the rule's rows each, so the
    programs and their bytes stay those the rule measured. `benchmarks/probes/gemv_silu.py`
    times the alternatives: the tiles it preferred on an H100 (6 loop stages for bf16, four K
    steps where K <= 1024) were slower on an H200 end to end (benchmarks/results/2026-11-27.md)."""
    if config is None or config.kernel != "fma":
        return None
    return replace(config, block_n=max(1, config.block_n // 2))


# The gated dot kernel at M = 5..16 (speculative verify steps; `fused_16_rows`): one launch
# instead of the product (cuBLAS or the dot kernel) and the SiLU-and-mul kernel. Not measured
# yet (`python benchmarks/probes/gemm_decode.py --gated`, which times it against cuBLAS +
# silu_and_mul): where the rule gives the product unsplit 16-row dot tiles (SmolLM2-135M's
# gate_up) it takes them at half the width per gate and up tile, so the programs and their
# bytes stay those the rule measured (as `gated_config` does for the GEMV); where the rule
# leaves a long-K product to cuBLAS (llama-3.1-8b's gate_up, 28672 x 4096) 16 x 64 tiles 128
# deep over 4 stages (224 programs at I = 14336; each streams a gate and an up tile, the
# bytes of the 16 x 128 tiles the split-K rule took on llama's other products).
def gated_dot_config(M: int, N: int, K: int, dtype: torch.dtype) -> LinearConfig | None:
    """The gated dot kernel's config (`small_m_linear(gated=True)`) for x [M, K] times a dense
    gate_up weight [N = 2I, K], or None where the product and the SiLU-and-mul run apart
    (outside 5..16 rows, where the rule splits K or runs the fma kernel, short-K products
    cuBLAS keeps); see the rule above."""
    if dtype not in _FAST_DTYPES or not 5 <= M <= 16 or K % 8 or N % 2:
        return None
    plain = linear_config(M, N, K, dtype)
    if plain is None:
        return LinearConfig("dot", 16, 64, 128, num_warps=4, num_stages=4) if K >= 4096 else None
    if plain.kernel == "dot" and plain.split_k == 1 and plain.block_m == 16:
        return replace(plain, block_n=max(16, plain.block_n // 2))  # tl.dot's tiles are >= 16 wide
    return None


def fp8_linear_config(M: int, N: int, K: int, dtype: torch.dtype, block: bool = False) -> LinearConfig | None:
    """The launch config for x [M, K] times an FP8 weight [N, K]^T (block: 128x128 block scales,
    else per-channel) on CUDA, or None for cuBLASLt's FP8 GEMM (per-channel) or
    `block_fp8_config` (block). M = 1..8: `_choose_fp8_few_rows` where it names a config (the
    GEMV's FP8 tiles at M = 1, "fp8" kernel configs at 2..8); otherwise the bf16 rule
    (`linear_config`).
    (benchmarks/probes/fp8_decode_sweep.py times the candidates against cuBLASLt and this rule.)"""
    if dtype in _FAST_DTYPES and 1 <= M <= 8 and K % 16 == 0:
        config = _choose_fp8_few_rows(M, N, K, block)
        if config is not None:
            return config
    return linear_config(M, N, K, dtype)


# FP8 weights at M = 2..8 (benchmarks/probes/fp8_decode_sweep.py on an H100, 2026-11-26, llama-3.1-8b
# and qwen3-8b shapes, M = 1, 2, 3, 4, 6, 8): the tensor-core variant on e4m3 x e4m3 (`x_fp8`:
# x rounded per row and K step, the precision class of cuBLASLt's path, which rounds x per
# token) won every shape at every M from 2: a llama-3.1-8b layer's four GEMMs in 93-97 us,
# against 145-148 us through cuBLASLt (smm) and 166 us in bf16. Wide outputs (qkv, gate_up)
# take 256-wide K steps in 4 splits, the rest (o_proj, down) 128-wide steps in 8 splits.
# At M = 1 the fma GEMV stays faster (85.7 against 90.8 us per layer), with its own FP8 tiles
# (`_choose_fp8_gemv`). Block scales are not swept yet: they keep `block_fp8_config`.
def _choose_fp8_few_rows(M: int, N: int, K: int, block: bool) -> LinearConfig | None:
    """M = 1..8 with FP8 weights: at M = 1 the GEMV's FP8 tiles, at 2..8 an "fp8" kernel
    config (block scales need 128 % block_k == 0), or None to keep the bf16 rule's choice (see
    the measurements above; block scales are not swept yet)."""
    if block or not 1 <= M <= 8:
        return None
    if M == 1:
        return _choose_fp8_gemv(N, K)
    if N > K and K % (4 * 256) == 0:
        return LinearConfig("fp8", 16, 64, 256, num_warps=4, num_stages=3, split_k=4, mma=True, x_fp8=True)
    if K % (8 * 128) == 0:
        return LinearConfig("fp8", 16, 64, 128, num_warps=4, num_stages=4, split_k=8, mma=True, x_fp8=True)
    return None


def block_fp8_config(M: int, N: int, K: int) -> LinearConfig:
    """The dot kernel's tiles for a block-scaled FP8 product the rule leaves to cuBLAS (not
    tuned: 64 x 128 tiles over 128-wide K blocks, one scale block per K step)."""
    if M <= 64:
        return LinearConfig("dot", 16 if M <= 16 else 64, 128, 128, num_warps=4, num_stages=4)
    return LinearConfig("dot", 128, 128, 128, num_warps=8, num_stages=3)
