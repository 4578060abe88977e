"""The qkv product with the rotary embedding and the K/V store in its epilogue, at decode's
few rows:
- one row (`qkv_rope_gemv`): a decode step at batch 1 runs the attention block's input
  projection, the neox rotation of q and k and the write of the new K/V into the cache in one
  launch instead of two (the GEMV, then `rotary.qk_norm_rope` with its store);
- 2..16 rows through a split-K config (`qkv_rope_rows`: speculative verify steps, whose 1 + K
  rows per request the rule gives 16-row split-K tiles): the product's kernel stores its fp32
  partials, then one epilogue kernel sums them, rounds, rotates and stores q|k|v and the K/V
  rows, instead of a sum kernel and the rotary kernel (two launches instead of three).

How: the GEMV is `linear._linear_fma_kernel`'s one-row scheme (the same K loop, `_fma_step`
and `_fma_outputs`), with its output rows paired for the rotation: program p of head h holds
PAIRS pairs of rows (j, j + D/2) of that head, j = p's first pair + 0..PAIRS-1 (heads in the
merged weight's order: q heads, k heads, v heads). After the K loop it rounds the products to
the output dtype (as the GEMV's store does), rotates the pairs of q and k heads exactly as
`rotary._norm_rope_heads` does (cos/sin rounded to the dtype first), stores the whole row
[q | k | v] in the GEMV's usual layout, and a k or v program also writes its heads into cache
slot `slot_mapping[0]` (skipped when negative), as `store_kv` would.

Rows (`_split_rope_kernel`): program (t, j) holds row t's heads j * BLOCK_H .. + BLOCK_H (the
merged order again), as pairs (d, d + D/2). It adds the split-K planes of those columns in
split order and the bias in fp32 and rounds once (exactly what `linear._sum_splits_kernel`
stores), then rotates and stores as above, and writes row t's k and v heads into cache slot
`slot_mapping[t]` (skipped when negative). Each row is its own token: its position and slot.

`qkv_rope_reference` is the torch twin of the output (the product, then `rope_reference`); the
cache rows it writes are those `rotary.qk_norm_rope` writes from the same q|k|v.

Invariants: no q/k norm (Qwen3 keeps the separate launches); the output equals the unfused
product + rotary kernel within one rounding step of the rotation (both round the product and
the rotated values to the dtype; only the fp32 rotation's contraction may differ; in Triton's
interpreter they are bit-equal), and the cache rows are those the rotary kernel's store writes
from it; under PDL only weights, tables and the step's inputs (positions, slots) are read
before the wait; launchers allocate only shape-determined outputs (graph-safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.launch import launch_options, pdl_start
from nanoserve.kernels.linear import (
    FP8_WEIGHT,
    LinearConfig,
    _fma_outputs,
    _fma_step,
    _prefetch_l2,
    _sum_planes,
    _x_step,
    small_m_linear,
)
from nanoserve.kernels.rotary import _to_cache, rope_reference


def qkv_rope_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_q_heads: int,
    num_k_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """The slow twin: x [T, K] W^T (+ b) in x's dtype [T, (Hq + 2 Hk) D], q and k of row t
    rotated in place at positions[t]."""
    y = (x.float() @ weight.float().t() + (0 if bias is None else bias.float())).to(x.dtype)
    heads = y.view(x.shape[0], num_q_heads + 2 * num_k_heads, head_dim)
    q, k, _ = heads.split([num_q_heads, num_k_heads, num_k_heads], 1)
    q_rot, k_rot = rope_reference(positions, q, k, cos, sin)
    q.copy_(q_rot)
    k.copy_(k_rot)
    return y


@triton.jit
def _qkv_rope_gemv_kernel(
    x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, pos_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    K, stride_wn, stride_cos, stride_kc, stride_vc,
    W_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, PAIRS: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    LINE: tl.constexpr, LOOP_STAGES: tl.constexpr, NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, STORE_KV: tl.constexpr, TO_FP8: tl.constexpr, EARLY_TABLES: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    HALF: tl.constexpr = HEAD_DIM // 2
    BLOCK_N: tl.constexpr = 2 * PAIRS
    pid = tl.program_id(0)
    head = pid // (HALF // PAIRS)
    j = (pid % (HALF // PAIRS)) * PAIRS + tl.arange(0, PAIRS)  # this program's pairs (j, j + HALF)
    n = tl.arange(0, BLOCK_N)
    rn_in = (head * HEAD_DIM + (pid % (HALF // PAIRS)) * PAIRS + n // 2 + (n % 2) * HALF).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rk[None, :]
    w_ptrs = w_ptr + rn_in[:, None] * stride_wn + rk[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    dtype = y_ptr.dtype.element_ty
    # The step's inputs and the tables are in place before the forward's first kernel.
    # EARLY_TABLES loads them before the K loop (held in registers through it); else they are
    # loaded after it.
    if EARLY_TABLES:
        pos = tl.load(pos_ptr).to(tl.int64)
        cos = tl.load(cos_ptr + pos * stride_cos + j).to(dtype).to(tl.float32)  # rounded, as the reference
        sin = tl.load(sin_ptr + pos * stride_cos + j).to(dtype).to(tl.float32)
    if USE_PDL:
        lines = tl.minimum(tl.arange(0, BLOCK_K // LINE) * LINE, K - 1)
        _prefetch_l2(w_ptr + rn_in[:, None] * stride_wn + lines[None, :])
        pdl_start(USE_PDL)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=LOOP_STAGES):
        x = _x_step(x_ptrs, k0, rk, K, EVEN_K)
        acc = _fma_step(acc, x, w_ptrs, s_ptr, rn_in, k0, rk, K, 0, W_SCALE, 1, EVEN_K)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not EARLY_TABLES:
        pos = tl.load(pos_ptr).to(tl.int64)
        cos = tl.load(cos_ptr + pos * stride_cos + j).to(dtype).to(tl.float32)
        sin = tl.load(sin_ptr + pos * stride_cos + j).to(dtype).to(tl.float32)
    if STORE_KV:
        slot = tl.load(slot_ptr).to(tl.int64)
    y = _fma_outputs(acc, s_ptr, b_ptr, rn_in, W_SCALE, HAS_BIAS, 1)  # [1, BLOCK_N] fp32
    y = y.to(dtype).to(tl.float32)  # the product's own rounding
    x1, x2 = tl.split(tl.reshape(y, [PAIRS, 2]))  # rows j and j + HALF
    if head < NUM_Q_HEADS + NUM_K_HEADS:  # q and k heads rotate; v heads pass
        o1 = (x1 * cos - x2 * sin).to(dtype)
        o2 = (x2 * cos + x1 * sin).to(dtype)
    else:
        o1 = x1.to(dtype)
        o2 = x2.to(dtype)
    row = y_ptr + head * HEAD_DIM + j
    tl.store(row, o1)
    tl.store(row + HALF, o2)
    if STORE_KV:  # noqa: SIM102 - `slot` exists only under the constexpr STORE_KV
        if (head >= NUM_Q_HEADS) & (slot >= 0):
            if head < NUM_Q_HEADS + NUM_K_HEADS:
                cache = k_cache_ptr + slot * stride_kc + (head - NUM_Q_HEADS) * HEAD_DIM + j
            else:
                cache = v_cache_ptr + slot * stride_vc + (head - NUM_Q_HEADS - NUM_K_HEADS) * HEAD_DIM + j
            cache_ty = k_cache_ptr.dtype.element_ty
            tl.store(cache, _to_cache(o1, cache_ty, TO_FP8))
            tl.store(cache + HALF, _to_cache(o2, cache_ty, TO_FP8))


def fuses_rope(config: LinearConfig | None, head_dim: int) -> bool:
    """Whether the one-row GEMV config `config` can carry the rotation: the fma kernel at one
    row, its tile's rows a whole number of pairs within half a head."""
    if config is None or config.kernel != "fma" or config.block_m != 1 or config.split_k != 1:
        return False
    pairs = config.block_n // 2
    return config.block_n % 2 == 0 and head_dim % 2 == 0 and (head_dim // 2) % pairs == 0


def _kv_store_args(kv_store, x: torch.Tensor, positions: torch.Tensor, num_k_heads: int, head_dim: int) -> tuple:
    """(k_cache, v_cache, slot_mapping) for the launch, checked; x and positions stand in for
    the unused pointers without a store."""
    if kv_store is None:
        return x, x, positions
    k_cache, v_cache, slots = kv_store
    row = (num_k_heads * head_dim, head_dim, 1)
    if any(c.stride()[1:] != row or c.shape[2:] != (num_k_heads, head_dim) for c in (k_cache, v_cache)):
        raise ValueError("kv_store needs caches [pages, page_size, Hk, D] dense in their last three dims")
    return k_cache, v_cache, slots


def qkv_rope_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: LinearConfig,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_q_heads: int,
    num_k_heads: int,
    head_dim: int,
    kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    w_scale: torch.Tensor | None = None,
    pdl: bool = True,
    early_tables: bool | None = None,
) -> torch.Tensor:
    """x [1, K] times the merged qkv weight [(Hq + 2 Hk) D, K] (bf16/fp16, or FP8 with
    per-channel `w_scale`) (+ bias), q and k rotated at positions[0] by the fp32 cos/sin tables
    [max_positions, D/2]: [1, (Hq + 2 Hk) D] in x's dtype. `kv_store` = (k_cache, v_cache,
    slot_mapping [1]): the rotated k and v also go into cache slot slot_mapping[0] (caches
    [pages, page_size, Hk, D], dense in their last three dims, x's dtype or fp8).
    `early_tables`: read the position and cos/sin before the K loop (None: on configs of at
    most 2 warps, where values held in registers through the loop cost nothing; on 8 warps
    they cost 2.4 us a call, llama-3.1-8b's qkv on an H200, benchmarks/probes/qkv_rope_bench.py)."""
    K = x.shape[1]
    rows = (num_q_heads + 2 * num_k_heads) * head_dim
    if x.shape[0] != 1 or x.stride(1) != 1 or weight.shape != (rows, K) or weight.stride(1) != 1:
        raise ValueError("qkv_rope_gemv takes one dense row x [1, K] and the merged weight [(Hq + 2 Hk) D, K]")
    if not fuses_rope(config, head_dim):
        raise ValueError(f"{config} cannot carry the rotation (see fuses_rope)")
    if (w_scale is not None) != (weight.dtype == FP8_WEIGHT) or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("an FP8 weight needs its per-channel w_scale; cos/sin need dense rows")
    k_cache, v_cache, slots = _kv_store_args(kv_store, x, positions, num_k_heads, head_dim)
    out = torch.empty(1, rows, dtype=x.dtype, device=x.device)
    pairs = config.block_n // 2
    grid = (rows // (2 * pairs),)
    _qkv_rope_gemv_kernel[grid](
        x, weight, bias if bias is not None else weight, w_scale if w_scale is not None else weight, out,
        positions, cos, sin, k_cache, v_cache, slots,
        K, weight.stride(0), cos.stride(0), k_cache.stride(1), v_cache.stride(1),
        W_SCALE=0 if w_scale is None else 1, HAS_BIAS=bias is not None, PAIRS=pairs, BLOCK_K=config.block_k,
        EVEN_K=K % config.block_k == 0, LINE=min(config.block_k, 128 // weight.element_size()),
        LOOP_STAGES=config.num_stages, NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HEAD_DIM=head_dim,
        STORE_KV=kv_store is not None, TO_FP8=k_cache.element_size() == 1 and kv_store is not None,
        EARLY_TABLES=config.num_warps <= 2 if early_tables is None else early_tables,
        num_warps=config.num_warps, **launch_options(x.device, pdl),
    )  # fmt: skip
    return out


# ------------------------------------------------------------------------------ 2..16 rows

ROWS_MAX = 16  # the rows `qkv_rope_rows` is meant for (the rule's 16-row tiles); any count runs
PAIRS_PER_PROGRAM = 512  # (head, pair) lanes per epilogue program: the sum kernel's 1024 columns


@triton.jit
def _split_rope_kernel(
    ws_ptr, b_ptr, y_ptr, pos_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_ym, stride_cos, stride_kc, stride_vc,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, STORE_KV: tl.constexpr,
    TO_FP8: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program (t, j): heads j * BLOCK_H .. + BLOCK_H (q, then k, then v heads) of row t, from
    the split-K workspace ws [SPLIT_K, T, N] (dense; T the grid's rows): summed in split order
    (+ bias) in fp32 and rounded once, q and k rotated at positions[t], the row stored into y
    [T, N]; k and v heads also into cache slot slot[t] (a negative slot skipped)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    HEADS: tl.constexpr = NUM_Q_HEADS + 2 * NUM_K_HEADS
    N: tl.constexpr = HEADS * HEAD_DIM
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    lanes = d < HALF
    mask = (h < HEADS)[:, None] & lanes[None, :]
    cols = h[:, None] * HEAD_DIM + d[None, :]  # the first halves; the second ones at + HALF
    dtype = y_ptr.dtype.element_ty
    # Weights, tables and the step's inputs (in place before the forward's first kernel) are
    # read before the PDL wait, overlapping the product kernel's tail.
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + d, mask=lanes, other=0.0).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + d, mask=lanes, other=0.0).to(dtype).to(tl.float32)[None, :]
    if HAS_BIAS:
        b1 = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        b2 = tl.load(b_ptr + cols + HALF, mask=mask, other=0.0).to(tl.float32)
    if STORE_KV:
        slot = tl.load(slot_ptr + t).to(tl.int64)
    pdl_start(USE_PDL)  # the partials come from the product kernel
    plane = tl.num_programs(0).to(tl.int64) * N
    src = ws_ptr + t * N + cols
    x1 = _sum_planes(src, plane, mask, SPLIT_K)
    x2 = _sum_planes(src + HALF, plane, mask, SPLIT_K)
    if HAS_BIAS:
        x1 += b1
        x2 += b2
    x1 = x1.to(dtype).to(tl.float32)  # the product's one rounding (the sum kernel's store)
    x2 = x2.to(dtype).to(tl.float32)
    rotates = (h < NUM_Q_HEADS + NUM_K_HEADS)[:, None]  # q and k heads; v heads pass
    o1 = tl.where(rotates, x1 * cos - x2 * sin, x1).to(dtype)  # as rotary._norm_rope_heads
    o2 = tl.where(rotates, x2 * cos + x1 * sin, x2).to(dtype)
    dst = y_ptr + t * stride_ym + cols
    tl.store(dst, o1, mask=mask)
    tl.store(dst + HALF, o2, mask=mask)
    if STORE_KV:  # noqa: SIM102 - `slot` exists only under the constexpr STORE_KV
        if slot >= 0:
            cache_ty = k_cache_ptr.dtype.element_ty
            c1, c2 = _to_cache(o1, cache_ty, TO_FP8), _to_cache(o2, cache_ty, TO_FP8)
            is_k = mask & ((h >= NUM_Q_HEADS) & (h < NUM_Q_HEADS + NUM_K_HEADS))[:, None]
            k_dst = k_cache_ptr + slot * stride_kc + (cols - NUM_Q_HEADS * HEAD_DIM)  # masked off where not k
            tl.store(k_dst, c1, mask=is_k)
            tl.store(k_dst + HALF, c2, mask=is_k)
            is_v = mask & (h >= NUM_Q_HEADS + NUM_K_HEADS)[:, None]
            v_dst = v_cache_ptr + slot * stride_vc + (cols - (NUM_Q_HEADS + NUM_K_HEADS) * HEAD_DIM)
            tl.store(v_dst, c1, mask=is_v)
            tl.store(v_dst + HALF, c2, mask=is_v)


def fuses_rope_in_sum(config: LinearConfig | None) -> bool:
    """Whether `qkv_rope_rows` can run the product of config `config`: a split-K config of the
    dot or fp8 kernel, whose partials its epilogue sums (an unsplit product would save no
    launch: it keeps the product + rotary kernel)."""
    return config is not None and config.kernel in ("dot", "fp8") and config.split_k > 1


def qkv_rope_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: LinearConfig,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_q_heads: int,
    num_k_heads: int,
    head_dim: int,
    kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    w_scale: torch.Tensor | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """x [T, K] (T tokens, dense rows) times the merged qkv weight [(Hq + 2 Hk) D, K] (bf16/fp16,
    or FP8 with per-channel `w_scale`) (+ bias) through the split-K config `config`
    (`fuses_rope_in_sum`), q and k of row t rotated at positions[t] by the fp32 cos/sin tables
    [max_positions, D/2]: [T, (Hq + 2 Hk) D] in x's dtype. `kv_store` = (k_cache, v_cache,
    slot_mapping [T]): row t's rotated k and its v also go into cache slot slot_mapping[t]
    (negative: skipped; caches [pages, page_size, Hk, D], dense in their last three dims, x's
    dtype or fp8). Two launches: the product's kernel (its fp32 partials, `small_m_linear`'s
    `partials_only`), then `_split_rope_kernel`."""
    T, K = x.shape
    rows = (num_q_heads + 2 * num_k_heads) * head_dim
    if x.stride(1) != 1 or weight.shape != (rows, K) or weight.stride(1) != 1 or head_dim % 2:
        raise ValueError("qkv_rope_rows takes x [T, K] and the merged weight [(Hq + 2 Hk) D, K], an even D")
    if not fuses_rope_in_sum(config):
        raise ValueError(f"{config} is not a split-K config (see fuses_rope_in_sum)")
    if positions.shape[0] < T or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("qkv_rope_rows needs a position per row and dense cos/sin rows")
    k_cache, v_cache, slots = _kv_store_args(kv_store, x, positions, num_k_heads, head_dim)
    if kv_store is not None and slots.shape[0] < T:
        raise ValueError("kv_store needs a slot per row")
    out = torch.empty(T, rows, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    # The bias joins in the epilogue: a split-K product adds it in its sum, never in the partials.
    planes = small_m_linear(x, weight, None, config, partials_only=True, pdl=pdl, w_scale=w_scale)
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    heads = num_q_heads + 2 * num_k_heads
    block_h = min(triton.next_power_of_2(heads), max(1, PAIRS_PER_PROGRAM // block_half))
    _split_rope_kernel[(T, triton.cdiv(heads, block_h))](
        planes, bias if bias is not None else planes, out, positions, cos, sin, k_cache, v_cache, slots,
        out.stride(0), cos.stride(0), k_cache.stride(1), v_cache.stride(1),
        HAS_BIAS=bias is not None, SPLIT_K=config.split_k, NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads,
        HEAD_DIM=head_dim, BLOCK_HALF=block_half, BLOCK_H=block_h, STORE_KV=kv_store is not None,
        TO_FP8=kv_store is not None and k_cache.element_size() == 1, num_warps=4,
        **launch_options(x.device, pdl),
    )  # fmt: skip
    return out
