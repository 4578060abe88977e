"""Tiny random Hugging Face checkpoints of every supported architecture, and greedy
generation with transformers as the reference."""

from __future__ import annotations

import random
from pathlib import Path

import torch

VOCAB = 512

# Every decoder family we support; GQA everywhere, one head_dim != hidden/heads, one with
# llama3 rope scaling, biases on q/k/v for Qwen2, q/k norms for Qwen3.
TINY_CONFIGS = {
    "llama": {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2},
    "llama3-rope": {
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "rope_theta": 500000.0,
    },
    "mistral": {"model_type": "mistral", "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": None},
    "qwen2": {"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
}


def tiny_config(arch: str) -> dict:
    """The Hugging Face config.json dict of tiny architecture `arch`."""
    base = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "max_position_embeddings": 1024,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
        "eos_token_id": None,
        "bos_token_id": None,
        "pad_token_id": None,
    }
    base.update(TINY_CONFIGS[arch])
    return base


def make_tiny_model(directory: Path, arch: str, seed: int = 0, max_shard_size: str | None = None) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = tiny_config(arch)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(directory), **kwargs)
    return directory


def random_prompts(num: int, seed: int = 0, min_len: int = 3, max_len: int = 80) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [min_len + (i * (max_len - min_len)) // max(num - 1, 1) for i in range(num)]
    rng.shuffle(lengths)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs
