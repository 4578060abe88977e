"""Tensor-parallel all-reduce fused with the residual add and the RMSNorm that follows a
row-parallel layer: the sum of every rank's partial rows, read from the peers' memory over
NVLink, plus the residual, then RMSNorm, in one launch where NCCL's all-reduce and
`norm.rms_norm` took two.

Two protocols: `all_reduce_rms_norm` publishes a flag per program and reads the peers'
partials ("pull"); `ll_all_reduce_rms_norm` has each rank store its partials into its peers'
memory as LL words (`ll_words.py`) and poll its own (no flags, no reads over NVLink). The
symmetric buffers, the flags and the call protocol are nanoserve/distributed/symm_all_reduce.py's;
these kernels only read and write the addresses they are given.
`all_reduce_rms_norm_reference` is the torch reference: the partials summed in rank order,
rounded once, then `norm.add_rms_norm_reference`.

Invariants: every rank adds the partials in rank order, in fp32, and rounds the sum once, so
all ranks hold the same bits (for two ranks, NCCL's); every rank makes the same calls in the
same order with the same row count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.launch import launch_options, pdl_start
from nanoserve.kernels.ll_words import _ll_send, _ll_unpack, _next_call
from nanoserve.kernels.norm import _lanes, _rms_normalize, add_rms_norm_reference, rms_norm_reference


def all_reduce_rms_norm_reference(
    parts: list[torch.Tensor], residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(s), s) for s = the ranks' partials (in rank order, fp32, rounded once) plus
    the residual (if any)."""
    total = parts[0].float()
    for p in parts[1:]:
        total = total + p.float()
    dtype = residual.dtype if residual is not None else weight.dtype
    s = total.to(dtype)
    if residual is None:
        return rms_norm_reference(s, weight, eps), s
    return add_rms_norm_reference(s, residual, weight, eps)


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
    pdl: bool = True,
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
    out, total, grid, options = _reduce_norm_launch(part, residual, weight, epochs, pdl)
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
    pdl: bool = True,
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
    out, total, grid, options = _reduce_norm_launch(part, residual, weight, epochs, pdl)
    if grid[0]:
        r = residual if residual is not None else part
        _ll_all_reduce_rms_norm_kernel[grid](
            part, dst_addrs, recv, recv.stride(0), epochs, r, weight, out, total,
            M, rank, r.stride(0), out.stride(0), total.stride(0), eps,
            PACK=pack, WORLD=dst_addrs.numel(), SENT=sent, **options,
        )  # fmt: skip
    return out, total


def _reduce_norm_launch(
    part: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, epochs: torch.Tensor, pdl: bool
):
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
        **launch_options(part.device, pdl),
    }
    return out, total, (min(M, epochs.numel()),), options
