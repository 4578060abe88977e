"""Architecture hyperparameters, normalised from a Hugging Face config.

Owns: `ModelConfig`, the one description of a decoder that the model, the weight loader
and the KV cache read. Built from a config.json dict (transformers 4.x field names such as
`rope_theta`/`rope_scaling`, or 5.x `rope_parameters`), whatever the source of the weights.

Mixture-of-experts families (qwen3_moe, qwen2_moe, mixtral) fill `moe`; which layers are
sparse is `is_moe_layer`, as Hugging Face decides it (Qwen: not in `mlp_only_layers` and
(i + 1) a multiple of `decoder_sparse_step`; Mixtral: every layer). Dense layers of a MoE
model use `intermediate_size`.

Models that mix attention kinds (Gemma 3) list one kind per layer in `layer_types`
("full_attention" or "sliding_attention", as Hugging Face's configs do); a sliding layer
attends to its last `sliding_window` positions (`window_of`) and may have its own rope
(`local_rope`). Any other layer kind is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.kvcache.linear_state import StateShape

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
LAYER_KINDS = ("full_attention", "sliding_attention")
LINEAR_KIND = "linear_attention"  # Qwen3.5's Gated DeltaNet layers (that family only)
_QWEN3_5_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Qwen3.5's Gated DeltaNet layers: a short causal convolution over the q/k/v channels,
    then the gated delta rule with a state [head_k_dim, head_v_dim] per value head (each key
    head serves num_v_heads / num_k_heads value heads)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:  # the convolved channels: q, k and v
        return 2 * self.key_dim + self.value_dim


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
    # gpt-oss: biased router and experts whose activation is a clamped SwiGLU,
    # (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit).
    clamped_swiglu: tuple[float, float] | None = None  # (alpha, limit); None: SiLU experts

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


_SUPPORTED_ROPE = ("default", "llama3", "linear", "yarn")


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
    # Mixed attention kinds and the Gemma family's details (defaults: a Llama-like model).
    layer_types: tuple[str, ...] = ()  # one of LAYER_KINDS per layer; empty: every layer full
    sliding_window: int = 0  # positions a sliding layer sees (itself included)
    local_rope: tuple[float, dict | None] | None = None  # sliding layers' (theta, scaling); None: the global one
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    hidden_act: str = "silu"  # the gated MLP's activation: silu or gelu_pytorch_tanh
    norm_weight_offset: float = 0.0  # Gemma's RMSNorm scales by (offset + weight)
    embed_scale: float | None = None  # Gemma multiplies the embedding by sqrt(hidden_size)
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c)
    sandwich_norms: bool = False  # Gemma: norms after attention and MLP as well as before
    attention_sinks: bool = False  # gpt-oss: a learned sink logit per query head
    o_bias: bool = False  # a bias on the attention output projection (gpt-oss)
    # Qwen3.5: Gated DeltaNet layers (LINEAR_KIND in layer_types), rope on the first
    # `rotary_dim` dims of each head only, and full attention whose output is gated per
    # channel by sigmoid of a second half of q_proj's rows.
    linear: LinearAttentionConfig | None = None
    rotary_dim: int = 0  # 0: head_dim
    attn_output_gate: bool = False
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def from_hf_dict(cfg: dict, name: str = "") -> ModelConfig:
        model_type = cfg.get("model_type", "")
        if model_type in ("gemma3", "gemma3_text"):
            return _gemma3_config(cfg, name)
        if model_type == "gpt_oss":
            return _gpt_oss_config(cfg, name)
        if model_type in _QWEN3_5_TYPES:
            return _qwen3_5_config(cfg, name)
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
        # A sliding window as Hugging Face applies it: on every layer for Mistral and Mixtral
        # (whenever sliding_window is set), on layers from max_window_layers on for the Qwen
        # families with use_sliding_window (unless the config lists layer_types itself).
        window = (
            cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type in ("mistral", "mixtral")) else None
        )
        layers = cfg["num_hidden_layers"]
        if not window:
            _layer_types(cfg, layers, ["full_attention"] * layers)  # checked, then every layer is full
            kinds = ()
        elif model_type in ("mistral", "mixtral"):
            kinds = _layer_types(cfg, layers, ["sliding_attention"] * layers)
        else:
            first = cfg.get("max_window_layers", 28)
            kinds = _layer_types(
                cfg, layers, ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
            )
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
            layer_types=kinds,
            sliding_window=int(window or 0),
            hf_config=dict(cfg),
        )

    @property
    def rope_dim(self) -> int:
        """Dims of each head that rope rotates (the first ones)."""
        return self.rotary_dim or self.head_dim

    def is_linear_layer(self, i: int) -> bool:
        """Whether layer i is a linear-attention (Gated DeltaNet) layer: no KV cache."""
        return bool(self.layer_types) and self.layer_types[i] == LINEAR_KIND

    @property
    def linear_state_shape(self) -> StateShape | None:
        """What the linear layers' state pool holds (nanoserve.kvcache.linear_state); None without them."""
        lin = self.linear
        if lin is None:
            return None
        layers = tuple(i for i in range(self.num_layers) if self.is_linear_layer(i))
        return StateShape(layers, lin.conv_dim, lin.conv_kernel, lin.num_v_heads, lin.head_k_dim, lin.head_v_dim)

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep K/V per token (all but linear-attention ones)."""
        return sum(not self.is_linear_layer(i) for i in range(self.num_layers))

    def window_of(self, i: int) -> int:
        """Layer i's sliding window in positions (0: full attention)."""
        if self.layer_types and self.layer_types[i] == "sliding_attention":
            return self.sliding_window
        return 0

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


def _sizes(cfg: dict, layers: int, heads: int, hidden: int, defaults: dict) -> dict:
    """ModelConfig's size, vocabulary and token fields from a config dict, with the family's
    `defaults` (Hugging Face key -> value) for what the dict leaves out."""

    def get(key):
        value = cfg.get(key)
        return defaults.get(key) if value is None else value

    eos = get("eos_token_id")
    return {
        "hidden_size": hidden,
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": get("num_key_value_heads"),
        "head_dim": get("head_dim"),
        "intermediate_size": get("intermediate_size"),
        "vocab_size": get("vocab_size"),
        "rms_norm_eps": get("rms_norm_eps"),
        "max_position_embeddings": cfg.get("max_position_embeddings", 131_072),
        "tie_word_embeddings": bool(get("tie_word_embeddings")),
        "torch_dtype": cfg.get("torch_dtype") or cfg.get("dtype"),
        "bos_token_id": get("bos_token_id"),
        "eos_token_ids": tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
    }


def _layer_types(
    cfg: dict, num_layers: int, default: list[str], allowed: tuple[str, ...] = LAYER_KINDS
) -> tuple[str, ...]:
    """The config's per-layer attention kinds (or `default`), checked: every entry one of
    `allowed`, one per layer."""
    kinds = cfg.get("layer_types") or default
    bad = sorted({k for k in kinds if k not in allowed})
    if bad:
        raise ValueError(f"unsupported layer_types entries {bad}: nanoserve runs {list(allowed)} for this family")
    if len(kinds) != num_layers:
        raise ValueError(f"layer_types has {len(kinds)} entries for {num_layers} layers")
    return tuple(kinds)


def _text_part(cfg: dict, multimodal: bool) -> dict:
    """The text decoder's config: a multimodal config's `text_config`, with the token, dtype
    and tying fields it leaves to the outer config; else the config itself."""
    if not multimodal:
        return dict(cfg)
    text = dict(cfg.get("text_config") or {})
    for key in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype", "tie_word_embeddings"):
        if key not in text and key in cfg:
            text[key] = cfg[key]
    return text


def _gemma3_rope(text: dict) -> tuple[tuple[float, dict | None], tuple[float, dict | None]]:
    """((theta, scaling) of full layers, (theta, scaling) of sliding layers) from either
    config generation: 5.x `rope_parameters` per layer kind, or 4.x `rope_theta`,
    `rope_local_base_freq` and a `rope_scaling` that applies to full layers only."""
    params = text.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full = _rope_fields({"rope_parameters": params["full_attention"]}, 1_000_000.0)
        local = _rope_fields({"rope_parameters": params.get("sliding_attention") or {}}, 10_000.0)
        return full, local
    full = _rope_fields({k: text[k] for k in ("rope_theta", "rope_scaling") if k in text}, 1_000_000.0)
    return full, (float(text.get("rope_local_base_freq", 10_000.0)), None)


def _gemma3_config(cfg: dict, name: str) -> ModelConfig:
    """Gemma 3's text decoder: a `gemma3_text` config, or the text part of a multimodal
    `gemma3` one (its vision tower is not loaded: nanoserve serves text only)."""
    text = _text_part(cfg, multimodal=cfg.get("model_type") == "gemma3")
    if text.get("attn_logit_softcapping"):
        raise ValueError("Gemma attention logit softcapping (attn_logit_softcapping) is not supported")
    if text.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True (an encoder) is not supported")
    if text.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported for Gemma 3")
    act = text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma 3 activation {act!r} is not supported (gelu_pytorch_tanh)")
    layers = text.get("num_hidden_layers", 26)
    pattern = text.get("sliding_window_pattern", 6)
    default_kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    hidden = text.get("hidden_size", 2304)
    heads = text.get("num_attention_heads", 8)
    (theta, scaling), local = _gemma3_rope(text)
    sliding = int(text.get("sliding_window") or 4096)
    defaults = {"num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 9216, "vocab_size": 262_208}
    defaults |= {"rms_norm_eps": 1e-6, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1}
    return ModelConfig(
        name=name,
        model_type="gemma3_text",
        **_sizes(text, layers, heads, hidden, defaults),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=False,
        qk_norm=True,
        layer_types=_layer_types(text, layers, default_kinds),
        sliding_window=sliding,
        local_rope=local,
        attention_scale=float(text.get("query_pre_attn_scalar", 256)) ** -0.5,
        hidden_act=act,
        norm_weight_offset=1.0,
        embed_scale=hidden**0.5,
        final_logit_softcapping=text.get("final_logit_softcapping"),
        sandwich_norms=True,
        hf_config=dict(cfg),
    )


def _gpt_oss_config(cfg: dict, name: str) -> ModelConfig:
    """gpt-oss: sliding-window layers alternating with full ones, attention sinks, biases on
    every attention projection, and a mixture of experts in every layer (biased router and
    experts, clamped SwiGLU). YaRN rope. Defaults as transformers' GptOssConfig."""
    layers = cfg.get("num_hidden_layers", 36)
    heads = cfg.get("num_attention_heads", 64)
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 128
    top_k = cfg.get("num_experts_per_tok", 4)
    if not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and num_local_experts {experts}")
    default_rope = {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    }
    rope_cfg = dict(cfg)
    if not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
        rope_cfg["rope_scaling"] = default_rope
    theta, scaling = _rope_fields(rope_cfg, default_theta=150_000.0)
    default_kinds = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    bias = bool(cfg.get("attention_bias", True))
    inter = cfg.get("intermediate_size", 2880)
    defaults = {"num_key_value_heads": heads, "head_dim": 64, "intermediate_size": inter, "vocab_size": 201_088}
    defaults |= {"rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    return ModelConfig(
        name=name,
        model_type="gpt_oss",
        **_sizes(cfg, layers, heads, cfg.get("hidden_size", 2880), defaults),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=bias,
        qk_norm=False,
        moe=MoEConfig(
            num_experts=int(experts),
            top_k=int(top_k),
            renormalize=True,  # a softmax over the k largest logits
            intermediate_size=int(inter),
            every_layer=True,
            clamped_swiglu=(float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0))),
        ),
        layer_types=_layer_types(cfg, layers, default_kinds),
        sliding_window=int(cfg.get("sliding_window") or 128),
        attention_sinks=True,
        o_bias=bias,
        hf_config=dict(cfg),
    )


def _qwen3_5_config(cfg: dict, name: str) -> ModelConfig:
    """Qwen3.5, dense and MoE: three Gated DeltaNet layers to each gated full-attention one
    (`full_attention_interval`), rope on a quarter of each head (for text the multimodal rope's
    three position axes coincide: plain rope), norms that scale by 1 + weight. A multimodal
    `qwen3_5` / `qwen3_5_moe` config serves its text part. Defaults as transformers'."""
    multimodal = cfg.get("model_type") in ("qwen3_5", "qwen3_5_moe")
    text = _text_part(cfg, multimodal)
    moe = "moe" in cfg.get("model_type", "")
    if text.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported for Qwen3.5")
    layers = text.get("num_hidden_layers", 40 if moe else 32)
    interval = text.get("full_attention_interval", 4)
    default_kinds = [LINEAR_KIND if (i + 1) % interval else "full_attention" for i in range(layers)]
    kinds = _layer_types(text, layers, default_kinds, allowed=("full_attention", LINEAR_KIND))
    heads = text.get("num_attention_heads", 16)
    hidden = text.get("hidden_size", 2048 if moe else 4096)
    params = dict(text.get("rope_parameters") or {})
    factor = float(params.pop("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    for key in ("mrope_section", "mrope_interleaved"):
        params.pop(key, None)
    rope_src = {"rope_parameters": params} if "rope_theta" in params else {}
    theta, scaling = _rope_fields(rope_src or text, default_theta=10_000.0)
    defaults = {"num_key_value_heads": 2 if moe else 4, "head_dim": 256, "vocab_size": 248_320}
    defaults |= {"intermediate_size": 0 if moe else 12288, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    sizes = _sizes(text, layers, heads, hidden, defaults)
    experts = None
    if moe:
        experts = MoEConfig(
            num_experts=int(text.get("num_experts", 256)),
            top_k=int(text.get("num_experts_per_tok", 8)),
            renormalize=True,  # the router always divides the top-k weights by their sum
            intermediate_size=int(text.get("moe_intermediate_size", 512)),
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 512)),
            every_layer=True,
        )
        if not 1 <= experts.top_k <= experts.num_experts:
            raise ValueError(f"num_experts_per_tok {experts.top_k} must be between 1 and num_experts")
    linear = LinearAttentionConfig(
        num_k_heads=int(text.get("linear_num_key_heads", 16)),
        num_v_heads=int(text.get("linear_num_value_heads", 32)),
        head_k_dim=int(text.get("linear_key_head_dim", 128)),
        head_v_dim=int(text.get("linear_value_head_dim", 128)),
        conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
    )
    if linear.num_v_heads % linear.num_k_heads:
        raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    return ModelConfig(
        name=name,
        model_type="qwen3_5_moe_text" if moe else "qwen3_5_text",
        **sizes,
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=False,
        qk_norm=True,
        moe=experts,
        layer_types=kinds,
        norm_weight_offset=1.0,
        linear=linear,
        rotary_dim=int(sizes["head_dim"] * factor),
        attn_output_gate=True,
        hf_config=dict(cfg),
    )
