"""gpt-oss's mixture-of-experts block and its checkpoint names.

Owns: `GptOssMoE` (a router with a bias; experts with biases whose activation is the clamped
SwiGLU) and `checkpoint_target` for its tensors. The rest of gpt-oss is the shared decoder
(nanoserve/models/decoder.py): biased q/k/v/o projections, attention sinks, sliding-window
layers alternating with full ones (model_config.py), YaRN rope (layers.py). MXFP4 expert
weights are dequantized at load (nanoserve/models/mxfp4.py) into the same tensors a bf16
checkpoint holds.

Routing (as Hugging Face's GptOssTopKRouter): logits = x Wr^T + br, the k largest, a softmax
over those k (in fp32 here). Expert e: g, u = split(x W13_e^T + b13_e); y = (clamp(u, -L, L)
+ 1) * g' * sigmoid(alpha g') with g' = min(g, L); out_e = y W2_e^T + b2_e; the block returns
sum_k weight_k out_{e_k}.

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
KernelSwitches.fused_gpt_oss is on (the default; 13x faster at batch 1 on gpt-oss-20b), else the
graph-safe sum over every expert (each weighted by the token's routing weight, zero if not
chosen), which reads all of them. MXFP4 experts are dequantized at load: an MXFP4 kernel is the
missing fast path.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.distributed import SINGLE, TPGroup
from nanoserve.kernels import moe as moe_kernels
from nanoserve.models.layers import _shard, _SwitchedLayer, linear
from nanoserve.models.model_config import ModelConfig
from nanoserve.models.moe import MLP_REDUCE_SLOT

_EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


class GptOssExperts(nn.Module):
    """w13 [E, 2*I/N, H], b13 [E, 2*I/N], w2 [E, H, I/N], b2 [E, H] (module docstring)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TPGroup):
        super().__init__()
        self.rank = tp.rank
        self.shard = s = _shard(intermediate_size, tp, "expert intermediate size")
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * s, hidden_size))
        self.b13 = nn.Parameter(torch.empty(num_experts, 2 * s))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, s))
        self.b2 = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.w13.weight_loader = lambda p, full, _: self._load_gate_up(p, full.transpose(1, 2))
        self.b13.weight_loader = lambda p, full, _: self._load_gate_up(p, full)
        self.w2.weight_loader = self._load_down
        self.b2.weight_loader = lambda p, full, _: _copy(p.data, full, "down_proj_bias")

    def _load_gate_up(self, param: nn.Parameter, rows: torch.Tensor) -> None:
        """rows [E, 2I, ...]: gate at even rows, up at odd rows; keeps this rank's slice of each."""
        s, r = self.shard, self.rank
        _copy(param.data[:, :s], rows[:, 0::2][:, r * s : (r + 1) * s], "gate_up_proj")
        _copy(param.data[:, s:], rows[:, 1::2][:, r * s : (r + 1) * s], "gate_up_proj")

    def _load_down(self, param: nn.Parameter, full: torch.Tensor, shard_id: str | None) -> None:
        s, r = self.shard, self.rank
        _copy(param.data, full.transpose(1, 2)[:, :, r * s : (r + 1) * s], "down_proj")


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

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights fp32 [T, k], expert ids [T, k]), largest logit first."""
        logits = linear(x, self.router.weight, self.router.bias, switches=self.switches)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top.float(), dim=-1), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        ex = self.experts
        act = moe_kernels.ClampedSwiGLU(ex.b13, ex.b2 if self.tp.rank == 0 else None, self.alpha, self.limit)
        slot = self.tp.partial_out(x.shape[0], x.shape[1], x.dtype, MLP_REDUCE_SLOT)
        switches = self.switches
        if x.is_cuda and switches.triton_ops and switches.fused_gpt_oss:  # reads only the chosen experts
            return moe_kernels.fused_moe(x, ex.w13, ex.w2, weights, ids, out=slot, pdl=switches.pdl, act=act)
        # graph-safe on CUDA: every expert on every token; on CPU the experts tokens chose, in
        # expert order (as Hugging Face sums them)
        twin = moe_kernels.fused_moe_every_expert if x.is_cuda else moe_kernels.fused_moe_reference
        out = twin(x, ex.w13, ex.w2, weights, ids, act)
        return out if slot is None else slot.copy_(out)


def checkpoint_target(name: str) -> tuple[str, str | None] | None:
    """(our parameter name, shard id) for a gpt-oss MoE tensor name (without "model."), or
    None when `name` is not one: mlp.router.{weight,bias}, mlp.experts.{gate_up_proj,
    gate_up_proj_bias, down_proj, down_proj_bias} (MXFP4 blocks and scales are dequantized
    into those before they get here)."""
    head, sep, rest = name.partition(".mlp.experts.")
    if sep:
        if rest not in _EXPERT_TENSORS:
            raise KeyError(f"unknown gpt-oss expert tensor {name!r}")
        leaf = {"gate_up_proj": "w13", "gate_up_proj_bias": "b13", "down_proj": "w2", "down_proj_bias": "b2"}[rest]
        return f"{head}.mlp.experts.{leaf}", None
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
