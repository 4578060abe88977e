"""Triton kernels for the decode hot path of the decoder's layers.

Owns six kernel families, their launchers and the rule that decides when the small-M linear
is used; the kernels launch with programmatic dependent launch where the GPU has it
(nanoserve/triton_pdl.py):
- `small_m_linear(x, weight, bias, config)`: y = x W^T (+ b) for the rows of a decode batch
  (M = 1..256). cuBLAS picks tiles made for large M and, on small matrices, spends >= 5 us per
  call whatever M; these kernels stream W once with wide loads:
  * "fma": products and sums on the CUDA cores, a [BLOCK_M, BLOCK_N, BLOCK_K] fp32
    accumulator reduced over K once at the end (BLOCK_M = 1 is the GEMV);
  * "dot": tensor-core tiles with M padded to BLOCK_M (rows past M are masked, never stored),
    optionally split along K (`split_k` programs per output tile, each storing its fp32
    partial to a workspace [split_k, M, N]; a second kernel adds the partials in split order
    and rounds once). The same kernels serve benchmarks/gemm_decode.py's sweep.
  `linear_config(M, N, K, dtype)` is the measured rule (see its comment): a config, or
  None where cuBLAS is as fast.
- `qk_norm_rope(positions, q, k, cos, sin, ...)`: Qwen3's per-head RMSNorm of q and k
  followed by the neox rotary embedding, one launch for both tensors (Llama: rotary only);
  optionally the same launch writes the rotated k and v into the KV cache (the store that
  attention's `store_kv` would otherwise do in a launch of its own).
- `rms_norm(x, weight, eps, residual)`: RMSNorm of each row, optionally after adding the
  residual (returning the sum too), one program per row. As fast as the torch.compile'd
  version (1.46 vs 1.45 us per call at hidden 1024, 1.92 vs 2.16 at 4096) and, unlike it,
  lets the next matmul launch early under PDL.
- `all_reduce_rms_norm(part, ...)`: under tensor parallelism, the sum of every rank's
  partial rows read straight from the peers' memory over NVLink (a one-shot all-reduce),
  plus the residual (if any: the embedding's sum has none), then RMSNorm: one launch where
  NCCL's all-reduce and `rms_norm` took two.
  `ll_all_reduce_rms_norm` is the same over the low-latency protocol: each rank pushes its
  partials into its peers' memory as 64-bit words tagged with the call count, and polls its
  own memory (no flags, no reads over NVLink).
  The buffers and the call protocols are nanoserve/distributed/symm_all_reduce.py's.
- `silu_and_mul(gate_up)`: the MLP's silu(gate) * up, one launch over rows x column blocks,
  under PDL (the torch.compile'd version it replaces cannot launch the down projection early).

Invariants:
- accumulation and normalisation run in fp32 whatever the input dtype; each output element
  is rounded once to the input dtype, except where the torch reference rounds in between
  (the normalised value before the norm weight, cos/sin to the input dtype, silu(gate)
  before the product), which the kernel repeats so that both paths agree within one bf16
  rounding;
- the split-K product is deterministic: the partials of an output element are added in split
  order, each partial's K order fixed by the config, so repeat runs are bit-identical and a
  row's result does not depend on the other rows of the batch (for a given config);
- launchers read no device data on the host and allocate only outputs and workspaces whose
  shapes come from the inputs' shapes, so they can be captured in CUDA graphs;
- on Hopper and later every kernel is launched with programmatic dependent launch
  (nanoserve/triton_pdl.py): before its `gdc_wait` a kernel reads only weights and writes
  nothing, so starting it while the previous kernel still runs never changes a result;
- `small_m_linear` needs x with a dense last dim and W with dense rows ([N, K], as
  nn.Linear stores it); `linear_config` returns None otherwise, so callers fall back to
  F.linear. A bias is added in fp32 before the one rounding (as cuBLAS's epilogue).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from nanoserve.triton_pdl import launch_options, pdl_start

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Triton's interpreter computes bf16 tl.dot wrongly (see attention/triton_kernels.py): under the
# interpreter the dot kernel upcasts its operands to fp32. Compiled kernels never do.
DOT_F32 = INTERPRET


@dataclass(frozen=True)
class LinearConfig:
    kernel: str  # "fma" or "dot"
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    split_k: int = 1  # "dot" only: programs along K, their fp32 partials summed by a second kernel


SUM_BLOCK = 1024  # columns per program of the split-K sum


# ------------------------------------------------------------------------------ small-M linear


@triton.jit
def _tile_ranges(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's output rows (M), output columns (N) and the K offsets of one tile;
    program axis 0 walks N, axis 1 walks M."""
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rm, rn, tl.arange(0, BLOCK_K)


@triton.jit
def _linear_fma_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym,
    push_addrs, epoch_ptr, rank,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, LINE: tl.constexpr, PUSH_WORLD: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """PUSH_WORLD > 0 (one row, 2-byte y): each program also stores its outputs into every
    peer's LL receive buffer (`_ll_push_row`), so the sum's kernel does not send them."""
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
    if USE_PDL:
        # Under PDL this program may start while the previous kernel still runs: pull the first
        # weight tile into L2 meanwhile (weights are never written), then wait before reading x.
        # (More than one tile was slower: 2 x H200, RESULTS.md, seventh round.)
        lines = tl.minimum(tl.arange(0, BLOCK_K // LINE) * LINE, K - 1)  # within the rows
        _prefetch_l2(w_ptr + rn_in[:, None] * stride_wn + lines[None, :])
        pdl_start(USE_PDL)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs).to(tl.float32)
            w = tl.load(w_ptrs).to(tl.float32)
        else:
            k_mask = (k0 + rk) < K
            x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0).to(tl.float32)
        if BLOCK_M == 1:
            acc += w * x
        else:
            acc += x[:, None, :] * w[None, :, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if BLOCK_M == 1:
        y = tl.sum(acc, axis=1)[None, :]
    else:
        y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn_in).to(tl.float32)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if PUSH_WORLD > 0:
        _ll_push_row(y, N, push_addrs, epoch_ptr, rank, y_ptr.dtype.element_ty, BLOCK_N, PUSH_WORLD)


@triton.jit
def _ll_push_row(y, N, dst_addrs, epoch_ptr, rank, dtype: tl.constexpr, BLOCK_N: tl.constexpr, WORLD: tl.constexpr):
    """This program's BLOCK_N columns of row 0 (y [1, BLOCK_N] fp32, rounded to the 2-byte
    `dtype` as stored) into every peer's receive buffer (`dst_addrs[q]`, as the LL kernel's
    send: two columns per 64-bit word, the even one in the low half, under the call count).
    The count is that of the LL call that sums this row: program 0's next (`_next_call`);
    the previous fused call has completed (PDL), and the coming one counts only after this
    kernel has. Why here: the words leave as each program finishes instead of after the
    whole matmul, and the sum's kernel only waits (measured in RESULTS.md, eleventh round)."""
    tag = (tl.load(epoch_ptr) + 1) << 32
    bits = y.to(dtype).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    lo, hi = tl.split(tl.reshape(bits, [BLOCK_N // 2, 2]))
    widx = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    _ll_send(dst_addrs, widx, lo | (hi << 16), tag, widx < N // 2, rank, WORLD)


@triton.jit
def _ll_send(dst_addrs, offsets, data, tag, mask, rank, WORLD: tl.constexpr):
    """32-bit `data` as LL words (the call count `tag` in the high 32 bits) at `offsets` (in
    words) of every peer's receive buffer (`dst_addrs[q]`, 256-byte aligned). Peers only, by
    the store's mask: a branch on the runtime rank here failed to compile in Triton 3.6 at
    WORLD = 4 (sm_90), "operand does not dominate this use"."""
    word = tag | data.to(tl.uint32).to(tl.int64)  # the 32 bits, zero-extended
    for q in tl.static_range(WORLD):
        dst = tl.multiple_of(tl.load(dst_addrs + q).to(tl.pointer_type(tl.int64)), 16)
        tl.store(dst + offsets, word, mask=mask & (tl.full([1], q, tl.int32) != rank))


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the lines at `ptrs` (one pointer per 128-byte line); nothing waits for them."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _linear_dot_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K, K_SPLIT, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
        if UPCAST:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        elif x.dtype == tl.float32:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask = m_mask[:, None] & (rn[None, :] < N)
    if SPLIT_K > 1:
        plane = y_ptr + tl.program_id(2).to(tl.int64) * M * N
        tl.store(plane + rm.to(tl.int64)[:, None] * N + rn[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn_in).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


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


def small_m_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: LinearConfig,
    out: torch.Tensor | None = None,
    partials_only: bool = False,
    push: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """y = x W^T (+ b) for x [M, K] (dense last dim), weight [N, K] (dense rows). `out` is an
    optional [M, N] result buffer with dense rows, in x's dtype or fp32 (then the fp32
    accumulator is stored unrounded); without it the result is a new [M, N] in x's dtype.
    A split-K config (`config.split_k` > 1) also allocates its fp32 workspace
    [split_k, M, N] here, from the caching allocator (a CUDA graph's pool under capture).
    With `partials_only` (a split-K config, no bias) the sum is left out and the workspace
    returned: `rms_norm` adds its planes as the sum kernel would. `push` = (dst_addrs,
    epochs, rank) of an LL sum (where `can_push` allows): the row also goes to the peers."""
    if partials_only and (config.split_k < 2 or bias is not None):
        raise ValueError("partials_only needs a split-K config and no bias")
    if out is None:
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    if push is not None and not can_push(config, x.shape[0], out.dtype):
        raise ValueError("only the one-row fma kernel with 2-byte outputs pushes to the peers")
    launches = _linear_launches(x, weight, bias, config, out, push)
    if partials_only:
        launches = launches[:1]
    for kernel, grid, args, options in launches:
        kernel[grid](*args, **options)
    if partials_only:
        _, _, dot_args, _ = launches[0]
        return dot_args[3]  # the dot kernel's output: the fp32 workspace [split_k, M, N]
    return out


def compile_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: LinearConfig, out: torch.Tensor
) -> None:
    """Compile (without running) the kernels `small_m_linear` launches for these arguments: the
    same launch arguments, so the same compile-cache keys (benchmarks compile ahead in threads)."""
    for kernel, grid, args, options in _linear_launches(x, weight, bias, config, out):
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
) -> list[tuple]:
    """(kernel, grid, args, options) of each launch of the product, in launch order."""
    M, K = x.shape
    N = weight.shape[0]
    if x.stride(1) != 1 or weight.stride(1) != 1 or weight.shape[1] != K:
        raise ValueError("small_m_linear needs x [M, K] and weight [N, K] with dense last dims")
    c = config
    if c.split_k < 1 or (c.split_k > 1 and c.kernel != "dot"):
        raise ValueError(f"split_k={c.split_k}: only the dot kernel splits K (split_k >= 1)")
    pdl = launch_options(x.device)
    b = bias if bias is not None else weight
    common = {
        "BLOCK_M": c.block_m,
        "BLOCK_N": c.block_n,
        "BLOCK_K": c.block_k,
        "num_warps": c.num_warps,
        "num_stages": c.num_stages,
        **pdl,
    }
    grid = (triton.cdiv(N, c.block_n), triton.cdiv(M, c.block_m), c.split_k)
    if c.kernel == "fma":
        line = min(c.block_k, 128 // weight.element_size())  # elements per 128-byte line
        dst, epochs, rank = push if push is not None else (weight, weight, 0)  # unused without a push
        args = (x, weight, b, out, M, N, K, x.stride(0), weight.stride(0), out.stride(0), dst, epochs, rank)
        world = 0 if push is None else dst.numel()
        options = {"HAS_BIAS": bias is not None, "EVEN_K": K % c.block_k == 0, "LINE": line, "PUSH_WORLD": world}
        options.update(common)
        return [(_linear_fma_kernel, grid[:2], args, options)]
    # Each split covers a whole number of K blocks; EVEN_K: every split's blocks lie within K.
    k_split = triton.cdiv(triton.cdiv(K, c.split_k), c.block_k) * c.block_k
    even_k = K % (c.block_k * c.split_k) == 0
    dot = {"SPLIT_K": c.split_k, "EVEN_K": even_k, "UPCAST": DOT_F32, **common}
    if c.split_k == 1:
        args = (x, weight, b, out, M, N, K, k_split, x.stride(0), weight.stride(0), out.stride(0))
        return [(_linear_dot_kernel, grid, args, {"HAS_BIAS": bias is not None, **dot})]
    ws = torch.empty(c.split_k, M, N, dtype=torch.float32, device=x.device)
    args = (x, weight, b, ws, M, N, K, k_split, x.stride(0), weight.stride(0), N)
    block = min(SUM_BLOCK, triton.next_power_of_2(N))
    sum_args = (ws, b, out, M, N, out.stride(0))
    sum_options = {"HAS_BIAS": bias is not None, "SPLIT_K": c.split_k, "BLOCK": block, "num_warps": 4, **pdl}
    return [
        (_linear_dot_kernel, grid, args, {"HAS_BIAS": False, **dot}),
        (_sum_splits_kernel, (triton.cdiv(N, block), M), sum_args, sum_options),
    ]


# The rule, from `python benchmarks/profile_decode.py --gemv` on an H200 (2026-11-21): for the
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
# M = 9..256, from `python benchmarks/gemm_decode.py --model qwen3` on an H200 (2026-11-21,
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
        return _choose_few_rows(M, N, K)
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
    if config is None or K % (config.split_k * config.block_k):
        return None
    return config


def _choose_few_rows(M: int, N: int, K: int) -> LinearConfig | None:
    """M = 1..8 (see the rule above)."""
    if M == 1:
        if N <= 2048:
            return LinearConfig("fma", 1, 2, min(2048, triton.next_power_of_2(K)), num_warps=8)
        return LinearConfig("fma", 1, 4, min(1024, triton.next_power_of_2(K)), num_warps=2)
    if M <= 4 and N * K <= 2**21:
        return LinearConfig("fma", triton.next_power_of_2(M), 2, 512, num_warps=4)
    if N >= 65536:
        return LinearConfig("dot", 16, 64, 128, num_warps=4, num_stages=3)
    return None


# ---------------------------------------------------------------------- q/k RMSNorm + rotary


@triton.jit
def _lanes(d, HALF: tl.constexpr):
    """The valid lanes of a half head. A power-of-two half needs no lane mask: leaving it out
    keeps the loads 16 bytes wide (Triton cannot see that `d < HALF` is all true)."""
    if HALF == d.shape[0]:
        return tl.full(d.shape, 1, tl.int1)
    return d < HALF


@triton.jit
def _norm_rope_heads(
    src, w_ptr, h0, num_heads, stride_h, cos, sin, d, eps, dtype: tl.constexpr,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    """Normalise (optionally) and rotate heads h0 .. h0 + BLOCK_H of one token: the rotated
    halves (rounded to dtype), the heads and the mask."""
    h = h0 + tl.arange(0, BLOCK_H)
    mask = (h < num_heads)[:, None] & _lanes(d, HALF)[None, :]
    p1 = src + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
        w1 = tl.load(w_ptr + d, mask=_lanes(d, HALF), other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + d, mask=_lanes(d, HALF), other=0.0).to(tl.float32)[None, :]
        # As the reference: normalised value rounded to the dtype, times the weight, rounded.
        x1 = ((x1 * inv).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * inv).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    o1 = (x1 * cos - x2 * sin).to(dtype)
    o2 = (x2 * cos + x1 * sin).to(dtype)
    return o1, o2, h, mask


@triton.jit
def _store_halves(dst, o1, o2, h, d, mask, HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    """Heads h of one token into rows [heads, HEAD_DIM] with a dense last dim at `dst`."""
    p1 = dst + h[:, None] * HEAD_DIM + d[None, :]
    tl.store(p1, o1, mask=mask)
    tl.store(p1 + HALF, o2, mask=mask)


@triton.jit
def _to_cache(x, cache_ty: tl.constexpr, TO_FP8: tl.constexpr):
    """x in the cache's dtype: an fp8 cache rounds to nearest even, saturating, as torch's
    cast and attention's `store_kv` do."""
    if TO_FP8:
        x = x.to(tl.float32).to(cache_ty, fp_downcast_rounding="rtne")
    return x.to(cache_ty)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
    k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_kc, stride_vc, eps,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, Q_BLOCKS: tl.constexpr,
    K_BLOCKS: tl.constexpr, HAS_NORM: tl.constexpr, STORE_KV: tl.constexpr, TO_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    # Program (t, j): token t; head block j of q, then of k, then (STORE_KV) of v. With
    # STORE_KV a k program also writes its rotated heads into cache slot slot[t], and a v
    # program copies its heads of v there (a negative slot skipped, as attention's
    # `store_kv` does). v gets programs of its own so that no program does twice the work.
    pdl_start(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    d = tl.arange(0, BLOCK_HALF)
    lanes = _lanes(d, HALF)
    if j < Q_BLOCKS + K_BLOCKS:
        if STORE_KV:
            slot = tl.load(slot_ptr + t).to(tl.int64)  # issued early: its latency overlaps the math
        pos = tl.load(pos_ptr + t).to(tl.int64)
        dtype = q_out_ptr.dtype.element_ty
        # cos/sin rounded to the activations' dtype first, as the reference (and transformers) do.
        cos = tl.load(cos_ptr + pos * stride_cos + d, mask=lanes, other=0.0).to(dtype).to(tl.float32)[None, :]
        sin = tl.load(sin_ptr + pos * stride_cos + d, mask=lanes, other=0.0).to(dtype).to(tl.float32)[None, :]
        if j < Q_BLOCKS:
            o1, o2, h, mask = _norm_rope_heads(
                q_ptr + t * stride_qt, qw_ptr, j * BLOCK_H, NUM_Q_HEADS, stride_qh, cos, sin, d, eps, dtype,
                HEAD_DIM, HALF, BLOCK_H, HAS_NORM,
            )  # fmt: skip
            _store_halves(q_out_ptr + t * (NUM_Q_HEADS * HEAD_DIM), o1, o2, h, d, mask, HEAD_DIM, HALF)
        else:
            o1, o2, h, mask = _norm_rope_heads(
                k_ptr + t * stride_kt, kw_ptr, (j - Q_BLOCKS) * BLOCK_H, NUM_K_HEADS, stride_kh, cos, sin, d, eps,
                dtype, HEAD_DIM, HALF, BLOCK_H, HAS_NORM,
            )  # fmt: skip
            _store_halves(k_out_ptr + t * (NUM_K_HEADS * HEAD_DIM), o1, o2, h, d, mask, HEAD_DIM, HALF)
            if STORE_KV:  # noqa: SIM102 - `slot` exists only under the constexpr STORE_KV
                if slot >= 0:
                    cache_ty = k_cache_ptr.dtype.element_ty
                    k1, k2 = _to_cache(o1, cache_ty, TO_FP8), _to_cache(o2, cache_ty, TO_FP8)
                    _store_halves(k_cache_ptr + slot * stride_kc, k1, k2, h, d, mask, HEAD_DIM, HALF)
    else:  # only launched with STORE_KV
        slot = tl.load(slot_ptr + t).to(tl.int64)
        h = (j - Q_BLOCKS - K_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (h < NUM_K_HEADS)[:, None] & lanes[None, :]
        pv = v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :]
        v1 = tl.load(pv, mask=mask, other=0.0)
        v2 = tl.load(pv + HALF, mask=mask, other=0.0)
        if slot >= 0:
            cache_ty = v_cache_ptr.dtype.element_ty
            c1, c2 = _to_cache(v1, cache_ty, TO_FP8), _to_cache(v2, cache_ty, TO_FP8)
            _store_halves(v_cache_ptr + slot * stride_vc, c1, c2, h, d, mask, HEAD_DIM, HALF)


def qk_norm_rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm (when weights are given) then neox rotary on q [T, Hq, D] and
    k [T, Hk, D] (views with a dense last dim, e.g. column slices of the fused qkv output).
    cos/sin: [max_positions, D/2] fp32 tables; positions: [T] ints. Returns new dense q, k.
    `kv_store` = (v [T, Hk, D], k_cache, v_cache, slot_mapping [T]): the rotated k and v are
    also written into the caches ([pages, page_size, Hk, D], dense in their last three dims,
    k's dtype or fp8) at slot_mapping's slots, exactly as attention's `store_kv` writes them."""
    tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if q.stride(2) != 1 or k.stride(2) != 1 or head_dim % 2 or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("qk_norm_rope needs dense head dims, an even head_dim and dense cos/sin rows")
    q_out = torch.empty(tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(tokens, num_k_heads, head_dim, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    # without kv_store the kernel never touches v, the caches or the slots: any tensors will do
    v, k_cache, v_cache, slots = kv_store if kv_store is not None else (k, k_out, k_out, positions)
    if kv_store is not None:
        row = (num_k_heads * head_dim, head_dim, 1)
        dense = all(c.stride()[1:] == row and c.shape[2:] == k.shape[1:] for c in (k_cache, v_cache))
        if v.shape != k.shape or v.stride(2) != 1 or not dense:
            raise ValueError("kv_store needs v shaped as k and caches [pages, page_size, Hk, D] dense in their last three dims")
    half = head_dim // 2
    block_h = min(4, triton.next_power_of_2(max(num_q_heads, num_k_heads)))
    q_blocks, k_blocks = triton.cdiv(num_q_heads, block_h), triton.cdiv(num_k_heads, block_h)
    grid = (tokens, q_blocks + k_blocks * (2 if kv_store is not None else 1))
    has_norm = q_weight is not None
    _qk_norm_rope_kernel[grid](
        q, k, v, q_out, k_out, positions, cos, sin,
        q_weight if has_norm else cos, k_weight if has_norm else cos,
        k_cache, v_cache, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        k_cache.stride(1), v_cache.stride(1), eps,
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HEAD_DIM=head_dim,
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_H=block_h, Q_BLOCKS=q_blocks, K_BLOCKS=k_blocks,
        HAS_NORM=has_norm, STORE_KV=kv_store is not None, TO_FP8=k_cache.element_size() == 1,
        num_warps=1 if half * block_h <= 256 else 4, **launch_options(q.device),
    )  # fmt: skip
    return q_out, k_out


# ------------------------------------------------------------------- (residual add +) RMSNorm


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o, stride_s, stride_plane, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SPLITS: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program r: row r of x (SPLITS == 0), or of the sum of SPLITS fp32 planes of a split-K
    product (x_ptr: the workspace [SPLITS, M, N], planes `stride_plane` apart), added in
    split order and rounded once to the output dtype exactly as `_sum_splits_kernel` would;
    then the residual add and the norm."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = _lanes(cols, N)
    dtype = out_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_start(USE_PDL)  # the next matmul starts streaming its weights now
    if SPLITS > 0:
        x = _sum_planes(x_ptr + row * stride_x + cols, stride_plane, mask, SPLITS).to(dtype)  # its one rounding
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(dtype)  # the sum is rounded before the norm reads it, as in the reference
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
        x = x.to(tl.float32)
    y = _rms_normalize(x, w, eps, N, dtype)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


@triton.jit
def _rms_normalize(x, w, eps, N: tl.constexpr, dtype: tl.constexpr):
    """One row x (fp32, masked lanes zero) normalised and scaled by w, rounded to dtype: the
    normalised value is rounded before the weight multiplies it, as in the reference."""
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    return ((x * inv).to(dtype).to(tl.float32) * w).to(dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of the rows of x [T, N] (dense rows); with `residual` [T, N], of x + residual,
    returning (normed, x + residual) like layers.add_rms_norm_plain. Outputs in x's dtype.

    x may also be a split-K product's unsummed fp32 partials [S, T, N] (dense; see
    `small_m_linear(..., partials_only=True)`), with the outputs in weight's dtype: the planes
    are summed in split order and rounded once to that dtype first, so the result is
    bit-identical to summing them with the product's own sum kernel, in one launch less."""
    splits = x.shape[0] if x.dim() == 3 else 0
    if splits and not x.is_contiguous():
        raise ValueError("split-K partials must be dense [S, T, N]")
    tokens, n = x.shape[-2:]
    if x.stride(-1) != 1 or (residual is not None and (residual.shape != (tokens, n) or residual.stride(1) != 1)):
        raise ValueError("rms_norm needs rows with a dense last dim")
    dtype = weight.dtype if splits else x.dtype
    out = torch.empty(tokens, n, dtype=dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else out
    if tokens:
        block = triton.next_power_of_2(n)
        r = residual if residual is not None else out
        _rms_norm_kernel[(tokens,)](
            x, r, weight, out, total, x.stride(-2), r.stride(0), out.stride(0), total.stride(0),
            tokens * n if splits else 0, eps,
            N=n, BLOCK=block, HAS_RESIDUAL=residual is not None, SPLITS=splits,
            num_warps=min(16, max(1, block // 256)), **launch_options(x.device),
        )  # fmt: skip
    return out if residual is None else (out, total)


# ------------------------------------------------- all-reduce + residual add + RMSNorm (TP)


@triton.jit
def _all_reduce_rms_norm_kernel(
    part_ptr, slot_addrs, flag_addrs, epoch_ptr, r_ptr, w_ptr, out_ptr, sum_ptr,
    M, rank, stride_r, stride_o, stride_s, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, WORLD: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program p takes rows p, p + P, ... (P programs). Every rank's partial sums [M, N] live
    in its own slot (`slot_addrs`: the slots' addresses in rank order, this rank's at `rank`;
    `part_ptr` is this rank's and gives the partials' dtype). The program publishes its call
    count at (p, rank) in every rank's flag array ([P_max, WORLD] int64 at flag_addrs[q]),
    waits until every rank's entry (p, q) in its own array has reached the count, and then
    reads its rows from every rank's slot over NVLink and sums them."""
    cols = tl.arange(0, BLOCK)
    mask = _lanes(cols, N)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_start(USE_PDL)  # the matmul that wrote this rank's partials has completed
    pid, epoch = _next_call(epoch_ptr)
    for q in tl.static_range(WORLD):
        flags = tl.load(flag_addrs + q).to(tl.pointer_type(tl.int64))
        # release at system scope: this GPU's partials are visible to a peer that sees the flag
        tl.atomic_xchg(flags + pid * WORLD + rank, epoch, sem="release", scope="sys")
    # The first row's local inputs (own partials, residual) are read while the peers' flags
    # are awaited, so that only the peers' reads remain after the wait (every program has a
    # first row: the grid is at most M programs).
    own = tl.load(part_ptr + pid.to(tl.int64) * N + cols, mask=mask, other=0.0).to(tl.float32)
    r = _residual_row(r_ptr, pid.to(tl.int64), stride_r, cols, mask, HAS_RESIDUAL)
    own_flags = tl.load(flag_addrs + rank).to(tl.pointer_type(tl.int64))
    for q in tl.static_range(WORLD):
        if q != rank:  # its own entry it has just written
            # >=, not ==: a fast peer may already have published its next call
            while tl.atomic_add(own_flags + pid * WORLD + q, 0, sem="acquire", scope="sys") < epoch:
                pass
    dtype = out_ptr.dtype.element_ty
    programs = tl.num_programs(0)
    for i in range(tl.cdiv(M - pid, programs)):
        row = pid.to(tl.int64) + i * programs
        if i > 0:
            own = tl.load(part_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
            r = _residual_row(r_ptr, row, stride_r, cols, mask, HAS_RESIDUAL)
        acc = tl.zeros([BLOCK], tl.float32)
        for q in tl.static_range(WORLD):  # rank order, so every rank adds the same way
            if q == rank:
                acc += own
            else:
                part = tl.load(slot_addrs + q).to(tl.pointer_type(part_ptr.dtype.element_ty))
                # slots are 256-byte aligned: said, or loads through a pointer read from
                # memory are not vectorised; .cv: never a stale cache line of a peer's slot
                part = tl.multiple_of(part, 16)
                acc += tl.load(part + row * N + cols, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
        _finish_row(acc, r, w, eps, row, out_ptr, sum_ptr, stride_o, stride_s, cols, mask, N, dtype)


@triton.jit
def _ll_all_reduce_rms_norm_kernel(
    part_ptr, dst_addrs, recv_ptr, recv_stride, epoch_ptr, r_ptr, w_ptr, out_ptr, sum_ptr,
    M, rank, stride_r, stride_o, stride_s, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, PACK: tl.constexpr, WORLD: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    SENT: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """The low-latency (LL) protocol: no flags and no reads over NVLink. Program p takes rows
    p, p + P, ...; it stores each row of its partials into every peer's receive buffer
    (`dst_addrs[q]`: where this rank's rows go in rank q's buffer) as 64-bit words, each
    holding 32 bits of partials (PACK elements) under its call count in the high 32 bits,
    then polls its own receive buffer (`recv_ptr + q * recv_stride`: rank q's rows) until
    every word of a row carries this call's count. A 64-bit store is seen whole or not at
    all, so a word with the right count holds that call's data: nothing else to wait for.
    SENT: the matmul that wrote the partials has already stored these words (`_ll_push_row`)."""
    cols = tl.arange(0, BLOCK)
    mask = _lanes(cols, N)
    WORDS: tl.constexpr = BLOCK // PACK
    words_per_row: tl.constexpr = N // PACK
    wcols = tl.arange(0, WORDS)
    wmask = _lanes(wcols, words_per_row)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_start(USE_PDL)  # the matmul that wrote this rank's partials has completed
    pid, epoch = _next_call(epoch_ptr)
    tag = epoch << 32
    part_words = part_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    programs = tl.num_programs(0)
    rows_here = tl.cdiv(M - pid, programs)
    for i in range(0 if SENT else rows_here):  # send first: no program waits before all of its rows are out
        row = pid.to(tl.int64) + i * programs
        data = tl.load(part_words + row * words_per_row + wcols, mask=wmask, other=0)
        _ll_send(dst_addrs, row * words_per_row + wcols, data, tag, wmask, rank, WORLD)
    dtype = out_ptr.dtype.element_ty
    for i in range(rows_here):
        row = pid.to(tl.int64) + i * programs
        own = tl.load(part_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        r = _residual_row(r_ptr, row, stride_r, cols, mask, HAS_RESIDUAL)
        acc = tl.zeros([BLOCK], tl.float32)
        for q in tl.static_range(WORLD):  # rank order, so every rank adds the same way
            if q == rank:
                acc += own
            else:
                src = recv_ptr + q * recv_stride + row * words_per_row + wcols
                word = tl.load(src, mask=wmask, other=tag, volatile=True)
                while tl.min(((word >> 32) == epoch).to(tl.int32), axis=0) == 0:
                    word = tl.load(src, mask=wmask, other=tag, volatile=True)
                acc += _ll_unpack(word, part_ptr.dtype.element_ty, BLOCK, PACK)
        _finish_row(acc, r, w, eps, row, out_ptr, sum_ptr, stride_o, stride_s, cols, mask, N, dtype)


@triton.jit
def _ll_unpack(word, part_dtype: tl.constexpr, BLOCK: tl.constexpr, PACK: tl.constexpr):
    """The partials in the low 32 bits of each word, as fp32 [BLOCK] in column order (with
    PACK = 2 the low half of a word is the even column: little-endian)."""
    data = word.to(tl.int32)  # the low 32 bits
    if PACK == 2:
        lo = data.to(tl.int16).to(part_dtype, bitcast=True).to(tl.float32)
        hi = (data >> 16).to(tl.int16).to(part_dtype, bitcast=True).to(tl.float32)
        values = tl.join(lo, hi).reshape([BLOCK])
    else:
        values = data.to(tl.float32, bitcast=True)
    return values


@triton.jit
def _next_call(epoch_ptr):
    """(program id, this program's call count), the count incremented in device memory (so
    graph replays count too); the same on every rank, as every rank makes the same calls."""
    pid = tl.program_id(0)
    epoch = tl.load(epoch_ptr + pid) + 1
    tl.store(epoch_ptr + pid, epoch)
    return pid, epoch


@triton.jit
def _residual_row(r_ptr, row, stride_r, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """One row of the residual in fp32, or zeros without one (the stream's first sum)."""
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        r = tl.zeros(cols.shape, tl.float32)
    return r


@triton.jit
def _finish_row(acc, r, w, eps, row, out_ptr, sum_ptr, stride_o, stride_s, cols, mask, N: tl.constexpr, dtype):
    """The sum over ranks rounded once (for 2 ranks NCCL's bits), then the residual added
    and rounded, as rms_norm does after an all-reduce; both outputs stored."""
    x = (acc.to(dtype).to(tl.float32) + r).to(dtype)
    tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    tl.store(out_ptr + row * stride_o + cols, _rms_normalize(x.to(tl.float32), w, eps, N, dtype), mask=mask)


def all_reduce_rms_norm(
    part: torch.Tensor,
    slot_addrs: torch.Tensor,
    flag_addrs: torch.Tensor,
    epochs: torch.Tensor,
    rank: int,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(s), s) for s = (sum over ranks of their partials) + residual (or no
    residual: the stream's first sum, outputs then in the weight's dtype), where part
    [M, N] (dense) is this rank's partials at the start of its slot of a symmetric buffer,
    `slot_addrs` [WORLD] the addresses of every rank's copy of that slot, `flag_addrs`
    [WORLD] those of every rank's flag array ([len(epochs), WORLD] int64, zeroed before the
    first call) and `epochs` [P_max] int64 this rank's call counts (zeroed with the flags).
    Every rank must make the same calls in the same order with the same M
    (nanoserve.distributed.symm_all_reduce owns the buffers and that protocol). Outputs in
    residual's dtype."""
    out, total, grid, options = _reduce_norm_launch(part, residual, weight, epochs)
    if grid[0]:
        r = residual if residual is not None else part
        _all_reduce_rms_norm_kernel[grid](
            part, slot_addrs, flag_addrs, epochs, r, weight, out, total,
            part.shape[0], rank, r.stride(0), out.stride(0), total.stride(0), eps,
            WORLD=slot_addrs.numel(), **options,
        )  # fmt: skip
    return out, total


def ll_all_reduce_rms_norm(
    part: torch.Tensor,
    dst_addrs: torch.Tensor,
    recv: torch.Tensor,
    epochs: torch.Tensor,
    rank: int,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    sent: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `all_reduce_rms_norm`, over the LL protocol (see its kernel): `dst_addrs` [WORLD]
    the addresses where this rank's words go in every rank's receive buffer, `recv` [WORLD,
    >= M * N * itemsize / 4] int64 this rank's receive buffer (rank q's words in row q; zeroed
    with `epochs` before the first call). Partials of 2 or 4 bytes, N * itemsize a multiple
    of 4. `sent`: the matmul already pushed this rank's words (`small_m_linear(push=...)`)."""
    M, N = part.shape
    pack = 4 // part.element_size()
    if pack not in (1, 2) or N % pack or recv.dtype != torch.int64 or recv.shape[1] * pack < M * N:
        raise ValueError("ll_all_reduce_rms_norm needs 2- or 4-byte partials, whole words and room for them")
    out, total, grid, options = _reduce_norm_launch(part, residual, weight, epochs)
    if grid[0]:
        r = residual if residual is not None else part
        _ll_all_reduce_rms_norm_kernel[grid](
            part, dst_addrs, recv, recv.stride(0), epochs, r, weight, out, total,
            M, rank, r.stride(0), out.stride(0), total.stride(0), eps,
            PACK=pack, WORLD=dst_addrs.numel(), SENT=sent, **options,
        )  # fmt: skip
    return out, total


def _reduce_norm_launch(part: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, epochs: torch.Tensor):
    """Outputs, grid and launch options shared by both reduce + norm launchers."""
    M, N = part.shape
    if not part.is_contiguous() or (residual is not None and (residual.shape != (M, N) or residual.stride(1) != 1)):
        raise ValueError("all_reduce_rms_norm needs dense partials and a residual of the same shape")
    dtype = residual.dtype if residual is not None else weight.dtype
    out = torch.empty(M, N, dtype=dtype, device=part.device)
    total = torch.empty_like(out)
    block = triton.next_power_of_2(N)
    options = {
        "N": N,
        "BLOCK": block,
        "HAS_RESIDUAL": residual is not None,
        "num_warps": min(16, max(1, block // 256)),
        **launch_options(part.device),
    }
    return out, total, (min(M, epochs.numel()),), options


# ------------------------------------------------------------------------------- SiLU-and-mul


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, I, stride_x, stride_o,
    BLOCK: tl.constexpr, EVEN: tl.constexpr, PRECISE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program (t, j): row t, output columns j*BLOCK .. (j+1)*BLOCK of silu(gate) * up."""
    pdl_start(USE_PDL)  # the down projection starts streaming its weights now
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    gate_ptrs = x_ptr + row * stride_x + cols
    if EVEN:
        gate = tl.load(gate_ptrs).to(tl.float32)
        up = tl.load(gate_ptrs + I).to(tl.float32)
    else:
        mask = cols < I
        gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_ptrs + I, mask=mask, other=0.0).to(tl.float32)
    if PRECISE:  # torch's CUDA silu: x / (1 + expf(-x)) with IEEE expf and division
        act = tl.math.div_rn(gate, 1.0 + libdevice.exp(-gate))
    else:  # the interpreter has no libdevice
        act = gate / (1.0 + tl.exp(-gate))
    dtype = out_ptr.dtype.element_ty
    y = act.to(dtype).to(tl.float32) * up  # silu rounded first, as the reference's F.silu
    if EVEN:
        tl.store(out_ptr + row * stride_o + cols, y.to(dtype))
    else:
        tl.store(out_ptr + row * stride_o + cols, y.to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for gate_up [M, 2I] (gate columns first, then up; dense last dim),
    into `out` [M, I] (dense rows) or a new tensor in gate_up's dtype. As the reference
    (layers.silu_and_mul_plain) rounds: silu in fp32 rounded to the dtype, times up in fp32,
    rounded again. On CUDA silu uses IEEE expf and division as torch's kernel does, so the two
    should agree bit for bit; the tests allow one rounding step (the interpreter's exp and
    its bf16 conversion differ)."""
    M, width = gate_up.shape
    if width % 2 or gate_up.stride(1) != 1:
        raise ValueError("silu_and_mul needs gate_up [M, 2I] with a dense last dim")
    inter = width // 2
    if out is None:
        out = torch.empty(M, inter, dtype=gate_up.dtype, device=gate_up.device)
    elif out.shape != (M, inter) or out.stride(1) != 1:
        raise ValueError(f"silu_and_mul: out must be [{M}, {inter}] with a dense last dim")
    if M and inter:
        # 1024 columns (16-byte loads on 4 warps) per program; rows on grid axis 0, which
        # has room for any prefill length.
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(M, triton.cdiv(inter, block))](
            gate_up, out, inter, gate_up.stride(0), out.stride(0),
            BLOCK=block, EVEN=inter % block == 0, PRECISE=not INTERPRET, num_warps=4,
            **launch_options(gate_up.device),
        )  # fmt: skip
    return out
