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
    # Sliding-window layers (a window far shorter than the prompts) between full ones, a rope
    # base per layer kind (linear scaling on the full layers, as gemma-3-12b/27b), a softmax
    # scale that is not head_dim's, softcapped logits, tied embeddings.
    "gemma3": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
        "query_pre_attn_scalar": 24,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
    },
    # Sliding layers alternating with full ones, attention sinks, biases everywhere, a MoE of
    # biased experts whose clamped SwiGLU clamps often (a low limit), YaRN rope.
    "gpt-oss": {
        "model_type": "gpt_oss",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
        "swiglu_limit": 1.0,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 32,
        },
    },
    # Gated DeltaNet layers around a gated full-attention one (3 + 1 + 1: a linear layer after
    # the full one too), more value heads than key heads, rope on a quarter of each head;
    # prompts longer than the delta rule's 64-token chunks.
    "qwen3.5": {
        "model_type": "qwen3_5_text",
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "layer_types": ["linear_attention"] * 3 + ["full_attention", "linear_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
    },
    # The MoE kin: every MLP sparse, with a gated shared expert.
    "qwen3.5-moe": {
        "model_type": "qwen3_5_moe_text",
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    },
}
# Architectures with linear-attention layers: one GPU, no piecewise graphs (the engine says so).
LINEAR = ("qwen3.5", "qwen3.5-moe")
# Architectures whose layers attend to a window only: their prompts outgrow it.
WINDOWED = ("gemma3", "gpt-oss")


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


def make_tiny_model(directory: Path, arch: str, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """`overrides`: config fields that replace the tiny architecture's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = tiny_config(arch) | overrides
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(directory), **kwargs)
    return directory


def make_tiny_gemma3_multimodal(directory: Path, seed: int = 0) -> Path:
    """A `gemma3` (Gemma3ForConditionalGeneration) checkpoint: the tiny gemma3 text decoder
    beside a one-layer vision tower, which nanoserve does not load."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = tiny_config("gemma3")
    text.pop("model_type")
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
    }
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=VOCAB - 3,
        boi_token_index=VOCAB - 2,
        eoi_token_index=VOCAB - 1,
    )
    torch.manual_seed(seed)
    Gemma3ForConditionalGeneration(config).float().save_pretrained(str(directory))
    return directory


def first_layer_draft(target_dir: Path, out_dir: Path) -> Path:
    """A draft model for speculative decoding: the target with only its first layer (same
    embedding and head), so that some of its drafts are accepted and some rejected."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    model.save_pretrained(str(out_dir))
    return out_dir


def random_prompts(num: int, seed: int = 0, min_len: int = 3, max_len: int = 80) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [min_len + (i * (max_len - min_len)) // max(num - 1, 1) for i in range(num)]
    rng.shuffle(lengths)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


# Below this gap between a greedy position's two most likely tokens (fp32 log-probabilities),
# another correct kernel's rounding can flip the token: exact-token tests need data above it.
NEAR_TIE = 1e-4


def smallest_margin(outputs) -> float:
    """The smallest gap between the top two log-probabilities over every generated position of
    `outputs` (`LLM.generate` results of a request with logprobs >= 2)."""
    gaps = []
    for out in outputs:
        for lp in out.outputs[0].logprobs:
            first, second = sorted(lp.top.values(), reverse=True)[:2]
            gaps.append(first - second)
    return min(gaps)


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
