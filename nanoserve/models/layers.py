"""Building blocks of the decoder, written so that tensor parallelism can shard them.

Owns: RMSNorm, rotary embedding (default, linear, llama3 and YaRN scaling), column- and
row-parallel linears, the vocab-parallel embedding and LM head, and the choice between the
torch references and the Triton kernels of nanoserve/kernels on CUDA. Which fast paths run
is set by the `KernelSwitches` each layer holds (`switches`, the defaults unless
`DecoderLM` hands its own to every layer with `apply_switches`).

Sharding invariants (rank r of a group of size N):
- a column-parallel linear holds rows [r*out/N, (r+1)*out/N) of every merged part
  (q/k/v or gate/up), so each rank computes its own heads / intermediate slice;
- a row-parallel linear holds the matching input columns and returns its partial sums
  (rank 0's plus the bias, so the sum holds it once); the RMSNorm that follows sums them
  over the ranks (`reduce_over`), fused with its residual add where symmetric memory
  allows (nanoserve/distributed/symm_all_reduce.py); on one GPU a product that runs
  split-K may return its unsummed fp32 partials (`SplitKPartials`), which the same norm
  sums: a row-parallel linear's output goes to the RMSNorm after it and nowhere else;
- the embedding holds vocabulary rows [r*V/N, (r+1)*V/N); lookups outside the slice give
  zeros, so its output is partial sums too, summed by the first layer's input norm
  (`RMSNorm.start_stream`, fused where symmetric memory allows); the LM head gathers the
  logit slices.
Each parameter carries a `weight_loader(param, full_tensor, shard_id)` that cuts the
rank's slice out of a full checkpoint tensor.

FP8 weights (`use_fp8`, nanoserve/models/quantization.py): a linear then holds its weight in
float8 e4m3 with fp32 scales sharded with it: per-channel scales `weight_scale` [rows] cut
like the weight's rows (column-parallel) or kept whole (row-parallel); block scales
`weight_scale_inv` [rows/128, K/128] cut by 128-row blocks (column-parallel) or by 128-column
blocks along K (row-parallel), so every shard must be a whole number of 128-blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.attention.base import KVSink
from nanoserve.distributed import SINGLE, TPGroup
from nanoserve.kernels import activation, norm, rotary
from nanoserve.kernels import fp8 as fp8_kernels
from nanoserve.kernels import linear as linear_kernels
from nanoserve.kernels.activation import silu_and_mul_reference
from nanoserve.kernels.fp8 import FP8_BLOCK, FP8_DTYPE
from nanoserve.kernels.norm import add_rms_norm_reference, rms_norm_reference
from nanoserve.kernels.rotary import rope_reference
from nanoserve.switches import KernelSwitches

DEFAULT_SWITCHES = KernelSwitches()

# Fused elementwise ops on CUDA: the torch references compiled by torch.compile (one kernel
# each, no host sync). The references themselves are the CPU path and the slow twin
# (KernelSwitches.fused off).
_compiled: dict = {}


def fused(fn):
    """`fn` compiled for CUDA tensors when `switches.fused`; the plain function otherwise."""

    def call(*args, switches: KernelSwitches = DEFAULT_SWITCHES):
        if not (switches.fused and args[0].is_cuda):
            return fn(*args)
        compiled = _compiled.get(fn)
        if compiled is None:
            compiled = _compiled[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
        return compiled(*args)

    call.plain = fn
    return call


def apply_switches(model: nn.Module, switches: KernelSwitches) -> None:
    """Hand `switches` to every layer of `model` that chooses between kernels."""
    for module in model.modules():
        if isinstance(module, _SwitchedLayer):
            module.switches = switches


_HALF_DTYPES = (torch.bfloat16, torch.float16)  # the activation dtypes the Triton GEMVs take


class _SwitchedLayer(nn.Module):
    """A layer whose forward picks Triton kernels or torch references by its switches."""

    switches: KernelSwitches = DEFAULT_SWITCHES


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    fp32_out: bool = False,
    out: torch.Tensor | None = None,
    push=None,
    switches: KernelSwitches = DEFAULT_SWITCHES,
) -> torch.Tensor:
    """x W^T (+ b) in x's dtype, or with `fp32_out` in fp32, accumulated in fp32 and never
    rounded to x's dtype; written into `out` ([rows, N], dense, of that dtype) when given. On
    CUDA the Triton small-M kernel runs where `kernels.linear.linear_config` says it beats cuBLAS
    for this shape (decode batches of up to 256 rows; split-K on narrow matrices); otherwise
    cuBLAS (F.linear, or torch.mm / addmm into `out`), or for fp32_out cuBLAS with an fp32
    output (`torch.mm(..., out_dtype)`), or on CPU (the slow twin) the matmul of fp32 copies.
    `push` (symm_all_reduce.LLPush, with `out`): the Triton kernel also sends the result to
    the peers where it can, and then marks the push sent."""
    fp32_out = fp32_out and x.dtype != torch.float32
    k, n = x.shape[-1], weight.shape[0]
    rows = x.numel() // k if k else 0
    config = _small_m_config(x, weight, switches)
    if config is not None:
        if out is None:
            out = torch.empty(rows, n, dtype=torch.float32 if fp32_out else x.dtype, device=x.device)
        pushing = push is not None and linear_kernels.can_push(config, rows, out.dtype)
        linear_kernels.small_m_linear(
            x.reshape(rows, k), weight, bias, config, out=out, push=push.args() if pushing else None, pdl=switches.pdl
        )
        if pushing:
            push.sent = True
        return out.view(*x.shape[:-1], n)
    if not fp32_out:
        if out is None:
            return F.linear(x, weight, bias)
        x2 = x.reshape(rows, k)
        if bias is None:
            torch.mm(x2, weight.t(), out=out)
        else:
            torch.addmm(bias, x2, weight.t(), out=out)
        return out.view(*x.shape[:-1], n)
    if not x.is_cuda:
        y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return y if out is None else out.copy_(y.reshape(rows, n)).view(*x.shape[:-1], n)
    y = torch.mm(x.reshape(rows, k), weight.t(), torch.float32)
    if bias is not None:
        y += bias
    if out is not None:
        y = out.copy_(y)
    return y.view(*x.shape[:-1], n)


def _small_m_config(x: torch.Tensor, weight: torch.Tensor, switches: KernelSwitches):
    """The small-M kernel's launch config for x W^T on CUDA (None: cuBLAS or the CPU path)."""
    if switches.triton_ops and x.is_cuda and x.dtype == weight.dtype and x.stride(-1) == 1 and weight.stride(1) == 1:
        k = x.shape[-1]
        return linear_kernels.linear_config(x.numel() // k if k else 0, weight.shape[0], k, x.dtype)
    return None


@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 linear's scales: per-channel fp32 [N] (`block` False) or 128x128 block scales
    [ceil(N/128), ceil(K/128)] (`block` True); `input_scale` fp32 [1] where the checkpoint
    gives static activation scales (else activations are quantized per token at run time)."""

    scale: torch.Tensor
    block: bool
    input_scale: torch.Tensor | None = None


def _fp8_small_m_config(x: torch.Tensor, weight: torch.Tensor, fp8: Fp8Weight):
    """The rule's Triton config for x times an FP8 weight (None: cuBLASLt's FP8 GEMM, or for
    block scales `block_fp8_config`); the FP8 twin of `_small_m_config`."""
    k = x.shape[-1]
    return linear_kernels.fp8_linear_config(x.numel() // k if k else 0, weight.shape[0], k, x.dtype, fp8.block)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    fp8: Fp8Weight,
    bias: torch.Tensor | None = None,
    fp32_out: bool = False,
    out: torch.Tensor | None = None,
    switches: KernelSwitches = DEFAULT_SWITCHES,
) -> torch.Tensor:
    """x W^T (+ b) for an FP8 weight W with its scales, as `linear` does for dense weights.
    On CUDA: decode-sized products (where `linear_config` takes the shape) and every
    block-scaled one run the Triton kernels of kernels/linear.py reading FP8 weights (fp32
    accumulation, scales applied in fp32); larger per-channel products run cuBLASLt's FP8 GEMM
    (`kernels.fp8.scaled_mm`) on activations quantized per token (or with the static input
    scale). Elsewhere, and with `triton_ops` off, the slow twin: W dequantized to x's dtype."""
    k, n = x.shape[-1], weight.shape[0]
    rows = x.numel() // k if k else 0
    dtype = torch.float32 if fp32_out else x.dtype
    fast = switches.triton_ops and x.is_cuda and x.dtype in _HALF_DTYPES and x.stride(-1) == 1
    if not fast or rows == 0:
        y = F.linear(x, fp8_kernels.dequantize_weight(weight, fp8.scale, fp8.block, x.dtype), bias)
        return y.to(dtype) if out is None else out.copy_(y.reshape(rows, n)).view(*x.shape[:-1], n)
    x2 = x.reshape(rows, k)
    config = _fp8_small_m_config(x, weight, fp8)
    if config is None and fp8.block:
        config = linear_kernels.block_fp8_config(rows, n, k)
    if config is not None:
        if out is None:
            out = torch.empty(rows, n, dtype=dtype, device=x.device)
        linear_kernels.small_m_linear(
            x2, weight, bias, config, out=out, w_scale=fp8.scale, block_scale=fp8.block, pdl=switches.pdl
        )
        return out.view(*x.shape[:-1], n)
    y = fp8_kernels.scaled_mm(x2, weight, fp8.scale, fp8.input_scale, bias, pdl=switches.pdl)
    if out is not None:
        return out.copy_(y).view(*x.shape[:-1], n)
    return y.to(dtype).view(*x.shape[:-1], n)


# A single-GPU row-parallel product that runs split-K leaves its fp32 partials unsummed and
# the RMSNorm after it adds them (one launch less on the chain of every layer's o_proj and
# down at 9..256 rows, bit-identical); `split_sum_in_norm` off: the sum kernel (A/B).


class SplitKPartials(NamedTuple):
    """A row-parallel product left unsummed: its split-K fp32 partials [S, T, N] (dense),
    which the next RMSNorm adds in split order and rounds once (kernels.norm.rms_norm)."""

    planes: torch.Tensor


rms_norm = fused(rms_norm_reference)
add_rms_norm = fused(add_rms_norm_reference)
_silu_and_mul_fused = fused(silu_and_mul_reference)
rope = fused(rope_reference)


# The Triton SiLU-and-mul rounds as eager torch (the compiled reference rounds once) and
# launches under PDL. It runs where it was measured faster: MLPs up to TRITON_SILU_MAX_I wide
# at any row count, wider ones from TRITON_SILU_WIDE_MIN_ROWS rows (decode's largest batches,
# prefill). qwen3-0.6b (I = 3072), H200, 2026-11-21: batch-1 TPOT 0.863 against 0.893 ms, and
# decode steps 1-5% faster together with the split-K rule. llama-3.1-8b (I = 14336), H100,
# 2026-11-27 (benchmarks/results/2026-11-27.md), ms per decode step, Triton against compiled: 6.232 / 6.196 at 2
# rows, 6.396 / 6.327 at 8, 6.616 / 6.574 at 16, 6.946 / 6.908 at 32, 7.200 / 7.201 at 64,
# 8.333 / 8.321 at 128, 11.152 / 11.329 at 256;
# the offline workload 8,305 -> 8,444-8,505 output tok/s (bf16), 9,857 -> 10,087-10,135
# (FP8 weights). At one row the gated GEMV runs instead where the rule allows (before it,
# the Triton kernel was slower there: 4.419 against 4.305 ms TPOT, H200, 2026-11-21).
# `triton_silu` off keeps the compiled one everywhere (A/B runs).
TRITON_SILU_MAX_I = 4096
TRITON_SILU_WIDE_MIN_ROWS = 129


def silu_and_mul(gate_up: torch.Tensor, switches: KernelSwitches = DEFAULT_SWITCHES) -> torch.Tensor:
    """silu(gate) * up of gate_up [..., 2I]. On CUDA a 2-D gate_up with a dense last dim goes
    through the Triton kernel (one launch, under PDL) where the size rule above says so;
    otherwise the fused torch version."""
    if (
        switches.triton_ops
        and switches.triton_silu
        and gate_up.is_cuda
        and gate_up.dim() == 2
        and gate_up.stride(1) == 1
        and (gate_up.shape[1] <= 2 * TRITON_SILU_MAX_I or gate_up.shape[0] >= TRITON_SILU_WIDE_MIN_ROWS)
    ):
        return activation.silu_and_mul(gate_up, pdl=switches.pdl)
    return _silu_and_mul_fused(gate_up, switches=switches)


silu_and_mul.plain = silu_and_mul_reference


class PendingNorm(NamedTuple):
    """A block's output that takes its own closing norm (Gemma's post-attention and
    post-feedforward norms) before it joins the residual stream. The next norm, given it with
    the residual, applies `norm` first (summing `x` over `reduce_over` there), in the same
    launch as its own add and norm where one kernel does both (`RMSNorm.forward`)."""

    x: torch.Tensor | SplitKPartials
    norm: RMSNorm
    reduce_over: TPGroup


class RMSNorm(_SwitchedLayer):
    """RMSNorm scaled by `weight`. `weight_offset` (Gemma: 1) is added to the checkpoint's
    weight at load, so that a norm that scales by (1 + w) runs as any other: exact in fp32;
    in 16-bit the sum is rounded once at load where Gemma rounds after its fp32 product."""

    def __init__(self, dim: int, eps: float, weight_offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        if weight_offset:
            self.weight.weight_loader = lambda p, full, shard_id: p.data.copy_(full.float() + weight_offset)

    def forward(
        self, x: torch.Tensor | SplitKPartials, residual: torch.Tensor | None = None, reduce_over: TPGroup = SINGLE
    ):
        """With `residual`, adds it first and returns (normed, sum) so the sum can be the
        next residual. On CUDA, rows of a 2-D x go through the Triton kernel (one launch).
        With `reduce_over` (and a residual), x holds this rank's partial sums of a
        row-parallel layer: they are summed over the group first, fused with the add and
        the norm where the group's symmetric-memory path holds x, else by its all-reduce.
        SplitKPartials (single GPU, CUDA) are summed by the norm's own kernel. A PendingNorm
        (with a residual) is normed by its own norm first: on one GPU, CUDA, in this norm's
        launch (in bf16 bit-identical to two launches; 96 launches less a gemma-3-12b step)."""
        switches = self.switches
        if isinstance(x, PendingNorm):
            fused = self._with_closing_norm(x, residual)
            if fused is not None:
                return fused
            x, reduce_over = x.norm(x.x, reduce_over=x.reduce_over), SINGLE  # summed by the closing norm
        if isinstance(x, SplitKPartials):
            return norm.rms_norm(x.planes, self.weight, self.eps, residual, pdl=switches.pdl)
        if reduce_over.size > 1:
            fused = None if residual is None else reduce_over.reduce_rms_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
            x = reduce_over.all_reduce(x).to(self.weight.dtype)  # fp32 partials: rounded once, here
        dense = x.dim() == 2 and x.stride(1) == 1 and x.dtype == self.weight.dtype
        if residual is not None:
            dense = dense and residual.shape == x.shape and residual.stride(-1) == 1 and residual.dtype == x.dtype
        if switches.triton_ops and x.is_cuda and dense:
            return norm.rms_norm(x, self.weight, self.eps, residual, pdl=switches.pdl)
        if residual is not None:
            return add_rms_norm(x, residual, self.weight, self.eps, switches=switches)
        return rms_norm(x, self.weight, self.eps, switches=switches)

    def _with_closing_norm(
        self, pending: PendingNorm, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`pending`'s closing norm, the add and this norm in one kernel, or None where that
        kernel does not apply (tensor parallelism, the torch path, rows it cannot read)."""
        if residual is None:
            raise ValueError("a block's output with its closing norm pending joins a residual stream")
        x, closing = pending.x, pending.norm
        if pending.reduce_over.size > 1 or not self.switches.triton_ops or closing.weight.dtype != self.weight.dtype:
            return None
        if not isinstance(x, SplitKPartials):
            if not (x.is_cuda and x.dim() == 2 and x.stride(1) == 1 and x.dtype == self.weight.dtype):
                return None
        elif not x.planes.is_cuda:
            return None
        if residual.dim() != 2 or residual.stride(-1) != 1 or residual.dtype != self.weight.dtype:
            return None
        rows = x.planes if isinstance(x, SplitKPartials) else x
        pre_norm = (closing.weight, closing.eps)
        return norm.rms_norm(rows, self.weight, self.eps, residual, pdl=self.switches.pdl, pre_norm=pre_norm)

    def embed_start(
        self, ids: torch.Tensor, token_pool: tuple[torch.Tensor, torch.Tensor], embedding: VocabParallelEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The first layer's input norm fused with the embedding lookup and the token pool's
        pending ids (see `VocabParallelEmbedding.forward`): (normed, stream), or None where it
        does not apply (tensor parallelism, the torch path)."""
        table = embedding.weight
        if embedding.tp.size > 1 or not (self.switches.triton_ops and ids.is_cuda) or table.dtype != self.weight.dtype:
            return None
        return norm.embed_rms_norm(ids, *token_pool, table, self.weight, self.eps)

    def start_stream(self, x: torch.Tensor, reduce_over: TPGroup = SINGLE) -> tuple[torch.Tensor, torch.Tensor]:
        """The first layer's input norm: x is the residual stream's start (the embedding;
        under TP this rank's partial sums of it). Returns (normed, stream): summed over the
        group first, fused with the norm where the symmetric-memory path holds x."""
        if reduce_over.size > 1:
            fused = reduce_over.reduce_rms_norm(x, None, self.weight, self.eps)
            if fused is not None:
                return fused
            x = reduce_over.all_reduce(x)
        return self(x), x


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    # llama3: long wavelengths slowed down by `factor`, short ones kept, a smooth ramp between.
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): frequencies that turn fewer than `beta_slow` times over the
    original context are interpolated (divided by `factor`), those that turn more than
    `beta_fast` times kept, with a linear ramp over the dimensions between; `truncate`
    (default true) rounds the ramp's ends to whole dimensions. As Hugging Face computes it."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over the original context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: extrapolated (kept as is), 0: interpolated
    base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    return (1.0 / (factor * base)) * (1 - kept) + (1.0 / base) * kept


def rope_attention_factor(scaling: dict | None) -> float:
    """What YaRN multiplies cos and sin by (1 for other ropes): `attention_factor` if given,
    else 0.1 ln(factor) + 1, or its ratio for `mscale` / `mscale_all_dim`."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
    return mscale()


# The rotary kernel also writes the new K/V into the cache where the caller hands it a KVSink
# (one launch less per layer); `kv_store_in_rope` off: attention's own store kernel (A/B).


class RotaryEmbedding(_SwitchedLayer):
    """Neox-style rotary embedding (rotate-half), cos/sin precomputed per position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        self._spec = (head_dim, max_positions, theta, scaling)
        cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)  # [max_pos, head_dim/2]
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim, max_positions, theta, scaling = self._spec
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(head_dim, theta, scaling))
        gain = rope_attention_factor(scaling)
        if gain != 1.0:  # YaRN scales both tables
            return freqs.cos() * gain, freqs.sin() * gain
        return freqs.cos(), freqs.sin()

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
        v: torch.Tensor | None = None,
        kv_sink: KVSink | None = None,
    ):
        """q: [T, Hq, D], k: [T, Hk, D]. With q_norm/k_norm (Qwen3) each head is
        RMS-normalised first; on CUDA both steps run in one Triton launch. With `kv_sink`
        (and v [T, Hk, D]) the rotated k and v are also written into the sink's cache
        slots: by the same launch on CUDA, else by the sink's own store."""
        switches = self.switches
        same_eps = q_norm is None or q_norm.eps == k_norm.eps
        if switches.triton_ops and q.is_cuda and same_eps:
            weights = (None, None, 0.0) if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
            fuse = kv_sink is not None and switches.kv_store_in_rope
            store = (v, kv_sink.k_cache, kv_sink.v_cache, kv_sink.slot_mapping) if fuse else None
            q, k = rotary.qk_norm_rope(positions, q, k, self.cos, self.sin, *weights, kv_store=store, pdl=switches.pdl)
            if kv_sink is not None and not fuse:
                kv_sink.store(k, v)
            return q, k
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        q, k = rope(positions, q, k, self.cos, self.sin, switches=switches)
        if kv_sink is not None:
            kv_sink.store(k, v)
        return q, k


def _gelu_tanh_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


gelu_tanh_and_mul = fused(_gelu_tanh_and_mul_reference)


def init_unloaded(model: nn.Module) -> None:
    """Fill what the checkpoint does not: the rotary tables and the FP8 input scales (which
    their loader raises to the largest part's). For a model built on the meta device and
    materialized with `to_empty`, whose tensors hold garbage until loaded."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            with torch.device(module.cos.device):
                cos, sin = module._tables()
            module.cos.copy_(cos)
            module.sin.copy_(sin)
        elif getattr(module, "fp8_block", None) is not None and hasattr(module, "input_scale"):
            module.input_scale.data.zero_()


def _shard(size: int, tp: TPGroup, what: str) -> int:
    if size % tp.size:
        raise ValueError(f"{what} ({size}) is not divisible by the tensor-parallel size {tp.size}")
    return size // tp.size


@dataclass(frozen=True)
class RowSlice:
    """The rows of one checkpoint tensor (a merged part such as "q" or "gate") that this
    rank keeps: full[offset : offset + size]."""

    name: str | None
    offset: int
    size: int

    @staticmethod
    def split(name: str | None, full_size: int, tp: TPGroup) -> RowSlice:
        size = _shard(full_size, tp, f"output size of {name or 'linear'}")
        return RowSlice(name, tp.rank * size, size)


class ColumnParallelLinear(_SwitchedLayer):
    """y = x W^T (+ b) for one or several merged outputs (q/k/v, gate/up), each part
    holding the rows given by its RowSlice; the output is the parts concatenated."""

    def __init__(self, input_size: int, parts: list[RowSlice], bias: bool):
        super().__init__()
        self.parts = parts
        rows = sum(p.size for p in parts)
        self.weight = nn.Parameter(torch.empty(rows, input_size))
        self.bias = nn.Parameter(torch.empty(rows)) if bias else None
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader = self._load

    def _load(self, param: nn.Parameter, full: torch.Tensor, shard_id: str | None) -> None:
        start = 0
        for part in self.parts:
            if part.name == shard_id:
                param.data[start : start + part.size].copy_(full[part.offset : part.offset + part.size])
                return
            start += part.size
        raise KeyError(f"no part {shard_id!r} in this linear")

    fp8_block: bool | None = None  # None: a dense weight; else FP8 with block (True) or per-channel scales

    @property
    def fp8(self) -> Fp8Weight | None:
        """The FP8 weight's scales (None for a dense weight), read from the parameters."""
        if self.fp8_block is None:
            return None
        scale = self.weight_scale_inv if self.fp8_block else self.weight_scale
        return Fp8Weight(scale, self.fp8_block, getattr(self, "input_scale", None))

    def use_fp8(self, block: bool, static_input: bool) -> None:
        """Hold the weight in FP8 with its scales (before loading): see the module docstring."""
        rows, cols = self.weight.shape
        if block:
            bad = [p.name for p in self.parts if p.offset % FP8_BLOCK or p.size % FP8_BLOCK]
            if bad:
                raise ValueError(f"block-wise FP8 needs 128-row shards; parts {bad} of this linear are not")
            scale = nn.Parameter(torch.empty(rows // FP8_BLOCK, -(-cols // FP8_BLOCK), dtype=torch.float32), False)
            scale.weight_loader = self._load_blocks
        else:
            scale = nn.Parameter(torch.empty(rows, dtype=torch.float32), requires_grad=False)
            scale.weight_loader = self._load
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=FP8_DTYPE), requires_grad=False)
        self.weight.weight_loader = self._load
        self.register_parameter("weight_scale_inv" if block else "weight_scale", scale)
        if static_input:
            # Merged parts share one input: it is quantized with the largest of their scales.
            input_scale = nn.Parameter(torch.zeros(1, dtype=torch.float32), requires_grad=False)
            input_scale.weight_loader = lambda p, full, shard_id: torch.maximum(p.data, full.reshape(1), out=p.data)
            self.input_scale = input_scale
        self.fp8_block = block

    def _load_blocks(self, param: nn.Parameter, full: torch.Tensor, shard_id: str | None) -> None:
        start = 0
        for part in self.parts:
            size = part.size // FP8_BLOCK
            if part.name == shard_id:
                first = part.offset // FP8_BLOCK
                param.data[start : start + size].copy_(full[first : first + size])
                return
            start += size
        raise KeyError(f"no part {shard_id!r} in this linear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fp8 = self.fp8
        if fp8 is not None:
            return fp8_linear(x, self.weight, fp8, self.bias, switches=self.switches)
        return linear(x, self.weight, self.bias, switches=self.switches)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this linear's product (an MLP's parts "gate" and "up"): on CUDA
        one launch where the rule gives the product to the fma GEMV (the SiLU in its epilogue,
        `gemv_silu`) or, at 5..16 rows, to the gated dot kernel (`fused_16_rows`), otherwise the
        product, then `silu_and_mul` (the slow twin)."""
        config = self._gated_config(x)
        if config is None:
            return silu_and_mul(self(x), self.switches)
        k = x.shape[-1]
        fp8 = self.fp8
        out = linear_kernels.small_m_linear(
            x.reshape(-1, k),
            self.weight,
            self.bias,
            config,
            # The gated dot kernel (5..16 rows) launches without PDL: under it llama-3.1-8b's K=4
            # verify step ran 5.33 ms against 4.41 (batch 1, H200, benchmarks/results/2026-12-02.md;
            # its trigger moved after the K loop: 4.56).
            pdl=self.switches.pdl and config.kernel != "dot",
            w_scale=None if fp8 is None else fp8.scale,
            block_scale=fp8 is not None and fp8.block,
            gated=True,
        )
        return out.view(*x.shape[:-1], out.shape[1])

    def small_m_config(self, x: torch.Tensor) -> linear_kernels.LinearConfig | None:
        """The Triton config `linear` or `fp8_linear` runs this product of x with (None: cuBLAS,
        cuBLASLt, the CPU path, or x not a dense 2-byte tensor on CUDA)."""
        if not self._on_triton(x):
            return None
        fp8 = self.fp8
        if fp8 is None:
            return _small_m_config(x, self.weight, self.switches)
        return _fp8_small_m_config(x, self.weight, fp8)

    def _on_triton(self, x: torch.Tensor) -> bool:
        """Whether x can enter the Triton products: the switch on, a dense 2-byte x on CUDA."""
        return self.switches.triton_ops and x.is_cuda and x.stride(-1) == 1 and x.dtype in _HALF_DTYPES

    def _gated_config(self, x: torch.Tensor) -> linear_kernels.LinearConfig | None:
        """The gated product's config for x (the fma GEMV's at the rule's fma rows, else the
        gated dot kernel's), or None where the product and SiLU run apart."""
        if [p.name for p in self.parts] != ["gate", "up"] or self.parts[0].size != self.parts[1].size:
            return None
        config = self.small_m_config(x)
        if config is not None and config.kernel == "fma":
            return linear_kernels.gated_config(config) if self.switches.gemv_silu else None
        return self._gated_dot_config(x) if self.switches.fused_16_rows else None

    def _gated_dot_config(self, x: torch.Tensor) -> linear_kernels.LinearConfig | None:
        """The gated dot kernel's config for x (`linear_kernels.gated_dot_config`: 5..16 rows,
        on CUDA, dense weights), or None."""
        if self.fp8 is not None or not self._on_triton(x) or x.dtype != self.weight.dtype:
            return None
        k = x.shape[-1]
        return linear_kernels.gated_dot_config(x.numel() // k, self.weight.shape[0], k, x.dtype)


# Tensor parallelism: row-parallel partial sums are all-reduced in the activation dtype, as
# vLLM and SGLang do; `tp_reduce_fp32` keeps them fp32 and rounds once (see
# RowParallelLinear). Measured on 2 x H200, dummy llama-3.1-8b bf16 (benchmarks/results/2026-11-21.md):
# bf16 sums 14,509 vs 13,025 offline tok/s and 3.20 vs 3.30 ms batch-1 TPOT, and greedy
# agreement with TP=1 no worse (4/16 vs 2/16 identical over 32 tokens; top-5 never broken).


class RowParallelLinear(_SwitchedLayer):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPGroup = SINGLE, reduce_slot: int = 0):
        super().__init__()
        self.tp = tp
        self.reduce_slot = reduce_slot  # symmetric-memory slot of its partials (symm_all_reduce)
        self.weight = nn.Parameter(torch.empty(output_size, _shard(input_size, tp, "row-parallel input")))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None
        self.weight.weight_loader = self._load_weight
        if self.bias is not None:
            self.bias.weight_loader = lambda p, full, shard_id: p.data.copy_(full)

    def _load_weight(self, param: nn.Parameter, full: torch.Tensor, shard_id: str | None) -> None:
        cols = param.shape[1]
        param.data.copy_(full[:, self.tp.rank * cols : (self.tp.rank + 1) * cols])

    fp8_block: bool | None = None  # None: a dense weight; else FP8 with block (True) or per-channel scales

    @property
    def fp8(self) -> Fp8Weight | None:
        """The FP8 weight's scales (None for a dense weight), read from the parameters."""
        if self.fp8_block is None:
            return None
        scale = self.weight_scale_inv if self.fp8_block else self.weight_scale
        return Fp8Weight(scale, self.fp8_block, getattr(self, "input_scale", None))

    def use_fp8(self, block: bool, static_input: bool) -> None:
        """Hold the weight in FP8 with its scales (before loading): see the module docstring."""
        rows, cols = self.weight.shape
        whole = lambda p, full, shard_id: p.data.copy_(full.reshape(p.shape))
        if block:
            if cols % FP8_BLOCK:
                raise ValueError(f"block-wise FP8 needs 128-column shards; this row-parallel shard has {cols}")
            scale = nn.Parameter(torch.empty(-(-rows // FP8_BLOCK), cols // FP8_BLOCK, dtype=torch.float32), False)
            scale.weight_loader = self._load_weight  # K blocks cut as the weight's columns
        else:
            scale = nn.Parameter(torch.empty(rows, dtype=torch.float32), requires_grad=False)
            scale.weight_loader = whole  # one scale per output row: every rank holds them all
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=FP8_DTYPE), requires_grad=False)
        self.weight.weight_loader = self._load_weight
        self.register_parameter("weight_scale_inv" if block else "weight_scale", scale)
        if static_input:
            input_scale = nn.Parameter(torch.zeros(1, dtype=torch.float32), requires_grad=False)
            input_scale.weight_loader = whole
            self.input_scale = input_scale
        self.fp8_block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitKPartials:
        """This rank's partial sums x_r W_r^T, rank 0's plus the bias: the layer's output once
        summed over the group, which the RMSNorm after it does (`reduce_over`), fused with
        its residual add where it can. With TP=1 the partial sum is the output, or, where
        the product runs split-K (`split_sum_in_norm`, no bias), its unsummed SplitKPartials:
        the RMSNorm after it is this layer's only consumer."""
        switches = self.switches
        fp8 = self.fp8
        if fp8 is not None:
            rows, n = x.numel() // x.shape[-1], self.weight.shape[0]
            fp32 = self.tp.size > 1 and switches.tp_reduce_fp32
            out = self.tp.partial_out(rows, n, torch.float32 if fp32 else x.dtype, self.reduce_slot)
            bias = self.bias if self.tp.rank == 0 else None
            return fp8_linear(x, self.weight, fp8, bias, fp32_out=fp32, out=out, switches=switches)
        if self.tp.size == 1 and self.bias is None and switches.split_sum_in_norm and x.dim() == 2:
            config = _small_m_config(x, self.weight, switches)
            if config is not None and config.split_k > 1:
                planes = linear_kernels.small_m_linear(
                    x, self.weight, None, config, partials_only=True, pdl=switches.pdl
                )
                return SplitKPartials(planes)
        # TP=1 rounds each output once, at the end of its full-width matmul; with
        # `tp_reduce_fp32` the partials stay fp32 through the sum and are rounded once after
        # it, as TP=1 does, for twice the bytes on the wire (opt-in).
        fp32 = self.tp.size > 1 and switches.tp_reduce_fp32
        rows, n = x.numel() // x.shape[-1], self.weight.shape[0]
        out = self.tp.partial_out(rows, n, torch.float32 if fp32 else x.dtype, self.reduce_slot)
        bias = self.bias if self.tp.rank == 0 else None
        return linear(x, self.weight, bias, fp32_out=fp32, out=out, push=self.tp.ll_push(out), switches=switches)


EMBEDDING_SLOT = 1  # the symmetric-memory slot of the embedding's partial sums


class VocabParallelEmbedding(_SwitchedLayer):
    def __init__(self, vocab_size: int, dim: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows = math.ceil(vocab_size / tp.size)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, dim))
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, full: torch.Tensor, shard_id: str | None) -> None:
        part = full[self.start : self.start + self.rows]
        param.data.zero_()
        param.data[: part.shape[0]].copy_(part)

    def forward(self, ids: torch.Tensor, token_pool: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Embeddings of ids [T]; under TP this rank's partial sums of them (its vocabulary
        slice's rows, zeros for other ids), which the first layer's input norm sums over the
        group (`RMSNorm.start_stream`), written where `partial_out` says so that the sum
        can take the fused path (slot 1: see nanoserve/distributed/symm_all_reduce.py).
        `token_pool` (pool, pool_index): ids < 0 are tokens still being sampled, read from
        pool[pool_index[row]] and written back into ids first (on CUDA the first layer's input
        norm gathers the rows itself instead: `RMSNorm.embed_start`)."""
        if token_pool is not None:
            norm.resolve_pending(ids, *token_pool)
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        # Rows outside this rank's slice are zeros, so the sum over ranks is exact in any dtype.
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = self.tp.partial_out(ids.numel(), self.weight.shape[1], self.weight.dtype, EMBEDDING_SLOT)
        rows = torch.index_select(self.weight, 0, local.clamp(0, self.rows - 1), out=out)
        return rows.masked_fill_(outside.unsqueeze(-1), 0)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the vocabulary; may share its weight with the embedding (tied)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = linear(hidden, self.weight, switches=self.switches)
        out = self.tp.all_gather_last_dim(out)
        return out[..., : self.vocab_size]
