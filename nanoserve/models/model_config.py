"""Architecture hyperparameters, normalised from a Hugging Face config.

Owns: `ModelConfig`, the one description of a decoder that the model, the weight loader
and the KV cache read. Built from a config.json dict (transformers 4.x field names such as
`rope_theta`/`rope_scaling`, or 5.x `rope_parameters`), whatever the source of the weights.

Mixture-of-experts families (qwen3_moe, qwen2_moe, mixtral) fill `moe`; which layers are
sparse is `is_moe_layer`, as Hugging Face decides it (Qwen: not in `mlp_only_layers` and
(i + 1) a multiple of `decoder_sparse_step`; Mixtral: every layer). Dense layers of a MoE
model use `intermediate_size`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# model_type -> (our decoder family, bias on q/k/v, per-head q/k RMSNorm)
_FAMILIES = {
    "llama": ("llama", False, False),
    "mistral": ("llama", False, False),
    "qwen2": ("qwen2", True, False),
    "qwen3": ("qwen3", False, True),
    "qwen2_moe": ("qwen2", True, False),
    "qwen3_moe": ("qwen3", False, True),
    "mixtral": ("llama", False, False),
}
_MOE_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral")


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MLP blocks of a mixture-of-experts model."""

    num_experts: int
    top_k: int
    renormalize: bool  # divide the top-k routing weights by their sum (Mixtral always does)
    intermediate_size: int  # of each routed expert
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    every_layer: bool = False  # Mixtral: every layer is sparse, whatever the two fields above say

    @staticmethod
    def from_hf_dict(cfg: dict, model_type: str) -> MoEConfig:
        experts = cfg.get("num_experts") or cfg.get("num_local_experts")
        top_k = cfg.get("num_experts_per_tok")
        if not experts or not top_k:
            raise ValueError(f"{model_type} config lacks num_experts / num_experts_per_tok")
        if not 1 <= top_k <= experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and num_experts {experts}")
        mixtral = model_type == "mixtral"
        return MoEConfig(
            num_experts=int(experts),
            top_k=int(top_k),
            renormalize=True if mixtral else bool(cfg.get("norm_topk_prob", False)),
            intermediate_size=int(cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"]),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
            if model_type == "qwen2_moe"
            else 0,
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
            every_layer=mixtral,
        )


_SUPPORTED_ROPE = ("default", "llama3", "linear")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    torch_dtype: str | None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None  # None: a dense model
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def from_hf_dict(cfg: dict, name: str = "") -> ModelConfig:
        model_type = cfg.get("model_type", "")
        if model_type not in _FAMILIES:
            raise ValueError(
                f"unsupported model_type {model_type!r}: nanoserve runs {sorted(_FAMILIES)} "
                "(Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE, Mixtral)"
            )
        family, qkv_bias, qk_norm = _FAMILIES[model_type]
        if family == "llama":
            qkv_bias = bool(cfg.get("attention_bias", False))
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        # Mixtral's defaults where its config.json leaves them out (as transformers' MixtralConfig)
        mixtral = model_type == "mixtral"
        rope_theta, rope_scaling = _rope_fields(cfg, default_theta=1e6 if mixtral else 10000.0)
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        max_pos = cfg.get("max_position_embeddings", 4096)
        window = (
            cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type in ("mistral", "mixtral")) else None
        )
        if window:
            # No sliding-window attention here: stay within the window, where full
            # attention computes the same thing.
            max_pos = min(max_pos, window)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return ModelConfig(
            name=name,
            model_type=model_type,
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5 if mixtral else 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            moe=MoEConfig.from_hf_dict(cfg, model_type) if model_type in _MOE_TYPES else None,
            hf_config=dict(cfg),
        )

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is the sparse mixture-of-experts block."""
        m = self.moe
        if m is None:
            return False
        return m.every_layer or (i not in m.mlp_only_layers and (i + 1) % m.decoder_sparse_step == 0)

    def with_eos(self, eos_ids) -> ModelConfig:
        merged = tuple(dict.fromkeys([*self.eos_token_ids, *eos_ids]))
        return ModelConfig(**{**self.__dict__, "eos_token_ids": merged})


def _rope_fields(cfg: dict, default_theta: float = 10000.0) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from either config generation's fields."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = params["rope_theta"]
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = cfg.get("rope_theta", default_theta)
        scaling = dict(cfg["rope_scaling"]) if cfg.get("rope_scaling") else None
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in _SUPPORTED_ROPE:
            raise ValueError(f"unsupported rope scaling {rope_type!r}; supported: {_SUPPORTED_ROPE}")
        scaling["rope_type"] = rope_type
        if rope_type == "default":
            scaling = None
    return float(theta), scaling
