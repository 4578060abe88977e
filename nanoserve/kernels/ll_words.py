"""The low-latency (LL) word format of the tensor-parallel all-reduce, shared by the kernels
that send partial sums (the one-row GEMV's push, `linear._linear_fma_kernel`) and the one
that receives and sums them (`all_reduce._ll_all_reduce_rms_norm_kernel`).

A word is 64 bits: 32 bits of data (one fp32 or two 2-byte values, the even column in the low
half) under the call count in the high 32 bits. A 64-bit store is seen whole or not at all,
so a receiver that sees its call's count holds that call's data: no flags, no fences.
The call count lives in device memory per program (`_next_call`), so CUDA-graph replays count
too, and every rank counts the same because every rank makes the same calls.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _ll_push_row(y, N, dst_addrs, epoch_ptr, rank, dtype: tl.constexpr, BLOCK_N: tl.constexpr, WORLD: tl.constexpr):
    """This program's BLOCK_N columns of row 0 (y [1, BLOCK_N] fp32, rounded to the 2-byte
    `dtype` as stored) into every peer's receive buffer (`dst_addrs[q]`, as the LL kernel's
    send: two columns per 64-bit word, the even one in the low half, under the call count).
    The count is that of the LL call that sums this row: program 0's next (`_next_call`);
    the previous fused call has completed (PDL), and the coming one counts only after this
    kernel has. Why here: the words leave as each program finishes instead of after the
    whole matmul, and the sum's kernel only waits (measured in benchmarks/results/2026-11-21.md, series 11)."""
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
