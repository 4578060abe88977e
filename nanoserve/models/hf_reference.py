"""A Hugging Face transformers model with exactly the weights nanoserve's dummy loader
makes for a bundled config: the reference for GPU correctness tests and the peer in the
offline benchmark. transformers is imported only here, lazily."""

from __future__ import annotations

import json

import torch

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
    state = dict(dummy_checkpoint(resolve_model(name).config, seed, device, dtype))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"HF model vs dummy checkpoint: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()
