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


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, e: int, act: ClampedSwiGLU | None) -> torch.Tensor:
    """Expert e's MLP on rows x, in x's dtype (as Hugging Face's run): silu(gate) * up, or
    gpt-oss's biased products and clamped SwiGLU."""
    inter = w2.shape[2]
    if act is None:
        gate, up = F.linear(x, w13[e]).split(inter, dim=-1)
        return F.linear(F.silu(gate) * up, w2[e])
    gate, up = F.linear(x, w13[e], act.b13[e]).split(inter, dim=-1)
    return F.linear(clamped_swiglu(gate, up, act.alpha, act.limit), w2[e], None if act.b2 is None else act.b2[e])


def fused_moe_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """sum_k w_k * down_e(silu(gate_e x) * up_e x) for hidden [T, H] (with `act`, gpt-oss's
    experts: `expert_mlp`): a loop over the experts that tokens chose. The expert MLPs run in
    hidden's dtype (as Hugging Face's do); the weighted sum accumulates in fp32 and is rounded
    once to hidden's dtype. Reads the routing on the host (torch.unique), so it is the CPU
    path, never a graph-captured one."""
    _check_args(hidden, w13, w2, topk_weights, topk_ids)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        y = expert_mlp(hidden[token], w13, w2, e, act).float() * topk_weights[token, slot, None].float()
        out.index_add_(0, token, y)
    return out.to(hidden.dtype)


def fused_moe_every_expert(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """The sum of `fused_moe_reference` without reading the routing on the host: every expert
    runs on every token and is weighted by the token's routing weight for it (zero if not
    chosen), summed in fp32 and rounded once. No host synchronisation, so CUDA graphs capture
    it: the CUDA slow twin of `fused_moe` (`triton_ops` off), at E/k times the routed FLOPs."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    ids = topk_ids.long()
    for e in range(w13.shape[0]):
        weight = (topk_weights.float() * (ids == e)).sum(dim=-1, keepdim=True)
        out += expert_mlp(hidden, w13, w2, e, act).float() * weight
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


def _check_args(hidden, w13, w2, topk_weights, topk_ids) -> None:
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError("fused_moe needs hidden [T, H], w13 [E, 2*I, H], w2 [E, H, I]")
    T, H = hidden.shape
    E, two_i, h13 = w13.shape
    if h13 != H or two_i % 2 or w2.shape != (E, H, two_i // 2):
        raise ValueError(
            f"fused_moe: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} do not fit "
            "(w13 [E, 2*I, H], w2 [E, H, I])"
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

DECODE_MAX_PAIRS = 64  # untuned buckets: T*k at most this takes the decode path


def _bucket(T: int) -> int:
    return triton.next_power_of_2(max(T, 1))


def _fallback_config(T: int, k: int, E: int, N: int, decode: bool) -> MoEConfig:
    """Block sizes for an untuned GEMM with N output columns. Under the interpreter: the
    smallest tiles tl.dot takes. Decode: 128 deep per program (16-byte loads on 4 warps) and
    the widest BLOCK_N that still gives ~512 programs, so a batch of one keeps every SM
    streaming weights. Grouped: BLOCK_M near the mean rows per expert (T*k/E), so sparse
    batches pad little."""
    if INTERPRET:
        return MoEConfig(16, 16, 16, 1, 1) if not decode else MoEConfig(1, 16, 32, 1, 1)
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


def _path_of(configs: tuple[MoEConfig, MoEConfig]) -> str:
    return "decode" if configs[0].block_m == 1 else "grouped"


def get_configs(H: int, inter: int, E: int, T: int, k: int, path: str | None = None) -> tuple[MoEConfig, MoEConfig]:
    """The (gate_up, down) launch parameters of a shape at T tokens on `path` (None: the path
    the table's entry for T's bucket measured fastest, else the T*k rule): the entry of the
    nearest measured bucket on that path, else the fallback. Decode configs have block_m 1."""
    bucket = _bucket(T)
    measured = {b: cfgs for (h, i, e, b), cfgs in TUNED.items() if (h, i, e) == (H, inter, E)}
    if path is None:
        exact = measured.get(bucket)
        path = _path_of(exact) if exact else ("decode" if T * k <= DECODE_MAX_PAIRS else "grouped")
    on_path = [b for b, cfgs in measured.items() if _path_of(cfgs) == path]
    if on_path:
        nearest = min(on_path, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))
        return measured[nearest]
    decode = path == "decode"
    return _fallback_config(T, k, E, inter, decode), _fallback_config(T, k, E, H, decode)


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


ALIGN_KERNEL_MAX_PAIRS = 4096  # pairs one program of `_align_kernel` sorts; more: align_reference


@triton.jit
def _align_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, scratch_ptr, pairs, capacity,
    E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """One program: `align_reference`'s result for up to BLOCK_P pairs. The pairs are sorted
    by (expert, index) (stable, as argsort), the i-th in that order goes to row
    padded_start[e] + (i - count_start[e]) of its expert e; scratch [2 * BLOCK_E] hands the
    per-expert shifts and group ends from the expert lanes to the pair lanes."""
    offs = tl.arange(0, BLOCK_P)
    e = tl.load(ids_ptr + offs, mask=offs < pairs, other=E)  # padding lanes sort after every expert
    experts = tl.arange(0, BLOCK_E)
    counts = tl.where(experts < E, tl.histogram(e, BLOCK_E), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    shift = (padded_end - padded) - (tl.cumsum(counts, 0) - counts)  # padded start - count start
    tl.store(scratch_ptr + experts, shift)
    tl.store(scratch_ptr + BLOCK_E + experts, padded_end)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    for c0 in range(0, capacity, BLOCK_C):  # every row padding until a pair lands on it
        rows = c0 + tl.arange(0, BLOCK_C)
        tl.store(sorted_ptr + rows, pairs + tl.zeros([BLOCK_C], tl.int32), mask=rows < capacity)
    tl.debug_barrier()  # the stores above are seen by every thread of the program below
    key = tl.sort(e * BLOCK_P + offs)
    sorted_e = key // BLOCK_P
    real = sorted_e < E
    dest = offs + tl.load(scratch_ptr + sorted_e, mask=real, other=0)
    tl.store(sorted_ptr + dest, key % BLOCK_P, mask=real)
    ends = tl.load(scratch_ptr + BLOCK_E + experts)
    for b0 in range(0, capacity // BLOCK_M, BLOCK_B):  # a block's expert: the groups ending at or before it
        blocks = b0 + tl.arange(0, BLOCK_B)
        done = (ends[None, :] <= (blocks * BLOCK_M)[:, None]) & (experts[None, :] < E)
        tl.store(block_expert_ptr + blocks, tl.sum(done.to(tl.int32), axis=1), mask=blocks < capacity // BLOCK_M)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort the T*k (token, slot) pairs by expert on the device, without host synchronisation:
    one launch of `_align_kernel` up to ALIGN_KERNEL_MAX_PAIRS pairs (every decode batch of a
    CUDA graph), `align_reference` beyond (and for CPU tensors outside the interpreter)."""
    T, k = topk_ids.shape
    pairs = T * k
    if pairs > ALIGN_KERNEL_MAX_PAIRS or not pairs or not (topk_ids.is_cuda or INTERPRET):
        return align_reference(topk_ids, num_experts, block_m)
    device = topk_ids.device
    capacity = align_capacity(T, k, num_experts, block_m)
    sorted_pairs = torch.empty(capacity, dtype=torch.int32, device=device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts + 1)  # lane E holds the padding lanes' count
    scratch = torch.empty(2 * block_e, dtype=torch.int32, device=device)
    block_p = triton.next_power_of_2(pairs)
    _align_kernel[(1,)](
        topk_ids.to(torch.int32).contiguous(), sorted_pairs, block_expert, num_padded, scratch, pairs, capacity,
        E=num_experts, BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_E=block_e, BLOCK_C=1024,
        BLOCK_B=max(16, 4096 // block_e), num_warps=4 if block_p <= 1024 else 8,
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
    if ACT == 1:  # gpt-oss: the products' biases
        gate += tl.load(b_ptr + e * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b_ptr + e * stride_be + I + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = _activation(gate, up, out_ptr.dtype.element_ty, ACT, ALPHA, LIMIT)
    o_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(o_ptrs, y, mask=valid[:, None] & col_ok[None, :])


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
    dtype = a_ptr.dtype.element_ty
    if HAS_BIAS:  # gpt-oss: added before the product is rounded, as cuBLAS's epilogue adds it
        acc += tl.load(b_ptr + e * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    weight = tl.load(topk_w_ptr + pair64, mask=valid, other=0.0)
    y = acc.to(dtype).to(tl.float32) * weight[:, None]  # the down product in the dtype, as the reference
    row = (pair64 % K) * stride_plane + (pair64 // K) * H
    tl.store(planes_ptr + row[:, None] + cols[None, :], y, mask=valid[:, None] & col_ok[None, :])


# ----------------------------------------------------------------------------------------------
# decode path


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
    if ACT == 1:  # gpt-oss: the products' biases
        gate += tl.load(b_ptr + e * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)
        up += tl.load(b_ptr + e * stride_be + I + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = _activation(gate, up, out_ptr.dtype.element_ty, ACT, ALPHA, LIMIT)
    tl.store(out_ptr + p * stride_o + cols, y, mask=col_ok)


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
    if HAS_BIAS:  # gpt-oss: once, in the first split, before the rounding (cuBLAS's epilogue)
        bias = tl.load(b_ptr + e * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc += tl.where(split == 0, bias, 0.0)
    if ROUND:
        acc = acc.to(a_ptr.dtype.element_ty).to(tl.float32)
    y = acc * tl.load(topk_w_ptr + p)
    plane = (p % K) * split_k + split
    tl.store(planes_ptr + plane * stride_plane + (p // K) * H + cols, y, mask=col_ok)


# ----------------------------------------------------------------------------------------------
# fused_moe


def _activation_args(w13: torch.Tensor, act: ClampedSwiGLU | None) -> tuple:
    """(b13, b2, the kernels' activation constexprs) for the launches; without biases, w13
    stands in for the unread bias pointers."""
    if act is None:
        return w13, w13, {"gate_up": {"ACT": 0, "ALPHA": 0.0, "LIMIT": 0.0}, "down": {"HAS_BIAS": False}}
    E, two_i, H = w13.shape
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


def fused_moe_partials(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    configs: tuple[MoEConfig, MoEConfig] | None = None,
    path: str | None = None,
    pdl: bool = True,
    scales: ExpertScales | None = None,
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
    rounding to the dtype. `act`: gpt-oss's experts (biases added before each product is rounded,
    the clamped SwiGLU)."""
    _check_device(hidden, "fused_moe")
    _check_args(hidden, w13, w2, topk_weights, topk_ids)
    s13, s2, scale_n, sk13, sk2 = _scale_args(w13, w2, scales)
    b13, b2, kinds = _activation_args(w13, act)
    if hidden.stride(1) != 1 or not w13.is_contiguous() or not w2.is_contiguous():
        raise ValueError("fused_moe needs hidden with a dense last dim and contiguous w13, w2")
    T, H = hidden.shape
    E, _, _ = w13.shape
    inter = w2.shape[2]
    k = topk_ids.shape[1]
    pairs = T * k
    if path not in (None, "decode", "grouped"):
        raise ValueError(f"fused_moe: path {path!r} is not 'decode' or 'grouped'")
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
    scales: ExpertScales | None = None,
    act: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """As `fused_moe_reference` ([T, H] in hidden's dtype, into `out` when given: a TP rank's
    reduce slot), in Triton: `fused_moe_partials`' planes added in plane order in fp32 and
    rounded once, as the reference rounds its fp32 sum once. FP8 experts: as there."""
    planes = fused_moe_partials(hidden, w13, w2, topk_weights, topk_ids, configs, path, pdl, scales, act)
    if out is None:
        out = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    elif out.shape != hidden.shape or out.stride(1) != 1:
        raise ValueError(
            f"fused_moe: out {tuple(out.shape)} must be [T, H] = {tuple(hidden.shape)} with a dense last dim"
        )
    return sum_planes(planes, out, pdl)
