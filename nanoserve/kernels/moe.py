"""Mixture-of-experts: the router's top-k and the fused expert MLPs, with their torch twins.

Owns `route` / `route_reference` (softmax over the E router logits in fp32, the k largest,
optionally divided by their sum) and `fused_moe` / `fused_moe_reference`
(sum_k w_k * down_e(silu(gate_e x) * up_e x) for every token x, e = topk_ids[t, k]), and
`fused_moe_partials`, the same sum left as its fp32 terms for the next RMSNorm to add.

Weights: w13 [E, 2*I, H] (an expert's gate rows, then its up rows), w2 [E, H, I].

`fused_moe` takes one of two paths, both Triton, chosen on the host from shapes only (the
measured table's entry for T, else T*k <= DECODE_MAX_PAIRS for decode):
- decode: one program per (token, slot, column block[, depth split]) reads its chosen
  expert's rows GEMV-style, so a batch of one reads only the k chosen experts;
- grouped: the (token, slot) pairs are sorted by expert and every expert's group padded to
  BLOCK_M on the device (`align`), then one grouped GEMM over gate and up with silu(gate)*up in
  its epilogue and one over down with the routing weight applied in its epilogue.
Both write each pair's fp32 contribution to its own plane of a [P, T, H] workspace (P = k, or
k * split_k when the decode path splits the down product's depth): `fused_moe` adds the planes
in plane order and rounds once (the split-K sum kernel of linear.py), `fused_moe_partials`
returns them for the next RMSNorm to add in the same order (one launch less per layer).

MXFP4 experts (gpt-oss's checkpoints; `Mxfp4Scales`): w13 [E, 2*I, H/2] and w2 [E, H, I/2] uint8,
packed codes in the kernels' layout (`pack_mxfp4`), and e8m0 scales [E, 2*I, H/32], [E, H, I/32]
uint8. Both paths read them packed and make the values in registers by bit operations
(`_e2m1_pair`): the decode path multiplies them in fp32 and applies each 32-group's scale to its
partial sum, the grouped path scales them, rounds them to the activations' dtype (exact) and runs
its dots on them. The twins dequantize the chosen experts on the fly (`dequantize_mxfp4`).

Invariants: nothing here reads device data on the host (buffer sizes come from T, E, k and
BLOCK_M only: the worst case T*k + E*(BLOCK_M-1) padded rows), so CUDA graphs capture route
and fused_moe; the block sizes come from `TUNED` (measured by benchmarks/moe.py --tune) or,
for shapes not in it, from `_fallback_config`, silently.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanoserve.kernels.activation import silu_mul_rounded
from nanoserve.kernels.fp8 import FP8_DTYPE, FP8_MAX
from nanoserve.kernels.launch import INTERPRET, launch_options, pdl_start
from nanoserve.kernels.linear import sum_planes

# ----------------------------------------------------------------------------------------------
# torch references (the CPU path and the slow twin)


def route_reference(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], expert ids int32 [T, k]), largest first: softmax over the experts
    in fp32, the k largest, divided by their sum when `renormalize` (as Hugging Face routes)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's experts: biases b13 [E, 2I] (gate rows, then up rows, as w13's) and b2 [E, H]
    (None on a tensor-parallel rank other than 0, whose partial sums must not hold it), and the
    activation `clamped_swiglu` with its alpha and limit, in place of silu(gate) * up."""

    b13: torch.Tensor
    b2: torch.Tensor | None
    alpha: float
    limit: float


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def expert_mlp(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    e: int,
    act: ClampedSwiGLU | None,
    scales: Mxfp4Scales | None = None,
) -> torch.Tensor:
    """Expert e's MLP on rows x, in x's dtype (as Hugging Face's run): silu(gate) * up, or
    gpt-oss's biased products and clamped SwiGLU. MXFP4 experts (`scales`): expert e's weights
    dequantized to x's dtype first (exact in bf16 and fp32), the others left packed."""
    if scales is None:
        w13_e, w2_e = w13[e], w2[e]
    else:
        w13_e, w2_e = scales.expert(w13, w2, e, x.dtype)
    inter = w2_e.shape[1]
    if act is None:
        gate, up = F.linear(x, w13_e).split(inter, dim=-1)
        return F.linear(F.silu(gate) * up, w2_e)
    gate, up = F.linear(x, w13_e, act.b13[e]).split(inter, dim=-1)
    return F.linear(clamped_swiglu(gate, up, act.alpha, act.limit), w2_e, None if act.b2 is None else act.b2[e])


def fused_moe_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act: ClampedSwiGLU | None = None,
    scales: Mxfp4Scales | None = None,
) -> torch.Tensor:
    """sum_k w_k * down_e(silu(gate_e x) * up_e x) for hidden [T, H] (with `act`, gpt-oss's
    experts: `expert_mlp`): a loop over the experts that tokens chose. The expert MLPs run in
    hidden's dtype (as Hugging Face's do); the weighted sum accumulates in fp32 and is rounded
    once to hidden's dtype. Reads the routing on the host (torch.unique), so it is the CPU
    path, never a graph-captured one. MXFP4 experts (packed w13, w2 and their `scales`): each
    chosen expert is dequantized on the fly (the twin of the kernels' MXFP4 path)."""
    _check_args(hidden, w13, w2, topk_weights, topk_ids, _packing(scales))
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        y = expert_mlp(hidden[token], w13, w2, e, act, scales).float() * topk_weights[token, slot, None].float()
        out.index_add_(0, token, y)
    return out.to(hidden.dtype)


def fused_moe_every_expert(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act: ClampedSwiGLU | None = None,
    scales: Mxfp4Scales | None = None,
) -> torch.Tensor:
    """The sum of `fused_moe_reference` without reading the routing on the host: every expert
    runs on every token and is weighted by the token's routing weight for it (zero if not
    chosen), summed in fp32 and rounded once. No host synchronisation, so CUDA graphs capture
    it: the CUDA slow twin of `fused_moe` (`triton_ops` off), at E/k times the routed FLOPs.
    MXFP4 experts: dequantized one at a time (one expert's weights in the dtype at a time)."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    ids = topk_ids.long()
    for e in range(w13.shape[0]):
        weight = (topk_weights.float() * (ids == e)).sum(dim=-1, keepdim=True)
        out += expert_mlp(hidden, w13, w2, e, act, scales).float() * weight
    return out.to(hidden.dtype)


@dataclass(frozen=True)
class ExpertScales:
    """The scales of FP8 (e4m3) expert weights: w13_scale [E, ceil(2I/bn), ceil(H/bk)] and
    w2_scale [E, ceil(H/bn), ceil(I/bk)], fp32, one per (bn x bk) block of each expert's
    weight: (128, 128) for block-scaled checkpoints, (1, K) per output channel (then the
    last dim is 1). Weight element (n, k) of expert e is w[e, n, k] * scale[e, n // bn, k // bk]."""

    w13: torch.Tensor
    w2: torch.Tensor
    block_n: int
    block_k13: int
    block_k2: int

    def dequantized(self, w13: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Both weights times their scales in `dtype` (in fp32: what the kernels multiply by)."""
        return (
            dequantize_experts(w13, self.w13, self.block_n, self.block_k13, dtype),
            dequantize_experts(w2, self.w2, self.block_n, self.block_k2, dtype),
        )


def quantize_experts(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 experts, fp32 scales [E, ceil(N/bn), ceil(K/bk)]) of experts [E, N, K]: each
    block's absolute maximum maps to 448 (benchmarks and tests; checkpoints come quantized)."""
    E, n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(E, nb * bn, kb * bk, device=w.device)
    padded[:, :n, :k] = w.float()
    s = (padded.reshape(E, nb, bn, kb, bk).abs().amax(dim=(2, 4)) / FP8_MAX).clamp(min=1e-12)
    full = s.repeat_interleave(bn, 1).repeat_interleave(bk, 2)[:, :n, :k]
    return (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s.contiguous()


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor, bn: int, bk: int, dtype: torch.dtype) -> torch.Tensor:
    """FP8 experts [E, N, K] times their block scales [E, ceil(N/bn), ceil(K/bk)], in `dtype`."""
    _, n, k = w.shape
    full = scale.float().repeat_interleave(bn, 1).repeat_interleave(bk, 2)[:, :n, :k]
    return (w.float() * full).to(dtype)


MXFP4_GROUP = 32  # weight elements per e8m0 scale (along the depth)
MXFP4_SCALE_BIAS = 127  # an e8m0 scale byte s is 2^(s - 127)
# The FP4 E2M1 codes' values, by code: sign bit 3, then 2 exponent bits and 1 mantissa bit.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_weights(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """E2M1 codes [..., G, 32] (int64, element order) and their e8m0 scales [..., G] uint8 -> the
    weights [..., G * 32] in `dtype` (exact in bf16 and fp32 unless a scale over- or underflows)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    values = torch.ldexp(table[codes], (scales.to(torch.int32) - MXFP4_SCALE_BIAS).unsqueeze(-1).float())
    return values.flatten(-2).to(dtype)


# The kernels' bit layout of one 32-bit word of a group (`pack_mxfp4`): word q holds the codes of
# elements 4(n + 4h) + q for n = 0..3, h = 0, 1 (its "pair" n: two elements 16 apart), each code's
# 3 magnitude bits (mantissa lowest) from a base bit and its sign bit apart, at
# (base, sign) for h = 0; h = 1 is 16 bits higher. Pairs 0 and 1 sit where one shift (0, 3) and
# one mask put them as two fp16s (magnitudes at 9..11, signs at 15: `_e2m1_pair`), pairs 2 and 3
# in the bits left (a shift each for the magnitudes and the signs): 11 integer operations a word.
_MXFP4_BITS = ((9, 15), (6, 12), (0, 13), (3, 14))


def pack_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    """A checkpoint's MXFP4 blocks [..., G, 16] uint8 (byte j of a group: element 2j in its low
    nibble, 2j+1 in its high one) in the kernels' layout [..., G*16] uint8: a group's 16 bytes
    are four little-endian 32-bit words, word q holding elements 4n + q and 16 + 4n + q (n =
    0..3) with their bits placed as `_MXFP4_BITS` says, so that the kernels decode each pair
    into two fp16s with one to four integer operations (`_e2m1_pair`)."""
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != MXFP4_GROUP // 2:
        raise ValueError(f"MXFP4 blocks must be uint8 [..., G, 16], got {blocks.dtype} {tuple(blocks.shape)}")
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., G, 32] in element order
    codes = codes.unflatten(-1, (2, 4, 4))  # [..., G, h, n, q]: element 16h + 4n + q
    words = torch.zeros(codes.shape[:-3] + (4,), dtype=torch.long, device=blocks.device)  # [..., G, q]
    for n, (base, sign) in enumerate(_MXFP4_BITS):
        for h in range(2):
            c = codes[..., h, n, :]
            words |= ((c & 7) << (base + 16 * h)) | ((c >> 3) << (sign + 16 * h))
    byte = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], dim=-1)  # little-endian
    return byte.to(torch.uint8).flatten(-3)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed codes [..., K/2] (`pack_mxfp4`'s layout) and e8m0 scales [..., K/32] uint8 -> the
    weights [..., K] in `dtype`: code value * 2^(scale - 127), exact in bf16 and fp32."""
    byte = packed.unflatten(-1, (-1, 4, 4)).long()  # [..., G, word q, byte]
    words = byte[..., 0] | (byte[..., 1] << 8) | (byte[..., 2] << 16) | (byte[..., 3] << 24)
    codes = torch.empty(words.shape[:-1] + (2, 4, 4), dtype=torch.long, device=packed.device)
    for n, (base, sign) in enumerate(_MXFP4_BITS):
        for h in range(2):
            codes[..., h, n, :] = ((words >> (base + 16 * h)) & 7) | (((words >> (sign + 16 * h)) & 1) << 3)
    return mxfp4_weights(codes.flatten(-3), scales, dtype)  # codes [..., G, 32] in element order


@dataclass(frozen=True)
class Mxfp4Scales:
    """The e8m0 scales of MXFP4 experts: w13 [E, 2I, H/32] and w2 [E, H, I/32] uint8, one per
    32 consecutive elements of a weight row (2^(s - 127)). The weights that go with them are
    packed uint8 w13 [E, 2I, H/2] and w2 [E, H, I/2] in `pack_mxfp4`'s layout: half a byte per
    element, and a scale byte per 32, instead of two bytes per element in bf16."""

    w13: torch.Tensor
    w2: torch.Tensor

    def expert(
        self, w13: torch.Tensor, w2: torch.Tensor, e: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's weights [2I, H] and [H, I] in `dtype`."""
        return dequantize_mxfp4(w13[e], self.w13[e], dtype), dequantize_mxfp4(w2[e], self.w2[e], dtype)

    def dequantized(self, w13: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every expert's weights [E, 2I, H] and [E, H, I] in `dtype`."""
        return dequantize_mxfp4(w13, self.w13, dtype), dequantize_mxfp4(w2, self.w2, dtype)


def _packing(scales: ExpertScales | Mxfp4Scales | None) -> int:
    """Weight elements per stored element along the depth: 2 for MXFP4, else 1."""
    return 2 if isinstance(scales, Mxfp4Scales) else 1


def _check_args(hidden, w13, w2, topk_weights, topk_ids, packing: int = 1) -> None:
    """Shapes; `packing`: weight elements per stored element along the depth (MXFP4: 2)."""
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError("fused_moe needs hidden [T, H], w13 [E, 2*I, H], w2 [E, H, I]")
    T, H = hidden.shape
    E, two_i, h13 = w13.shape
    if h13 * packing != H or two_i % 2 or w2.shape != (E, H, two_i // 2 // packing) or (two_i // 2) % packing:
        layout = "w13 [E, 2*I, H], w2 [E, H, I]" if packing == 1 else "MXFP4: w13 [E, 2*I, H/2], w2 [E, H, I/2]"
        raise ValueError(
            f"fused_moe: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} do not fit "
            f"({layout})"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"fused_moe: topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} must be [T={T}, k]"
        )


def _check_device(x: torch.Tensor, what: str) -> None:
    if not (x.is_cuda or INTERPRET):
        raise ValueError(
            f"{what} runs Triton on CUDA tensors (or under TRITON_INTERPRET=1); on CPU use {what}_reference"
        )


# ----------------------------------------------------------------------------------------------
# route


@triton.jit
def _route_kernel(
    logits_ptr, w_ptr, ids_ptr, E, stride_l,
    K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORM: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program t: softmax over row t's E logits in fp32, then k rounds of (max, first argmax,
    mask it out), largest first as torch.topk."""
    pdl_start(USE_PDL)  # every read here is of the previous kernel's output
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_l + offs, mask=offs < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(offs < E, p, -1.0)  # padded lanes are never chosen
    kr = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(K):
        m = tl.max(p, axis=0)
        i = tl.min(tl.where(p == m, offs, BLOCK_E), axis=0)  # the lowest index among ties
        w = tl.where(kr == j, m, w)
        ids = tl.where(kr == j, i, ids)
        p = tl.where(offs == i, -1.0, p)
    if RENORM:
        w = w / tl.sum(w, axis=0)
    tl.store(w_ptr + t * K + kr, w, mask=kr < K)
    tl.store(ids_ptr + t * K + kr, ids, mask=kr < K)


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, pdl: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `route_reference`, in one Triton launch (one program per token; under PDL where
    `pdl` and the GPU allow, see launch.py). Ties go to the lower expert index (torch.topk
    leaves their order unspecified)."""
    _check_device(router_logits, "route")
    if router_logits.dim() != 2 or router_logits.stride(1) != 1:
        raise ValueError("route needs router_logits [T, E] with a dense last dim")
    T, E = router_logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"route: top_k {top_k} must be in 1..{E} (the number of experts)")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=router_logits.device)
    # One warp up to 256 experts: its k rounds of max and argmin are warp shuffles, with no
    # shared-memory step between warps. At batch 1 gate_up waits for this kernel: on an H200
    # (2026-11-27) one warp instead of four took qwen3-30b-a3b's TPOT from 2.562-2.565 ms to
    # 2.505-2.507 (E = 128; the kernel took 3.3 us a layer with four, PDL off).
    if T:
        _route_kernel[(T,)](
            router_logits, weights, ids, E, router_logits.stride(0),
            K=top_k, BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(top_k),
            RENORM=renormalize, num_warps=1 if E <= 256 else 4, **launch_options(router_logits.device, pdl),
        )  # fmt: skip
    return weights, ids


# ----------------------------------------------------------------------------------------------
# block sizes


@dataclass(frozen=True)
class MoEConfig:
    """One shape's launch parameters. Grouped path: BLOCK_M rows (token slots of one expert)
    x BLOCK_N columns per program, BLOCK_K deep steps. Decode path: BLOCK_N output rows per
    program, BLOCK_K deep steps, num_stages the K loop's pipelining depth (1: none); split_k > 1
    (down product only) splits its depth I over that many programs, each writing its own fp32
    plane (more programs for a batch of one).
    Grouped path: group_m > 0 sorted blocks sweep the column blocks together (their rows stay
    in L2 while the weights stream; large T), 0 every sorted block in turn per column block.
    Measured in bf16: an fp32 run reads tiles of the same bytes (`_for_dtype`)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    group_m: int = 0


def _path_of(configs: tuple[MoEConfig, MoEConfig]) -> str:
    return "decode" if configs[0].block_m == 1 else "grouped"


# (H, I, E, T bucket) -> (config of the first GEMM [gate_up], config of the second [down]).
# Measured with `python benchmarks/moe.py --tune` on the GPU it names; T buckets are powers of
# two (`_bucket`). An entry also picks its bucket's path: block_m 1 is the decode path (it wins
# where few tokens pick distinct experts), else the grouped one. Buckets without an entry take
# the nearest measured bucket of their path, shapes without any the fallback.
TUNED: dict[tuple[int, int, int, int], tuple[MoEConfig, MoEConfig]] = {
    # H200, 2026-11-26 (at 063d661; entries with group_m at 5ddca2a, where groups at 1024 and
    # 4096 tokens did not beat the kept entries beyond the runs' +-4% noise): route +
    # fused_moe_partials per layer; "was" is the previous entry or the fallback. qwen3-30b-a3b:
    # Decode-path entries (block_m 1) re-measured on 2026-11-27 with pipelined loops (num_stages
    # is the K loop's depth there; "was" is the 2026-11-26 entry run with pipelined loops). Their
    # down product is unsplit: the tuning had chosen 2 depth splits without counting the next
    # RMSNorm's read of twice the planes (16 x H fp32 a row); unsplit, batch 1 decode steps
    # 2.476-2.479 -> 2.432 ms, batches 2 / 4 / 8 0.3-0.9% faster (H200, 2026-11-27,
    # benchmarks/probes/batch_decode.py). Times below: the tuning's, with the splits.
    (2048, 768, 128, 1): (MoEConfig(1, 8, 256, 8, 2), MoEConfig(1, 16, 256, 4, 2)),  # 26.9 us (was 27.8)
    (2048, 768, 128, 2): (MoEConfig(1, 8, 512, 2, 1), MoEConfig(1, 16, 256, 2, 2)),  # 44.7 us (was 52.1)
    (2048, 768, 128, 4): (MoEConfig(1, 16, 128, 2, 4), MoEConfig(1, 16, 256, 2, 2)),  # 78.6 us (was 89.3)
    (2048, 768, 128, 8): (MoEConfig(1, 8, 256, 4, 2), MoEConfig(1, 32, 256, 4, 2)),  # 129.5 us (was 147.9)
    (2048, 768, 128, 16): (MoEConfig(16, 128, 128, 4, 3), MoEConfig(16, 64, 128, 4, 4)),  # 246.2 us (was 253.4)
    (2048, 768, 128, 32): (MoEConfig(16, 64, 128, 4, 4), MoEConfig(16, 64, 128, 4, 3)),  # 327.3 us (was 332.6)
    (2048, 768, 128, 64): (MoEConfig(16, 128, 128, 4, 3), MoEConfig(16, 64, 128, 4, 4)),  # 367.6 us (was 370.8)
    (2048, 768, 128, 128): (MoEConfig(16, 128, 128, 4, 3), MoEConfig(16, 64, 128, 4, 3)),  # 377.4 us (was 381.6)
    (2048, 768, 128, 256): (MoEConfig(16, 64, 128, 4, 3), MoEConfig(16, 128, 128, 4, 3)),  # 403.8 us (was 405.6)
    (2048, 768, 128, 1024): (MoEConfig(32, 128, 64, 8, 4), MoEConfig(32, 128, 64, 4, 4)),  # 604.1 us (was 631.8)
    (2048, 768, 128, 4096): (
        MoEConfig(64, 64, 64, 4, 3, group_m=16),
        MoEConfig(64, 128, 64, 8, 3, group_m=4),
    ),  # 1024.6 us (was 1091.1)
    (2048, 768, 128, 8192): (
        MoEConfig(128, 128, 64, 8, 4, group_m=4),
        MoEConfig(128, 128, 64, 8, 3, group_m=4),
    ),  # 1565.2 us (was 1726.9)
    # mixtral-8x7b (from 8 tokens on the grouped path wins: the decode one reads an expert per pair).
    # At 2 and 4 tokens the down product is unsplit, as qwen3-30b-a3b's above (the tuning chose 4
    # depth splits): decode steps 10.97 -> 10.87 ms at batch 2, 16.90 -> 16.58 at batch 4 (H200,
    # 2026-11-27, benchmarks/probes/batch_decode.py). Times below: the tuning's, with the splits.
    (4096, 14336, 8, 1): (MoEConfig(1, 8, 256, 2, 2), MoEConfig(1, 16, 256, 4, 3)),  # 170.9 us (was 176.4)
    (4096, 14336, 8, 2): (MoEConfig(1, 8, 512, 8, 3), MoEConfig(1, 8, 256, 4, 2)),  # 326.2 us (was 367.1)
    (4096, 14336, 8, 4): (MoEConfig(1, 8, 256, 2, 2), MoEConfig(1, 16, 256, 2, 2)),  # 456.7 us (was 475.4)
    (4096, 14336, 8, 8): (MoEConfig(16, 128, 128, 4, 3), MoEConfig(16, 64, 64, 4, 3)),  # 614.1 us (was 898.5)
    (4096, 14336, 8, 16): (MoEConfig(16, 128, 128, 8, 3), MoEConfig(16, 128, 128, 4, 4)),  # 686.5 us (was 1568.4)
    (4096, 14336, 8, 32): (MoEConfig(16, 128, 128, 8, 3), MoEConfig(16, 128, 128, 8, 4)),  # 693.9 us (was 2917.6)
    (4096, 14336, 8, 64): (MoEConfig(16, 64, 128, 4, 4), MoEConfig(16, 128, 128, 4, 3)),  # 725.7 us (was 795.5)
    (4096, 14336, 8, 128): (MoEConfig(32, 128, 128, 8, 4), MoEConfig(32, 128, 64, 4, 4)),  # 794.3 us (was 848.0)
    (4096, 14336, 8, 256): (MoEConfig(128, 128, 64, 8, 4), MoEConfig(128, 128, 64, 8, 3)),  # 812.8 us (was 1163.6)
    (4096, 14336, 8, 1024): (MoEConfig(128, 128, 64, 8, 3), MoEConfig(128, 128, 128, 8, 3)),  # 1814.0 us (was 2015.6)
    (4096, 14336, 8, 4096): (
        MoEConfig(128, 128, 64, 8, 3),
        MoEConfig(128, 128, 64, 8, 3),
    ),  # 6255.8 us (was 5986.9, the same configs)
    (4096, 14336, 8, 8192): (
        MoEConfig(128, 128, 64, 8, 3, group_m=16),
        MoEConfig(128, 128, 64, 4, 3, group_m=8),
    ),  # 11523.2 us (was 12923.6)
    # mixtral-8x7b, one rank of TP=2 (expert slices I/2 wide; 2026-11-27, pipelined loops; "was":
    # the 2026-11-26 entries, whose loops were not pipelined):
    (4096, 7168, 8, 1): (MoEConfig(1, 8, 128, 2, 2), MoEConfig(1, 16, 512, 4, 3, 4)),  # 95.3 us (was 99.1)
    (4096, 7168, 8, 2): (MoEConfig(1, 8, 512, 4, 3), MoEConfig(1, 64, 128, 8, 4)),  # 172.5 us (was 178.4)
}

# The same for MXFP4 experts (`Mxfp4Scales`), whose tiles are a quarter of bf16's bytes: measured
# with `python benchmarks/moe.py --tune --mxfp4` (H200; grouped entries 2026-12-03, decode ones
# 2026-12-04 with `--paths decode`). gpt-oss-20b:
TUNED_MXFP4: dict[tuple[int, int, int, int], tuple[MoEConfig, MoEConfig]] = {
    # Decode entries of the f16x2 products (`_mx_group_sums_h2`; "was": the fp32 products' entries on them):
    (2880, 2880, 32, 1): (MoEConfig(1, 8, 1024, 8, 1), MoEConfig(1, 8, 1024, 8, 1)),  # 31.1 us (was 32.9)
    (2880, 2880, 32, 2): (MoEConfig(1, 8, 512, 4, 1), MoEConfig(1, 16, 1024, 4, 3)),  # 51.3 us (was 52.4)
    (2880, 2880, 32, 8): (MoEConfig(1, 4, 512, 1, 1), MoEConfig(1, 32, 256, 1, 1)),  # 163.4 us (was 175.0)
    # Grouped entries at cbeeea2 (bf16 dequantized in PTX, one dot a K step; "was": the fallback):
    (2880, 2880, 32, 32): (MoEConfig(16, 64, 128, 4, 4), MoEConfig(16, 128, 128, 4, 3)),  # 262.1 us (was 292.3)
    (2880, 2880, 32, 256): (MoEConfig(64, 128, 128, 4, 3), MoEConfig(64, 128, 64, 4, 3)),  # 429.2 us (was 665.4)
    (2880, 2880, 32, 1024): (MoEConfig(64, 128, 128, 4, 3), MoEConfig(64, 128, 64, 4, 3)),  # 1090.6 us (was 1096.8)
}
# gpt-oss-120b: the same experts (H = I = 2880, top-4) out of 128. Its decode-path entries are
# 20b's: those programs are (token, expert) pairs times row blocks whatever E is (not measured on
# 120b). Its grouped path takes the fallback: there an expert's rows per block depend on E.
TUNED_MXFP4 |= {
    (h, i, 128, b): cfgs
    for (h, i, e, b), cfgs in TUNED_MXFP4.items()
    if (h, i, e) == (2880, 2880, 32) and _path_of(cfgs) == "decode"
}

DECODE_MAX_PAIRS = 64  # untuned buckets: T*k at most this takes the decode path


def _bucket(T: int) -> int:
    return triton.next_power_of_2(max(T, 1))


def _fallback_config(T: int, k: int, E: int, N: int, decode: bool, mxfp4: bool = False) -> MoEConfig:
    """Block sizes for an untuned GEMM with N output columns. Under the interpreter: the
    smallest tiles (MXFP4: one 32-element group deep). Decode: 128 deep per
    program (16-byte loads on 4 warps) and the widest BLOCK_N that still gives ~512 programs,
    so a batch of one keeps every SM streaming weights. MXFP4 decode: 8 rows 512 deep (a
    group's four words a thread), the K loop not pipelined through shared memory (its tiles
    prefetched in registers): gpt-oss-20b's best gate_up config at T=1 of 417 tried on an
    H200 (2026-12-03; its down product's best: 16 x 1024 on 8 warps), where the earlier
    32 x 512 on three stages took 1.7x as long.
    Grouped: BLOCK_M near the mean rows per expert (T*k/E), so sparse batches pad little."""
    if INTERPRET:
        return MoEConfig(1, 16, 32, 1, 1) if decode else MoEConfig(16, 16, 32 if mxfp4 else 16, 1, 1)
    if decode and mxfp4:
        return MoEConfig(block_m=1, block_n=8, block_k=512, num_warps=4, num_stages=1)
    if decode:
        block_n = next((n for n in (64, 32) if T * k * triton.cdiv(N, n) >= 512), 16)
        return MoEConfig(block_m=1, block_n=block_n, block_k=128, num_warps=4, num_stages=3)
    rows = T * k / E
    if rows <= 16:
        return MoEConfig(16, 64, 128, 4, 3)
    if rows <= 64:
        return MoEConfig(32, 64, 128, 4, 3)
    if rows <= 256:
        return MoEConfig(64, 128, 64, 4, 3)
    return MoEConfig(128, 128, 64, 8, 3)


def _for_dtype(config: MoEConfig, dtype: torch.dtype) -> MoEConfig:
    """A table config for `dtype`: wider elements than bf16's read tiles as many bytes deep
    (half the BLOCK_K for fp32), so whatever fits the GPU's shared memory in bf16 fits."""
    if dtype.itemsize <= 2:
        return config
    return replace(config, block_k=max(16, config.block_k * 2 // dtype.itemsize))


def get_configs(
    H: int, inter: int, E: int, T: int, k: int, path: str | None = None, mxfp4: bool = False
) -> tuple[MoEConfig, MoEConfig]:
    """The (gate_up, down) launch parameters of a shape at T tokens on `path` (None: the path
    the table's entry for T's bucket measured fastest, else the T*k rule): the entry of the
    nearest measured bucket on that path, else the fallback. Decode configs have block_m 1.
    `mxfp4`: MXFP4 experts' (`TUNED_MXFP4`, the fallback's MXFP4 rule)."""
    bucket = _bucket(T)
    table = TUNED_MXFP4 if mxfp4 else TUNED
    measured = {b: cfgs for (h, i, e, b), cfgs in table.items() if (h, i, e) == (H, inter, E)}
    if path is None:
        exact = measured.get(bucket)
        path = _path_of(exact) if exact else ("decode" if T * k <= DECODE_MAX_PAIRS else "grouped")
    on_path = [b for b, cfgs in measured.items() if _path_of(cfgs) == path]
    if on_path:
        nearest = min(on_path, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))
        return measured[nearest]
    decode = path == "decode"
    return _fallback_config(T, k, E, inter, decode, mxfp4), _fallback_config(T, k, E, H, decode, mxfp4)


# ----------------------------------------------------------------------------------------------
# align: (token, slot) pairs sorted by expert, each expert's group padded to BLOCK_M


@dataclass
class Alignment:
    """sorted_pairs [capacity]: flat pair indices t*k + j grouped by expert, each group padded
    to a multiple of block_m with the sentinel T*k; block_expert [capacity / block_m]: the
    expert of each block (E for blocks past the end); num_padded [1]: rows in use."""

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    block_m: int


def align_capacity(T: int, k: int, E: int, block_m: int) -> int:
    """The worst-case padded rows: every expert's group may add block_m - 1 padding rows."""
    pairs = T * k
    return triton.cdiv(pairs + E * (block_m - 1), block_m) * block_m


def align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort the T*k (token, slot) pairs by expert on the device in torch, without host
    synchronisation (sizes from T, k, E and block_m only; scatter_add instead of bincount,
    whose output size is read from the data): about 25 launches, the slow twin of `align` and
    its path beyond ALIGN_KERNEL_MAX_PAIRS."""
    T, k = topk_ids.shape
    device = topk_ids.device
    pairs = T * k
    flat = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in pair order within one
    expert_of = flat[order]
    rank = torch.arange(pairs, device=device) - count_start[expert_of]
    capacity = align_capacity(T, k, num_experts, block_m)
    sorted_pairs = torch.full((capacity,), pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, padded_start[expert_of] + rank, order.to(torch.int32))
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return Alignment(sorted_pairs, block_expert, padded_end[-1:].to(torch.int32), block_m)


ALIGN_KERNEL_MAX_PAIRS = 4096  # pairs each program of `_align_kernel` holds; more: align_reference


@triton.jit
def _align_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, pairs, capacity,
    E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """`align_reference`'s result for up to BLOCK_P pairs in E + 1 programs. Each counts the
    pairs per expert (all of them: the counts give every group's padded start). Program e < E
    writes expert e's group: its pairs in index order (the i-th at padded_start[e] + i, as the
    twin's stable argsort puts them), the group's padding rows and its blocks' expert; program E
    the rows past every group (padding, blocks of expert E) and num_padded."""
    me = tl.program_id(0)
    offs = tl.arange(0, BLOCK_P)
    e = tl.load(ids_ptr + offs, mask=offs < pairs, other=E)  # padding lanes count as expert E
    experts = tl.arange(0, BLOCK_E)
    counts = tl.where(experts < E, tl.histogram(e, BLOCK_E), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    if me == E:
        used = tl.sum(padded, 0)
        tl.store(num_padded_ptr, used)
        for c0 in range(used, capacity, BLOCK_C):
            rows = c0 + tl.arange(0, BLOCK_C)
            tl.store(sorted_ptr + rows, pairs + tl.zeros([BLOCK_C], tl.int32), mask=rows < capacity)
        for b0 in range(used // BLOCK_M, capacity // BLOCK_M, BLOCK_B):
            blocks = b0 + tl.arange(0, BLOCK_B)
            tl.store(block_expert_ptr + blocks, E + tl.zeros([BLOCK_B], tl.int32), mask=blocks < capacity // BLOCK_M)
    else:
        start = tl.sum(tl.where(experts < me, padded, 0), 0)
        count = tl.sum(tl.where(experts == me, counts, 0), 0)
        end = start + (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        mine = e == me
        rank = tl.cumsum(mine.to(tl.int32), 0) - 1
        tl.store(sorted_ptr + start + rank, offs, mask=mine)
        pad = start + count + tl.arange(0, BLOCK_M)
        tl.store(sorted_ptr + pad, pairs + tl.zeros([BLOCK_M], tl.int32), mask=pad < end)
        for b0 in range(start // BLOCK_M, end // BLOCK_M, BLOCK_B):
            blocks = b0 + tl.arange(0, BLOCK_B)
            tl.store(block_expert_ptr + blocks, me + tl.zeros([BLOCK_B], tl.int32), mask=blocks < end // BLOCK_M)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int, interpreted: bool = False) -> Alignment:
    """Sort the T*k (token, slot) pairs by expert on the device, without host synchronisation:
    one launch of `_align_kernel` up to ALIGN_KERNEL_MAX_PAIRS pairs (every decode batch of a
    CUDA graph), `align_reference` beyond and for CPU tensors. `interpreted`: CPU tensors too,
    under Triton's interpreter (the kernel's own tests; its program per expert is slow there,
    0.7 s for 3 pairs at E = 64, and the twin's result is the same)."""
    T, k = topk_ids.shape
    pairs = T * k
    if pairs > ALIGN_KERNEL_MAX_PAIRS or not pairs or not (topk_ids.is_cuda or (interpreted and INTERPRET)):
        return align_reference(topk_ids, num_experts, block_m)
    device = topk_ids.device
    capacity = align_capacity(T, k, num_experts, block_m)
    sorted_pairs = torch.empty(capacity, dtype=torch.int32, device=device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    block_p = triton.next_power_of_2(pairs)
    _align_kernel[(num_experts + 1,)](
        topk_ids.to(torch.int32).contiguous(), sorted_pairs, block_expert, num_padded, pairs, capacity,
        E=num_experts, BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_E=triton.next_power_of_2(num_experts + 1),
        BLOCK_C=1024, BLOCK_B=64, num_warps=4 if block_p <= 1024 else 8,
    )  # fmt: skip
    return Alignment(sorted_pairs, block_expert, num_padded, block_m)


# ----------------------------------------------------------------------------------------------
# grouped path


@triton.jit
def _dot(a, b, acc, F32: tl.constexpr):
    """acc + a @ b. F32: in fp32 without TF32, for fp32 inputs (the twin's tight check) and
    under the interpreter, whose bf16 tl.dot is wrong in Triton 3.9 (see attention.py)."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _activation(gate, up, dtype: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """An expert's activation of its fp32 gate and up products, each rounded to `dtype` first as
    the reference's products are: ACT 0 silu(gate) * up (rounded as the reference rounds it);
    1 gpt-oss's clamped SwiGLU (`clamped_swiglu`), in fp32 and rounded once."""
    g = gate.to(dtype).to(tl.float32)
    u = up.to(dtype).to(tl.float32)
    if ACT == 0:
        return silu_mul_rounded(g, u, dtype, False)
    g = tl.minimum(g, LIMIT)
    u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
    return ((u + 1.0) * (g * tl.sigmoid(ALPHA * g))).to(dtype)


@triton.jit
def _block_of(pid, num_m, n_blocks, GROUP_M: tl.constexpr):
    """(sorted block, column block) of program pid in a grid of num_m x n_blocks: GROUP_M
    sorted blocks take every column block in turn together, so their rows are read from HBM
    once and each weight tile once per group; GROUP_M 0: all num_m blocks form one group."""
    if GROUP_M == 0:
        return pid % num_m, pid // num_m
    in_group = GROUP_M * n_blocks
    first = (pid // in_group) * GROUP_M
    rows = tl.minimum(num_m - first, GROUP_M)
    return first + (pid % in_group) % rows, (pid % in_group) // rows


@triton.jit
def _grouped_gate_up_store(
    gate, up, out_ptr, b_ptr, e, I, cols, col_ok, pair, valid, stride_o, stride_be,
    ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
):  # fmt: skip
    """The grouped gate_up kernels' epilogue (bf16 / FP8 and MXFP4 weights): gpt-oss's biases,
    the activation, the rows of the sorted pairs stored."""
    if ACT == 1:  # gpt-oss: the products' biases
        gate += tl.load(b_ptr + e * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b_ptr + e * stride_be + I + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = _activation(gate, up, out_ptr.dtype.element_ty, ACT, ALPHA, LIMIT)
    o_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(o_ptrs, y, mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _grouped_down_store(
    acc, planes_ptr, topk_w_ptr, b_ptr, e, H, cols, col_ok, pair64, valid, stride_plane, stride_be,
    dtype: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """The grouped down kernels' epilogue: the bias (gpt-oss), the product rounded to the dtype,
    times the routing weight, into pair t*k + j's plane j, row t."""
    if HAS_BIAS:  # gpt-oss: added before the product is rounded, as cuBLAS's epilogue adds it
        acc += tl.load(b_ptr + e * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    weight = tl.load(topk_w_ptr + pair64, mask=valid, other=0.0)
    y = acc.to(dtype).to(tl.float32) * weight[:, None]  # the down product in the dtype, as the reference
    row = (pair64 % K) * stride_plane + (pair64 // K) * H
    tl.store(planes_ptr + row[:, None] + cols[None, :], y, mask=valid[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])  # T*k varies per step: one compile
def _grouped_gate_up_kernel(
    x_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr, s_ptr, b_ptr,
    H, I, num_pairs, num_m, stride_x, stride_we, stride_wn, stride_o, stride_se, stride_sn, stride_be,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, F32: tl.constexpr, SCALED: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
):  # fmt: skip
    """Program (b, n) (`_block_of`): the pairs of sorted block b (one expert's), columns
    n*BLOCK_N.. of silu(x W_gate^T) * (x W_up^T) (ACT 1: gpt-oss's biased products and clamped
    SwiGLU, `_activation`), into out[pair] ([T*k, I]). SCALED: W is e4m3; each K step (within
    one scale block) is a product of x with the e4m3 values, scaled per output column as it is added."""
    b, n = _block_of(tl.program_id(0), num_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    if b * BLOCK_M >= tl.load(num_padded_ptr):
        return
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    token = (pair // K).to(tl.int64)
    cols = n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_x + ks[None, :]
    g_ptrs = w_ptr + e * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    u_ptrs = g_ptrs + I * stride_wn
    sg_ptrs = s_ptr + e * stride_se + (cols // SCALE_N) * stride_sn
    su_ptrs = s_ptr + e * stride_se + ((I + cols) // SCALE_N) * stride_sn
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = ks < H - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        wu = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if SCALED:
            zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            kb = k0 // SCALE_K
            sg = tl.load(sg_ptrs + kb, mask=col_ok, other=0.0)
            su = tl.load(su_ptrs + kb, mask=col_ok, other=0.0)
            gate += _dot(a, wg.to(a.dtype), zero, F32) * sg[None, :]
            up += _dot(a, wu.to(a.dtype), zero, F32) * su[None, :]
        else:
            gate = _dot(a, wg, gate, F32)
            up = _dot(a, wu, up, F32)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    _grouped_gate_up_store(
        gate, up, out_ptr, b_ptr, e, I, cols, col_ok, pair, valid, stride_o, stride_be, ACT, ALPHA, LIMIT
    )


@triton.jit(do_not_specialize=["num_pairs"])  # T*k varies per step: one compile
def _grouped_down_kernel(
    a_ptr, w_ptr, planes_ptr, topk_w_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr, s_ptr, b_ptr,
    H, I, num_pairs, num_m, stride_a, stride_we, stride_wn, stride_plane, stride_se, stride_sn, stride_be,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, F32: tl.constexpr, SCALED: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """Program (b, n) (`_block_of`): planes[j, t, n*BLOCK_N..] = topk_weight[pair] *
    (act[pair] W_down^T) for the pairs t*k + j of sorted block b (planes [k, T, H], rows H apart)."""
    b, n = _block_of(tl.program_id(0), num_m, tl.cdiv(H, BLOCK_N), GROUP_M)
    if b * BLOCK_M >= tl.load(num_padded_ptr):
        return
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    pair64 = pair.to(tl.int64)
    cols = n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + pair64[:, None] * stride_a + ks[None, :]
    w_ptrs = w_ptr + e * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    s_ptrs = s_ptr + e * stride_se + (cols // SCALE_N) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = ks < I - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if SCALED:  # as the gate_up kernel
            scale = tl.load(s_ptrs + k0 // SCALE_K, mask=col_ok, other=0.0)
            acc += _dot(a, w.to(a.dtype), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), F32) * scale[None, :]
        else:
            acc = _dot(a, w, acc, F32)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _grouped_down_store(
        acc, planes_ptr, topk_w_ptr, b_ptr, e, H, cols, col_ok, pair64, valid, stride_plane, stride_be,
        a_ptr.dtype.element_ty, K, HAS_BIAS,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# decode path


@triton.jit
def _decode_gate_up_store(
    gate, up, out_ptr, b_ptr, e, I, cols, col_ok, p, stride_o, stride_be, dtype: tl.constexpr,
    ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
):  # fmt: skip
    """The decode gate_up kernels' epilogue (bf16 / FP8 and MXFP4 weights): gpt-oss's biases,
    the activation rounded to the model's `dtype`, pair p's output columns stored (as fp16 by
    the MXFP4 kernels' HALF2 path: exact for the clamped SwiGLU's bf16 values)."""
    if ACT == 1:  # gpt-oss: the products' biases
        gate += tl.load(b_ptr + e * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)
        up += tl.load(b_ptr + e * stride_be + I + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = _activation(gate, up, dtype, ACT, ALPHA, LIMIT)
    tl.store(out_ptr + p * stride_o + cols, y, mask=col_ok)


@triton.jit
def _decode_gate_up_kernel(
    x_ptr, w_ptr, out_ptr, ids_ptr, s_ptr, b_ptr, H, I, stride_x, stride_we, stride_wn, stride_o, stride_se,
    stride_sn, stride_be, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOOP_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr, SCALED: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
):  # fmt: skip
    """Program (p, n): pair p = t*k + j, columns n*BLOCK_N.. of its expert's silu(gate)*up
    (ACT 1: as the grouped kernel's): reads only that expert's rows. LOOP_STAGES > 1 pipelines the loop's loads (cp.async,
    LOOP_STAGES - 1 steps ahead: Triton pipelines a loop without a dot only when the loop
    names its stages)."""
    pdl_start(USE_PDL)  # which rows to read comes from the route kernel
    p = tl.program_id(0).to(tl.int64)
    e = tl.load(ids_ptr + p).to(tl.int64)
    token = p // K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    ks = tl.arange(0, BLOCK_K)
    g_ptrs = w_ptr + e * stride_we + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    u_ptrs = g_ptrs + I * stride_wn
    x_ptrs = x_ptr + token * stride_x + ks
    sg_ptrs = s_ptr + e * stride_se + (cols // SCALE_N) * stride_sn
    su_ptrs = s_ptr + e * stride_se + ((I + cols) // SCALE_N) * stride_sn
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=LOOP_STAGES):
        k_ok = ks < H - k0
        x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        wg = tl.load(g_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        wu = tl.load(u_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if SCALED:  # the K step lies in one scale block: one scale per output row
            kb = k0 // SCALE_K
            gate += tl.sum(wg * x[None, :], axis=1) * tl.load(sg_ptrs + kb, mask=col_ok, other=0.0)
            up += tl.sum(wu * x[None, :], axis=1) * tl.load(su_ptrs + kb, mask=col_ok, other=0.0)
        else:
            gate += tl.sum(wg * x[None, :], axis=1)
            up += tl.sum(wu * x[None, :], axis=1)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    _decode_gate_up_store(
        gate, up, out_ptr, b_ptr, e, I, cols, col_ok, p, stride_o, stride_be, out_ptr.dtype.element_ty, ACT, ALPHA, LIMIT
    )  # fmt: skip


@triton.jit
def _decode_down_store(
    acc, planes_ptr, topk_w_ptr, b_ptr, e, H, cols, col_ok, p, split, split_k, stride_plane, stride_be,
    dtype: tl.constexpr, K: tl.constexpr, ROUND: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """The decode down kernels' epilogue (bf16 / FP8 and MXFP4 weights): the bias once, in the
    first split; the product rounded to the dtype (unsplit); times the routing weight, into
    plane j*split_k + split at row t."""
    if HAS_BIAS:  # gpt-oss: once, in the first split, before the rounding (cuBLAS's epilogue)
        bias = tl.load(b_ptr + e * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc += tl.where(split == 0, bias, 0.0)
    if ROUND:
        acc = acc.to(dtype).to(tl.float32)
    y = acc * tl.load(topk_w_ptr + p)
    plane = (p % K) * split_k + split
    tl.store(planes_ptr + plane * stride_plane + (p // K) * H + cols, y, mask=col_ok)


@triton.jit
def _decode_down_kernel(
    a_ptr, w_ptr, planes_ptr, ids_ptr, topk_w_ptr, s_ptr, b_ptr, H, I, k_split, split_k, stride_a, stride_we,
    stride_wn, stride_plane, stride_se, stride_sn, stride_be, K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, ROUND: tl.constexpr, LOOP_STAGES: tl.constexpr, USE_PDL: tl.constexpr,
    SCALED: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """Program (p, n, s), pair p = t*k + j: columns n*BLOCK_N.. of act[p] W_down^T over the
    depth [s*k_split, (s+1)*k_split) of p's expert, times topk_weight[p], into plane j*split_k + s
    at row t (planes [k*split_k, T, H], rows H apart). ROUND (unsplit): the product is rounded
    to the dtype before the weight multiplies it, as the reference; a split's partial is not
    (a partial product has no rounding of the reference to match). LOOP_STAGES as the gate_up
    kernel's."""
    pdl_start(USE_PDL)  # the expert ids and act come from the kernels before
    p = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    e = tl.load(ids_ptr + p).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    ks = tl.arange(0, BLOCK_K)
    k_start = split * k_split
    k_end = tl.minimum(k_start + k_split, I)
    w_ptrs = w_ptr + e * stride_we + cols[:, None].to(tl.int64) * stride_wn + k_start + ks[None, :]
    a_ptrs = a_ptr + p * stride_a + k_start + ks
    s_ptrs = s_ptr + e * stride_se + (cols // SCALE_N) * stride_sn
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=LOOP_STAGES):
        k_ok = ks < k_end - k0
        a = tl.load(a_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if SCALED:  # as the gate_up kernel
            acc += tl.sum(w * a[None, :], axis=1) * tl.load(s_ptrs + k0 // SCALE_K, mask=col_ok, other=0.0)
        else:
            acc += tl.sum(w * a[None, :], axis=1)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _decode_down_store(
        acc, planes_ptr, topk_w_ptr, b_ptr, e, H, cols, col_ok, p, split, split_k, stride_plane, stride_be,
        a_ptr.dtype.element_ty, K, ROUND, HAS_BIAS,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# MXFP4 experts: both paths decode the packed codes in registers
#
# A K step of BLOCK_K elements is BLOCK_K / 32 groups of a weight row, each 16 bytes of codes
# (four 32-bit words in `pack_mxfp4`'s layout) and one e8m0 scale byte. Values are made by bit
# operations, no table: a code's sign bit goes to fp16's sign bit and its 2 exponent + 1 mantissa
# bits to fp16's lowest two exponent bits and highest mantissa bit, which is the E2M1 value times
# 2^-14 (code 1, 0.5, lands on fp16's subnormal 2^-15; fp16 -> fp32 is exact, so no fp32
# subnormal is ever made and flushing them cannot matter). Two elements come out of a word at
# once, as its two fp16 halves (`_e2m1_pair`: one to four integer operations). The scale
# 2^(s - 127) is made times 2^14 (s + 14 in fp32's exponent field), so value * scale is the
# weight exactly.


@triton.jit
def _e8m0(s):
    """2^(s - 127) * 2^14 in fp32 for uint8 scales s (exact for s <= 240; larger scales do not
    occur in weights: 2^113 and up)."""
    return ((s.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp16_bits(bits):
    """The fp16 whose bits are the low 16 of int32 `bits`, in fp32."""
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_pair_bits(w, N: tl.constexpr):
    """Pair N (0 <= N < 4) of int32 words w in `pack_mxfp4`'s layout, (element 4N + q's,
    element 16 + 4N + q's), as an f16x2 word of their E2M1 values times 2^-14: magnitude bits
    at 9..11 and 25..27, sign bits at 15 and 31."""
    if N == 0:
        bits = w & -1912566272  # 0x8E008E00 as an int32
    elif N == 1:
        bits = (w << 3) & -1912566272
    elif N == 2:
        bits = ((w << 9) & 0x0E000E00) | ((w << 2) & -2147450880)  # 0x80008000
    else:
        bits = ((w << 6) & 0x0E000E00) | ((w << 1) & -2147450880)
    return bits


@triton.jit
def _e2m1_pair(w, N: tl.constexpr):
    """`_e2m1_pair_bits`' two values in fp32."""
    bits = _e2m1_pair_bits(w, N)
    return _fp16_bits(bits), _fp16_bits(bits >> 16)


# The decode kernels' bf16 path multiplies in f16x2 (HALF2): a weight pair's word
# (`_e2m1_pair_bits`) times the word of its two activations in fp16, added into an f16x2
# accumulator per word, one `fma.rn.f16x2` for two elements where the fp32 path spends a
# conversion and an FMA on each; a group's four words are added in f16x2 and its two fp16
# sums (16 products each) go to fp32 before its scale multiplies them. The K loop's SASS
# (sm_90, host build) went 5.3 -> 3.2-3.7 instructions an element; gpt-oss-20b's expert layer
# at T=1 took 35.4 -> 31.0 us on an H200 (2026-12-04, retuned), so it is not issue-bound alone.
# Rounding: the products are exact and each FMA rounds once to fp16 (2^-11 relative; sums
# under 2^-14 round to fp16's subnormal grid, 2^-24 absolute, below what bf16 keeps of the
# dot product); fp16 overflows only at |activation| >= 65504 (clamped there: bf16 reaches
# further), far above what a normed hidden row or the clamped SwiGLU's output (at most
# (limit + 1) * limit) holds. ASM: the PTX instructions; else (the interpreter) the same
# arithmetic in Triton's fp32 and fp16, so CI runs this path's logic.


@triton.jit
def _h2_join(lo, hi, ASM: tl.constexpr):
    """The f16x2 word of fp16 tensors lo (low half) and hi."""
    if ASM:
        return tl.inline_asm_elementwise(
            "mov.b32 $0, {$1, $2};", "=r,h,h", [lo, hi], dtype=tl.int32, is_pure=True, pack=1
        )
    return (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _h2_pack(lo, hi, ASM: tl.constexpr):
    """The f16x2 word of fp32 tensors lo and hi, rounded to nearest, clamped to fp16's range."""
    if ASM:
        return tl.inline_asm_elementwise(
            "cvt.rn.satfinite.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32, is_pure=True, pack=1
        )
    lo = tl.minimum(tl.maximum(lo, -65504.0), 65504.0)
    hi = tl.minimum(tl.maximum(hi, -65504.0), 65504.0)
    return _h2_join(lo.to(tl.float16), hi.to(tl.float16), False)


@triton.jit
def _h2_fma(a, b, c, ASM: tl.constexpr):
    """a * b + c on f16x2 words, each half rounded once to fp16 (under the interpreter: the
    exact product plus c in fp32, then rounded to fp16)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
        )
    lo = _fp16_bits(a) * _fp16_bits(b) + _fp16_bits(c)
    hi = _fp16_bits(a >> 16) * _fp16_bits(b >> 16) + _fp16_bits(c >> 16)
    return _h2_join(lo.to(tl.float16), hi.to(tl.float16), False)


@triton.jit
def _mx_x_pair(ptrs, ok, ASM: tl.constexpr):
    """The f16x2 word (x[i], x[i + 16]) of the activations at ptrs (element i): bf16 ones
    rounded to fp16 (exact inside fp16's normal range), fp16 ones (the down kernel's act)
    joined as they are."""
    lo = tl.load(ptrs, mask=ok, other=0.0)
    hi = tl.load(ptrs + 16, mask=ok, other=0.0)
    if lo.dtype == tl.float16:
        return _h2_join(lo, hi, ASM)
    return _h2_pack(lo.to(tl.float32), hi.to(tl.float32), ASM)


@triton.jit
def _mx_x_pairs(x_ptrs, x_ok, ASM: tl.constexpr):
    """The four f16x2 words [G, 4] of a K step's activations that meet `_e2m1_pair_bits`'
    pairs 0..3 (`_mx_x_pair` at elements 4n + q of each group)."""
    p0 = _mx_x_pair(x_ptrs, x_ok, ASM)
    p1 = _mx_x_pair(x_ptrs + 4, x_ok, ASM)
    p2 = _mx_x_pair(x_ptrs + 8, x_ok, ASM)
    p3 = _mx_x_pair(x_ptrs + 12, x_ok, ASM)
    return p0, p1, p2, p3


@triton.jit
def _h2_add_asm(a, b):
    return tl.inline_asm_elementwise("add.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _h2_add_emulated(a, b):
    lo = (_fp16_bits(a) + _fp16_bits(b)).to(tl.float16)
    return _h2_join(lo, (_fp16_bits(a >> 16) + _fp16_bits(b >> 16)).to(tl.float16), False)


@triton.jit
def _mx_group_sums_h2(w, p0, p1, p2, p3, ASM: tl.constexpr):
    """For words w [BLOCK_N, G, 4] (a group's four words one thread's): each group's 32
    products summed in fp32, through f16x2: a word's eight in two fp16 halves (four FMAs of
    two), its four words' halves added in f16x2, then the two halves in fp32. p0..p3 from
    `_mx_x_pairs`."""
    acc = _h2_fma(_e2m1_pair_bits(w, 0), p0[None], tl.zeros(w.shape, dtype=tl.int32), ASM)
    acc = _h2_fma(_e2m1_pair_bits(w, 1), p1[None], acc, ASM)
    acc = _h2_fma(_e2m1_pair_bits(w, 2), p2[None], acc, ASM)
    acc = _h2_fma(_e2m1_pair_bits(w, 3), p3[None], acc, ASM)
    if ASM:
        acc = tl.reduce(acc, 2, _h2_add_asm)
    else:
        acc = tl.reduce(acc, 2, _h2_add_emulated)
    return _fp16_bits(acc) + _fp16_bits(acc >> 16)


@triton.jit
def _row_words(stride):
    """A weight row's stride in 32-bit words, as whole 16-byte groups of codes (which
    `_check_mxfp4` makes it) in a form Triton can see: its specialization knows multiples of 16
    only, and without this loads gpt-oss's rows (H/8 = 360 words) 4 bytes at a time, not 16."""
    return stride // 4 * 4


@triton.jit
def _mx_word_sums(w, x_ptrs, x_ok):
    """For int32 words w [BLOCK_N, G, 4] in `pack_mxfp4`'s layout (word q of group g of a row):
    each word's eight weights (times 2^-14, `_e2m1_pair`) times their activations, summed in
    fp32, one FMA an element; x_ptrs [G, 4] point at element q of each group (+ 4n: 4n + q)."""
    part = tl.zeros(w.shape, dtype=tl.float32)
    for n in tl.static_range(4):  # nibbles n and n + 4: elements 4n + q and 16 + 4n + q
        x_lo = tl.load(x_ptrs + 4 * n, mask=x_ok, other=0.0).to(tl.float32)[None]
        x_hi = tl.load(x_ptrs + 16 + 4 * n, mask=x_ok, other=0.0).to(tl.float32)[None]
        lo, hi = _e2m1_pair(w, n)
        part += lo * x_lo
        part += hi * x_hi
    return part


@triton.jit
def _mx_rows(w_ptrs, s_ptrs, row_ok, gs, groups_left):
    """One K step's words [BLOCK_N, G, 4] of a program's weight rows and their groups' scales
    [BLOCK_N, G] (`_e8m0`); groups_left <= 0: nothing is read."""
    g_ok = gs < groups_left
    w = tl.load(w_ptrs, mask=row_ok[:, None, None] & g_ok[None, :, None], other=0)
    return w, _e8m0(tl.load(s_ptrs, mask=row_ok[:, None] & g_ok[None, :], other=0))


@triton.jit
def _decode_gate_up_mx_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, ids_ptr, b_ptr, H, I, stride_x, stride_we, stride_wn, stride_se, stride_sn,
    stride_o, stride_be, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    LOOP_STAGES: tl.constexpr, USE_PDL: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    HALF2: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """`_decode_gate_up_kernel` on MXFP4 weights (w: the packed codes as int32 words [E, 2I, H/8],
    s [E, 2I, H/32]): each K step multiplies a [BLOCK_N, G, 4] tile of words of the gate rows
    and one of the up rows (G = BLOCK_K / 32 groups, a group's four words one thread's) while
    the next step's tiles load (held in registers: no wait on memory at the top of a step),
    and adds each group's sum times its scale into a [BLOCK_N, G] accumulator, summed over G
    once, after the loop (H is whole groups). HALF2 (bf16 x): the products in f16x2
    (`_mx_group_sums_h2`; ASM: its PTX), stored as fp16 (out_ptr's dtype); else in fp32."""
    pdl_start(USE_PDL)  # which rows to read comes from the route kernel
    G: tl.constexpr = BLOCK_K // 32
    p = tl.program_id(0).to(tl.int64)
    e = tl.load(ids_ptr + p).to(tl.int64)
    token = p // K
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < I
    gs = tl.arange(0, G)
    qs = tl.arange(0, 4)
    words = (gs[:, None] * 4 + qs[None, :])[None]
    row_words = _row_words(stride_wn)
    g_ptrs = w_ptr + e * stride_we + rows[:, None, None].to(tl.int64) * row_words + words
    u_ptrs = g_ptrs + I * row_words
    sg_ptrs = s_ptr + e * stride_se + rows[:, None].to(tl.int64) * stride_sn + gs[None, :]
    su_ptrs = sg_ptrs + I * stride_sn
    x_ptrs = x_ptr + token * stride_x + gs[:, None] * 32 + qs[None, :]
    wg, sg = _mx_rows(g_ptrs, sg_ptrs, row_ok, gs, H // 32)
    wu, su = _mx_rows(u_ptrs, su_ptrs, row_ok, gs, H // 32)
    gate = tl.zeros([BLOCK_N, G], dtype=tl.float32)
    up = tl.zeros([BLOCK_N, G], dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=LOOP_STAGES):
        left = (H - k0 - BLOCK_K) // 32  # the next step's groups
        wg_next, sg_next = _mx_rows(g_ptrs + BLOCK_K // 8, sg_ptrs + G, row_ok, gs, left)
        wu_next, su_next = _mx_rows(u_ptrs + BLOCK_K // 8, su_ptrs + G, row_ok, gs, left)
        x_ok = (gs < (H - k0) // 32)[:, None]
        if HALF2:
            p0, p1, p2, p3 = _mx_x_pairs(x_ptrs, x_ok, ASM)
            gate += _mx_group_sums_h2(wg, p0, p1, p2, p3, ASM) * sg
            up += _mx_group_sums_h2(wu, p0, p1, p2, p3, ASM) * su
        else:
            gate += tl.sum(_mx_word_sums(wg, x_ptrs, x_ok), axis=2) * sg
            up += tl.sum(_mx_word_sums(wu, x_ptrs, x_ok), axis=2) * su
        wg, sg, wu, su = wg_next, sg_next, wu_next, su_next
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K // 8
        u_ptrs += BLOCK_K // 8
        sg_ptrs += G
        su_ptrs += G
    gate_n = tl.sum(gate, axis=1)
    up_n = tl.sum(up, axis=1)
    _decode_gate_up_store(
        gate_n, up_n, out_ptr, b_ptr, e, I, rows, row_ok, p, stride_o, stride_be, x_ptr.dtype.element_ty, ACT, ALPHA,
        LIMIT,
    )  # fmt: skip


@triton.jit
def _decode_down_mx_kernel(
    a_ptr, w_ptr, s_ptr, planes_ptr, ids_ptr, topk_w_ptr, b_ptr, H, I, k_split, split_k, stride_a, stride_we,
    stride_wn, stride_se, stride_sn, stride_plane, stride_be, K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, ROUND: tl.constexpr, LOOP_STAGES: tl.constexpr, USE_PDL: tl.constexpr,
    HAS_BIAS: tl.constexpr, HALF2: tl.constexpr, ASM: tl.constexpr, ACT_F16: tl.constexpr,
):  # fmt: skip
    """`_decode_down_kernel` on MXFP4 weights (w: int32 words [E, H, I/8], s [E, H, I/32]), K
    steps as `_decode_gate_up_mx_kernel`'s; each split's depth is whole BLOCK_K steps (groups).
    HALF2, ASM as its; ACT_F16: the activations are the HALF2 gate_up kernel's fp16 ones of a bf16
    model (the product rounds to bf16)."""
    pdl_start(USE_PDL)  # the expert ids and act come from the kernels before
    G: tl.constexpr = BLOCK_K // 32
    p = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    e = tl.load(ids_ptr + p).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    gs = tl.arange(0, G)
    qs = tl.arange(0, 4)
    k_start = tl.multiple_of(split * k_split, BLOCK_K)  # whole steps: the words' loads stay 16 bytes wide
    k_end = tl.minimum(k_start + k_split, I)
    words = (gs[:, None] * 4 + qs[None, :])[None]
    w_ptrs = w_ptr + e * stride_we + cols[:, None, None].to(tl.int64) * _row_words(stride_wn) + k_start // 8 + words
    s_ptrs = s_ptr + e * stride_se + cols[:, None].to(tl.int64) * stride_sn + k_start // 32 + gs[None, :]
    a_ptrs = a_ptr + p * stride_a + k_start + gs[:, None] * 32 + qs[None, :]
    w, scale = _mx_rows(w_ptrs, s_ptrs, col_ok, gs, (k_end - k_start) // 32)
    acc = tl.zeros([BLOCK_N, G], dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=LOOP_STAGES):
        w_next, scale_next = _mx_rows(w_ptrs + BLOCK_K // 8, s_ptrs + G, col_ok, gs, (k_end - k0 - BLOCK_K) // 32)
        a_ok = (gs < (k_end - k0) // 32)[:, None]
        if HALF2:
            p0, p1, p2, p3 = _mx_x_pairs(a_ptrs, a_ok, ASM)
            acc += _mx_group_sums_h2(w, p0, p1, p2, p3, ASM) * scale
        else:
            acc += tl.sum(_mx_word_sums(w, a_ptrs, a_ok), axis=2) * scale
        w, scale = w_next, scale_next
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 8
        s_ptrs += G
    dtype: tl.constexpr = tl.bfloat16 if ACT_F16 else a_ptr.dtype.element_ty  # the model's
    _decode_down_store(
        tl.sum(acc, axis=1), planes_ptr, topk_w_ptr, b_ptr, e, H, cols, col_ok, p, split, split_k,
        stride_plane, stride_be, dtype, K, ROUND, HAS_BIAS,
    )  # fmt: skip


# The grouped kernels' bf16 dequantize, in PTX: a word's four pairs (`_e2m1_pair`'s) put where
# bf16's lowest two exponent bits and highest mantissa bit are (magnitudes at 6..8 and 22..24,
# signs at 15 and 31), which is the E2M1 value times 2^-126 (code 1, 0.5, lands on bf16's
# subnormal 2^-127, which bf16 arithmetic keeps), then two bf16x2 products: by 2^126 (exact)
# and by the group's scale 2^(s - 127) (exact for 1 <= s <= 254; s = 0 reads as 0). The grouped
# gate_up kernel's K loop then runs 4.8 SASS instructions an element (sm_90, 16 x 64 x 128
# tiles), against 7.7 through `_e2m1_pair`'s fp16 -> fp32 -> scaled -> bf16.
# Operands: $0..$7 the bf16 outputs (pair n's element of half 0, of half 1), $8 the word, $9 the
# scale as a bf16x2 (s << 7 in both halves).
_MX_BF16_ASM: tl.constexpr = tl.constexpr(
    """{
    .reg .b32 m<4>, t, c;
    mov.b32 c, 0x7E807E80;
    shr.b32 t, $8, 3;
    and.b32 t, t, 0x01C001C0;
    and.b32 m0, $8, 0x80008000;
    or.b32 m0, m0, t;
    and.b32 t, $8, 0x01C001C0;
    shl.b32 m1, $8, 3;
    and.b32 m1, m1, 0x80008000;
    or.b32 m1, m1, t;
    shl.b32 t, $8, 6;
    and.b32 t, t, 0x01C001C0;
    shl.b32 m2, $8, 2;
    and.b32 m2, m2, 0x80008000;
    or.b32 m2, m2, t;
    shl.b32 t, $8, 3;
    and.b32 t, t, 0x01C001C0;
    shl.b32 m3, $8, 1;
    and.b32 m3, m3, 0x80008000;
    or.b32 m3, m3, t;
    mul.rn.bf16x2 m0, m0, c;
    mul.rn.bf16x2 m1, m1, c;
    mul.rn.bf16x2 m2, m2, c;
    mul.rn.bf16x2 m3, m3, c;
    mul.rn.bf16x2 m0, m0, $9;
    mul.rn.bf16x2 m1, m1, $9;
    mul.rn.bf16x2 m2, m2, $9;
    mul.rn.bf16x2 m3, m3, $9;
    mov.b32 {$0, $1}, m0;
    mov.b32 {$2, $3}, m1;
    mov.b32 {$4, $5}, m2;
    mov.b32 {$6, $7}, m3;
    }"""
)


@triton.jit
def _mx_tile(w, s, dtype: tl.constexpr, ASM: tl.constexpr):
    """One K step's MXFP4 weights of a program's rows for the grouped kernels' dots, dequantized
    in registers (exact: an MXFP4 weight has two significant bits): w [BLOCK_N, W] int32 words
    (word r % 4 of group r // 4 of the step), s [BLOCK_N, W / 4] their groups' uint8 scales ->
    [BLOCK_N, 8W] in `dtype`, depth in the order k' = 8r + 2n + h of word r's pair n, half h
    (group element 16h + 4n + r % 4; `_mx_activations` puts the activations in that order).
    ASM: bf16 by `_MX_BF16_ASM`; else through `_e2m1_pair` in fp32 (any dtype, the interpreter)."""
    BN: tl.constexpr = w.shape[0]
    W: tl.constexpr = w.shape[1]
    if ASM:
        s = s.to(tl.int32)
        scale = _per_word((s << 7) | (s << 23), W)  # 2^(s - 127) as a bf16x2
        lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3 = tl.inline_asm_elementwise(
            _MX_BF16_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [w, scale], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1
        )
    else:
        scale = _per_word(_e8m0(s), W)
        lo0, hi0 = _e2m1_scaled(w, 0, scale, dtype)
        lo1, hi1 = _e2m1_scaled(w, 1, scale, dtype)
        lo2, hi2 = _e2m1_scaled(w, 2, scale, dtype)
        lo3, hi3 = _e2m1_scaled(w, 3, scale, dtype)
    lo = tl.join(tl.join(lo0, lo2), tl.join(lo1, lo3))  # [BN, W, j, i]: pair n = 2j + i
    hi = tl.join(tl.join(hi0, hi2), tl.join(hi1, hi3))
    return tl.reshape(tl.join(lo, hi), [BN, 8 * W])  # trailing per-thread dims merged: no data moves


@triton.jit
def _per_word(v, W: tl.constexpr):
    """A group's value [BLOCK_N, W / 4] repeated for each of its four words: [BLOCK_N, W]."""
    return tl.reshape(tl.broadcast_to(v[:, :, None], [v.shape[0], W // 4, 4]), [v.shape[0], W])


@triton.jit
def _e2m1_scaled(w, N: tl.constexpr, scale, dtype: tl.constexpr):
    """Pair N of words w (`_e2m1_pair`) times their `_e8m0` scales, in `dtype` (exact)."""
    lo, hi = _e2m1_pair(w, N)
    return (lo * scale).to(dtype), (hi * scale).to(dtype)


@triton.jit
def _mx_activations(x):
    """Activations [BLOCK_M, BLOCK_K] in natural order -> in `_mx_tile`'s depth order: position
    32g + 8q + 2n + h holds element 32g + 16h + 4n + q."""
    BM: tl.constexpr = x.shape[0]
    BK: tl.constexpr = x.shape[1]
    x = tl.permute(tl.reshape(x, [BM, BK // 32, 2, 4, 4]), (0, 1, 4, 3, 2))
    return tl.reshape(x, [BM, BK])


@triton.jit
def _mx_step(w_ptrs, s_ptrs, col_ok, gs, groups_left, dtype: tl.constexpr, ASM: tl.constexpr):
    """One K step's dequantized weight tile [BLOCK_N, BLOCK_K] (`_mx_tile`) for the grouped
    kernels: w_ptrs [BLOCK_N, BLOCK_K / 8] at the step's words, s_ptrs [BLOCK_N, BLOCK_K / 32]
    at its groups' scales; groups past groups_left read as zeros (masked by whole groups: a
    group's four words stay one 16-byte load)."""
    W: tl.constexpr = w_ptrs.shape[1]
    r = tl.arange(0, W)
    w = tl.load(w_ptrs, mask=col_ok[:, None] & (r // 4 < groups_left)[None, :], other=0)
    s = tl.load(s_ptrs, mask=col_ok[:, None] & (gs < groups_left)[None, :], other=0)
    return _mx_tile(w, s, dtype, ASM)


@triton.jit(do_not_specialize=["num_pairs"])  # T*k varies per step: one compile
def _grouped_gate_up_mx_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr, b_ptr,
    H, I, num_pairs, num_m, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_o, stride_be,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, F32: tl.constexpr, ASM: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
):  # fmt: skip
    """`_grouped_gate_up_kernel` on MXFP4 weights (as `_decode_gate_up_mx_kernel`'s: int32
    words [E, 2I, H/8]): each K step's weight tiles are dequantized in registers (`_mx_step`)
    and multiplied in one dot each; H is whole groups."""
    b, n = _block_of(tl.program_id(0), num_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    if b * BLOCK_M >= tl.load(num_padded_ptr):
        return
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    token = (pair // K).to(tl.int64)
    cols = n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    ks = tl.arange(0, BLOCK_K)
    gs = tl.arange(0, BLOCK_K // 32)
    x_ptrs = x_ptr + token[:, None] * stride_x + ks[None, :]
    row_words = _row_words(stride_wn)
    g_ptrs = w_ptr + e * stride_we + cols[:, None].to(tl.int64) * row_words + tl.arange(0, BLOCK_K // 8)[None, :]
    u_ptrs = g_ptrs + I * row_words
    sg_ptrs = s_ptr + e * stride_se + cols[:, None].to(tl.int64) * stride_sn + gs[None, :]
    su_ptrs = sg_ptrs + I * stride_sn
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        left = (H - k0) // 32
        x = _mx_activations(tl.load(x_ptrs, mask=valid[:, None] & (ks < H - k0)[None, :], other=0.0))
        gate = _dot(x, tl.trans(_mx_step(g_ptrs, sg_ptrs, col_ok, gs, left, x.dtype, ASM)), gate, F32)
        up = _dot(x, tl.trans(_mx_step(u_ptrs, su_ptrs, col_ok, gs, left, x.dtype, ASM)), up, F32)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K // 8
        u_ptrs += BLOCK_K // 8
        sg_ptrs += BLOCK_K // 32
        su_ptrs += BLOCK_K // 32
    _grouped_gate_up_store(
        gate, up, out_ptr, b_ptr, e, I, cols, col_ok, pair, valid, stride_o, stride_be, ACT, ALPHA, LIMIT
    )


@triton.jit(do_not_specialize=["num_pairs"])  # T*k varies per step: one compile
def _grouped_down_mx_kernel(
    a_ptr, w_ptr, s_ptr, planes_ptr, topk_w_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr, b_ptr,
    H, I, num_pairs, num_m, stride_a, stride_we, stride_wn, stride_se, stride_sn, stride_plane, stride_be,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, F32: tl.constexpr, ASM: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """`_grouped_down_kernel` on MXFP4 weights (as `_grouped_gate_up_mx_kernel`'s); I is whole groups."""
    b, n = _block_of(tl.program_id(0), num_m, tl.cdiv(H, BLOCK_N), GROUP_M)
    if b * BLOCK_M >= tl.load(num_padded_ptr):
        return
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    pair64 = pair.to(tl.int64)
    cols = n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    ks = tl.arange(0, BLOCK_K)
    gs = tl.arange(0, BLOCK_K // 32)
    a_ptrs = a_ptr + pair64[:, None] * stride_a + ks[None, :]
    w_ptrs = w_ptr + e * stride_we + cols[:, None].to(tl.int64) * _row_words(stride_wn)
    w_ptrs += tl.arange(0, BLOCK_K // 8)[None, :]
    s_ptrs = s_ptr + e * stride_se + cols[:, None].to(tl.int64) * stride_sn + gs[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        a = _mx_activations(tl.load(a_ptrs, mask=valid[:, None] & (ks < I - k0)[None, :], other=0.0))
        w = _mx_step(w_ptrs, s_ptrs, col_ok, gs, (I - k0) // 32, a.dtype, ASM)
        acc = _dot(a, tl.trans(w), acc, F32)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 8
        s_ptrs += BLOCK_K // 32
    _grouped_down_store(
        acc, planes_ptr, topk_w_ptr, b_ptr, e, H, cols, col_ok, pair64, valid, stride_plane, stride_be,
        a_ptr.dtype.element_ty, K, HAS_BIAS,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# fused_moe


def _activation_args(w13: torch.Tensor, act: ClampedSwiGLU | None, H: int) -> tuple:
    """(b13, b2, the kernels' activation constexprs) for the launches; without biases, w13
    stands in for the unread bias pointers."""
    if act is None:
        return w13, w13, {"gate_up": {"ACT": 0, "ALPHA": 0.0, "LIMIT": 0.0}, "down": {"HAS_BIAS": False}}
    E, two_i, _ = w13.shape
    if tuple(act.b13.shape) != (E, two_i) or (act.b2 is not None and tuple(act.b2.shape) != (E, H)):
        raise ValueError(f"fused_moe: biases b13 [E, 2I] = {(E, two_i)} and b2 [E, H] = {(E, H)} expected")
    if not act.b13.is_contiguous() or (act.b2 is not None and not act.b2.is_contiguous()):
        raise ValueError("fused_moe: biases must be contiguous")
    b2 = act.b2 if act.b2 is not None else w13
    kinds = {
        "gate_up": {"ACT": 1, "ALPHA": float(act.alpha), "LIMIT": float(act.limit)},
        "down": {"HAS_BIAS": act.b2 is not None},
    }
    return act.b13, b2, kinds


def _k_step(block_k: int, scale_k: int, depth: int) -> int:
    """The largest K step up to block_k that no scale block boundary cuts (a per-channel scale,
    scale_k >= depth, has none)."""
    if scale_k >= depth:
        return block_k
    while scale_k % block_k:
        block_k //= 2
    return block_k


def _scale_args(w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales | None) -> tuple:
    """(w13 scales, w2 scales, SCALE_N, SCALE_K of w13, of w2) for the kernels; without FP8
    weights, w13 stands in for the unread scale pointers."""
    if torch.uint8 in (w13.dtype, w2.dtype):
        raise ValueError("fused_moe: packed uint8 (MXFP4) experts need their Mxfp4Scales")
    fp8 = w13.dtype == FP8_DTYPE
    if fp8 != (w2.dtype == FP8_DTYPE) or fp8 != (scales is not None):
        raise ValueError("fused_moe: FP8 experts need both weights in float8_e4m3fn and their scales, and only they")
    if scales is None:
        return w13, w13, 1, 1, 1
    E, two_i, H = w13.shape
    inter = w2.shape[2]
    bn, bk13, bk2 = scales.block_n, scales.block_k13, scales.block_k2
    for name, t, shape in (
        ("w13", scales.w13, (E, triton.cdiv(two_i, bn), triton.cdiv(H, bk13))),
        ("w2", scales.w2, (E, triton.cdiv(H, bn), triton.cdiv(inter, bk2))),
    ):
        if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(
                f"fused_moe: {name} scales must be contiguous fp32 {shape}, got {tuple(t.shape)} {t.dtype}"
            )
    if bn > 1 and inter % bn:
        raise ValueError(f"fused_moe: block scales need the expert width ({inter}) in whole {bn}-row blocks")
    return scales.w13, scales.w2, bn, bk13, bk2


def _check_mxfp4(w13: torch.Tensor, w2: torch.Tensor, scales: Mxfp4Scales) -> None:
    """MXFP4 experts: packed uint8 weights and uint8 scales of the shapes `Mxfp4Scales` says."""
    E, two_i, half_h = w13.shape
    H, half_i = w2.shape[1], w2.shape[2]
    if w13.dtype != torch.uint8 or w2.dtype != torch.uint8:
        raise ValueError(f"fused_moe: MXFP4 experts are packed uint8, got {w13.dtype} and {w2.dtype}")
    for name, t, shape in (
        ("w13", scales.w13, (E, two_i, half_h * 2 // MXFP4_GROUP)),
        ("w2", scales.w2, (E, H, half_i * 2 // MXFP4_GROUP)),
    ):
        if tuple(t.shape) != shape or t.dtype != torch.uint8 or not t.is_contiguous():
            raise ValueError(
                f"fused_moe: MXFP4 {name} scales must be contiguous uint8 {shape}, got {tuple(t.shape)} {t.dtype}"
            )
    if (half_h * 2) % MXFP4_GROUP or (half_i * 2) % MXFP4_GROUP:
        raise ValueError(f"fused_moe: MXFP4 experts need H ({half_h * 2}) and I ({half_i * 2}) in whole 32-groups")


def _mx_configs(cfg13: MoEConfig, cfg2: MoEConfig, path: str, dtype: torch.dtype) -> tuple[MoEConfig, MoEConfig]:
    """MXFP4 launch parameters: K steps of whole 32-element groups, on the grouped path as
    deep in bytes of activations as bf16's (`_for_dtype`); the decode path's as given (one row
    of activations; its weights half a byte an element whatever the dtype)."""
    out = []
    for c in (cfg13, cfg2):
        if path == "grouped":
            c = _for_dtype(c, dtype)
        c = replace(c, block_k=max(c.block_k, MXFP4_GROUP))
        if c.block_k & (c.block_k - 1):
            raise ValueError(f"fused_moe: MXFP4 K steps must be a power of two of at least 32, got {c.block_k}")
        out.append(c)
    return out[0], out[1]


def _mxfp4_partials(hidden, w13, w2, scales: Mxfp4Scales, ids, weights, cfg13, cfg2, path, pdl, b13, b2, kinds):
    """`fused_moe_partials` on MXFP4 experts (checked by the caller): the MXFP4 kernels' launches."""
    T, H = hidden.shape
    E, k = w13.shape[0], ids.shape[1]
    inter = w2.shape[2] * 2
    pairs = T * k
    s13, s2 = scales.w13, scales.w2
    split = cfg2.split_k if path == "decode" else 1
    planes = torch.empty(k * split, T, H, dtype=torch.float32, device=hidden.device)
    if T == 0:
        return planes
    half2 = path == "decode" and hidden.dtype == torch.bfloat16  # see `_mx_group_sums_h2`
    act_f16 = half2 and kinds["gate_up"]["ACT"] == 1  # the clamped SwiGLU's values: exact in fp16
    act_dtype = torch.float16 if act_f16 else hidden.dtype
    out13 = torch.empty(pairs, inter, dtype=act_dtype, device=hidden.device)  # the activations
    w13, w2 = w13.view(torch.int32), w2.view(torch.int32)  # the codes as 32-bit words (`pack_mxfp4`)
    if path == "decode":
        h2 = {"HALF2": half2, "ASM": half2 and not INTERPRET}
        _decode_gate_up_mx_kernel[(pairs, triton.cdiv(inter, cfg13.block_n))](
            hidden, w13, s13, out13, ids, b13, H, inter, hidden.stride(0), w13.stride(0), w13.stride(1),
            s13.stride(0), s13.stride(1), out13.stride(0), b13.stride(0), K=k, BLOCK_N=cfg13.block_n,
            BLOCK_K=cfg13.block_k, LOOP_STAGES=cfg13.num_stages, **kinds["gate_up"], **h2,
            num_warps=cfg13.num_warps, num_stages=cfg13.num_stages, **launch_options(hidden.device, pdl),
        )  # fmt: skip
        k_split = triton.cdiv(triton.cdiv(inter, split), cfg2.block_k) * cfg2.block_k  # whole K steps
        _decode_down_mx_kernel[(pairs, triton.cdiv(H, cfg2.block_n), split)](
            out13, w2, s2, planes, ids, weights, b2, H, inter, k_split, split, out13.stride(0), w2.stride(0),
            w2.stride(1), s2.stride(0), s2.stride(1), T * H, b2.stride(0), K=k, BLOCK_N=cfg2.block_n,
            BLOCK_K=cfg2.block_k, ROUND=split == 1, LOOP_STAGES=cfg2.num_stages, **kinds["down"], **h2,
            ACT_F16=act_f16, num_warps=cfg2.num_warps, num_stages=cfg2.num_stages,
            **launch_options(hidden.device, pdl),
        )  # fmt: skip
        return planes
    f32 = hidden.dtype == torch.float32 or INTERPRET  # see _dot
    asm = hidden.dtype == torch.bfloat16 and not INTERPRET  # `_MX_BF16_ASM`
    al13 = align(ids, E, cfg13.block_m)
    al2 = al13 if cfg2.block_m == cfg13.block_m else align(ids, E, cfg2.block_m)
    num_m = al13.block_expert.numel()
    _grouped_gate_up_mx_kernel[(num_m * triton.cdiv(inter, cfg13.block_n),)](
        hidden, w13, s13, out13, al13.sorted_pairs, al13.block_expert, al13.num_padded, b13,
        H, inter, pairs, num_m, hidden.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1),
        out13.stride(0), b13.stride(0), K=k, BLOCK_M=cfg13.block_m, BLOCK_N=cfg13.block_n, BLOCK_K=cfg13.block_k,
        GROUP_M=cfg13.group_m, F32=f32, ASM=asm, **kinds["gate_up"], num_warps=cfg13.num_warps,
        num_stages=cfg13.num_stages,
    )  # fmt: skip
    num_m = al2.block_expert.numel()
    _grouped_down_mx_kernel[(num_m * triton.cdiv(H, cfg2.block_n),)](
        out13, w2, s2, planes, weights, al2.sorted_pairs, al2.block_expert, al2.num_padded, b2,
        H, inter, pairs, num_m, out13.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), T * H,
        b2.stride(0), K=k, BLOCK_M=cfg2.block_m, BLOCK_N=cfg2.block_n, BLOCK_K=cfg2.block_k, GROUP_M=cfg2.group_m,
        F32=f32, ASM=asm, **kinds["down"], num_warps=cfg2.num_warps, num_stages=cfg2.num_stages,
    )  # fmt: skip
    return planes


def fused_moe_partials(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    configs: tuple[MoEConfig, MoEConfig] | None = None,
    path: str | None = None,
    pdl: bool = True,
    scales: ExpertScales | Mxfp4Scales | None = None,
    act: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """The terms of `fused_moe_reference`'s sum, unsummed: fp32 planes [P, T, H] (dense), plane
    j*S + s holding slot j's weighted down product (split s of its depth; S = the down config's
    split_k on the decode path, else 1), so that adding the planes in order and rounding once
    gives `fused_moe` bit for bit. Two launches (decode path) or the device-side align plus two
    (grouped path), no host synchronisation. `configs` and `path` ("decode" | "grouped")
    override the table and the T*k rule (the tuning script and the tests use them). The
    decode path launches under PDL where `pdl` and the GPU allow (launch.py). FP8 (e4m3) w13 and
    w2 need their `scales`: each K step (BLOCK_K cut to lie within one scale block) multiplies
    the activations by the e4m3 values and scales the fp32 partial per output as it adds it, so
    the weights enter exactly (w * scale, not rounded to hidden's dtype): `fused_moe_reference`
    on `scales.dequantized(w13, w2, torch.float32)` up to summation order and the products' own
    rounding to the dtype. MXFP4 w13 and w2 (packed uint8 with `Mxfp4Scales`): the MXFP4 kernels
    decode the codes and scales in registers (section above), so the weights enter exactly:
    `fused_moe_reference` with the same `scales` (which dequantizes them) up to summation order.
    `act`: gpt-oss's experts (biases added before each product is rounded, the clamped SwiGLU)."""
    _check_device(hidden, "fused_moe")
    mx = isinstance(scales, Mxfp4Scales)
    _check_args(hidden, w13, w2, topk_weights, topk_ids, _packing(scales))
    if mx:
        _check_mxfp4(w13, w2, scales)
    else:
        s13, s2, scale_n, sk13, sk2 = _scale_args(w13, w2, scales)
    T, H = hidden.shape
    b13, b2, kinds = _activation_args(w13, act, H)
    if hidden.stride(1) != 1 or not w13.is_contiguous() or not w2.is_contiguous():
        raise ValueError("fused_moe needs hidden with a dense last dim and contiguous w13, w2")
    E, _, _ = w13.shape
    inter = w2.shape[2] * _packing(scales)
    k = topk_ids.shape[1]
    pairs = T * k
    if path not in (None, "decode", "grouped"):
        raise ValueError(f"fused_moe: path {path!r} is not 'decode' or 'grouped'")
    if mx:
        cfg13, cfg2 = configs or get_configs(H, inter, E, T, k, path, mxfp4=True)
        path = path or _path_of((cfg13, cfg2))
        cfg13, cfg2 = _mx_configs(cfg13, cfg2, path, hidden.dtype)
        ids, weights = topk_ids.to(torch.int32).contiguous(), topk_weights.to(torch.float32).contiguous()
        return _mxfp4_partials(hidden, w13, w2, scales, ids, weights, cfg13, cfg2, path, pdl, b13, b2, kinds)
    cfg13, cfg2 = configs or (_for_dtype(c, hidden.dtype) for c in get_configs(H, inter, E, T, k, path))
    path = path or _path_of((cfg13, cfg2))
    if scales is not None:  # every K step within one scale block
        cfg13 = replace(cfg13, block_k=_k_step(cfg13.block_k, sk13, H))
        cfg2 = replace(cfg2, block_k=_k_step(cfg2.block_k, sk2, inter))
    split = cfg2.split_k if path == "decode" else 1
    planes = torch.empty(k * split, T, H, dtype=torch.float32, device=hidden.device)
    if T == 0:
        return planes
    ids = topk_ids.to(torch.int32).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    out13 = torch.empty(pairs, inter, dtype=hidden.dtype, device=hidden.device)  # the activations
    if path == "decode":
        _decode_gate_up_kernel[(pairs, triton.cdiv(inter, cfg13.block_n))](
            hidden, w13, out13, ids, s13, b13, H, inter, hidden.stride(0), w13.stride(0), w13.stride(1),
            out13.stride(0), s13.stride(0), s13.stride(1), b13.stride(0), K=k, BLOCK_N=cfg13.block_n,
            BLOCK_K=cfg13.block_k, LOOP_STAGES=cfg13.num_stages, SCALED=scales is not None, SCALE_N=scale_n,
            SCALE_K=sk13, **kinds["gate_up"], num_warps=cfg13.num_warps, num_stages=cfg13.num_stages,
            **launch_options(hidden.device, pdl),
        )  # fmt: skip
        # Each split covers a whole number of BLOCK_K steps.
        k_split = triton.cdiv(triton.cdiv(inter, split), cfg2.block_k) * cfg2.block_k
        _decode_down_kernel[(pairs, triton.cdiv(H, cfg2.block_n), split)](
            out13, w2, planes, ids, weights, s2, b2, H, inter, k_split, split, out13.stride(0), w2.stride(0),
            w2.stride(1), T * H, s2.stride(0), s2.stride(1), b2.stride(0), K=k, BLOCK_N=cfg2.block_n,
            BLOCK_K=cfg2.block_k, ROUND=split == 1, LOOP_STAGES=cfg2.num_stages, SCALED=scales is not None,
            SCALE_N=scale_n, SCALE_K=sk2, **kinds["down"], num_warps=cfg2.num_warps, num_stages=cfg2.num_stages,
            **launch_options(hidden.device, pdl),
        )  # fmt: skip
        return planes
    f32 = hidden.dtype == torch.float32 or INTERPRET  # see _dot
    al13 = align(ids, E, cfg13.block_m)
    al2 = al13 if cfg2.block_m == cfg13.block_m else align(ids, E, cfg2.block_m)
    num_m = al13.block_expert.numel()
    _grouped_gate_up_kernel[(num_m * triton.cdiv(inter, cfg13.block_n),)](
        hidden, w13, out13, al13.sorted_pairs, al13.block_expert, al13.num_padded, s13, b13,
        H, inter, pairs, num_m, hidden.stride(0), w13.stride(0), w13.stride(1), out13.stride(0),
        s13.stride(0), s13.stride(1), b13.stride(0),
        K=k, BLOCK_M=cfg13.block_m, BLOCK_N=cfg13.block_n, BLOCK_K=cfg13.block_k, GROUP_M=cfg13.group_m, F32=f32,
        SCALED=scales is not None, SCALE_N=scale_n, SCALE_K=sk13, **kinds["gate_up"], num_warps=cfg13.num_warps,
        num_stages=cfg13.num_stages,
    )  # fmt: skip
    num_m = al2.block_expert.numel()
    _grouped_down_kernel[(num_m * triton.cdiv(H, cfg2.block_n),)](
        out13, w2, planes, weights, al2.sorted_pairs, al2.block_expert, al2.num_padded, s2, b2,
        H, inter, pairs, num_m, out13.stride(0), w2.stride(0), w2.stride(1), T * H, s2.stride(0), s2.stride(1),
        b2.stride(0), K=k, BLOCK_M=cfg2.block_m, BLOCK_N=cfg2.block_n, BLOCK_K=cfg2.block_k, GROUP_M=cfg2.group_m,
        F32=f32, SCALED=scales is not None, SCALE_N=scale_n, SCALE_K=sk2, **kinds["down"], num_warps=cfg2.num_warps,
        num_stages=cfg2.num_stages,
    )  # fmt: skip
    return planes


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    configs: tuple[MoEConfig, MoEConfig] | None = None,
    path: str | None = None,
    out: torch.Tensor | None = None,
    pdl: bool = True,
    scales: ExpertScales | Mxfp4Scales | None = None,
    act: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """As `fused_moe_reference` ([T, H] in hidden's dtype, into `out` when given: a TP rank's
    reduce slot), in Triton: `fused_moe_partials`' planes added in plane order in fp32 and
    rounded once, as the reference rounds its fp32 sum once. FP8 and MXFP4 experts: as there."""
    planes = fused_moe_partials(hidden, w13, w2, topk_weights, topk_ids, configs, path, pdl, scales, act)
    if out is None:
        out = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    elif out.shape != hidden.shape or out.stride(1) != 1:
        raise ValueError(
            f"fused_moe: out {tuple(out.shape)} must be [T, H] = {tuple(hidden.shape)} with a dense last dim"
        )
    return sum_planes(planes, out, pdl)
