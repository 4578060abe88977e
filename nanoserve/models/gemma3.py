"""Gemma 3's decoder layer and checkpoint names (`gemma3_text`, and the text part of `gemma3`).

Owns: `Gemma3DecoderLayer` and `text_checkpoint` (a multimodal checkpoint's text decoder
under the names of a text-only one). What Gemma 3 shares with the other
decoders lives in nanoserve/models/decoder.py (attention with per-head q/k norms, the gated
MLP, here with gelu_pytorch_tanh) and model_config.py (five sliding-window layers to each full
one, a rope base per layer kind, `query_pre_attn_scalar`, the embedding scaled by
sqrt(hidden_size), norms that scale by 1 + weight, the final logit softcapping).

What differs is the layer's flow ("sandwich" norms): attention and MLP outputs are each
normed before they join the residual stream,
    h = h + post_attention_norm(attn(input_norm(h)))
    h = h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))
Invariant: `after_attention` returns (the MLP's output with post_feedforward_norm pending,
the stream before it is added); the next layer's input norm (or the final norm) applies the
pending norm and adds the two, in one launch on one GPU (`layers.PendingNorm`), as the
pre-feedforward norm does with the post-attention one. Under tensor parallelism the post
norms sum the row-parallel partial sums first, so what this layer hands on carries its own
sum (`output_summed`): the next norm must not sum it again.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from nanoserve.distributed import TPGroup
from nanoserve.models.decoder import AttentionInputs, DecoderLayer
from nanoserve.models.layers import PendingNorm, RMSNorm
from nanoserve.models.model_config import ModelConfig

# A multimodal `gemma3` checkpoint's tensors outside the text decoder (not loaded: nanoserve
# serves text only), in both the transformers 4.x and 5.x layouts.
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
# Where the text decoder's tensors sit in a multimodal checkpoint (5.x, then 4.x layout).
_TEXT_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


def text_checkpoint(checkpoint: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A Gemma 3 checkpoint's tensors under text-only names (model.layers..., lm_head...),
    without the vision tower and projector of a multimodal one."""
    for name, tensor in checkpoint:
        if name.startswith(_VISION_PREFIXES):
            continue
        for prefix, replacement in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = replacement + name[len(prefix) :]
                break
        yield name, tensor


class Gemma3DecoderLayer(DecoderLayer):
    output_summed = True
    sandwich_norms = True

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup):
        super().__init__(cfg, layer_id, tp)
        h, eps, offset = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset
        self.pre_feedforward_layernorm = RMSNorm(h, eps, offset)
        self.post_feedforward_layernorm = RMSNorm(h, eps, offset)

    def before_attention(self, positions, hidden, residual, rotary, kv_sink=None) -> AttentionInputs:
        """Input norm (after the previous layer's pending post-feedforward norm and its add to
        the stream; the first layer starts the stream with the embedding) and the attention
        inputs."""
        if residual is None:
            hidden, residual = self.input_layernorm.start_stream(hidden, reduce_over=self.tp)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        return self.attention_inputs(positions, hidden, residual, rotary, kv_sink)

    def after_attention(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[PendingNorm, torch.Tensor]:
        """(the MLP's output with its post-feedforward norm pending, and the stream it joins)."""
        hidden = self.self_attn.after_attention(attn_out)
        attended = PendingNorm(hidden, self.post_attention_layernorm, self.tp)
        hidden, residual = self.pre_feedforward_layernorm(attended, residual)
        return PendingNorm(self.mlp(hidden), self.post_feedforward_layernorm, self.tp), residual
