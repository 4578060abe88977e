"""Qwen3.5's decoder layers (`qwen3_5_text`, `qwen3_5_moe_text`, and the text part of the
multimodal `qwen3_5` / `qwen3_5_moe` checkpoints).

Owns: `Qwen35DecoderLayer` and its two token mixers, `GatedDeltaNet` (linear attention) and
`GatedAttention`, and their checkpoint tensors' shapes (decoder.py maps their names). What Qwen3.5 shares with the other
decoders (norms that scale by 1 + weight, the gated MLP or the sparse MoE block with a gated
shared expert, the residual flow) comes from nanoserve/models/decoder.py and moe.py; the
architecture's numbers from `ModelConfig` (`linear`, `rotary_dim`, `attn_output_gate`).

Each layer's mixer crosses the piece boundary (see decoder.py) as three tensors in
`AttentionInputs` and is run between the pieces by `Qwen35DecoderLayer.mix`:
- a full-attention layer hands on q [T, H, 2D]: the normed, rotated query heads with each
  head's output gate behind it, and k, v as any layer; `mix` attends with the query half and
  multiplies the result by sigmoid(gate);
- a Gated DeltaNet layer hands on its input projection's parts: the q/k/v channels before the
  convolution [T, conv_dim], the gate z [T, Hv * Dv] and the write-strength and decay inputs
  [T, 2 Hv]; `mix` runs the convolution and the delta rule against the request's state
  (nanoserve.kvcache.linear_state), then the gated norm, and returns [T, Hv * Dv] for
  out_proj. An extend's chunked rule runs through fla-core's kernels on CUDA in 16-bit where
  fla imports (nanoserve.kernels.gated_delta_fla; `prefill_path` says which, the switch
  NANOSERVE_FLA turns it off), else through the torch twin.
Rows mix only inside `mix`, so everything else stays row-wise. Tensor parallelism is not
supported for these layers (refused at start).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.attention.base import ForwardBatch, KVSink
from nanoserve.distributed import TPGroup
from nanoserve.kernels import gated_delta, gated_delta_fla
from nanoserve.models.decoder import Attention, AttentionInputs, DecoderLayer, _mlp_block
from nanoserve.models.layers import (
    ColumnParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    RowSlice,
    _SwitchedLayer,
)
from nanoserve.models.model_config import ModelConfig
from nanoserve.switches import KernelSwitches


class GatedAttention(Attention):
    """Full attention with per-head q/k norms, rope on the first `rotary_dim` dims of each head,
    and the output gated by sigmoid of a second query projection (q_proj's rows hold, per
    head, the query then its gate)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup):
        super().__init__(cfg, layer_id, tp)
        d = cfg.head_dim
        q = RowSlice("q", 0, 2 * cfg.num_heads * d)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q, *self.qkv_proj.parts[1:]], bias=False)
        self.rotary_dim = cfg.rope_dim

    def before_attention(self, positions, x, rotary: RotaryEmbedding, kv_sink: KVSink | None = None):
        """(q with its gates [T, H, 2D], k [T, Hk, D], v), k and v stored through `kv_sink`."""
        tokens, d, r = x.shape[0], self.head_dim, self.rotary_dim
        qkv = self.qkv_proj(x)
        q_gate, k, v = qkv.split([2 * self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q_gate = q_gate.view(tokens, self.num_heads, 2 * d)
        q, gate = self.q_norm(q_gate[..., :d]), q_gate[..., d:]
        k = self.k_norm(k.reshape(tokens, self.num_kv_heads, d))
        v = v.reshape(tokens, self.num_kv_heads, d)
        q_rot, k_rot = rotary(positions, q[..., :r].contiguous(), k[..., :r].contiguous())
        q = torch.cat([q_rot, q[..., r:]], dim=-1)
        k = torch.cat([k_rot, k[..., r:]], dim=-1)
        if kv_sink is not None:
            kv_sink.store(k, v)
        return torch.cat([q, gate], dim=-1), k, v

    def gated_attention(self, batch: ForwardBatch, layer_id: int, q_gate, k, v) -> torch.Tensor:
        d = self.head_dim
        out = batch.attend(layer_id, q_gate[..., :d].contiguous(), k, v, self.scale, kv_stored=True)
        return out * torch.sigmoid(q_gate[..., d:])


class GatedDeltaNet(_SwitchedLayer):
    """Linear attention: one input projection (the q/k/v channels, the gate z, the write
    strength b and the decay input a), a causal depthwise convolution with SiLU over the q/k/v
    channels, the gated delta rule (nanoserve.kernels.gated_delta), an RMSNorm gated by
    SiLU(z) per value head, and the output projection."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup):
        super().__init__()
        if tp.size > 1:
            raise ValueError("tensor parallelism is not supported for Gated DeltaNet layers (Qwen3.5): use tp=1")
        lin = cfg.linear
        self.layer_id = layer_id
        self.lin = lin
        hv = lin.num_v_heads
        parts = [RowSlice("qkv", 0, lin.conv_dim), RowSlice("z", 0, lin.value_dim), RowSlice("b", 0, hv)]
        self.in_proj = ColumnParallelLinear(cfg.hidden_size, [*parts, RowSlice("a", 0, hv)], bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(lin.conv_dim, 1, lin.conv_kernel))
        self.dt_bias = nn.Parameter(torch.empty(hv))
        self.A_log = nn.Parameter(torch.empty(hv))
        self.norm = RMSNorm(lin.head_v_dim, cfg.rms_norm_eps)  # its weight; the gated norm is `mix`'s
        self.out_proj = RowParallelLinear(lin.value_dim, cfg.hidden_size, bias=False, tp=tp, reduce_slot=0)

    def before_attention(self, positions, x, rotary=None, kv_sink=None):
        """The input projection's parts: (q/k/v channels [T, conv_dim], z [T, Hv*Dv], b|a [T, 2Hv])."""
        lin = self.lin
        qkv, z, ba = self.in_proj(x).split([lin.conv_dim, lin.value_dim, 2 * lin.num_v_heads], dim=-1)
        return qkv, z, ba

    def mix(self, batch: ForwardBatch, qkv: torch.Tensor, z: torch.Tensor, ba: torch.Tensor) -> torch.Tensor:
        """The convolution, the delta rule over each request's state and the gated norm:
        [T, Hv * Dv] in the model's dtype. Rows of one token each (a decode step, a mixed
        step's leading decode rows) go through the step at once (graph-safe); the other
        requests' tokens all together through the chunked rule (`_extend`)."""
        states, meta = batch.linear_states, batch.meta
        if states.rows_host is None:
            return self._decode_rows(states.pool, qkv, z, ba, states.rows, meta.prefix_lens)
        k = meta.num_decode_rows
        parts = (
            []
            if k == 0
            else [self._decode_rows(states.pool, qkv[:k], z[:k], ba[:k], states.rows[:k], meta.prefix_lens[:k])]
        )
        lengths = [seq - prefix for seq, prefix in zip(meta.seq_lens_host[k:], meta.prefix_lens_host[k:])]
        parts.append(
            self._extend(states.pool, qkv[k:], z[k:], ba[k:], states.rows_host[k:], meta.prefix_lens_host[k:], lengths)
        )
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _pools(self, pool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        entry = pool.index[self.layer_id]
        return pool.conv[entry], pool.recurrent[entry], self.conv1d.weight[:, 0, :]

    def _gates(self, ba: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(decay g in log space, write strength beta), [T, Hv] fp32."""
        b, a = ba.split(self.lin.num_v_heads, dim=-1)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return g, torch.sigmoid(b.float())

    def _decode_rows(self, pool, qkv, z, ba, rows: torch.Tensor, prefix_lens: torch.Tensor) -> torch.Tensor:
        """One token per row, each at state row rows[i] (from zeros where prefix_lens is 0)."""
        lin = self.lin
        conv_states, rec_states, weight = self._pools(pool)
        if qkv.is_cuda and self.switches.triton_ops:  # three launches
            return gated_delta.decode_step(
                qkv, z, ba, weight, self.A_log, self.dt_bias, self.norm.weight, self.norm.eps, conv_states,
                rec_states, rows, prefix_lens, lin.num_k_heads, lin.head_k_dim,
            )  # fmt: skip
        g, beta = self._gates(ba)
        fresh = (prefix_lens == 0)[:, None, None]  # a request at position 0 starts from zeros
        conv = conv_states[rows].masked_fill(fresh, 0)
        x = gated_delta.causal_conv_step(qkv, weight, conv)
        conv_states[rows] = conv
        q, k, v = self._split_heads(x)
        rec = rec_states[rows].masked_fill(fresh[..., None], 0)
        out = gated_delta.delta_rule_step(q, k, v, g, beta, rec)
        rec_states[rows] = rec
        return self._gated_norm(out, z, qkv.dtype)

    def fla_prefill(self, x: torch.Tensor) -> bool:
        """Whether an extend of activations like `x` runs the fast path (see `prefill_path`)."""
        return self.switches.fla and gated_delta_fla.usable(x)

    def _extend(self, pool, qkv, z, ba, rows: list[int], prefixes: list[int], lengths: list[int]) -> torch.Tensor:
        """Each request's tokens (lengths[i] of them after prefixes[i], packed one request after
        another), all requests at once. Fast path (`fla_prefill`): the convolution and fla-core's
        varlen chunked delta rule over the packed tokens (cu_seqlens, no padding). Slow twin:
        the requests right-padded to the longest, convolved as a batch and run side by side as
        heads of one torch chunked rule (the padding written with g = 0 and beta = 0: no decay,
        no write)."""
        conv_states, rec_states, weight = self._pools(pool)
        g, beta = self._gates(ba)
        dev = qkv.device
        slot = torch.tensor(rows).to(dev, non_blocking=True)
        fresh = torch.tensor([p == 0 for p in prefixes]).to(dev, non_blocking=True)[:, None, None]  # from zeros
        conv0 = conv_states[slot].masked_fill(fresh, 0)
        fast = self.fla_prefill(qkv)
        if fast:  # packed: one Triton launch on CUDA, the indexed torch twin elsewhere
            conv = (
                gated_delta.causal_conv_packed
                if qkv.is_cuda and self.switches.triton_ops
                else gated_delta.causal_conv_varlen
            )
            x, conv_states[slot] = conv(qkv, weight, conv0, lengths)
        else:
            where, longest = gated_delta.packed_to_padded(lengths, dev)
            padded = qkv.new_zeros(len(lengths) * longest, qkv.shape[1])
            padded[where] = qkv
            x, conv_states[slot] = gated_delta.causal_conv(
                padded.view(len(lengths), longest, -1), weight, conv0, torch.tensor(lengths, device=dev)
            )
            x = x.reshape(len(lengths) * longest, -1)[where]
        q, k, v = self._split_heads(x)
        rec0 = rec_states[slot].masked_fill(fresh[..., None], 0)
        o, rec_states[slot] = gated_delta_fla.delta_rule_varlen(q, k, v, g, beta, rec0, lengths, use_fla=fast)
        return self._gated_norm(o, z, qkv.dtype)

    def _gated_norm(self, out: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        lin = self.lin
        out = out.to(dtype).reshape(-1, lin.head_v_dim)
        normed = gated_delta.gated_rms_norm(out, z.reshape(-1, lin.head_v_dim), self.norm.weight, self.norm.eps)
        return normed.reshape(-1, lin.value_dim)

    def _split_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lin = self.lin
        q, k, v = x.split([lin.key_dim, lin.key_dim, lin.value_dim], dim=-1)
        t = x.shape[0]
        return (
            q.reshape(t, lin.num_k_heads, lin.head_k_dim),
            k.reshape(t, lin.num_k_heads, lin.head_k_dim),
            v.reshape(t, lin.num_v_heads, lin.head_v_dim),
        )

    def after_attention(self, out: torch.Tensor):
        return self.out_proj(out)


class Qwen35DecoderLayer(DecoderLayer):
    """A Qwen3.5 layer: input norm, the layer's mixer (`linear_attn` or `self_attn`), post norm,
    MLP (dense or MoE); the residual flow as decoder.py's."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup):
        nn.Module.__init__(self)
        self.tp = tp
        self.is_linear = cfg.is_linear_layer(layer_id)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, layer_id, tp)
        else:
            self.self_attn = GatedAttention(cfg, layer_id, tp)
        self.mlp = _mlp_block(cfg, layer_id, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset)

    @property
    def mixer(self) -> GatedDeltaNet | GatedAttention:
        return self.linear_attn if self.is_linear else self.self_attn

    def attention_inputs(self, positions, normed, residual, rotary, kv_sink=None) -> AttentionInputs:
        return AttentionInputs(*self.mixer.before_attention(positions, normed, rotary, kv_sink), residual)

    def mix(self, layer_id: int, batch: ForwardBatch, q, k, v) -> torch.Tensor:
        if self.is_linear:
            return self.linear_attn.mix(batch, q, k, v)
        return self.self_attn.gated_attention(batch, layer_id, q, k, v)

    def after_attention(self, attn_out, residual):
        hidden = self.mixer.after_attention(attn_out)
        hidden, residual = self.post_attention_layernorm(hidden, residual, reduce_over=self.tp)
        return self.mlp(hidden), residual


def prefill_path(device: torch.device, dtype: torch.dtype, switches: KernelSwitches) -> str:
    """Which path a Gated DeltaNet layer's extend (prefill) takes on `device` in `dtype`, in
    words, for the start-up log and benchmarks (`GatedDeltaNet.fla_prefill` decides per call)."""
    why = None if switches.fla else f"{KernelSwitches.env_name('fla')}=0"
    why = why or gated_delta_fla.unusable_reason(device, dtype)
    if why is None:
        return f"fla-core {gated_delta_fla.version()} chunked kernels, requests packed (cu_seqlens)"
    return f"torch chunked rule, requests padded side by side ({why})"


def hf_shapes(cfg: ModelConfig, i: int, prefix: str) -> dict[str, tuple[int, ...]]:
    """Layer i's mixer tensors in a Hugging Face checkpoint (`prefix`: "model.layers.{i}.")."""
    h, d = cfg.hidden_size, cfg.head_dim
    if not cfg.is_linear_layer(i):
        p = prefix + "self_attn."
        kv = cfg.num_kv_heads * d
        return {
            p + "q_proj.weight": (2 * cfg.num_heads * d, h),
            p + "k_proj.weight": (kv, h),
            p + "v_proj.weight": (kv, h),
            p + "o_proj.weight": (h, cfg.num_heads * d),
            p + "q_norm.weight": (d,),
            p + "k_norm.weight": (d,),
        }
    lin = cfg.linear
    p = prefix + "linear_attn."
    return {
        p + "in_proj_qkv.weight": (lin.conv_dim, h),
        p + "in_proj_z.weight": (lin.value_dim, h),
        p + "in_proj_b.weight": (lin.num_v_heads, h),
        p + "in_proj_a.weight": (lin.num_v_heads, h),
        p + "conv1d.weight": (lin.conv_dim, 1, lin.conv_kernel),
        p + "dt_bias": (lin.num_v_heads,),
        p + "A_log": (lin.num_v_heads,),
        p + "norm.weight": (lin.head_v_dim,),
        p + "out_proj.weight": (h, lin.value_dim),
    }


# A multimodal checkpoint's text decoder sits under model.language_model.; its vision tower
# (model.visual.) and the multi-token-prediction head (mtp.) are not loaded.
_SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")


def text_checkpoint(checkpoint: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A Qwen3.5 checkpoint's text-decoder tensors under text-only names."""
    for name, tensor in checkpoint:
        if name.startswith(_SKIPPED_PREFIXES):
            continue
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model.") :]
        yield name, tensor
