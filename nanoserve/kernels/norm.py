"""RMSNorm of each row, optionally after adding the residual (returning the sum too), one
program per row; it also sums a split-K product's fp32 partials first (`linear.py`), so that
product needs no sum kernel of its own, or gathers its rows from an embedding table
(`embed_rms_norm`: a decode graph's first kernel, which also reads the input ids still being
sampled from the engine's token pool). It replaces the pool's index_select before the graph
and the embedding's own lookup, which took 6-7 us with their gaps per batch-1 decode step on
an H200 (benchmarks/results/2026-11-27.md).

As fast as the torch.compile'd reference (1.46 vs 1.45 us per call at hidden 1024, 1.92 vs
2.16 at 4096 on an H200) and, unlike it, lets the next matmul launch early under PDL.
`rms_norm_reference` / `add_rms_norm_reference` are the torch references (and the CPU path).

Invariants: fp32 statistics; the sum with the residual is rounded to the dtype before the norm
reads it, and the normalised value is rounded before the weight multiplies it, as the
reference does, so both agree within one rounding step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.launch import INTERPRET, launch_options, pdl_start
from nanoserve.kernels.linear import _sum_planes


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(RMSNorm(x + residual), x + residual)."""
    x = x + residual
    return rms_norm_reference(x, weight, eps), x


def sandwich_norm_reference(
    x: torch.Tensor, pre_weight: torch.Tensor, pre_eps: float, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(RMSNorm_pre(x) + residual), RMSNorm_pre(x) + residual): a block's closing
    norm, the residual add and the next block's opening norm."""
    return add_rms_norm_reference(rms_norm_reference(x, pre_weight, pre_eps), residual, weight, eps)


def resolve_pending(ids: torch.Tensor, pool: torch.Tensor, pool_index: torch.Tensor) -> torch.Tensor:
    """ids with each id < 0 (a token still being sampled) replaced, in place, by
    pool[pool_index[row]]."""
    return torch.where(ids < 0, pool[pool_index], ids, out=ids)


def embed_rms_norm_reference(
    ids: torch.Tensor,
    pool: torch.Tensor,
    pool_index: torch.Tensor,
    table: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(rows), rows), rows = table[ids] once the pending ids are resolved in place."""
    rows = torch.nn.functional.embedding(resolve_pending(ids, pool, pool_index), table)
    return rms_norm_reference(rows, weight, eps), rows


@triton.jit
def _lanes(d, HALF: tl.constexpr):
    """The valid lanes of a half head. A power-of-two half needs no lane mask: leaving it out
    keeps the loads 16 bytes wide (Triton cannot see that `d < HALF` is all true)."""
    if HALF == d.shape[0]:
        return tl.full(d.shape, 1, tl.int1)
    return d < HALF


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, ids_ptr, pool_ptr, index_ptr, pre_w_ptr,
    stride_x, stride_r, stride_o, stride_s, stride_plane, eps, pre_eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SPLITS: tl.constexpr, GATHER: tl.constexpr,
    PRE_NORM: tl.constexpr, FENCE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program r: row r of x (SPLITS == 0), or of the sum of SPLITS fp32 planes of a split-K
    product (x_ptr: the workspace [SPLITS, M, N], planes `stride_plane` apart), added in
    split order and rounded once to the output dtype exactly as `_sum_splits_kernel` would;
    PRE_NORM: that row normed by pre_w first (a block's closing norm, rounded as its own
    launch would); then the residual add and the norm. GATHER: row ids[r] of the table x (an
    id < 0 read from pool[index[r]] and written back), stored to sum_ptr as the stream's start."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = _lanes(cols, N)
    dtype = out_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_start(USE_PDL)  # the next matmul starts streaming its weights now
    if GATHER:
        token = tl.load(ids_ptr + row)
        if token < 0:
            token = tl.load(pool_ptr + tl.load(index_ptr + row))
            tl.store(ids_ptr + row, token)
        x = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    elif SPLITS > 0:
        x = _sum_planes(x_ptr + row * stride_x + cols, stride_plane, mask, SPLITS).to(dtype)  # its one rounding
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if PRE_NORM:
        pre_w = tl.load(pre_w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = _rms_normalize(x, pre_w, pre_eps, N, dtype).to(tl.float32)
        if FENCE:
            # The closing norm's product must be rounded before the residual add reads it: left
            # to itself the compiler contracts (y * w) + r into one fma and drops the rounding
            # (28% of the sums differed from two launches on an H200). An opaque identity stops it.
            x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
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


def _row_shape(n: int) -> dict:
    """`_rms_norm_kernel`'s row width, block and warps for rows of n values (one program a row)."""
    block = triton.next_power_of_2(n)
    return {"N": n, "BLOCK": block, "num_warps": min(16, max(1, block // 256))}


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    pdl: bool = True,
    pre_norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of the rows of x [T, N] (dense rows); with `residual` [T, N], of x + residual,
    returning (normed, x + residual) like `add_rms_norm_reference`. Outputs in x's dtype.

    `pre_norm` (weight, eps), with a residual: x is first normed by that weight, so that a
    block's closing norm, the residual add and the next block's opening norm (Gemma's sandwich
    norms) run in one launch (`sandwich_norm_reference`): in bf16 and fp16 bit-identical to the
    closing norm's own launch followed by this one (H200, rows 48-3840 wide); in fp32 the
    compiler's own contractions can leave the two one rounding apart.

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
    if pre_norm is not None and (residual is None or pre_norm[0].dtype != weight.dtype):
        raise ValueError("pre_norm needs a residual and a weight of the norm's dtype")
    dtype = weight.dtype if splits else x.dtype
    out = torch.empty(tokens, n, dtype=dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else out
    if tokens:
        r = residual if residual is not None else out
        pre_w, pre_eps = pre_norm if pre_norm is not None else (weight, eps)
        _rms_norm_kernel[(tokens,)](
            x, r, weight, out, total, out, out, out, pre_w, x.stride(-2), r.stride(0), out.stride(0), total.stride(0),
            tokens * n if splits else 0, eps, pre_eps,
            HAS_RESIDUAL=residual is not None, SPLITS=splits, GATHER=False, PRE_NORM=pre_norm is not None, FENCE=not INTERPRET,
            **_row_shape(n), **launch_options(x.device, pdl),
        )  # fmt: skip
    return out if residual is None else (out, total)


def embed_rms_norm(
    ids: torch.Tensor,
    pool: torch.Tensor,
    pool_index: torch.Tensor,
    table: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(rows), rows) for rows = table[ids] (long [T]; table [V, N], dense rows), where
    an id < 0 is a token still being sampled: read from pool[pool_index[row]] (long) and
    written back into ids. One launch, never under PDL: it is a forward's first kernel (see
    launch.py); `embed_rms_norm_reference` is its torch twin."""
    tokens, n = ids.shape[0], table.shape[1]
    if table.stride(1) != 1 or weight.dtype != table.dtype:
        raise ValueError("embed_rms_norm needs a table with dense rows in the weight's dtype")
    out = torch.empty(tokens, n, dtype=table.dtype, device=table.device)
    rows = torch.empty_like(out)
    if tokens:
        _rms_norm_kernel[(tokens,)](
            table, out, weight, out, rows, ids, pool, pool_index, weight, table.stride(0), 0, out.stride(0),
            rows.stride(0), 0, eps, eps, HAS_RESIDUAL=False, SPLITS=0, GATHER=True, PRE_NORM=False, FENCE=False, **_row_shape(n),
            USE_PDL=False,
        )  # fmt: skip
    return out, rows
