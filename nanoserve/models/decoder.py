"""One decoder for the Llama family (Llama 2/3/3.1, SmolLM2, dense Mistral), Qwen2 (bias
on q/k/v) and Qwen3 (per-head RMSNorm on q and k), and their mixture-of-experts kin
(Mixtral, Qwen2-MoE, Qwen3-MoE), whose sparse layers take the MLP block of
nanoserve/models/moe.py where `ModelConfig.is_moe_layer` says so.

Owns: the `DecoderLM` module tree and the map from Hugging Face parameter names to ours.
Parameter names follow Hugging Face's, except that q/k/v are merged into `qkv_proj` and
gate/up into `gate_up_proj` (one matmul each); `checkpoint_target` says where a checkpoint
tensor goes.

Data flow is explicit: `forward(input_ids, positions, batch)` takes the flattened new
tokens of all requests, their positions, and the `ForwardBatch` that carries attention
metadata, backend and KV cache down to every attention layer.

Pieces: the forward is cut at every attention call into L + 1 pieces (L layers). Piece i
runs everything from just after layer i-1's attention to just before layer i's attention:
piece 0 starts at the embedding, piece L ends after the final norm. Between pieces only
the residual stream and one attention call's q/k/v (or its output) cross. `forward` is
exactly the pieces chained with `batch.attend` between them, so a caller that runs the
pieces itself (piecewise CUDA graphs, nanoserve.engine.piecewise_graph) computes the
same function. The only difference is where the new K/V are stored: `forward` hands each
piece its layer's `KVSink` and the rotary kernel writes them (at one row the qkv GEMV itself
rotates and stores where it can: `Attention._rotating_qkv`); a caller that passes none leaves
the store to the attention call. Every op inside a piece is row-wise (one token per row:
norms, linears, rotary by position, SiLU): rows never mix outside attention.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from nanoserve.attention.base import ForwardBatch, KVSink
from nanoserve.distributed import SINGLE, TPGroup
from nanoserve.kernels import qkv_rope
from nanoserve.models.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    RowSlice,
    SplitKPartials,
    VocabParallelEmbedding,
    _SwitchedLayer,
    apply_switches,
)
from nanoserve.models.model_config import ModelConfig
from nanoserve.models.moe import SparseMoE
from nanoserve.models.moe import checkpoint_target as moe_checkpoint_target
from nanoserve.switches import KernelSwitches


def kv_heads_per_rank(cfg: ModelConfig, tp: TPGroup) -> int:
    """KV heads are split across ranks, or replicated when there are fewer than ranks."""
    if cfg.num_kv_heads >= tp.size:
        if cfg.num_kv_heads % tp.size:
            raise ValueError(f"num_key_value_heads {cfg.num_kv_heads} not divisible by tp size {tp.size}")
        return cfg.num_kv_heads // tp.size
    if tp.size % cfg.num_kv_heads:
        raise ValueError(f"tp size {tp.size} not a multiple of num_key_value_heads {cfg.num_kv_heads}")
    return 1


class AttentionInputs(NamedTuple):
    """What crosses from a piece into layer i's attention call (and on to piece i+1)."""

    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hk, D]
    v: torch.Tensor  # [T, Hk, D]
    residual: torch.Tensor  # [T, hidden]: the residual stream entering layer i's attention


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup):
        super().__init__()
        self.layer_id = layer_id
        d = cfg.head_dim
        self.num_heads = cfg.num_heads // tp.size
        self.num_kv_heads = kv_heads_per_rank(cfg, tp)
        if cfg.num_kv_heads >= tp.size:
            kv = [RowSlice.split(name, cfg.num_kv_heads * d, tp) for name in ("k", "v")]
        else:  # replicated: rank r serves KV head r * num_kv_heads // tp.size
            head = tp.rank * cfg.num_kv_heads // tp.size
            kv = [RowSlice(name, head * d, d) for name in ("k", "v")]
        q = RowSlice.split("q", cfg.num_heads * d, tp)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q, *kv], bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, bias=False, tp=tp, reduce_slot=0)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.head_dim = d
        self.scale = d**-0.5

    def before_attention(
        self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding, kv_sink: KVSink | None = None
    ):
        """q [T, Hq, D], k and v [T, Hk, D] for the attention call: qkv projection, q/k norms
        (Qwen3), rotary; with `kv_sink`, k and v are also stored into the layer's cache."""
        tokens, d = x.shape[0], self.head_dim
        fused = self._rotating_qkv(positions, x, rotary, kv_sink)
        qkv = fused if fused is not None else self.qkv_proj(x)
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q = q.view(tokens, self.num_heads, d)
        k = k.view(tokens, self.num_kv_heads, d)
        v = v.view(tokens, self.num_kv_heads, d)
        if fused is None:
            q, k = rotary(positions, q, k, self.q_norm, self.k_norm, v, kv_sink)  # q/k norms (Qwen3) first
        elif kv_sink is not None and not self.qkv_proj.switches.kv_store_in_rope:
            kv_sink.store(k, v)
        return q, k, v

    def _rotating_qkv(self, positions, x, rotary: RotaryEmbedding, kv_sink: KVSink | None) -> torch.Tensor | None:
        """The qkv product with q and k rotated (and, with `kv_sink`, K/V stored) by the GEMV's
        epilogue (`kernels.qkv_rope`: one launch at one row, `rope_in_gemv`), or None where
        that does not run (more rows, q/k norms, block-scaled FP8, a config without whole
        pairs): then the product and the rotary kernel run apart."""
        proj = self.qkv_proj
        sw = proj.switches
        if not sw.rope_in_gemv or self.q_norm is not None or x.dim() != 2 or x.shape[0] != 1:
            return None
        fp8 = proj.fp8
        config = proj.small_m_config(x)
        if (fp8 is not None and fp8.block) or not qkv_rope.fuses_rope(config, self.head_dim):
            return None
        store = None
        if kv_sink is not None and sw.kv_store_in_rope:
            store = (kv_sink.k_cache, kv_sink.v_cache, kv_sink.slot_mapping)
        return qkv_rope.qkv_rope_gemv(
            x, proj.weight, proj.bias, config, positions, rotary.cos, rotary.sin, self.num_heads,
            self.num_kv_heads, self.head_dim, store, w_scale=None if fp8 is None else fp8.scale, pdl=sw.pdl,
        )  # fmt: skip

    def after_attention(self, out: torch.Tensor) -> torch.Tensor | SplitKPartials:
        """The output projection of the attention result [T, Hq, D] (this rank's partial sums,
        or unsummed split-K partials: see RowParallelLinear; the next norm sums either)."""
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))


class MLP(_SwitchedLayer):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        parts = [RowSlice.split(name, cfg.intermediate_size, tp) for name in ("gate", "up")]
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, parts, bias=False)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=False, tp=tp, reduce_slot=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitKPartials:
        """This rank's partial sums of the MLP's output (see RowParallelLinear)."""
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.self_attn = Attention(cfg, layer_id, tp)
        self.mlp = SparseMoE(cfg, tp) if cfg.is_moe_layer(layer_id) else MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def before_attention(self, positions, hidden, residual, rotary, kv_sink: KVSink | None = None) -> AttentionInputs:
        """Input norm (adding the previous layer's output, partial sums under TP, to the
        residual stream; the first layer starts the stream with the embedding) and the
        attention inputs (stored through `kv_sink` when given)."""
        if residual is None:
            hidden, residual = self.input_layernorm.start_stream(hidden, reduce_over=self.tp)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, reduce_over=self.tp)
        return self.attention_inputs(positions, hidden, residual, rotary, kv_sink)

    def attention_inputs(self, positions, normed, residual, rotary, kv_sink: KVSink | None = None) -> AttentionInputs:
        """The attention inputs of the input norm's output `normed` (see `before_attention`)."""
        return AttentionInputs(*self.self_attn.before_attention(positions, normed, rotary, kv_sink), residual)

    def after_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor | SplitKPartials, torch.Tensor]:
        """Output projection, post-attention norm (+ residual) and MLP: (MLP output, residual);
        under TP the MLP output is this rank's partial sums, on one GPU possibly unsummed
        split-K partials; the next norm (in the same piece) sums either."""
        hidden = self.self_attn.after_attention(attn_out)
        hidden, residual = self.post_attention_layernorm(hidden, residual, reduce_over=self.tp)
        return self.mlp(hidden), residual


class DecoderLM(nn.Module):
    def __init__(
        self, cfg: ModelConfig, max_positions: int, tp: TPGroup = SINGLE, switches: KernelSwitches | None = None
    ):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if switches is not None:
            apply_switches(self, switches)

    @property
    def num_pieces(self) -> int:
        return len(self.layers) + 1

    def piece(
        self,
        i: int,
        positions: torch.Tensor,
        input_ids: torch.Tensor | None,
        attn_out: torch.Tensor | None,
        residual: torch.Tensor | None,
        kv_sink: KVSink | None = None,
        token_pool: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> AttentionInputs | torch.Tensor:
        """Piece i of the forward (see the module docstring). Piece 0 reads `input_ids` (ids
        < 0 from `token_pool`, see `VocabParallelEmbedding.forward`);
        piece i > 0 reads layer i-1's attention output `attn_out` [T, Hq, D] and the
        `residual` that entered it. Pieces 0..L-1 return layer i's AttentionInputs (with
        `kv_sink`, layer i's new K/V are already in its cache); piece L returns the hidden
        states [T, hidden] after the final norm."""
        if i == 0 and token_pool is not None:
            first = self.layers[0]
            fused = first.input_layernorm.embed_start(input_ids, token_pool, self.embed_tokens)
            if fused is not None:  # the lookup and the input norm in one launch
                return first.attention_inputs(positions, *fused, self.rotary, kv_sink)
        if i == 0:
            hidden, residual = self.embed_tokens(input_ids, token_pool), None
        else:
            hidden, residual = self.layers[i - 1].after_attention(attn_out, residual)
        if i == len(self.layers):
            return self.norm(hidden, residual, reduce_over=self.tp)[0]
        return self.layers[i].before_attention(positions, hidden, residual, self.rotary, kv_sink)

    def attention_scale(self, i: int) -> float:
        return self.layers[i].self_attn.scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every new token: the pieces
        chained with layer i's attention between them. The new K/V are stored by the piece
        before the attention, in the rotary kernel on CUDA (one launch less per layer)."""
        attn_out = residual = None
        for i in range(len(self.layers)):
            q, k, v, residual = self.piece(
                i, positions, input_ids, attn_out, residual, batch.kv_sink(i), batch.token_pool
            )
            attn_out = batch.attend(i, q, k, v, self.attention_scale(i), kv_stored=True)
        return self.piece(len(self.layers), positions, input_ids, attn_out, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)

    def checkpoint_target(self, hf_name: str) -> tuple[str, str | None] | None:
        """(our parameter name, shard id) for a Hugging Face checkpoint tensor name, or
        None for tensors we do not use (e.g. rotary caches, a tied lm_head copy)."""
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name:
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        if self.config.moe is not None:
            target = moe_checkpoint_target(name)
            if target is not None:
                return target
        for src, dst, shard in (
            ("self_attn.q_proj", "self_attn.qkv_proj", "q"),
            ("self_attn.k_proj", "self_attn.qkv_proj", "k"),
            ("self_attn.v_proj", "self_attn.qkv_proj", "v"),
            ("mlp.gate_proj", "mlp.gate_up_proj", "gate"),
            ("mlp.up_proj", "mlp.gate_up_proj", "up"),
        ):
            if src in name:
                return name.replace(src, dst), shard
        return name, None
