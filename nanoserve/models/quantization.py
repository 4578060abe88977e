"""FP8 weights: which quantized checkpoints we read, and how their tensors reach the layers.

Owns: `Fp8Scheme` (what a checkpoint's `quantization_config`, or `--quantization fp8`, asks
for), `parse_quantization_config` (the one place that accepts or refuses a config), and the
checkpoint filters that turn a stream of Hugging Face tensors into what the model holds:
- `dequantized`: FP8 weights times their scales in the compute dtype (CPU, the slow twin);
- `fp8_tensors`: FP8 weights kept, each scale in the one shape the layers take: a
  per-channel fp32 vector `weight_scale` [N] (a per-tensor scale repeated over the rows, so
  merged q/k/v or gate/up parts with different scales stay exact) or the block scales
  `weight_scale_inv` [ceil(N/128), ceil(K/128)] fp32; static `input_scale` scalars kept;
- `quantized_online`: bf16/fp32 linear weights quantized per output channel, one tensor at
  a time on the target device (`--quantization fp8`), then either kept (GPU) or dequantized
  again (CPU, so the CPU runs the same rounded weights).

Supported: `quant_method: "fp8"` (e4m3; per-tensor, per-channel or 128x128 block weight
scales; `activation_scheme` dynamic or static) and compressed-tensors `float-quantized` FP8
(per-tensor or per-channel weights; dynamic per-token or static per-tensor activations).
Invariants: any other config is refused before a model is built (`UnsupportedQuantization`);
every FP8 weight meets exactly one scale and every scale one FP8 weight, else loading fails
naming the tensor; the embedding, the LM head and the norms are never quantized.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from nanoserve.kernels.fp8 import FP8_BLOCK as BLOCK
from nanoserve.kernels.fp8 import FP8_DTYPE as FP8
from nanoserve.kernels.fp8 import FP8_MAX

SUPPORTED = (
    "quant_method 'fp8' (float8 e4m3 weights with per-tensor, per-channel or 128x128 block scales, "
    "dynamic or static activation scales) and compressed-tensors 'float-quantized' FP8 (per-tensor or "
    "per-channel weights); or an unquantized checkpoint, optionally with --quantization fp8"
)

# The linear layers' checkpoint names (Mixtral's experts: w1, w3, w2); only these may hold FP8 weights.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


class UnsupportedQuantization(ValueError):
    """A checkpoint's quantization_config (or a --quantization value) nanoserve cannot run."""


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's linear weights are stored in FP8.

    `source`: "fp8" (HF fp8 checkpoint), "compressed-tensors", or "online" (quantized at load).
    `block`: (128, 128) for block-wise scales, None for per-tensor / per-channel (the scale's
    shape tells which). `static_activations`: the checkpoint carries `input_scale`s.
    `ignored`: Hugging Face module names (or compiled patterns) left unquantized."""

    source: str
    block: tuple[int, int] | None = None
    static_activations: bool = False
    ignored: tuple[str | re.Pattern, ...] = ()

    def is_ignored(self, module: str) -> bool:
        """Whether the HF module `module` (e.g. "model.layers.0.mlp.down_proj") stays unquantized."""
        for rule in self.ignored:
            if isinstance(rule, re.Pattern):
                if rule.match(module):
                    return True
            elif module == rule or module.endswith("." + rule) or module.startswith(rule + "."):
                return True
        return False


def online_scheme(quantization: str | None) -> Fp8Scheme | None:
    """The scheme of `--quantization` (None or "fp8"), refusing anything else."""
    if quantization is None:
        return None
    if quantization != "fp8":
        raise UnsupportedQuantization(f"--quantization {quantization!r} is not supported; supported: fp8")
    return Fp8Scheme("online")


def parse_quantization_config(hf_config: dict) -> Fp8Scheme | None:
    """The FP8 scheme of a config.json dict, None if it has no quantization_config; raises
    UnsupportedQuantization naming the method (and what is supported) for anything else."""
    q = hf_config.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None

    def refuse(why: str) -> UnsupportedQuantization:
        return UnsupportedQuantization(
            f"quantization_config with quant_method {method!r}: {why}; nanoserve supports {SUPPORTED}"
        )

    if method == "fp8":
        return _parse_hf_fp8(q, refuse)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(q, refuse)
    raise refuse("this quantization method is not supported")


def _parse_hf_fp8(q: dict, refuse) -> Fp8Scheme:
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise refuse(f"fmt {fmt!r} is not supported (only e4m3)")
    activation = q.get("activation_scheme", "dynamic")
    if activation not in ("dynamic", "static"):
        raise refuse(f"activation_scheme {activation!r} is not supported (dynamic or static)")
    block = q.get("weight_block_size")
    if block is not None:
        if list(block) != [BLOCK, BLOCK]:
            raise refuse(f"weight_block_size {block} is not supported (only [128, 128])")
        block = (BLOCK, BLOCK)
    if block is not None and activation == "static":
        raise refuse("block-wise weights with static activation scales are not supported")
    ignored = tuple(q.get("modules_to_not_convert") or q.get("ignored_layers") or ())
    return Fp8Scheme("fp8", block=block, static_activations=activation == "static", ignored=ignored)


def _parse_compressed_tensors(q: dict, refuse) -> Fp8Scheme:
    fmt = q.get("format")
    if fmt != "float-quantized":
        raise refuse(f"format {fmt!r} is not supported (only 'float-quantized' FP8)")
    if q.get("kv_cache_scheme"):
        raise refuse("kv_cache_scheme (calibrated KV scales) is not supported; use --kv-cache-dtype fp8")
    groups = q.get("config_groups") or {}
    if not groups:
        raise refuse("no config_groups")
    static = set()
    for name, group in groups.items():
        w = group.get("weights") or {}
        if (w.get("num_bits"), w.get("type")) != (8, "float"):
            raise refuse(f"group {name!r}: weights {w.get('num_bits')}-bit {w.get('type')!r} (only 8-bit float)")
        if w.get("strategy") not in ("tensor", "channel"):
            raise refuse(f"group {name!r}: weight strategy {w.get('strategy')!r} (only tensor or channel)")
        if not w.get("symmetric", True) or w.get("dynamic", False):
            raise refuse(f"group {name!r}: asymmetric or dynamic weight scales")
        a = group.get("input_activations")
        if a is None:
            static.add(False)  # weight-only: activations quantized per token at run time
            continue
        if (a.get("num_bits"), a.get("type")) != (8, "float"):
            raise refuse(f"group {name!r}: activations {a.get('num_bits')}-bit {a.get('type')!r} (only 8-bit float)")
        if a.get("dynamic", False):
            if a.get("strategy") not in ("token", "tensor"):
                raise refuse(f"group {name!r}: dynamic activation strategy {a.get('strategy')!r}")
            static.add(False)
        elif a.get("strategy") == "tensor":
            static.add(True)
        else:
            raise refuse(f"group {name!r}: static activation strategy {a.get('strategy')!r} (only tensor)")
    if len(static) > 1:
        raise refuse("groups mixing static and dynamic activation scales")
    ignored = tuple(re.compile(r[3:]) if r.startswith("re:") else r for r in q.get("ignore") or ())
    return Fp8Scheme("compressed-tensors", static_activations=static.pop(), ignored=ignored)


# ---- scales and (de)quantization ------------------------------------------------------------


def channel_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A per-tensor ([], [1]) or per-channel ([N], [N, 1]) weight scale as fp32 [N]."""
    s = scale.float().reshape(-1)
    if s.numel() == 1:
        return s.expand(rows).contiguous()
    if s.numel() != rows:
        raise ValueError(f"weight scale of {s.numel()} values for a weight of {rows} rows")
    return s.contiguous()


def expand_block_scales(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Block scales [ceil(N/128), ceil(K/128)] repeated to one fp32 value per weight element."""
    n, k = shape
    full = scale.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return full[:n, :k]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: bool, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 weight [N, K] times its scales (per-channel [N] or block), in `dtype`."""
    if block:
        return (weight.float() * expand_block_scales(scale, weight.shape)).to(dtype)
    return (weight.float() * channel_scales(scale, weight.shape[0])[:, None]).to(dtype)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, fp32 scale [N]) with each row's absolute maximum mapped to 448."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


# ---- checkpoint filters ---------------------------------------------------------------------

Checkpoint = Iterator[tuple[str, torch.Tensor]]
_SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale")


def _split(name: str) -> tuple[str, str]:
    module, _, leaf = name.rpartition(".")
    return module, leaf


def _is_linear(module: str) -> bool:
    return module.rsplit(".", 1)[-1] in LINEAR_NAMES


def _paired(
    checkpoint: Checkpoint, scheme: Fp8Scheme
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """(module, weight, weight scale, input scale) for every FP8 weight, and (name, tensor,
    None, None) for every other tensor, in checkpoint order as far as pairing allows: an FP8
    weight waits for its scale (and the other way round), and at the end nothing may wait."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    inputs: dict[str, torch.Tensor] = {}
    for name, tensor in checkpoint:
        module, leaf = _split(name)
        if leaf == "input_scale" and not scheme.static_activations:
            continue  # dynamic activation scales: a stored calibration is not used
        if leaf in _SCALE_SUFFIXES:
            if leaf == "weight_scale_inv" and scheme.block is None:
                raise ValueError(f"{name}: block scales in a checkpoint whose config names no weight_block_size")
            if leaf == "weight_scale" and scheme.block is not None:
                raise ValueError(f"{name}: a per-tensor/per-channel scale in a block-wise (128x128) checkpoint")
            (inputs if leaf == "input_scale" else scales)[module] = tensor
        elif leaf == "weight" and tensor.dtype == FP8:
            if not _is_linear(module):
                raise ValueError(f"{name}: FP8 weights are supported on linear layers only, not on this tensor")
            weights[module] = tensor
        else:
            yield name, tensor, None, None
            continue
        if module in weights and module in scales and (module in inputs or not scheme.static_activations):
            yield module, weights.pop(module), scales.pop(module), inputs.pop(module, None)
    left = sorted(set(weights) | set(scales) | set(inputs))
    if left:
        m = left[0]
        what = "a weight without its scale" if m in weights else "a scale without its FP8 weight"
        if m in weights and m in scales:
            what = "an FP8 weight without its input_scale (the config says activation_scheme static)"
        raise ValueError(f"checkpoint tensor(s) of {m!r} unpaired: {what} ({len(left)} module(s) in all)")


def dequantized(checkpoint: Checkpoint, scheme: Fp8Scheme, dtype: torch.dtype) -> Checkpoint:
    """The checkpoint with every FP8 weight times its scales in `dtype` (scales dropped;
    activations are not quantized on this path)."""
    for module, tensor, scale, _ in _paired(checkpoint, scheme):
        if scale is None:
            yield module, tensor
        else:
            yield f"{module}.weight", dequantize(tensor, scale, scheme.block is not None, dtype)


def is_expert(module: str) -> bool:
    """Whether a checkpoint module is a routed MoE expert's projection (mlp.experts.E.*)."""
    return ".experts." in module


def fp8_tensors(checkpoint: Checkpoint, scheme: Fp8Scheme, experts_dtype: torch.dtype | None = None) -> Checkpoint:
    """The checkpoint with FP8 weights kept and scales in the layers' shapes (see the module
    docstring): `weight_scale` fp32 [N], or `weight_scale_inv` fp32 block scales, and a
    static `input_scale` fp32 [1]. `experts_dtype`: MoE experts are dequantized to it instead."""
    for module, tensor, scale, input_scale in _paired(checkpoint, scheme):
        if scale is None:
            yield module, tensor
            continue
        if experts_dtype is not None and is_expert(module):
            yield f"{module}.weight", dequantize(tensor, scale, scheme.block is not None, experts_dtype)
            continue
        yield f"{module}.weight", tensor
        if scheme.block is not None:
            yield f"{module}.weight_scale_inv", scale.float()
        else:
            yield f"{module}.weight_scale", channel_scales(scale, tensor.shape[0])
        if input_scale is not None:
            yield f"{module}.input_scale", input_scale.float().reshape(1)


def quantized_online(
    checkpoint: Checkpoint, device: torch.device, keep_fp8: bool, dtype: torch.dtype, keep_experts: bool = True
) -> Checkpoint:
    """Linear weights of an unquantized checkpoint quantized per output channel on `device`,
    one tensor at a time (the full model never sits there in high precision). keep_fp8: FP8
    weight and `weight_scale` [N]; otherwise (and for MoE experts without keep_experts) the
    rounded weight dequantized to `dtype`."""
    for name, tensor in checkpoint:
        module, leaf = _split(name)
        if leaf != "weight" or not _is_linear(module):
            yield name, tensor
            continue
        if tensor.dtype == FP8:
            raise ValueError(f"{name} is already FP8: --quantization fp8 is for unquantized checkpoints")
        q, scale = quantize_per_channel(tensor.to(device))
        if keep_fp8 and (keep_experts or not is_expert(module)):
            yield name, q
            yield f"{module}.weight_scale", scale
        else:
            yield name, dequantize(q, scale, False, dtype)
