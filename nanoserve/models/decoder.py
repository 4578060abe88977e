"""One decoder for the Llama family (Llama 2/3/3.1, SmolLM2, dense Mistral), Qwen2 (bias
on q/k/v) and Qwen3 (per-head RMSNorm on q and k), and their mixture-of-experts kin
(Mixtral, Qwen2-MoE, Qwen3-MoE), whose sparse layers take the MLP block of
nanoserve/models/moe.py where `ModelConfig.is_moe_layer` says so; Gemma 3's layers (extra
norms around attention and MLP) are nanoserve/models/gemma3.py's, gpt-oss's expert block
nanoserve/models/gpt_oss.py's. Each layer's attention kind (a sliding window, its rope,
gpt-oss's sinks) comes from `ModelConfig.window_of` / `local_rope` / `attention_sinks`.

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
rotates and stores where it can, at 2..16 rows the split-K qkv product's sum kernel:
`Attention._rotating_qkv`); a caller that passes none leaves the store to the attention call.
Every op inside a piece is row-wise (one token per row: norms, linears, rotary by position,
SiLU): rows never mix outside attention.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from nanoserve.attention.base import ForwardBatch, KVSink
from nanoserve.distributed import SINGLE, TPGroup
from nanoserve.kernels import qkv_rope
from nanoserve.kvcache.features import FeatureCache
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
    gelu_tanh_and_mul,
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
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, bias=cfg.o_bias, tp=tp, reduce_slot=0)
        offset = cfg.norm_weight_offset
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, offset) if cfg.qk_norm else None
        self.head_dim = d
        self.scale = cfg.attention_scale if cfg.attention_scale is not None else d**-0.5
        self.window = cfg.window_of(layer_id)  # 0: full attention
        self.sinks = None  # gpt-oss: this rank's heads' sink logits [Hq / N]
        if cfg.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(self.num_heads))
            first = tp.rank * self.num_heads
            self.sinks.weight_loader = lambda p, full, _: p.data.copy_(full[first : first + self.num_heads])

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
        """The qkv product with q and k rotated (and, with `kv_sink`, K/V stored) in its
        epilogue (`kernels.qkv_rope`): at one row by the GEMV (one launch, `rope_in_gemv`), at
        2..16 rows by the split-K sum (`qkv_rope_rows`, `fused_16_rows`: speculative verify
        steps); or None where neither runs (more rows, q/k norms, block-scaled FP8, a config
        without whole pairs or not split): then the product and the rotary kernel run apart."""
        proj = self.qkv_proj
        sw = proj.switches
        if self.q_norm is not None or x.dim() != 2:
            return None
        rows = x.shape[0]
        one_row = rows == 1 and sw.rope_in_gemv
        if not (one_row or (1 < rows <= qkv_rope.ROWS_MAX and sw.fused_16_rows)):
            return None
        fp8 = proj.fp8
        if fp8 is not None and fp8.block:
            return None
        config = proj.small_m_config(x)
        fuses = qkv_rope.fuses_rope(config, self.head_dim) if one_row else qkv_rope.fuses_rope_in_sum(config)
        if not fuses:
            return None
        store = None
        if kv_sink is not None and sw.kv_store_in_rope:
            store = (kv_sink.k_cache, kv_sink.v_cache, kv_sink.slot_mapping)
        fused = qkv_rope.qkv_rope_gemv if one_row else qkv_rope.qkv_rope_rows
        return fused(
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
        if cfg.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"MLP activation {cfg.hidden_act!r} is not supported (silu, gelu_pytorch_tanh)")
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitKPartials:
        """This rank's partial sums of the MLP's output (see RowParallelLinear)."""
        if self.gelu:  # Gemma: no fused GEMV epilogue for it, the compiled elementwise op on CUDA
            return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x), switches=self.switches))
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.self_attn = Attention(cfg, layer_id, tp)
        self.mlp = _mlp_block(cfg, layer_id, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset)

    # Whether `after_attention` returns a summed output (Gemma's closing norm sums it) rather
    # than this rank's partial sums, which the next norm must sum over the group.
    output_summed = False
    sandwich_norms = False  # norms after attention and MLP too (ModelConfig.sandwich_norms)

    def before_attention(self, positions, hidden, residual, rotary, kv_sink: KVSink | None = None) -> AttentionInputs:
        """Input norm (adding the previous layer's output, partial sums under TP, to the
        residual stream; the first layer starts the stream with the embedding) and the
        attention inputs (stored through `kv_sink` when given)."""
        if residual is None:
            hidden, residual = self.input_layernorm.start_stream(hidden, reduce_over=self.tp)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, reduce_over=self.tp)
        return self.attention_inputs(positions, hidden, residual, rotary, kv_sink)

    def mix(self, layer_id: int, batch: ForwardBatch, q, k, v) -> torch.Tensor:
        """The layer's token mixing between its two pieces: attention over the cache (its new
        K/V already stored through the layer's KV sink)."""
        attn = self.self_attn
        return batch.attend(layer_id, q, k, v, attn.scale, kv_stored=True, window=attn.window, sinks=attn.sinks)

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
    """`layer_class`: the family's decoder layer (Gemma 3's is nanoserve.models.gemma3's, which
    `loader.build_model` passes; it must be given for a config with sandwich norms)."""

    # Where the residual stream entering chosen layers is stored (EAGLE-3's target features,
    # nanoserve.kvcache.features); None: nothing is written (the default).
    feature_sink: FeatureCache | None = None

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        tp: TPGroup = SINGLE,
        switches: KernelSwitches | None = None,
        layer_class: type[DecoderLayer] | None = None,
    ):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        layer_class = layer_class or DecoderLayer
        if cfg.sandwich_norms != layer_class.sandwich_norms:
            raise ValueError(f"{cfg.model_type} needs its own decoder layer class, not {layer_class.__name__}")
        self.layers = nn.ModuleList(layer_class(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset)
        self.rotary = RotaryEmbedding(cfg.rope_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        # Sliding layers' own rope (Gemma 3: another base), else they share the global one.
        self.rotary_local = None
        if cfg.local_rope is not None:
            self.rotary_local = RotaryEmbedding(cfg.rope_dim, max_positions, *cfg.local_rope)
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
        scale = self.config.embed_scale
        if i == 0 and token_pool is not None and scale is None:
            first = self.layers[0]
            fused = first.input_layernorm.embed_start(input_ids, token_pool, self.embed_tokens)
            if fused is not None:  # the lookup and the input norm in one launch
                return self._tap(0, first.attention_inputs(positions, *fused, self.rotary_of(0), kv_sink))
        if i == 0:
            hidden, residual = self.embed_tokens(input_ids, token_pool), None
            if scale is not None:  # Gemma: the scale rounded to the weights' dtype, as Hugging Face does
                hidden = hidden * torch.tensor(scale, dtype=torch.float32).to(hidden.dtype)
        else:
            hidden, residual = self.layers[i - 1].after_attention(attn_out, residual)
        if i == len(self.layers):
            summed = self.layers[-1].output_summed
            return self.norm(hidden, residual, reduce_over=SINGLE if summed else self.tp)[0]
        return self._tap(i, self.layers[i].before_attention(positions, hidden, residual, self.rotary_of(i), kv_sink))

    def rotary_of(self, i: int) -> RotaryEmbedding:
        """Layer i's rotary embedding: the sliding layers' own where the model has one."""
        if self.rotary_local is not None and self.config.window_of(i):
            return self.rotary_local
        return self.rotary

    def _tap(self, i: int, inputs: AttentionInputs) -> AttentionInputs:
        """Layer i's attention inputs, after storing the residual stream entering layer i
        into the feature sink when one is attached (inside the piece: eager, piecewise-graph
        and decode-graph forwards all write it)."""
        if self.feature_sink is not None:
            self.feature_sink.write(i, inputs.residual)
        return inputs

    @property
    def attention_module(self) -> Attention:
        """The first softmax-attention layer's module (every one has the same head counts;
        a model may also have linear-attention layers, which have none)."""
        return next(layer.self_attn for layer in self.layers if hasattr(layer, "self_attn"))

    @property
    def has_linear_layers(self) -> bool:
        return self.config.linear is not None

    def attention_scale(self, i: int) -> float:
        return self.layers[i].self_attn.scale

    def attention_kind(self, i: int) -> dict:
        """Layer i's attention kind, as `ForwardBatch.attend` takes it (window, sinks)."""
        attn = self.layers[i].self_attn
        return {"window": attn.window, "sinks": attn.sinks}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every new token: the pieces
        chained with layer i's attention between them. The new K/V are stored by the piece
        before the attention, in the rotary kernel on CUDA (one launch less per layer)."""
        attn_out = residual = None
        for i in range(len(self.layers)):
            q, k, v, residual = self.piece(
                i, positions, input_ids, attn_out, residual, batch.kv_sink(i), batch.token_pool
            )
            attn_out = self.layers[i].mix(i, batch, q, k, v)
        return self.piece(len(self.layers), positions, input_ids, attn_out, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap:  # Gemma: c * tanh(logits / c), as Hugging Face computes it
            logits = torch.tanh(logits / cap) * cap
        return logits

    def checkpoint_target(self, hf_name: str) -> tuple[str, str | None] | None:
        """(our parameter name, shard id) for a Hugging Face checkpoint tensor name, or
        None for tensors we do not use (e.g. rotary caches, a tied lm_head copy)."""
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name:
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        if self.config.moe is not None:
            if self.config.moe.clamped_swiglu is not None:
                from nanoserve.models.gpt_oss import checkpoint_target as gpt_oss_target

                target = gpt_oss_target(name)
            else:
                target = moe_checkpoint_target(name)
            if target is not None:
                return target
        for src, dst, shard in (
            ("self_attn.q_proj", "self_attn.qkv_proj", "q"),
            ("self_attn.k_proj", "self_attn.qkv_proj", "k"),
            ("self_attn.v_proj", "self_attn.qkv_proj", "v"),
            ("mlp.gate_proj", "mlp.gate_up_proj", "gate"),
            ("mlp.up_proj", "mlp.gate_up_proj", "up"),
            # Qwen3.5's Gated DeltaNet input projections (nanoserve.models.qwen3_5)
            ("linear_attn.in_proj_qkv", "linear_attn.in_proj", "qkv"),
            ("linear_attn.in_proj_z", "linear_attn.in_proj", "z"),
            ("linear_attn.in_proj_b", "linear_attn.in_proj", "b"),
            ("linear_attn.in_proj_a", "linear_attn.in_proj", "a"),
        ):
            if src in name:
                return name.replace(src, dst), shard
        return name, None


def _mlp_block(cfg: ModelConfig, layer_id: int, tp: TPGroup) -> nn.Module:
    """Layer `layer_id`'s MLP: dense, the shared sparse block, or gpt-oss's."""
    if not cfg.is_moe_layer(layer_id):
        return MLP(cfg, tp)
    if cfg.moe.clamped_swiglu is not None:
        from nanoserve.models.gpt_oss import GptOssMoE

        return GptOssMoE(cfg, tp)
    return SparseMoE(cfg, tp)
