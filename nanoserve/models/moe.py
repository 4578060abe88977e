"""The sparse mixture-of-experts MLP block (Qwen3-MoE, Qwen2-MoE, Mixtral).

Owns: `SparseMoE` (router, routed experts stacked in two tensors, Qwen2-MoE's gated shared
expert) and the map from a checkpoint's per-expert tensors to the stacked ones.

Layout: every expert's gate and up rows are stacked into `experts.w13` [E, 2*I, H] (gate rows
first, then up rows) and its down projection into `experts.w2` [E, H, I], so that one grouped
kernel (nanoserve/kernels/moe.py) reads any expert by index. On CUDA the router's top-k and the
experts run the fused Triton kernels (`route`, `fused_moe`; `triton_ops` off: their torch
twins, the experts as a graph-safe sum over every expert); on CPU the torch references. Checkpoint tensors arrive one
expert at a time (`shard_id` "gate:e", "up:e", "down:e") and are written into their expert's
rows as they stream in.

Tensor parallelism (rank r of N): every rank holds a slice of every expert along the
intermediate dimension, rows [r*I/N, (r+1)*I/N) of gate and up and the same columns of down,
so silu(gate)*up is computed on the rank's own slice and the down product gives this rank's
partial sums. The router is replicated (every rank routes every token the same way), so the
block's output is a partial sum exactly like a dense MLP's, summed by the RMSNorm after it
(`reduce_over`, fused where symmetric memory allows). Qwen2-MoE's shared expert is sharded the
same way; its sigmoid gate is replicated and scales the partial sums, which is linear.
Invariant: under TP, and with a shared expert, the block's output is this rank's partial sums
[T, H] in the hidden dtype (the routed and shared outputs are added before the norm sees them);
on one GPU without a shared expert, the fused kernels' unsummed fp32 terms (SplitKPartials,
`split_sum_in_norm`), which the next RMSNorm adds in the order `fused_moe` would.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.distributed import SINGLE, TPGroup
from nanoserve.kernels import moe as moe_kernels
from nanoserve.kernels.fp8 import FP8_BLOCK, FP8_DTYPE
from nanoserve.models.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    RowSlice,
    SplitKPartials,
    _shard,
    _SwitchedLayer,
    linear,
)
from nanoserve.models.model_config import ModelConfig

MLP_REDUCE_SLOT = 1  # the symmetric-memory slot a dense MLP's down projection writes (decoder.MLP)

# The fused MoE kernels launch under PDL (KernelSwitches.pdl) where that was measured faster:
# experts (this rank's slice) up to MOE_PDL_MAX_INTER wide. H200, 2026-11-27 (benchmarks/results/2026-11-27.md):
# qwen3-30b-a3b (I = 768) batch-1 TPOT 2.891 -> 2.764 ms on one machine; mixtral-8x7b
# (I = 14336) 7.033 ms with it against 6.965-6.966 without on two others, so wide experts
# launch without it. One TP=2 rank of mixtral-8x7b (I = 7168) gains from it: batch-1 TPOT
# 3.959 ms with it against 4.041 without on one host of two H200s (2026-11-27, 5386314).
MOE_PDL_MAX_INTER = 8192


class Router(nn.Module):
    """A replicated [outputs, H] projection without bias (the router, the shared expert's
    gate): every rank holds it whole, so every rank computes the same logits."""

    def __init__(self, hidden_size: int, outputs: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(outputs, hidden_size))


class StackedExperts(nn.Module):
    """The routed experts' weights, stacked: w13 [E, 2*I/N, H], w2 [E, H, I/N] (module docstring).
    FP8 (`use_fp8`): both in e4m3 with fp32 scales w13_scale / w2_scale in the layout of
    `kernels.moe.ExpertScales` (128x128 blocks, or one per output channel)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TPGroup):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.rank = tp.rank
        self.shard = _shard(intermediate_size, tp, "expert intermediate size")
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.shard, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.shard))
        self.w13.weight_loader = self._load_w13
        self.w2.weight_loader = self._load_w2
        self.scale_block: int | None = None  # FP8: 128 (block scales) or 1 (per channel)

    def use_fp8(self, block: bool) -> None:
        """Hold the experts in e4m3 with their scales (before loading)."""
        E, s, H = self.num_experts, self.shard, self.hidden_size
        if block and s % FP8_BLOCK:
            raise ValueError(f"block-wise FP8 experts need 128-row shards of the expert width; this one is {s}")
        self.w13, self.w2 = _frozen(FP8_DTYPE, E, 2 * s, H), _frozen(FP8_DTYPE, E, H, s)
        self.w13.weight_loader = self._load_w13
        self.w2.weight_loader = self._load_w2
        f32 = torch.float32
        if block:
            self.w13_scale = _frozen(f32, E, 2 * s // FP8_BLOCK, -(-H // FP8_BLOCK))
            self.w2_scale = _frozen(f32, E, -(-H // FP8_BLOCK), s // FP8_BLOCK)
        else:
            self.w13_scale, self.w2_scale = _frozen(f32, E, 2 * s, 1), _frozen(f32, E, H, 1)
        self.w13_scale.weight_loader = self._load_w13_scale
        self.w2_scale.weight_loader = self._load_w2_scale
        self.scale_block = FP8_BLOCK if block else 1

    @property
    def scales(self) -> moe_kernels.ExpertScales | None:
        """The FP8 experts' scales as the kernels take them (None: not FP8)."""
        b = self.scale_block
        if b is None:
            return None
        k13, k2 = (b, b) if b > 1 else (self.hidden_size, self.shard)
        return moe_kernels.ExpertScales(self.w13_scale, self.w2_scale, b, k13, k2)

    def expected_shards(self, leaf: str) -> list[str]:
        """The shard ids a checkpoint must deliver for parameter `leaf` (the loader checks)."""
        parts = ("gate", "up") if leaf.startswith("w13") else ("down",)
        return [f"{p}:{e}" for e in range(self.num_experts) for p in parts]

    def _expert(self, shard_id: str | None, parts: tuple[str, ...]) -> tuple[str, int]:
        part, _, expert = (shard_id or "").partition(":")
        if part not in parts or not expert.isdigit() or int(expert) >= self.num_experts:
            raise KeyError(f"no expert shard {shard_id!r} here ({self.num_experts} experts, parts {parts})")
        return part, int(expert)

    def _load_w13(self, param: nn.Parameter, full: torch.Tensor, shard_id: str | None) -> None:
        part, e = self._expert(shard_id, ("gate", "up"))
        s = self.shard
        rows = full[self.rank * s : (self.rank + 1) * s]
        dst = param.data[e, :s] if part == "gate" else param.data[e, s:]
        _copy(dst, rows, shard_id)

    def _load_w2(self, param: nn.Parameter, full: torch.Tensor, shard_id: str | None) -> None:
        _, e = self._expert(shard_id, ("down",))
        s = self.shard
        _copy(param.data[e], full[:, self.rank * s : (self.rank + 1) * s], shard_id)

    def _load_w13_scale(self, param: nn.Parameter, full: torch.Tensor, shard_id: str | None) -> None:
        """Block scales [I/128, ceil(H/128)] or per-channel ones [I] of one expert's gate or up."""
        part, e = self._expert(shard_id, ("gate", "up"))
        rows = self.shard // self.scale_block
        full = full.reshape(full.shape[0], -1)  # per channel: [I, 1]
        dst = param.data[e, :rows] if part == "gate" else param.data[e, rows:]
        _copy(dst, full[self.rank * rows : (self.rank + 1) * rows], f"{shard_id} scales")

    def _load_w2_scale(self, param: nn.Parameter, full: torch.Tensor, shard_id: str | None) -> None:
        """Block scales [ceil(H/128), I/128] (this rank's columns) or per-channel ones [H] (all)."""
        _, e = self._expert(shard_id, ("down",))
        if self.scale_block == 1:
            _copy(param.data[e], full.reshape(-1, 1), f"{shard_id} scales")
            return
        cols = self.shard // self.scale_block
        _copy(param.data[e], full[:, self.rank * cols : (self.rank + 1) * cols], f"{shard_id} scales")


def _frozen(dtype: torch.dtype, *shape: int) -> nn.Parameter:
    """An uninitialised parameter that is never trained (FP8 weights and their scales)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str | None) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"expert tensor {what}: checkpoint slice {tuple(src.shape)}, model {tuple(dst.shape)}")
    dst.copy_(src)


class SharedExpert(_SwitchedLayer):
    """Qwen2-MoE's shared expert: a dense SiLU MLP sharded as decoder.MLP, whose down product
    returns plain partial sums (added to the routed experts' before the norm sums them)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup):
        super().__init__()
        parts = [RowSlice.split(name, intermediate_size, tp) for name in ("gate", "up")]
        self.gate_up_proj = ColumnParallelLinear(hidden_size, parts, bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.gate_up_proj.silu_and_mul(x), self.down_proj.weight, switches=self.switches)


class SparseMoE(_SwitchedLayer):
    """Router top-k over E experts, the chosen experts' SiLU MLPs weighted and summed, plus
    (Qwen2-MoE) sigmoid(shared_expert_gate x) * shared_expert(x). Returns this rank's
    partial sums [T, H] (module docstring)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE):
        super().__init__()
        moe = cfg.moe
        self.tp = tp
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.gate = Router(cfg.hidden_size, moe.num_experts)
        self.experts = StackedExperts(moe.num_experts, cfg.hidden_size, moe.intermediate_size, tp)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(cfg.hidden_size, moe.shared_expert_intermediate_size, tp)
            self.shared_expert_gate = Router(cfg.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitKPartials:
        switches = self.switches
        logits = linear(x, self.gate.weight, switches=switches)
        w13, w2 = self.experts.w13, self.experts.w2
        scales = self.experts.scales
        if x.is_cuda and switches.triton_ops:  # the fused Triton kernels: no host sync, graph-safe
            pdl = switches.pdl and self.experts.shard <= MOE_PDL_MAX_INTER
            weights, ids = moe_kernels.route(logits, self.top_k, self.renormalize, pdl=pdl)
            if self.shared_expert is None:
                if self.tp.size == 1 and switches.split_sum_in_norm:  # the next norm adds the terms
                    planes = moe_kernels.fused_moe_partials(x, w13, w2, weights, ids, pdl=pdl, scales=scales)
                    return SplitKPartials(planes)
                out = self._reduce_slot(x)
                return moe_kernels.fused_moe(x, w13, w2, weights, ids, out=out, pdl=pdl, scales=scales)
            out = moe_kernels.fused_moe(x, w13, w2, weights, ids, pdl=pdl, scales=scales)
        else:  # slow twins: the loop over chosen experts on CPU, the graph-safe every-expert sum on CUDA
            if scales is not None:  # FP8 experts (CUDA only): the twins run on the dequantized weights
                w13, w2 = scales.dequantized(w13, w2, x.dtype)
            weights, ids = moe_kernels.route_reference(logits, self.top_k, self.renormalize)
            twin = moe_kernels.fused_moe_every_expert if x.is_cuda else moe_kernels.fused_moe_reference
            out = twin(x, w13, w2, weights, ids)
        if self.shared_expert is not None:
            gate = torch.sigmoid(linear(x, self.shared_expert_gate.weight, switches=switches))
            out = out + gate * self.shared_expert(x)
        slot = self._reduce_slot(out)
        return out if slot is None else slot.copy_(out)

    def _reduce_slot(self, like: torch.Tensor) -> torch.Tensor | None:
        """Under TP on CUDA, where the partial sums must land for the next norm's fused
        all-reduce to read them (None: anywhere)."""
        return self.tp.partial_out(like.shape[0], like.shape[1], like.dtype, MLP_REDUCE_SLOT)


# An expert's checkpoint tensors -> the suffix of the stacked parameter they fill (an FP8 weight's
# scales, as nanoserve.models.quantization delivers them: block scales or per-channel ones).
_EXPERT_TENSORS = {"weight": "", "weight_scale_inv": "_scale", "weight_scale": "_scale"}


def checkpoint_target(name: str) -> tuple[str, str | None] | None:
    """(our parameter name, shard id) for a MoE checkpoint tensor name (without "model."),
    or None when `name` is not a MoE block's tensor. Qwen: mlp.gate, mlp.experts.{e}.
    gate_proj/up_proj/down_proj, mlp.shared_expert.*, mlp.shared_expert_gate; Mixtral:
    block_sparse_moe.gate and block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) / w2 (down)."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    head, sep, rest = name.partition(".mlp.experts.")
    if sep:
        expert, _, proj = rest.partition(".")
        part = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
        kind, _, tensor = proj.partition(".")
        if not expert.isdigit() or kind not in part or tensor not in _EXPERT_TENSORS:
            raise KeyError(f"unknown expert tensor {name!r}")
        leaf = ("w2" if part[kind] == "down" else "w13") + _EXPERT_TENSORS[tensor]
        return f"{head}.mlp.experts.{leaf}", f"{part[kind]}:{expert}"
    for src, shard in (("mlp.shared_expert.gate_proj", "gate"), ("mlp.shared_expert.up_proj", "up")):
        if src in name:
            return name.replace(src, "mlp.shared_expert.gate_up_proj"), shard
    if ".mlp.gate." in name or ".mlp.shared_expert" in name:
        return name, None
    return None


def hf_moe_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors (Hugging Face names, per expert) of a sparse layer's block."""
    moe, h = cfg.moe, cfg.hidden_size
    i, e = moe.intermediate_size, moe.num_experts
    if cfg.model_type == "mixtral":  # Mixtral's names
        p = prefix + "block_sparse_moe."
        shapes = {p + "gate.weight": (e, h)}
        for x in range(e):
            shapes |= {
                f"{p}experts.{x}.w1.weight": (i, h),
                f"{p}experts.{x}.w3.weight": (i, h),
                f"{p}experts.{x}.w2.weight": (h, i),
            }
        return shapes
    p = prefix + "mlp."
    shapes = {p + "gate.weight": (e, h)}
    for x in range(e):
        shapes |= {
            f"{p}experts.{x}.gate_proj.weight": (i, h),
            f"{p}experts.{x}.up_proj.weight": (i, h),
            f"{p}experts.{x}.down_proj.weight": (h, i),
        }
    s = moe.shared_expert_intermediate_size
    if s:
        shapes |= {
            p + "shared_expert.gate_proj.weight": (s, h),
            p + "shared_expert.up_proj.weight": (s, h),
            p + "shared_expert.down_proj.weight": (h, s),
            p + "shared_expert_gate.weight": (1, h),
        }
    return shapes
