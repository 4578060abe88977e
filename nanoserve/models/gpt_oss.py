"""gpt-oss's mixture-of-experts block and its checkpoint names.

Owns: `GptOssMoE` (a router with a bias; experts with biases whose activation is the clamped
SwiGLU) and `checkpoint_target` for its tensors. The rest of gpt-oss is the shared decoder
(nanoserve/models/decoder.py): biased q/k/v/o projections, attention sinks, sliding-window
layers alternating with full ones (model_config.py), YaRN rope (layers.py). MXFP4 expert
weights (nanoserve/models/mxfp4.py) stay packed with NANOSERVE_MXFP4_EXPERTS=1
(`GptOssExperts.use_mxfp4`, KernelSwitches.mxfp4_experts, off by default: switches.py says
why): w13 and w2 hold the codes in the kernels' layout, w13_scale and w2_scale the e8m0
scales, 17/32 byte a weight; with the switch off (the default) they are dequantized at load
into the same tensors a bf16 checkpoint holds.

Routing (as Hugging Face's GptOssTopKRouter): logits = x Wr^T + br, the k largest, a softmax
over those k (in fp32 here; on the fused path moe.py's route kernel, the same function).
Expert e: g, u = split(x W13_e^T + b13_e); y = (clamp(u, -L, L) + 1) * g' * sigmoid(alpha g')
with g' = min(g, L); out_e = y W2_e^T + b2_e; the block returns sum_k weight_k out_{e_k}.

Layout: Hugging Face stores gate_up_proj [E, H, 2I] with gate and up columns interleaved
(gate at even, up at odd indices) and down_proj [E, I, H]. Here, as in moe.py, w13 is
[E, 2*I/N, H] with the gate rows first, then the up rows (de-interleaved at load), and w2
[E, H, I/N]; b13 [E, 2*I/N] follows w13's rows, b2 [E, H] is whole.

Tensor parallelism (rank r of N): every expert's intermediate slice [r*I/N, (r+1)*I/N) of gate
and up (rows of w13 and b13) and the same columns of w2; the router is replicated. The block
returns this rank's partial sums; b2 is added by rank 0 only, so the sum holds it once.

The experts run as the SiLU experts of moe.py do, with the biases and the clamped SwiGLU
(`kernels.moe.ClampedSwiGLU`): on CPU `fused_moe_reference` (a loop over the experts tokens
chose), on CUDA the fused MoE kernels, which read only the chosen experts, where
KernelSwitches.fused_gpt_oss is on (the default; 13x faster at batch 1 on gpt-oss-20b), else
the graph-safe sum over every expert (each weighted by the token's routing weight, zero if not
chosen), which reads all of them. Packed MXFP4 experts take the same paths with their scales:
the kernels decode the codes in registers (kernels/moe.py), the twins dequantize one expert at a
time. Tensor parallelism slices whole 32-element groups (an expert shard not in whole groups is
dequantized at load instead: loader.py says so in the log).
"""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.distributed import SINGLE, TPGroup
from nanoserve.kernels import moe as moe_kernels
from nanoserve.models.layers import SplitKPartials, _shard, _SwitchedLayer, linear
from nanoserve.models.model_config import ModelConfig
from nanoserve.models.moe import MLP_REDUCE_SLOT

# Checkpoint tensor -> our parameter: unquantized (or dequantized at load), then MXFP4's halves.
_EXPERT_TENSORS = {
    "gate_up_proj": "w13",
    "gate_up_proj_bias": "b13",
    "down_proj": "w2",
    "down_proj_bias": "b2",
    "gate_up_proj_blocks": "w13",
    "gate_up_proj_scales": "w13_scale",
    "down_proj_blocks": "w2",
    "down_proj_scales": "w2_scale",
}


class GptOssExperts(nn.Module):
    """w13 [E, 2*I/N, H], b13 [E, 2*I/N], w2 [E, H, I/N], b2 [E, H] (module docstring); with
    `use_mxfp4`, w13 and w2 packed MXFP4 with their scales w13_scale, w2_scale."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TPGroup):
        super().__init__()
        self.rank = tp.rank
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.shard = s = _shard(intermediate_size, tp, "expert intermediate size")
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * s, hidden_size))
        self.b13 = nn.Parameter(torch.empty(num_experts, 2 * s))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, s))
        self.b2 = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.w13.weight_loader = lambda p, full, _: self._load_gate_up(p, full.transpose(1, 2))
        self.b13.weight_loader = lambda p, full, _: self._load_gate_up(p, full)
        self.w2.weight_loader = self._load_down
        self.b2.weight_loader = lambda p, full, _: _copy(p.data, full, "down_proj_bias")
        self.mxfp4 = False

    @staticmethod
    def mxfp4_fits(hidden_size: int, shard: int) -> bool:
        """Whether the experts can stay MXFP4: H and this rank's expert width in whole 32-groups
        (a group cut by the tensor-parallel slice would need its scale twice)."""
        return hidden_size % moe_kernels.MXFP4_GROUP == 0 and shard % moe_kernels.MXFP4_GROUP == 0

    def use_mxfp4(self) -> None:
        """Hold w13 and w2 as MXFP4 (before loading, best on the meta device: the full-precision
        tensors are then never allocated): packed codes w13 [E, 2*I/N, H/2], w2 [E, H, I/N/2]
        uint8 in `kernels.moe.pack_mxfp4`'s layout and e8m0 scales w13_scale [E, 2*I/N, H/32],
        w2_scale [E, H, I/N/32] uint8, filled from the checkpoint's `*_blocks` / `*_scales`."""
        E, s, H = self.num_experts, self.shard, self.hidden_size
        if not self.mxfp4_fits(H, s):
            raise ValueError(f"MXFP4 experts need H ({H}) and the expert shard ({s}) in whole 32-element groups")
        g = moe_kernels.MXFP4_GROUP
        self.w13, self.w2 = _frozen(E, 2 * s, H // 2), _frozen(E, H, s // 2)
        self.w13_scale, self.w2_scale = _frozen(E, 2 * s, H // g), _frozen(E, H, s // g)
        self.w13.weight_loader = lambda p, full, _: self._load_gate_up(p, moe_kernels.pack_mxfp4(full))
        self.w13_scale.weight_loader = lambda p, full, _: self._load_gate_up(p, full)
        self.w2.weight_loader = self._load_down_blocks
        self.w2_scale.weight_loader = self._load_down_scales
        self.mxfp4 = True

    @property
    def scales(self) -> moe_kernels.Mxfp4Scales | None:
        """The MXFP4 experts' scales as the kernels take them (None: not MXFP4)."""
        return moe_kernels.Mxfp4Scales(self.w13_scale, self.w2_scale) if self.mxfp4 else None

    def _load_gate_up(self, param: nn.Parameter, rows: torch.Tensor) -> None:
        """rows [E, 2I, ...]: gate at even rows, up at odd rows; keeps this rank's slice of each."""
        s, r = self.shard, self.rank
        _copy(param.data[:, :s], rows[:, 0::2][:, r * s : (r + 1) * s], "gate_up_proj")
        _copy(param.data[:, s:], rows[:, 1::2][:, r * s : (r + 1) * s], "gate_up_proj")

    def _load_down(self, param: nn.Parameter, full: torch.Tensor, shard_id: str | None) -> None:
        s, r = self.shard, self.rank
        _copy(param.data, full.transpose(1, 2)[:, :, r * s : (r + 1) * s], "down_proj")

    def _load_down_blocks(self, param: nn.Parameter, full: torch.Tensor, shard_id: str | None) -> None:
        """blocks [E, H, I/32, 16]: this rank's groups of every row, packed."""
        g = self.shard // moe_kernels.MXFP4_GROUP
        _copy(param.data, moe_kernels.pack_mxfp4(full[:, :, self.rank * g : (self.rank + 1) * g]), "down_proj_blocks")

    def _load_down_scales(self, param: nn.Parameter, full: torch.Tensor, shard_id: str | None) -> None:
        g = self.shard // moe_kernels.MXFP4_GROUP
        _copy(param.data, full[:, :, self.rank * g : (self.rank + 1) * g], "down_proj_scales")


def _frozen(*shape: int) -> nn.Parameter:
    """An uninitialised uint8 parameter (MXFP4 codes or scales: never trained)."""
    return nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"expert tensor {what}: checkpoint slice {tuple(src.shape)}, model {tuple(dst.shape)}")
    dst.copy_(src)


class GptOssRouter(nn.Module):
    """The replicated router: weight [E, H] and bias [E]."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts))


class GptOssMoE(_SwitchedLayer):
    """The sparse block of every gpt-oss layer; returns this rank's partial sums [T, H]."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE):
        super().__init__()
        moe = cfg.moe
        self.tp = tp
        self.top_k = moe.top_k
        self.alpha, self.limit = moe.clamped_swiglu
        self.router = GptOssRouter(cfg.hidden_size, moe.num_experts)
        self.experts = GptOssExperts(moe.num_experts, cfg.hidden_size, moe.intermediate_size, tp)

    def route(self, x: torch.Tensor, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights fp32 [T, k], expert ids [T, k]), largest logit first. `fused`: by moe.py's
        route kernel, whose softmax over all E logits, its k largest divided by their sum, is
        the softmax over the k largest (the other terms cancel); one launch where torch.topk,
        its sort and the softmax took five (12 us a layer at batch 1 on an H200, 2026-12-03)."""
        logits = linear(x, self.router.weight, self.router.bias, switches=self.switches)
        if fused:
            return moe_kernels.route(logits, self.top_k, True, pdl=self.switches.pdl)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top.float(), dim=-1), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitKPartials:
        """This rank's partial sums [T, H]; on one GPU through the fused kernels, their unsummed
        fp32 terms, which the next RMSNorm adds (`split_sum_in_norm`: one launch fewer a layer,
        the same bits)."""
        switches = self.switches
        fused = x.is_cuda and switches.triton_ops and switches.fused_gpt_oss  # reads only the chosen experts
        weights, ids = self.route(x, fused)
        ex = self.experts
        act = moe_kernels.ClampedSwiGLU(ex.b13, ex.b2 if self.tp.rank == 0 else None, self.alpha, self.limit)
        slot = self.tp.partial_out(x.shape[0], x.shape[1], x.dtype, MLP_REDUCE_SLOT)
        scales = ex.scales  # MXFP4: decoded in the kernels' registers, or per expert by the twins
        if fused and self.tp.size == 1 and switches.split_sum_in_norm:
            planes = moe_kernels.fused_moe_partials(
                x, ex.w13, ex.w2, weights, ids, pdl=switches.pdl, scales=scales, act=act
            )
            return SplitKPartials(planes)
        if fused:
            return moe_kernels.fused_moe(
                x, ex.w13, ex.w2, weights, ids, out=slot, pdl=switches.pdl, scales=scales, act=act
            )
        # graph-safe on CUDA: every expert on every token; on CPU the experts tokens chose, in
        # expert order (as Hugging Face sums them)
        twin = moe_kernels.fused_moe_every_expert if x.is_cuda else moe_kernels.fused_moe_reference
        out = twin(x, ex.w13, ex.w2, weights, ids, act, scales)
        return out if slot is None else slot.copy_(out)


def checkpoint_target(name: str) -> tuple[str, str | None] | None:
    """(our parameter name, shard id) for a gpt-oss MoE tensor name (without "model."), or
    None when `name` is not one: mlp.router.{weight,bias}, mlp.experts.{gate_up_proj,
    gate_up_proj_bias, down_proj, down_proj_bias}, and MXFP4's {gate_up_proj,down_proj}_{blocks,
    scales} where the experts stay packed (else those are dequantized before they get here)."""
    head, sep, rest = name.partition(".mlp.experts.")
    if sep:
        if rest not in _EXPERT_TENSORS:
            raise KeyError(f"unknown gpt-oss expert tensor {name!r}")
        return f"{head}.mlp.experts.{_EXPERT_TENSORS[rest]}", None
    if ".mlp.router." in name:
        return name, None
    return None


def hf_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """The unquantized checkpoint tensors (Hugging Face names and layout) of one layer's block."""
    e, h, i = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size
    p = prefix + "mlp."
    return {
        p + "router.weight": (e, h),
        p + "router.bias": (e,),
        p + "experts.gate_up_proj": (e, h, 2 * i),
        p + "experts.gate_up_proj_bias": (e, 2 * i),
        p + "experts.down_proj": (e, i, h),
        p + "experts.down_proj_bias": (e, h),
    }
