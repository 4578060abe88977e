"""Qwen3's per-head RMSNorm of q and k followed by the neox rotary embedding, one launch for
both tensors (Llama: rotary only); optionally the same launch writes the rotated k and v
into the KV cache (the store that attention's `store_kv` would otherwise do in a launch of
its own).

`rope_reference` is the torch reference (and the CPU path): cos/sin rounded to the
activations' dtype, rotate-half, as transformers does. The kernel repeats its roundings
(normalised value, then times the weight; cos/sin), so both agree within one rounding step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.launch import launch_options, pdl_start
from nanoserve.kernels.norm import _lanes


def rope_reference(positions, q, k, cos_table, sin_table):
    """Neox rotary of q [T, Hq, D] and k [T, Hk, D] at `positions`, from fp32 cos/sin tables
    [max_positions, D/2]."""
    cos = cos_table[positions].unsqueeze(1)
    sin = sin_table[positions].unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    cos = torch.cat((cos, cos), dim=-1).to(x.dtype)
    sin = torch.cat((sin, sin), dim=-1).to(x.dtype)
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@triton.jit
def _norm_weight_halves(w_ptr, d, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    """The per-head norm's weight as two halves [1, BLOCK_HALF] in fp32 (zeros without a norm)."""
    if HAS_NORM:
        w1 = tl.load(w_ptr + d, mask=_lanes(d, HALF), other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + d, mask=_lanes(d, HALF), other=0.0).to(tl.float32)[None, :]
    else:
        w1 = tl.zeros([1, d.shape[0]], tl.float32)
        w2 = w1
    return w1, w2


@triton.jit
def _norm_rope_heads(
    src, w1, w2, h0, num_heads, stride_h, cos, sin, d, eps, dtype: tl.constexpr,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    """Normalise (optionally, by the weight halves w1, w2) and rotate heads h0 .. h0 + BLOCK_H
    of one token: the rotated halves (rounded to dtype), the heads and the mask."""
    h = h0 + tl.arange(0, BLOCK_H)
    mask = (h < num_heads)[:, None] & _lanes(d, HALF)[None, :]
    p1 = src + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
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
    # Positions and slots are the step's inputs (written before its first kernel), the
    # tables and norm weights constants: all are read before the PDL wait, so their loads
    # overlap the previous kernel (the qkv product) instead of following it.
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    d = tl.arange(0, BLOCK_HALF)
    lanes = _lanes(d, HALF)
    if STORE_KV:
        slot = tl.load(slot_ptr + t).to(tl.int64)
    if j < Q_BLOCKS + K_BLOCKS:
        pos = tl.load(pos_ptr + t).to(tl.int64)
        dtype = q_out_ptr.dtype.element_ty
        # cos/sin rounded to the activations' dtype first, as the reference (and transformers) do.
        cos = tl.load(cos_ptr + pos * stride_cos + d, mask=lanes, other=0.0).to(dtype).to(tl.float32)[None, :]
        sin = tl.load(sin_ptr + pos * stride_cos + d, mask=lanes, other=0.0).to(dtype).to(tl.float32)[None, :]
        if j < Q_BLOCKS:
            w1, w2 = _norm_weight_halves(qw_ptr, d, HALF, HAS_NORM)
            pdl_start(USE_PDL)  # q comes from the previous kernel
            o1, o2, h, mask = _norm_rope_heads(
                q_ptr + t * stride_qt, w1, w2, j * BLOCK_H, NUM_Q_HEADS, stride_qh, cos, sin, d, eps, dtype,
                HEAD_DIM, HALF, BLOCK_H, HAS_NORM,
            )  # fmt: skip
            _store_halves(q_out_ptr + t * (NUM_Q_HEADS * HEAD_DIM), o1, o2, h, d, mask, HEAD_DIM, HALF)
        else:
            w1, w2 = _norm_weight_halves(kw_ptr, d, HALF, HAS_NORM)
            pdl_start(USE_PDL)  # k comes from the previous kernel
            o1, o2, h, mask = _norm_rope_heads(
                k_ptr + t * stride_kt, w1, w2, (j - Q_BLOCKS) * BLOCK_H, NUM_K_HEADS, stride_kh, cos, sin, d, eps,
                dtype, HEAD_DIM, HALF, BLOCK_H, HAS_NORM,
            )  # fmt: skip
            _store_halves(k_out_ptr + t * (NUM_K_HEADS * HEAD_DIM), o1, o2, h, d, mask, HEAD_DIM, HALF)
            if STORE_KV:  # noqa: SIM102 - `slot` exists only under the constexpr STORE_KV
                if slot >= 0:
                    cache_ty = k_cache_ptr.dtype.element_ty
                    k1, k2 = _to_cache(o1, cache_ty, TO_FP8), _to_cache(o2, cache_ty, TO_FP8)
                    _store_halves(k_cache_ptr + slot * stride_kc, k1, k2, h, d, mask, HEAD_DIM, HALF)
    elif STORE_KV:  # the v programs (launched only with STORE_KV)
        pdl_start(USE_PDL)  # v comes from the previous kernel
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
    pdl: bool = True,
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
            raise ValueError(
                "kv_store needs v shaped as k and caches [pages, page_size, Hk, D] dense in their last three dims"
            )
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
        num_warps=1 if half * block_h <= 256 else 4, **launch_options(q.device, pdl),
    )  # fmt: skip
    return q_out, k_out
