"""A Hugging Face transformers model with exactly the weights nanoserve's dummy loader
makes for a bundled config: the reference for GPU correctness tests and the peer in the
offline benchmark. transformers is imported only here, lazily."""

from __future__ import annotations

import json

import torch

from nanoserve.models import mxfp4
from nanoserve.models.loader import dummy_checkpoint
from nanoserve.models.registry import BUNDLED_DIR, resolve_model


def hf_dummy_model(name: str, seed: int, device: torch.device | str, dtype: torch.dtype):
    """transformers' model for bundled config `name`, weights from `dummy_checkpoint`
    (same seed, device and dtype as an engine built with load_format='dummy')."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((BUNDLED_DIR / f"{name}.json").read_text())
    cfg.pop("architectures", None)
    cfg.pop("torch_dtype", None)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    device = torch.device(device)
    with torch.device(device):  # built on the device so that buffers (rotary) are right
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # gpt-oss's dummy experts come as MXFP4 blocks and scales: transformers gets them dequantized
    dummy = mxfp4.dequantized(dummy_checkpoint(resolve_model(name).config, seed, device, dtype), dtype)
    state = _as_hf_layout(dict(dummy), model)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"HF model vs dummy checkpoint: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


# Checkpoint names of one expert's projections -> (transformers >= 5's stacked parameter, slot)
_EXPERT_PARTS = {
    "gate_proj": ("gate_up_proj", 0),
    "w1": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "w3": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "w2": ("down_proj", None),
}


def _as_hf_layout(state: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """The checkpoint's per-expert MoE tensors (experts.{e}.gate_proj, Mixtral's w1/w3/w2) in
    the layout the transformers model holds: unchanged where it has per-expert parameters,
    stacked into mlp.experts.gate_up_proj [E, 2I, H] (gate rows, then up) and
    mlp.experts.down_proj [E, H, I] where it holds them stacked (transformers >= 5)."""
    own = set(model.state_dict())
    stacked: dict[str, dict[int, list]] = {}
    out = {}
    for key, tensor in state.items():
        head, sep, rest = key.replace(".block_sparse_moe.", ".mlp.").partition(".mlp.experts.")
        if not sep or key in own:
            out[key.replace(".block_sparse_moe.", ".mlp.") if key not in own else key] = tensor
            continue
        expert, proj = rest.split(".")[:2]
        target, slot = _EXPERT_PARTS[proj]
        parts = stacked.setdefault(f"{head}.mlp.experts.{target}", {}).setdefault(int(expert), [None, None])
        parts[slot or 0] = tensor
    for key, experts in stacked.items():
        rows = [torch.cat([t for t in experts[e] if t is not None]) for e in sorted(experts)]
        out[key] = torch.stack(rows)
    return out
