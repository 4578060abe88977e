"""Triton kernels for attention over the paged KV cache, and their launchers.

Owns three kernels and the host functions that launch them:
- `store_kv`: writes the new tokens' K/V rows into their cache slots (one launch per layer);
- `paged_decode`: one query token per request over its pages; split-KV ("flash decoding")
  partial results in a caller-provided fp32 workspace, merged by a second reduce kernel; or,
  for a verify step's runs (a request's consecutive positions as rows), one program per run
  that reads the request's K/V once for all its rows;
- `paged_extend`: the new tokens of several requests (varlen, causal among themselves) over
  their cached prefix (read through the page table) and themselves (read from k/v directly).
Both attention kernels take a layer's kind: a sliding `window` (decode reads positions
max(0, seq_len - window) .. seq_len only; extend masks each row to its own window and skips
tiles before the block's first window) and `sinks` (a logit per query head added to the
softmax's denominator: at the end of a direct decode or extend row, in the reduce for split
decode). Without either, the kernels compile exactly as before (constexpr flags).

Conventions shared by all kernels (see base.py for the metadata invariants):
- caches are [num_pages, page_size, num_kv_heads, head_dim] with the last three dims dense,
  so cache slot s of head h starts at s * stride_slot + h * head_dim; their dtype may be
  narrower than q's (fp8: `store_kv` rounds into it, the attention kernels upcast what they
  read, to fp16 for 16-bit q, before any product);
- softmax runs in base 2: logits are multiplied by scale * log2(e) once, and the log-sum-exp
  kept per split (`lse`) is in base 2 too;
- accumulation is fp32 whatever the input dtype; P is cast to q's dtype before the PV
  product (as FlashAttention does), so bf16/fp16 inputs use 16-bit tensor-core products, and
  fp32 inputs full-precision fp32 products (not tf32);
- launchers read lengths and page tables from device tensors only (no host sync, no
  data-dependent allocation), so decode and store can be captured in CUDA graphs; grids depend
  only on host ints (batch size, head counts, split count, max query length);
- the store, decode split and reduce kernels launch with programmatic dependent launch where
  the GPU has it (and the caller's `pdl` switch allows), and wait for the previous kernel
  before their first read (launch.py).

`attention_reference` is the torch reference the tests compare with (fp32 softmax over the
gathered pages); `store_kv_reference` is the store's. The engine's slow twin is
nanoserve/attention/torch_backend.py, built on the same two functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanoserve.kernels.launch import INTERPRET, launch_options, pdl_start

LOG2E = 1.4426950408889634

# Cascade decode (a shared prefix read once per group, planned on the host by
# nanoserve/attention/cascade.py). A work item's int32 fields, in this order: the group's
# first entry in `members`, the member count, the batch row whose page table the item reads
# (any member's: they agree on the prefix), the token range [lo, hi), and which of the
# group's parts it is.
ITEM_FIELDS = ("first_member", "count", "table_row", "lo", "hi", "part")
# The most parts one group's prefix is split into (the reduce reads this many extra columns).
MAX_CASCADE_PARTS = 8


@dataclass
class CascadeInputs:
    """Device side of a `nanoserve.attention.cascade.CascadePlan` (int32 tensors)."""

    prefix_len: torch.Tensor  # [B] positions of request b read by its group's prefix pass (0: none)
    num_parts: torch.Tensor  # [B] partial results the prefix pass gives request b
    members: torch.Tensor  # [B] batch rows, each group's members contiguous
    items: torch.Tensor  # [W, len(ITEM_FIELDS)] work items; unused ones have count 0


@dataclass
class RunInputs:
    """A decode batch's runs (rows that are consecutive positions of one request, in order):
    `rows` [B] int32 holds a run's length at its first row and 0 at its other rows;
    `max_rows` is the longest run any batch of these kernels' graphs may hold (a host int:
    it sizes the query tile); `count` the runs in the batch (a host int, for the split
    count; a graph captures it from its padded size)."""

    rows: torch.Tensor
    max_rows: int
    count: int


def graph_run_count(rows: int, max_rows: int) -> int:
    """The runs a decode graph of `rows` rows is captured for (its split count follows from
    them): as many as fill it with runs of `max_rows`. The workspace reservation and every
    runs graph's inputs count them so."""
    return -(-rows // max_rows)


# Triton's interpreter runs each program in numpy: small blocks keep CPU tests fast and make
# tiny shapes cross several blocks (pages, splits, causal tiles) so that the logic is exercised.

# Launch configurations, keyed by head_dim bucket; benchmarks may override entries to sweep.
# Tuned on an H200 for head_dim 128 (decode and extend); the 64 and 256 extend entries are untuned.
DECODE_CONFIG: dict[str, int] = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
# Decode rows wider than 256 bytes (head_dim 256 in 16 bits: BLOCK_N is halved for them,
# `_decode_block_n`), for a full layer and for a sliding-window one. H200, gemma-3-12b's 16k
# decode at batch 8 (`benchmarks/attention.py --wide`, 8 splits): a full layer 298 -> 255 us
# (85% -> 99% of the copy bandwidth) with a fourth stage; a 1,024-token window 28.0 -> 23.3 us
# with 16-token blocks (its 128 positions a split run 8 blocks deep instead of 4). Only where
# the requests fill the GPU (at most WIDE_MAX_SPLITS splits): a batch-1 step (32 splits of
# short contexts) keeps DECODE_CONFIG, with which gemma-3-12b's TPOT was measured at 6.433 ms
# (3961f73); with these configs it took 6.515 (another host, not compared on one).
WIDE_DECODE_CONFIG: dict[str, int] = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 4}
WIDE_WINDOW_DECODE_CONFIG: dict[str, int] = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3}
WIDE_MAX_SPLITS = 8
EXTEND_CONFIG: dict[int, dict[str, int]] = {
    64: {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    128: {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    256: {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
}
INTERPRET_DECODE_CONFIG: dict[str, int] = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
# The cascade prefix kernel: BLOCK_M query rows = members x query heads per kv head. Untuned.
CASCADE_CONFIG: dict[str, int] = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
INTERPRET_CASCADE_CONFIG: dict[str, int] = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
INTERPRET_EXTEND_CONFIG: dict[str, int] = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
# Triton 3.9's interpreter computes bf16 tl.dot wrongly (fp16 and fp32 are right): under the
# interpreter the kernels upcast dot operands to fp32. Compiled kernels never do.
DOT_F32 = INTERPRET
# A decode split never gets fewer tokens than this (a split's fixed cost is its launch slot
# and the reduce's read of one partial row). 64 = one BLOCK_N tile: at batch 1 a split then
# runs one tile instead of up to four in a row, and the split kernel took 3.9-4.1 us per
# layer instead of 8.5-8.6 (H200, benchmarks/probes/profile_decode.py --min-split-tokens 256 64:
# batch-1 decode step 1.109 -> 1.021 ms on qwen3-0.6b, 4.478 -> 4.327 ms on llama-3.1-8b).
MIN_SPLIT_TOKENS = 16 if INTERPRET else 64
# A decode over runs aims at fewer programs per multiprocessor than the 4 of one over requests:
# each split costs the reduce a partial row per position of the run, not one (H200, llama-3.1-8b
# K=4 verify steps: 2 beat 4 and 1, results/2026-12-03.md).
RUNS_PROGRAMS_PER_SM = 2
# Decode programs in launch order (`paged_decode(heads_first=...)`, KernelSwitches'
# decode_heads_first): all kv heads of a request next to each other (grid axis 0 = kv head),
# so the heads' programs run at the same time and read each token's cache row (kv heads x
# head_dim, contiguous) together, or one head of every request first.


def store_kv_reference(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The store's torch twin: k/v [T, Hk, D] into cache slots slot_mapping [T], all >= 0
    (the kernel also skips negative slots; the engine never makes them). No host sync."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v.to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, page_table: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """[B, max_seq_len, num_kv_heads, head_dim]: the first max_seq_len positions of every
    request (page_table [B, pages]; positions past a request's length hold whatever its
    table points at)."""
    page_size = cache.shape[1]
    positions = torch.arange(max_seq_len, device=cache.device)
    slots = page_table[:, positions // page_size].long() * page_size + positions % page_size
    return cache.view(-1, cache.shape[2], cache.shape[3])[slots]


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal_offset: int | None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [Tq, Hq, D] over k/v [Tk, Hk, D] (grouped-query heads) with an fp32
    softmax, rounded once to q's dtype. `causal_offset`: query i sees keys up to
    causal_offset + i (the queries are the last Tq of the keys); None: all keys. `window` > 0
    (with a causal offset): query i sees only its last `window` keys, itself included.
    `sinks` [Hq]: a learned logit per head that joins the softmax's denominator and adds no
    value (gpt-oss's attention sinks)."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    if causal_offset is not None:
        tq, tk = q.shape[0], k.shape[0]
        key = torch.arange(tk, device=q.device)[None, :]
        last = causal_offset + torch.arange(tq, device=q.device)[:, None]
        allowed = key <= last
        if window > 0:
            allowed &= key > last - window
        logits = logits.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(-1, 1, 1).expand(-1, logits.shape[1], 1)
        probs = torch.cat([logits, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = logits.softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)


def _stages(cfg: dict[str, int], x: torch.Tensor) -> int:
    """Pipeline depth: fp32 tiles are twice as large, so they get at most 2 stages of shared memory."""
    return min(cfg["num_stages"], 2) if x.element_size() >= 4 else cfg["num_stages"]


def _flat_cache(cache: torch.Tensor) -> tuple[int, int]:
    """(stride of one slot, stride of one kv head) of a [pages, page_size, heads, dim] cache."""
    if cache.stride(3) != 1 or cache.stride(2) != cache.shape[3] or cache.stride(0) != cache.shape[1] * cache.stride(1):
        raise ValueError("KV cache must be dense in its last three dims")
    return cache.stride(1), cache.stride(2)


@triton.jit
def _load_tile(ptrs, row_mask, d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROW_MASKED: tl.constexpr):
    """Load a [rows, BLOCK_D] tile. Masks only what can be out of range (a head_dim that is not
    a power of two, the ragged end of a row range), so that full tiles keep wide loads."""
    if BLOCK_D == HEAD_DIM:
        if ROW_MASKED:
            x = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
        else:
            x = tl.load(ptrs)
    else:
        if ROW_MASKED:
            x = tl.load(ptrs, mask=row_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        else:
            x = tl.load(ptrs, mask=d[None, :] < HEAD_DIM, other=0.0)
    return x


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    # fp32 inputs get full fp32 products (not tf32): fp32 serving is the exactness path.
    if UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif a.dtype == tl.float32:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _attend_block(
    q,
    k,
    v,
    m_i,
    l_i,
    acc,
    mask,
    scale_log2,
    MASKED: tl.constexpr,
    DOT_F32: tl.constexpr,
    ROWS_MAY_BE_EMPTY: tl.constexpr = False,
):
    """One online-softmax step of a [BLOCK_M, D] query tile over a [BLOCK_N, D] K/V block.
    ROWS_MAY_BE_EMPTY: a row may have seen no key yet after this block (a sliding window's
    rows start at different keys): its max stays -inf and must not turn the step into NaN."""
    qk = _dot(q, tl.trans(k.to(q.dtype)), DOT_F32) * scale_log2
    if MASKED:
        qk = tl.where(mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if ROWS_MAY_BE_EMPTY:
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # K and V are upcast to q's dtype first (an fp8 cache's values are exact in it).
    acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype), DOT_F32)
    return m_new, l_i, acc


@triton.jit
def _attend_pages(
    q,
    m_i,
    l_i,
    acc,
    table,
    page,
    k_base,
    v_base,
    lo,
    hi,
    stride_kc_slot,
    stride_vc_slot,
    d,
    scale_log2,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
    row_lo=0,
    PER_ROW_LO: tl.constexpr = False,
    row_hi=0,
    PER_ROW_HI: tl.constexpr = False,
):
    """Online softmax of a query tile over cache positions [lo, hi) of one request's pages
    (`table`: its page-table row, `page`: its first block's page ids from `_first_pages`;
    k_base / v_base: the caches offset to one kv head). Every kernel that reads K/V through a
    page table does it here. PER_ROW_LO (sliding window): row r also skips positions below
    row_lo[r]; PER_ROW_HI (a run of one request's positions): row r also skips positions
    from row_hi[r] on."""
    if k_base.dtype.element_ty.is_fp8() and q.dtype != tl.float32:
        # fp8 cache: the products run in fp16, which fp8 converts to in one instruction per
        # pair (to bf16 it takes several, and the kernel became ALU-bound: measured slower
        # than a bf16 cache with twice the bytes). fp8 values are exact in fp16; q rounds.
        q = q.to(tl.float16)
    # Each block's page ids are loaded one iteration ahead (loop-carried), so that its K/V
    # addresses never wait on a load issued in the same iteration (H200, one layer's decode
    # over the offline workload's batches: 1,475-1,500 -> 1,438 us in bf16, 1,479 -> 1,276
    # in fp8; `benchmarks/attention.py --ragged`).
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < hi
        slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
        ahead = pos + BLOCK_N
        page = tl.load(table + ahead // PAGE_SIZE, mask=ahead < hi, other=0)
        k = _load_tile(k_base + slot[:, None] * stride_kc_slot + d[None, :], n_mask, d, HEAD_DIM, BLOCK_D, True)
        v = _load_tile(v_base + slot[:, None] * stride_vc_slot + d[None, :], n_mask, d, HEAD_DIM, BLOCK_D, True)
        if PER_ROW_LO:
            mask = n_mask[None, :] & (pos[None, :] >= row_lo[:, None])
            m_i, l_i, acc = _attend_block(q, k, v, m_i, l_i, acc, mask, scale_log2, True, DOT_F32, True)
        elif PER_ROW_HI:
            mask = n_mask[None, :] & (pos[None, :] < row_hi[:, None])
            m_i, l_i, acc = _attend_block(q, k, v, m_i, l_i, acc, mask, scale_log2, True, DOT_F32, True)
        else:
            mask = n_mask[None, :]
            m_i, l_i, acc = _attend_block(q, k, v, m_i, l_i, acc, mask, scale_log2, MASKED=True, DOT_F32=DOT_F32)
    return m_i, l_i, acc


@triton.jit
def _first_pages(table, lo, hi, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The page ids of positions lo .. lo + BLOCK_N (within hi) of a page-table row: what
    `_attend_pages` reads first. The table is a step input, so a PDL kernel may load it
    before its wait."""
    pos = lo + tl.arange(0, BLOCK_N)
    return tl.load(table + pos // PAGE_SIZE, mask=pos < hi, other=0)


@triton.jit
def _attend_rows(
    q_ptr,
    q_rows,
    row_mask,
    table,
    page,
    k_base,
    v_base,
    lo,
    hi,
    stride_kc_slot,
    stride_vc_slot,
    scale_log2,
    ROWS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
    row_hi=0,
    PER_ROW_HI: tl.constexpr = False,
):
    """Attention of ROWS query rows (element offsets `q_rows` into q; rows off `row_mask` read
    zeros) over positions [lo, hi) of one page-table row (`page`: `_first_pages` of it), and
    with PER_ROW_HI below row_hi[r] for row r. Returns the normalised output [ROWS, BLOCK_D]
    in fp32, the running max and sum (for a log-sum-exp), and the dim mask."""
    d = tl.arange(0, BLOCK_D)
    if BLOCK_D == HEAD_DIM:
        d_mask = d < BLOCK_D  # all true: keeps the dim mask out of the vectorised loads
    else:
        d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    m_i, l_i, acc = _attend_pages(
        q, m_i, l_i, acc, table, page, k_base, v_base, lo, hi, stride_kc_slot, stride_vc_slot, d, scale_log2,
        PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_F32, row_hi=row_hi, PER_ROW_HI=PER_ROW_HI,
    )  # fmt: skip
    return acc / tl.maximum(l_i, 1e-30)[:, None], m_i, l_i, d, d_mask


# ------------------------------------------------------------------------------------ store


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_slot,
    stride_vc_slot,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TO_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)  # launched early (nanoserve/triton_pdl.py): wait before reading anything
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # a negative slot marks a token whose K/V must not be kept
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
        t64 = t.to(tl.int64)
        k = tl.load(k_ptr + t64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(v_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        dst = h[:, None] * HEAD_DIM + d[None, :]
        cache_ty = k_cache_ptr.dtype.element_ty
        if TO_FP8:  # round to nearest even, saturating, as torch's cast
            k = k.to(tl.float32).to(cache_ty, fp_downcast_rounding="rtne")
            v = v.to(tl.float32).to(cache_ty, fp_downcast_rounding="rtne")
        tl.store(k_cache_ptr + slot * stride_kc_slot + dst, k.to(cache_ty), mask=mask)
        tl.store(v_cache_ptr + slot * stride_vc_slot + dst, v.to(cache_ty), mask=mask)


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    pdl: bool = True,
) -> None:
    """Write k/v [T, num_kv_heads, head_dim] into cache slots slot_mapping [T] (slots < 0 skipped)."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    assert k.stride(2) == 1 and v.stride(2) == 1, "k/v rows must be dense along head_dim"
    kc_slot, _ = _flat_cache(k_cache)
    vc_slot, _ = _flat_cache(v_cache)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kc_slot,
        vc_slot,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        TO_FP8=k_cache.element_size() == 1,
        num_warps=4,
        **launch_options(k.device, pdl),
    )


# ----------------------------------------------------------------------------------- decode


@triton.jit
def _kv_start(kv_start_ptr, b, seq_len, window, HAS_START: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The first position a decode request's splits read: its cascade group's prefix end
    (HAS_START), the start of its sliding window (HAS_WINDOW), or 0."""
    if HAS_START:
        start = tl.load(kv_start_ptr + b)
    elif HAS_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    else:
        start = 0
    return start


@triton.jit
def _with_sink(out, m_i, l_i, sinks_ptr, heads, row_mask):
    """Rows of a normalised output (max m_i and sum l_i of their base-2 exponentials) with
    each head's sink logit (natural base, unscaled) added to the softmax's denominator."""
    sink = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0).to(tl.float32) * 1.4426950408889634
    m_all = tl.maximum(m_i, sink)
    seen = l_i * tl.exp2(m_i - m_all)  # 0 for a row that saw no key (m_i = -inf)
    return out * (seen / (seen + tl.exp2(sink - m_all)))[:, None]


@triton.jit
def _split_len(seq_len, num_splits, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """Tokens per split of one request: its length spread over the splits, in whole blocks.
    Both decode kernels compute it the same way, so no split count travels between them."""
    per_split = tl.cdiv(seq_len, num_splits)
    per_split = tl.maximum(per_split, MIN_SPLIT)
    return tl.cdiv(per_split, BLOCK_N) * BLOCK_N


# Ints that vary from batch to batch (page-table width, block counts) are not specialized:
# Triton would otherwise compile a variant per value class (== 1, divisible by 16) while the
# engine is serving.
@triton.jit(do_not_specialize=["stride_pt", "num_splits", "num_cols", "window"])
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    page_table_ptr,
    seq_lens_ptr,
    kv_start_ptr,
    run_rows_ptr,
    sinks_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    stride_qt,
    stride_qh,
    stride_kc_slot,
    stride_vc_slot,
    stride_pt,
    stride_ot,
    stride_oh,
    num_splits,
    num_cols,
    window,
    scale_log2,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
    DIRECT: tl.constexpr,
    HAS_START: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_F32: tl.constexpr,
    USE_PDL: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    RUNS: tl.constexpr = False,
    SKIP_EMPTY: tl.constexpr = False,
):
    # One program = one (request, kv head, split): the GROUP query heads sharing the kv head
    # are the rows of one tile, so each K/V block is loaded once for the whole group.
    # With HAS_START (cascade), a request's positions before kv_start[b] are another
    # kernel's (its group's shared prefix): the splits cover kv_start[b]..seq_len only.
    # With HAS_WINDOW (a sliding-window layer, never with cascade) the splits cover the
    # last `window` positions only: nothing before them is read.
    # With RUNS (a verify step: rows that are consecutive positions of one request, in
    # order; RunInputs), one program = one (batch row, kv head, split) and only a run's first
    # row has work (run_rows[b] = the run's length there, 0 on its other rows): the tile's
    # rows are every position's GROUP heads (row r: position r // GROUP, head r % GROUP),
    # each masked to its own length, so the request's K/V is read once for the whole run.
    # The splits divide the run's longest length (its last row's): a row's later splits
    # may see nothing (zeros and lse -inf). The reduce counts a row's splits by the row's
    # own length; as split lengths grow with the length, that covers every split holding
    # any of the row's positions. Never with HAS_START or HAS_WINDOW.
    # Lengths, starts and the page table are the step's inputs (written before its first
    # kernel): read before the PDL wait, so that only q and K/V loads follow it.
    b = tl.program_id(1) if HEADS_FIRST else tl.program_id(0)
    kvh = tl.program_id(0) if HEADS_FIRST else tl.program_id(1)
    split = tl.program_id(2)
    if RUNS:
        count = tl.load(run_rows_ptr + b)
    else:
        count = 1  # a compile-time 1: the branch below is no branch
    if count > 0:  # a run's later rows have no work
        if RUNS:
            seq_len = tl.load(seq_lens_ptr + b + count - 1)  # the run's last row
        else:
            seq_len = tl.load(seq_lens_ptr + b)
        kv_start = _kv_start(kv_start_ptr, b, seq_len, window, HAS_START, HAS_WINDOW)
        split_len = _split_len(seq_len - kv_start, num_splits, BLOCK_N, MIN_SPLIT)
        start = kv_start + split * split_len
        end = tl.minimum(start + split_len, seq_len)
        # An empty split (start >= end) writes zeros and lse = -inf, which the reduce never
        # reads: it reads a row's splits up to cdiv(length, split_len), all non-empty. Over
        # runs such a program exits before its PDL wait instead. Most of a runs graph's grid
        # is empty (its padding rows, every split past a short context), and leaving at once
        # frees their slots for the programs with work: a K=4 verify step at batch 1 took
        # 4.336 -> 4.300 ms (H200, llama-3.1-8b, context 512). The kernel still completes
        # after the one before it, as split 0 of a real run always waits. Over requests the
        # exit cost a batch-1 decode step 5-12 us (3.910 -> 3.915 ms), so it stays off there
        # (SKIP_EMPTY, a constexpr: the plain variants compile as before). In DIRECT mode (no
        # reduce) an empty request gets zeros either way.
        if (end > start) | (not SKIP_EMPTY):
            g = tl.arange(0, BLOCK_H)
            if RUNS:
                rows = (b + g // GROUP).to(tl.int64)  # each tile row's batch row
                heads = kvh * GROUP + g % GROUP
                row_mask = g < count * GROUP
                row_len = tl.load(seq_lens_ptr + rows, mask=row_mask, other=0)
            else:
                rows = b.to(tl.int64)
                heads = kvh * GROUP + g
                row_mask = g < GROUP
                row_len = seq_len  # unused
            b64 = b.to(tl.int64)
            table = page_table_ptr + b64 * stride_pt
            page = _first_pages(table, start, end, PAGE_SIZE, BLOCK_N)
            pdl_start(USE_PDL)  # q and this step's K/V come from the kernels before
            out, m_i, l_i, d, d_mask = _attend_rows(
                q_ptr, rows * stride_qt + heads * stride_qh, row_mask, table, page,
                k_cache_ptr + kvh * HEAD_DIM, v_cache_ptr + kvh * HEAD_DIM, start, end, stride_kc_slot, stride_vc_slot,
                scale_log2, BLOCK_H, PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_F32, row_hi=row_len, PER_ROW_HI=RUNS,
            )  # fmt: skip
            store_mask = row_mask[:, None] & d_mask[None, :]
            if DIRECT:
                if HAS_SINKS:
                    out = _with_sink(out, m_i, l_i, sinks_ptr, heads, row_mask)
                if RUNS:
                    out_ptrs = out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
                else:
                    out_ptrs = out_ptr + b64 * stride_ot + heads[:, None] * stride_oh + d[None, :]
                tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=store_mask)
            else:
                # workspace rows: [B, num_q_heads, num_cols, (HEAD_DIM | 1)]; columns 0..num_splits-1
                # are this kernel's, the rest the cascade prefix kernel's
                row = (rows * NUM_Q_HEADS + heads) * num_cols + split
                _store_partial(part_ptr, lse_ptr, row, out, m_i, l_i, d, row_mask, store_mask, HEAD_DIM)


@triton.jit
def _store_partial(part_ptr, lse_ptr, row, out, m_i, l_i, d, row_mask, store_mask, HEAD_DIM: tl.constexpr):
    """One split's normalised output rows and their base-2 log-sum-exp (-inf: saw nothing)."""
    tl.store(part_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=store_mask)
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
    tl.store(lse_ptr + row, lse, mask=row_mask)


@triton.jit(do_not_specialize=["num_splits", "num_cols", "window"])
def _decode_reduce_kernel(
    part_ptr,
    lse_ptr,
    seq_lens_ptr,
    kv_start_ptr,
    num_parts_ptr,
    sinks_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_splits,
    num_cols,
    window,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
    HAS_CASCADE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Merges a (request, head)'s partial results: the split kernel's active splits (columns
    # 0..), and with HAS_CASCADE the prefix kernel's num_parts[b] (columns num_splits..).
    # Which columns are active follows from the step's inputs, read before the PDL wait.
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    kv_start = _kv_start(kv_start_ptr, b, seq_len, window, HAS_CASCADE, HAS_WINDOW)
    split_len = _split_len(seq_len - kv_start, num_splits, BLOCK_N, MIN_SPLIT)
    num_active = tl.cdiv(seq_len - kv_start, split_len)  # 0 for an empty (padding) request: writes zeros
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_active
    if HAS_CASCADE:
        num_parts = tl.load(num_parts_ptr + b)
        s_mask = s_mask | ((s >= num_splits) & (s < num_splits + num_parts))
    d_mask = d < HEAD_DIM
    pdl_start(USE_PDL)  # the partials come from the kernels before
    row = (b.to(tl.int64) * NUM_Q_HEADS + h) * num_cols + s
    lse = tl.load(lse_ptr + row, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:  # the head's sink logit joins the denominator (natural base, unscaled)
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    else:
        m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(s_mask, tl.exp2(lse - m), 0.0)
    part = tl.load(part_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    denom = tl.sum(w, 0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m)
    out = tl.sum(part * w[:, None], 0) / tl.maximum(denom, 1e-30)
    tl.store(out_ptr + b.to(tl.int64) * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def decode_config(head_dim: int, cache: torch.Tensor, window: int, num_splits: int) -> dict[str, int]:
    """The decode launch config for `head_dim` over `cache`'s dtype, in a layer with `window`,
    at `num_splits` splits a request."""
    if head_dim * cache.element_size() <= 256 or num_splits > WIDE_MAX_SPLITS:
        return DECODE_CONFIG
    return WIDE_WINDOW_DECODE_CONFIG if window > 0 else WIDE_DECODE_CONFIG


def _decode_block_n(cfg: dict[str, int], head_dim: int, x: torch.Tensor) -> int:
    """Tokens per K/V block: halved when a row is wider than 256 bytes (head_dim 256 in
    16-bit, 128 in fp32) so that the pipelined tiles fit in shared memory; doubled for an fp8
    cache with rows of 128 bytes or fewer, keeping the bytes per block (H200, the offline
    workload's decode batches, fp8: 1,241 vs 1,276 us, `benchmarks/attention.py --ragged`)."""
    row = head_dim * x.element_size()
    if x.element_size() == 1 and row <= 128:
        return 2 * cfg["BLOCK_N"]
    return cfg["BLOCK_N"] if row <= 256 else max(16, cfg["BLOCK_N"] // 2)


def workspace_numel(batch: int, num_q_heads: int, head_dim: int, num_cols: int) -> int:
    """fp32 elements of decode workspace: partial outputs then their log-sum-exps, `num_cols`
    per (request, head): the splits, plus MAX_CASCADE_PARTS with cascade."""
    return batch * num_q_heads * num_cols * (head_dim + 1)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    workspace: torch.Tensor | None,
    out: torch.Tensor,
    cascade: CascadeInputs | None = None,
    heads_first: bool = True,
    pdl: bool = True,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    runs: RunInputs | None = None,
) -> torch.Tensor:
    """out[b] = attention of q[b] ([B, Hq, D], one token per request) over the first
    seq_lens[b] positions of request b's pages. With num_splits > 1 or a cascade, `workspace`
    (fp32, at least workspace_numel(...) elements) holds the partial results.

    `window` > 0 (a sliding-window layer): only the last `window` positions are read, from
    max(0, seq_lens[b] - window); not with a cascade. `sinks` [Hq]: each head's sink logit
    joins the softmax's denominator (attention_reference says how).

    `cascade` (nanoserve.attention.cascade): requests grouped by a shared prefix; each
    group's prefix is read once by the prefix kernel for all its members, the split kernel
    reads each request's positions from cascade.prefix_len[b] on, and the reduce merges both.

    `runs`: rows that are consecutive positions of one request (same page-table row, lengths
    one apart) are attended by one program per (run, kv head, split), which reads their K/V
    once; neither with a cascade nor a window."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    assert q.stride(2) == 1 and out.stride(2) == 1
    kc_slot, _ = _flat_cache(k_cache)
    vc_slot, _ = _flat_cache(v_cache)
    if window > 0 and cascade is not None:
        raise ValueError("cascade decode does not take a sliding window")
    if runs is not None and (window > 0 or cascade is not None):
        raise ValueError("runs decode takes neither a sliding window nor a cascade")
    has_sinks = sinks is not None
    if has_sinks:
        assert sinks.shape == (num_q_heads,) and sinks.is_contiguous()
    block_d = triton.next_power_of_2(head_dim)
    cfg = INTERPRET_DECODE_CONFIG if INTERPRET else decode_config(block_d, k_cache, window, num_splits)
    block_n = _decode_block_n(cfg, block_d, k_cache)
    direct = num_splits == 1 and cascade is None
    num_cols = num_splits + (MAX_CASCADE_PARTS if cascade is not None else 0)
    if direct:
        part, lse = out, out  # unused
    else:
        assert workspace is not None and workspace.dtype == torch.float32
        n_lse = batch * num_q_heads * num_cols
        n_part = n_lse * head_dim
        assert workspace.numel() >= n_part + n_lse, "decode workspace too small"
        part, lse = workspace[:n_part], workspace[n_part : n_part + n_lse]
    kv_start = cascade.prefix_len if cascade is not None else seq_lens  # unused without cascade
    grid = (num_kv_heads, batch, num_splits) if heads_first else (batch, num_kv_heads, num_splits)
    sinks_arg = sinks if has_sinks else seq_lens  # unused without sinks
    block_h = max(16, triton.next_power_of_2(group)) if runs is None else runs_block_h(runs.max_rows, group)
    _decode_split_kernel[grid](
        q, k_cache, v_cache, page_table, seq_lens, kv_start, runs.rows if runs is not None else seq_lens, sinks_arg,
        out, part, lse,
        q.stride(0), q.stride(1),
        kc_slot, vc_slot,
        page_table.stride(0),
        out.stride(0), out.stride(1),
        num_splits, num_cols, window, scale * LOG2E,
        NUM_Q_HEADS=num_q_heads, GROUP=group, PAGE_SIZE=page_size,
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        BLOCK_N=block_n, MIN_SPLIT=MIN_SPLIT_TOKENS, DIRECT=direct, HAS_START=cascade is not None,
        HAS_WINDOW=window > 0, HAS_SINKS=has_sinks, DOT_F32=DOT_F32, HEADS_FIRST=heads_first, RUNS=runs is not None, SKIP_EMPTY=runs is not None and not direct, num_warps=cfg["num_warps"], num_stages=_stages(cfg, k_cache),
        **launch_options(q.device, pdl),
    )  # fmt: skip
    if cascade is not None:
        assert cascade.items.shape[1] == len(ITEM_FIELDS)
        ccfg = cascade_config(group)
        assert ccfg is not None, "cascade planned for a head group too large for the prefix kernel"
        _cascade_prefix_kernel[(cascade.items.shape[0], num_kv_heads)](
            q, k_cache, v_cache, page_table, cascade.items, cascade.members,
            part, lse,
            q.stride(0), q.stride(1), kc_slot, vc_slot, page_table.stride(0),
            num_splits, num_cols, scale * LOG2E,
            NUM_Q_HEADS=num_q_heads, GROUP=group, PAGE_SIZE=page_size,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=ccfg["BLOCK_M"], BLOCK_N=ccfg["BLOCK_N"],
            DOT_F32=DOT_F32, num_warps=ccfg["num_warps"], num_stages=_stages(ccfg, k_cache),
        )  # fmt: skip
    if not direct:
        num_parts = cascade.num_parts if cascade is not None else seq_lens  # unused without cascade
        _decode_reduce_kernel[(batch, num_q_heads)](
            part, lse, seq_lens, kv_start, num_parts, sinks_arg, out,
            out.stride(0), out.stride(1), num_splits, num_cols, window,
            NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_S=_reduce_block_s(num_cols), BLOCK_N=block_n, MIN_SPLIT=MIN_SPLIT_TOKENS,
            HAS_CASCADE=cascade is not None, HAS_WINDOW=window > 0, HAS_SINKS=has_sinks, num_warps=4,
            **launch_options(q.device, pdl),
        )  # fmt: skip
    return out


def _reduce_block_s(num_cols: int) -> int:
    """Columns the reduce kernel reads per (request, head), masked past the active ones: one
    width for every split count up to 32 (the backend's cap) and one for cascade's extra
    columns, so that a split count first met while serving (a mixed step's eager decode rows,
    a prefix hit with cascade) compiles no new variant mid-run; the masked lanes load nothing."""
    return max(32 if num_cols <= 32 else 64, triton.next_power_of_2(num_cols))


def runs_block_h(max_rows: int, group: int) -> int:
    """Query rows of the decode tile over runs: every position of the longest run, GROUP heads each."""
    return max(16, triton.next_power_of_2(max_rows * group))


def cascade_config(group: int) -> dict[str, int] | None:
    """The prefix kernel's launch config for `group` query heads per kv head; None when fewer
    than two requests' heads fit in one tile (no cascade then)."""
    cfg = INTERPRET_CASCADE_CONFIG if INTERPRET else CASCADE_CONFIG
    return cfg if cfg["BLOCK_M"] // group >= 2 else None


def cascade_max_members(group: int) -> int:
    """Most requests one cascade work item serves (their heads fill the query tile)."""
    cfg = cascade_config(group)
    return 0 if cfg is None else cfg["BLOCK_M"] // group


def choose_num_splits(
    batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int, max_splits: int, programs_per_sm: int = 4
) -> int:
    """About `programs_per_sm` (request, kv head, split) programs per multiprocessor (4 for
    decode over requests, RUNS_PROGRAMS_PER_SM over runs), rounded to the nearest split count
    (measured on an H200: batch 8 x 8 kv heads is best at 8 splits, batch 64 x 8 at 1), and no
    split shorter than MIN_SPLIT_TOKENS of the longest request. Host ints only."""
    programs = max(1, batch * num_kv_heads)
    wanted = int(programs_per_sm * num_sms / programs + 0.5)
    by_length = math.ceil(max(1, max_seq_len) / MIN_SPLIT_TOKENS)
    return max(1, min(wanted, by_length, max_splits))


# ----------------------------------------------------------------------------------- extend


@triton.jit(do_not_specialize=["stride_pt", "num_m_blocks", "window"])
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_q_ptr,
    prefix_lens_ptr,
    page_table_ptr,
    sinks_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_slot,
    stride_vc_slot,
    stride_pt,
    stride_ot,
    stride_oh,
    num_m_blocks,
    window,
    scale_log2,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    # Heads vary fastest in launch order so that the group sharing a kv head runs together
    # (its K/V stays in L2); query blocks run last-first so the longest causal rows start early.
    h = tl.program_id(0)
    b = tl.program_id(1)
    m_blk = num_m_blocks - 1 - tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    m0 = m_blk * BLOCK_M
    if m0 < q_len:
        kvh = h // GROUP
        prefix = tl.load(prefix_lens_ptr + b)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < q_len
        d = tl.arange(0, BLOCK_D)
        if BLOCK_D == HEAD_DIM:
            d_mask = d < BLOCK_D
        else:
            d_mask = d < HEAD_DIM
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        offs_n = tl.arange(0, BLOCK_N)

        # 1) the cached prefix, through the page table: every prefix position precedes every
        #    new token, so only the length masks it (and, with a sliding window, each row's
        #    window: row r sees positions from prefix + r - window + 1 on; the block reads
        #    from its first row's start).
        table = page_table_ptr + b.to(tl.int64) * stride_pt
        kc_base = k_cache_ptr + kvh * HEAD_DIM
        vc_base = v_cache_ptr + kvh * HEAD_DIM
        if HAS_WINDOW:
            row_lo = prefix + offs_m - window + 1  # in positions
            lo = tl.maximum(prefix + m0 - window + 1, 0)
        else:
            row_lo = offs_m  # unused
            lo = 0
        page = _first_pages(table, lo, prefix, PAGE_SIZE, BLOCK_N)
        m_i, l_i, acc = _attend_pages(
            q, m_i, l_i, acc, table, page, kc_base, vc_base, lo, prefix, stride_kc_slot, stride_vc_slot, d,
            scale_log2, PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_F32, row_lo, HAS_WINDOW,
        )  # fmt: skip

        # 2) new tokens before this query block: visible to every row, no mask (with a
        #    window: from the block's first row's window start, masked by each row's).
        k_base = k_ptr + (q_start.to(tl.int64)) * stride_kt + kvh * stride_kh
        v_base = v_ptr + (q_start.to(tl.int64)) * stride_vt + kvh * stride_vh
        if HAS_WINDOW:
            col_lo = offs_m - window + 1  # in new-token columns
            first = tl.maximum(m0 - window + 1, 0) // BLOCK_N * BLOCK_N  # whole tiles that end at m0
            for n0 in range(first, m0, BLOCK_N):
                cols = n0 + offs_n
                k = _load_tile(k_base + cols[:, None] * stride_kt + d[None, :], offs_n, d, HEAD_DIM, BLOCK_D, False)
                v = _load_tile(v_base + cols[:, None] * stride_vt + d[None, :], offs_n, d, HEAD_DIM, BLOCK_D, False)
                mask = cols[None, :] >= col_lo[:, None]
                m_i, l_i, acc = _attend_block(q, k, v, m_i, l_i, acc, mask, scale_log2, True, DOT_F32, True)
        else:
            for n0 in range(0, m0, BLOCK_N):
                cols = n0 + offs_n
                k = _load_tile(k_base + cols[:, None] * stride_kt + d[None, :], offs_n, d, HEAD_DIM, BLOCK_D, False)
                v = _load_tile(v_base + cols[:, None] * stride_vt + d[None, :], offs_n, d, HEAD_DIM, BLOCK_D, False)
                m_i, l_i, acc = _attend_block(q, k, v, m_i, l_i, acc, offs_n, scale_log2, MASKED=False, DOT_F32=DOT_F32)

        # 3) the diagonal: causal and length masks. Row m0 sees column m0, so no row of the
        #    first diagonal block is fully masked and m_i is finite from then on.
        hi = tl.minimum(m0 + BLOCK_M, q_len)
        for n0 in range(m0, hi, BLOCK_N):
            cols = n0 + offs_n
            n_mask = cols < q_len
            k = _load_tile(k_base + cols[:, None] * stride_kt + d[None, :], n_mask, d, HEAD_DIM, BLOCK_D, True)
            v = _load_tile(v_base + cols[:, None] * stride_vt + d[None, :], n_mask, d, HEAD_DIM, BLOCK_D, True)
            mask = (cols[None, :] <= offs_m[:, None]) & n_mask[None, :]
            if HAS_WINDOW:
                mask = mask & (cols[None, :] >= col_lo[:, None])
                m_i, l_i, acc = _attend_block(q, k, v, m_i, l_i, acc, mask, scale_log2, True, DOT_F32, True)
            else:
                m_i, l_i, acc = _attend_block(q, k, v, m_i, l_i, acc, mask, scale_log2, MASKED=True, DOT_F32=DOT_F32)

        if HAS_SINKS:  # the head's sink logit joins the denominator (natural base, unscaled)
            sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
            m_all = tl.maximum(m_i, sink)
            out = acc * tl.exp2(m_i - m_all)[:, None] / (l_i * tl.exp2(m_i - m_all) + tl.exp2(sink - m_all))[:, None]
        else:
            out = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=m_mask[:, None] & d_mask[None, :],
        )


def extend_config(head_dim: int) -> dict[str, int]:
    if INTERPRET:
        return INTERPRET_EXTEND_CONFIG
    return EXTEND_CONFIG[min(256, max(64, triton.next_power_of_2(head_dim)))]


def paged_extend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_query_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    page_table: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens (q/k/v rows cu_query_lens[i]:[i+1])
    over its cached prefix (prefix_lens[i] positions in its pages) and its new tokens;
    `window` > 0: each token over its last `window` positions only; `sinks` [Hq]: as
    `paged_decode`."""
    num_reqs = cu_query_lens.shape[0] - 1
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    if num_reqs == 0 or max_query_len == 0:
        return out
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and out.stride(2) == 1
    kc_slot, _ = _flat_cache(k_cache)
    vc_slot, _ = _flat_cache(v_cache)
    if sinks is not None:
        assert sinks.shape == (num_q_heads,) and sinks.is_contiguous()
    cfg = extend_config(head_dim)
    num_m_blocks = triton.cdiv(max_query_len, cfg["BLOCK_M"])
    _extend_kernel[(num_q_heads, num_reqs, num_m_blocks)](
        q,
        k,
        v,
        k_cache,
        v_cache,
        out,
        cu_query_lens,
        prefix_lens,
        page_table,
        prefix_lens if sinks is None else sinks,  # unused without sinks
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kc_slot,
        vc_slot,
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        num_m_blocks,
        window,
        scale * LOG2E,
        GROUP=num_q_heads // num_kv_heads,
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        DOT_F32=DOT_F32,
        HAS_WINDOW=window > 0,
        HAS_SINKS=sinks is not None,
        num_warps=cfg["num_warps"],
        num_stages=_stages(cfg, q),
    )
    return out


# ---------------------------------------------------------------------- cascade (shared prefix)


@triton.jit(do_not_specialize=["stride_pt", "num_splits", "num_cols"])
def _cascade_prefix_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    page_table_ptr,
    items_ptr,
    members_ptr,
    part_ptr,
    lse_ptr,
    stride_qt,
    stride_qh,
    stride_kc_slot,
    stride_vc_slot,
    stride_pt,
    num_splits,
    num_cols,
    scale_log2,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    # One program = one (work item, kv head). The rows of its query tile are every member's
    # GROUP heads of this kv head (row r: member r // GROUP, head r % GROUP), so each K/V block
    # of the shared prefix is read once for the whole group instead of once per request.
    # A work item's 6 int32 fields, in the order of nanoserve.attention.cascade.ITEM_FIELDS.
    item = items_ptr + tl.program_id(0) * 6
    kvh = tl.program_id(1)
    count = tl.load(item + 1)
    if count > 0:  # graphs launch a fixed number of items; unused ones have no members
        first = tl.load(item + 0)
        row_b = tl.load(item + 2).to(tl.int64)
        lo = tl.load(item + 3)
        hi = tl.load(item + 4)
        col = num_splits + tl.load(item + 5)
        r = tl.arange(0, BLOCK_M)
        member = r // GROUP
        heads = kvh * GROUP + r % GROUP
        row_mask = member < count
        b = tl.load(members_ptr + first + member, mask=row_mask, other=0).to(tl.int64)
        table = page_table_ptr + row_b * stride_pt
        out, m_i, l_i, d, d_mask = _attend_rows(
            q_ptr, b * stride_qt + heads * stride_qh, row_mask, table, _first_pages(table, lo, hi, PAGE_SIZE, BLOCK_N),
            k_cache_ptr + kvh * HEAD_DIM, v_cache_ptr + kvh * HEAD_DIM, lo, hi, stride_kc_slot, stride_vc_slot,
            scale_log2, BLOCK_M, PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_F32,
        )  # fmt: skip
        row = (b * NUM_Q_HEADS + heads) * num_cols + col
        _store_partial(
            part_ptr, lse_ptr, row, out, m_i, l_i, d, row_mask, row_mask[:, None] & d_mask[None, :], HEAD_DIM
        )
