"""The one-row qkv GEMV with the rotary embedding and the K/V store in its epilogue: a decode
step at batch 1 runs the attention block's input projection, the neox rotation of q and k
and the write of the new K/V into the cache in one launch instead of two (the GEMV, then
`rotary.qk_norm_rope` with its store).

How: the GEMV is `linear._linear_fma_kernel`'s one-row scheme (the same K loop, `_fma_step`
and `_fma_outputs`), with its output rows paired for the rotation: program p of head h holds
PAIRS pairs of rows (j, j + D/2) of that head, j = p's first pair + 0..PAIRS-1 (heads in the
merged weight's order: q heads, k heads, v heads). After the K loop it rounds the products to
the output dtype (as the GEMV's store does), rotates the pairs of q and k heads exactly as
`rotary._norm_rope_heads` does (cos/sin rounded to the dtype first), stores the whole row
[q | k | v] in the GEMV's usual layout, and a k or v program also writes its heads into cache
slot `slot_mapping[0]` (skipped when negative), as `store_kv` would.

`qkv_rope_reference` is the torch twin of the output (the product, then `rope_reference`); the
cache rows it writes are those `rotary.qk_norm_rope` writes from the same q|k|v.

Invariants: one row; no q/k norm (Qwen3 keeps the two launches); the output equals the
unfused GEMV + rotary kernel within one rounding step of the rotation (both round the product
and the rotated values to the dtype; only the fp32 rotation's contraction may differ); under
PDL only weights, tables and the step's inputs (position, slot) are read before the wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.launch import launch_options, pdl_start
from nanoserve.kernels.linear import FP8_WEIGHT, LinearConfig, _fma_outputs, _fma_step, _prefetch_l2, _x_step
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
    """The slow twin: x W^T (+ b) in x's dtype [1, (Hq + 2 Hk) D], q and k rotated in place."""
    y = (x.float() @ weight.float().t() + (0 if bias is None else bias.float())).to(x.dtype)
    q, k, _ = y.view(1, num_q_heads + 2 * num_k_heads, head_dim).split([num_q_heads, num_k_heads, num_k_heads], 1)
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
    k_cache, v_cache, slots = kv_store if kv_store is not None else (x, x, positions)  # unused without a store
    if kv_store is not None:
        row = (num_k_heads * head_dim, head_dim, 1)
        if any(c.stride()[1:] != row or c.shape[2:] != (num_k_heads, head_dim) for c in (k_cache, v_cache)):
            raise ValueError("kv_store needs caches [pages, page_size, Hk, D] dense in their last three dims")
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
