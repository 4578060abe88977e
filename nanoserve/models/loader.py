"""Weight loading: builds a `DecoderLM` and fills it from safetensors, GGUF or dummy data.

Owns: the three checkpoint readers (each yields Hugging Face-named full tensors) and
`load_weights`, which routes every tensor through its parameter's `weight_loader` so the
layers cut out their tensor-parallel slices.
Invariant: after loading, every parameter was written exactly once (tied weights count
once); a missing or unexpected tensor is an error, never silently left random.
FP8 (nanoserve/models/quantization.py): a checkpoint's quantization_config is accepted or
refused before the model is built; on CUDA the linears hold FP8 weights and their scales, on
CPU (or with keep_fp8=False) the weights are dequantized to the compute dtype at load.
MXFP4 (gpt-oss's experts, nanoserve/models/mxfp4.py): kept packed on every device where
KernelSwitches.mxfp4_experts is on (NANOSERVE_MXFP4_EXPERTS=1), else (the default) dequantized at load.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from nanoserve.distributed import SINGLE, TPGroup
from nanoserve.models import mxfp4
from nanoserve.models import quantization as quant
from nanoserve.models.decoder import DecoderLayer, DecoderLM
from nanoserve.models.gemma3 import Gemma3DecoderLayer, text_checkpoint
from nanoserve.models.gpt_oss import GptOssExperts
from nanoserve.models.gpt_oss import hf_shapes as gpt_oss_shapes
from nanoserve.models.layers import ColumnParallelLinear, RowParallelLinear, init_unloaded
from nanoserve.models.model_config import ModelConfig
from nanoserve.models.moe import StackedExperts, hf_moe_shapes
from nanoserve.models.qwen3_5 import Qwen35DecoderLayer, prefill_path
from nanoserve.models.qwen3_5 import hf_shapes as qwen3_5_shapes
from nanoserve.models.qwen3_5 import text_checkpoint as qwen3_5_text_checkpoint
from nanoserve.models.registry import ModelSource, gguf_metadata
from nanoserve.switches import KernelSwitches

log = logging.getLogger("nanoserve")

Checkpoint = Iterator[tuple[str, torch.Tensor]]


def safetensors_checkpoint(directory: Path) -> Checkpoint:
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    for file in tqdm(files, desc="loading safetensors", disable=len(files) < 2):
        with safe_open(str(directory / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 -- a safetensors handle, not a dict
                yield name, f.get_tensor(name)


_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of q/k rows (interleaved rotary pairs) so the weights
    work with rotate-half rotary, as in the Hugging Face checkpoint."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_checkpoint(path: Path, cfg: ModelConfig) -> Checkpoint:
    from gguf.quants import dequantize

    _, reader = gguf_metadata(path)
    for tensor in tqdm(reader.tensors, desc="dequantizing GGUF", leave=False):
        weight = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
        parts = tensor.name.split(".")
        if parts[0] == "blk":
            layer, kind, suffix = parts[1], parts[2], parts[3]
            name = f"model.layers.{layer}.{_GGUF_NAMES[kind]}.{suffix}"
            if cfg.model_type == "llama" and kind in ("attn_q", "attn_k"):
                weight = _unpermute_rope(weight, cfg.num_heads if kind == "attn_q" else cfg.num_kv_heads)
        else:
            name = {
                "token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight",
            }[tensor.name]
        yield name, weight


def hf_parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of this architecture holds, with its shape."""
    h, d = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if cfg.sandwich_norms:
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        if cfg.linear is not None:  # Qwen3.5: its own mixers
            shapes |= qwen3_5_shapes(cfg, i, p)
            shapes |= _mlp_shapes(cfg, i, p)
            continue
        for proj, rows in (
            ("q_proj", cfg.num_heads * d),
            ("k_proj", cfg.num_kv_heads * d),
            ("v_proj", cfg.num_kv_heads * d),
        ):
            shapes[p + f"self_attn.{proj}.weight"] = (rows, h)
            if cfg.qkv_bias:
                shapes[p + f"self_attn.{proj}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.num_heads * d)
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.attention_sinks:
            shapes[p + "self_attn.sinks"] = (cfg.num_heads,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes |= _mlp_shapes(cfg, i, p)
    return shapes


def _mlp_shapes(cfg: ModelConfig, i: int, p: str) -> dict[str, tuple[int, ...]]:
    """Layer i's MLP tensors (`p`: "model.layers.{i}.")."""
    h = cfg.hidden_size
    if cfg.is_moe_layer(i):
        return gpt_oss_shapes(cfg, p) if cfg.moe.clamped_swiglu else hf_moe_shapes(cfg, p)
    return {
        p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
        p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
        p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
    }


# Dummy weights: gains over a unit base. Every matrix, the embedding and lm_head included,
# is uniform with variance 1/fan_in, so it maps order-one inputs to order-one outputs and the
# residual grows like sqrt(layers) (about 6 at 36 layers: bf16-safe). The embedding is thus
# small beside what the layers add: with tied embeddings a large one (as before 2026-11-25,
# variance 1/3) made the current token's own row win the logits, and greedy outputs repeated
# one token whatever the context.
DUMMY_LOGIT_GAIN = 6.0
"""Final norm weight: the logits' spread over the vocabulary is about this. Dummy qwen3-0.6b
(all 28 layers, fp32, 8 prompts x 16 greedy tokens) then has a median top-1 probability of
0.40 and 9.5 distinct tokens per output, as in trained models the top token is neither certain
nor lost among 150k; and bf16 stays as close to fp32 as on real weights: 4/8 outputs identical,
mean common prefix 10.1 of 16, every divergence keeps the other run's token in its top-5.
Measured 2026-11-25 (benchmarks/results/2026-11-25.md): gain 8 with queries scaled by 4 varied as much
but made bf16 and fp32 disagree on the first token's top-5 (too chaotic to compare fast paths
on); gain 3 gave a median top-1 probability of 0.05 (too flat)."""


def dummy_checkpoint(cfg: ModelConfig, seed: int, device: torch.device, dtype: torch.dtype) -> Checkpoint:
    """Random full tensors, each a function of (seed, name) alone, so every rank and every
    run with the same seed on the same device type sees the same weights.

    Activations stay of order one through the layers; greedy outputs vary from prompt to
    prompt and step to step, and logits are spread as in trained models (tests/test_dummy_weights.py).
    A model that scales its embedding (Gemma: by sqrt(hidden_size)) gets an embedding divided by
    that scale, so that its stream starts as other families' do (at full scale the current
    token's own row won the tied logits and outputs looped over 2-5 tokens); with tied
    embeddings the final norm's gain then makes up for the smaller LM head.

    A config whose checkpoint is MXFP4 (gpt-oss's bundled ones) gets its experts as random
    MXFP4 `*_blocks` / `*_scales` (`mxfp4.dummy_pair`), as its checkpoint holds them: the
    loader keeps them packed or dequantizes them, as it would a real checkpoint's."""
    tied_gain = cfg.embed_scale if (cfg.embed_scale and cfg.tie_word_embeddings) else 1.0
    mx = mxfp4.is_mxfp4_checkpoint(cfg.hf_config)
    for name, shape in hf_parameter_shapes(cfg).items():
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if mx and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            yield from mxfp4.dummy_pair(name, shape, gen, device)
            continue
        values = torch.rand(shape, generator=gen, device=device, dtype=torch.float32) * 2 - 1
        if name.endswith("norm.weight"):
            values = 1 + 0.1 * values
            if name == "model.norm.weight":
                values = values * DUMMY_LOGIT_GAIN * tied_gain
            if not name.endswith("linear_attn.norm.weight"):  # Qwen3.5's gated norm scales by its weight alone
                values = values - cfg.norm_weight_offset  # the gain once the loader adds the offset back
        elif name.endswith((".bias", "_bias")):
            values = 0.1 * values
        elif name.endswith(".sinks"):  # logits of order one
            pass
        else:  # gpt-oss's experts are stored [E, fan_in, fan_out]
            fan_in = shape[1] if name.endswith(("experts.gate_up_proj", "experts.down_proj")) else shape[-1]
            values = values * (3.0 / fan_in) ** 0.5
            if name == "model.embed_tokens.weight" and cfg.embed_scale:
                values = values / cfg.embed_scale  # which the model multiplies back (see above)
        yield name, values.to(dtype)


def load_weights(model: DecoderLM, checkpoint: Checkpoint) -> None:
    params = dict(model.named_parameters())
    expected = set(params)
    loaded: set[str] = set()
    for hf_name, tensor in checkpoint:
        target = model.checkpoint_target(hf_name)
        if target is None:
            continue
        name, shard = target
        if name not in params:
            raise KeyError(f"checkpoint tensor {hf_name!r} has no place in the model ({name!r})")
        param = params[name]
        loader = getattr(param, "weight_loader", None)
        tensor = tensor.to(device=param.device, dtype=param.dtype)
        if loader is not None:
            loader(param, tensor, shard)
        else:
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"shape mismatch for {hf_name}: checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
        loaded.add(name if shard is None else f"{name}:{shard}")
    needed = set()
    for name in expected:
        prefix, leaf = name.rsplit(".", 1)
        module = model.get_submodule(prefix)
        parts = getattr(module, "parts", None)
        if hasattr(module, "expected_shards"):  # stacked MoE experts: one shard per expert and part
            needed |= {f"{name}:{s}" for s in module.expected_shards(leaf)}
        else:
            needed |= {f"{name}:{p.name}" for p in parts} if parts and parts[0].name else {name}
    missing = needed - loaded
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:4]}")


def build_model(
    source: ModelSource,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    max_positions: int,
    tp: TPGroup = SINGLE,
    switches: KernelSwitches | None = None,
    quantization: str | None = None,
    keep_fp8: bool | None = None,
) -> DecoderLM:
    """The model with its weights. `quantization` "fp8": linear weights quantized per
    channel at load. `keep_fp8` (default: on CUDA) holds FP8 weights in the linears; off,
    FP8 weights are dequantized to `dtype` at load (the CPU path and slow twin)."""
    cfg = source.config
    # Refused here, before anything is built or read: nothing is ever half-loaded.
    mx = mxfp4.is_mxfp4_checkpoint(cfg.hf_config)  # gpt-oss experts: packed, or dequantized at load
    scheme = None if mx else quant.parse_quantization_config(cfg.hf_config)
    online = quant.online_scheme(quantization)
    if (scheme is not None or mx) and online is not None:
        raise quant.UnsupportedQuantization(
            f"the checkpoint is already quantized (quant_method {'mxfp4' if mx else scheme.source!r}): "
            "leave out --quantization"
        )
    if scheme is not None and load_format == "dummy":
        scheme, online = None, quant.Fp8Scheme("online")  # random weights: quantized at load per channel
    if cfg.model_type == "gpt_oss" and (scheme or online) is not None:
        raise quant.UnsupportedQuantization(
            "FP8 weights are not supported for gpt-oss (its experts come as MXFP4): leave out --quantization"
        )
    if cfg.moe is not None and scheme is not None and scheme.static_activations:
        raise quant.UnsupportedQuantization(
            f"static activation scales on mixture-of-experts experts are not supported ({cfg.model_type}): the "
            "fused MoE kernels quantize no activations; use a checkpoint with dynamic activation scales"
        )
    keep = device.type == "cuda" if keep_fp8 is None else keep_fp8
    fp8 = keep and (scheme or online) is not None
    # FP8 MoE experts stay e4m3 only where the fused MoE kernels are to run them (KernelSwitches.fp8_experts),
    # else they are dequantized at load while the linears keep FP8.
    keep_experts = keep and (switches or KernelSwitches()).fp8_experts
    packed = mx and _keeps_mxfp4(cfg, tp, switches or KernelSwitches())
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        # FP8 linears and MXFP4 experts are built on the meta device first and allocated once
        # converted: the model never takes its high-precision size on the device (a 70B model,
        # or gpt-oss-120b's experts in bf16, would not fit).
        with torch.device("meta" if fp8 or packed else device):
            layer_class = _layer_class(cfg)
            model = DecoderLM(cfg, max_positions=max_positions, tp=tp, switches=switches, layer_class=layer_class)
            if fp8:
                _use_fp8(model, scheme or online, keep_experts)
            for module in model.modules() if packed else ():
                if isinstance(module, GptOssExperts):
                    module.use_mxfp4()
        if fp8 or packed:
            _materialize(model, device)
            init_unloaded(model)
    finally:
        torch.set_default_dtype(previous)
    if load_format == "dummy":
        checkpoint = dummy_checkpoint(cfg, seed, device, dtype)
    elif source.kind == "hf":
        checkpoint = safetensors_checkpoint(source.path)
    elif source.kind == "gguf":
        checkpoint = gguf_checkpoint(source.path, cfg)
    else:
        raise ValueError(f"model {cfg.name!r} is a bundled config without weights: use load_format='dummy'")
    if mx and not packed:
        checkpoint = mxfp4.dequantized(checkpoint, dtype)
    if cfg.model_type == "gemma3_text":
        checkpoint = text_checkpoint(checkpoint)
    if cfg.linear is not None:
        checkpoint = qwen3_5_text_checkpoint(checkpoint)
    if scheme is not None:
        if keep:
            checkpoint = quant.fp8_tensors(checkpoint, scheme, None if keep_experts else dtype)
        else:
            checkpoint = quant.dequantized(checkpoint, scheme, dtype)
    elif online is not None:
        checkpoint = quant.quantized_online(checkpoint, device, keep, dtype, keep_experts)
    with torch.no_grad():
        load_weights(model, checkpoint)
    if cfg.linear is not None:
        log.info("Gated DeltaNet prefill: %s", prefill_path(device, dtype, switches or KernelSwitches()))
    return model.eval()


def _keeps_mxfp4(cfg: ModelConfig, tp: TPGroup, switches: KernelSwitches) -> bool:
    """Whether an MXFP4 checkpoint's experts stay packed (KernelSwitches.mxfp4_experts): where
    the switch is on and the widths are whole 32-element groups, else they are dequantized at
    load (said in the log: the slow path, not an error)."""
    if not switches.mxfp4_experts:
        return False
    shard = cfg.moe.intermediate_size // tp.size
    if not GptOssExperts.mxfp4_fits(cfg.hidden_size, shard):
        log.warning(
            "MXFP4 experts dequantized at load: hidden size %d or expert shard %d is not whole 32-element groups",
            cfg.hidden_size,
            shard,
        )
        return False
    return True


def _layer_class(cfg: ModelConfig) -> type[DecoderLayer]:
    if cfg.linear is not None:
        return Qwen35DecoderLayer
    return Gemma3DecoderLayer if cfg.sandwich_norms else DecoderLayer


_MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _use_fp8(model: DecoderLM, scheme: quant.Fp8Scheme, experts: bool) -> None:
    """Turn every linear (and with `experts` every stacked-experts block) the scheme quantizes
    into an FP8 one (before loading)."""
    for name, module in model.named_modules():
        if isinstance(module, StackedExperts):
            if not experts:
                continue
            hf_name, parts = f"model.{name}", ("gate_proj", "up_proj", "down_proj")
            if model.config.model_type == "mixtral":
                hf_name, parts = hf_name.replace(".mlp.", ".block_sparse_moe."), ("w1", "w3", "w2")
            hf = [f"{hf_name}.{e}.{p}" for e in range(module.num_experts) for p in parts]
            ignored = [scheme.is_ignored(n) for n in hf]
            if any(ignored) and not all(ignored):
                raise quant.UnsupportedQuantization(f"model.{name}: experts of which only some are quantized")
            if not any(ignored):
                module.use_fp8(scheme.block is not None)
            continue
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        prefix, _, leaf = f"model.{name}".rpartition(".")
        hf_names = [f"{prefix}.{part}" for part in _MERGED.get(leaf, (leaf,))]
        ignored = [scheme.is_ignored(n) for n in hf_names]
        if all(ignored):
            continue
        if any(ignored):
            raise quant.UnsupportedQuantization(f"{hf_names}: merged projections of which only some are quantized")
        module.use_fp8(scheme.block is not None, scheme.static_activations)


def _materialize(model: DecoderLM, device: torch.device) -> None:
    """Give every meta tensor of `model` storage on `device` (garbage until loaded or
    `init_unloaded`), each Parameter keeping its attributes (its weight_loader) and ties."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) not in made:
                q = torch.nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                q.__dict__.update(p.__dict__)
                made[id(p)] = q
            if p is not None:
                module._parameters[name] = made[id(p)]
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.empty_like(b, device=device)
