"""MXFP4 weights (the OCP microscaling format gpt-oss ships its experts in).

Owns: the format's decoding (`dequantize`), the check of a checkpoint's quantization_config
(`is_mxfp4_checkpoint`), random MXFP4 tensors for dummy weights (`dummy_pair`), and the
checkpoint filter `dequantized` that turns each pair of `<name>_blocks` / `<name>_scales`
tensors into `<name>` in the compute dtype, laid out as an unquantized Hugging Face checkpoint
holds it.

Two ways in (KernelSwitches.mxfp4_experts, NANOSERVE_MXFP4_EXPERTS): with the switch on gpt-oss's experts
stay MXFP4 (nanoserve/models/gpt_oss.py `GptOssExperts.use_mxfp4`: the blocks repacked into the
kernels' bit layout, `kernels.moe.pack_mxfp4`, the scales as they are), and the fused MoE kernels
decode them in registers (kernels/moe.py), the torch twins per expert on the fly; with the switch
off (the default) (or widths not in whole 32-groups) `dequantized` runs at load and the model never sees MXFP4.

The format, per group of 32 consecutive elements along the input dimension:
- 32 FP4 E2M1 codes, two to a byte, the even element in the low nibble: a sign bit, then
  (exponent, mantissa) of 2 + 1 bits, values 0, 0.5, 1, 1.5, 2, 3, 4, 6 (and their negatives);
- one E8M0 scale byte s: the group is multiplied by 2^(s - 127).
gpt-oss's tensors: blocks [E, rows, K/32, 16] uint8, scales [E, rows, K/32] uint8, for a weight
whose dequantized form is [E, rows, K]; Hugging Face's unquantized parameter is its transpose
[E, K, rows] (gate_up_proj [E, H, 2I], down_proj [E, I, H]), which is what `dequantized` yields.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from nanoserve.kernels.moe import E2M1_VALUES, mxfp4_weights
from nanoserve.kernels.moe import MXFP4_GROUP as GROUP
from nanoserve.kernels.moe import MXFP4_SCALE_BIAS as SCALE_BIAS


def is_mxfp4_checkpoint(hf_config: dict) -> bool:
    """Whether config.json says the checkpoint's experts are MXFP4; refuses an MXFP4 config on
    a model that nanoserve does not read it for."""
    q = hf_config.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "mxfp4":
        return False
    if hf_config.get("model_type") != "gpt_oss":
        from nanoserve.models.quantization import UnsupportedQuantization

        raise UnsupportedQuantization(
            f"quant_method 'mxfp4' is read for gpt-oss experts only, not for model_type {hf_config.get('model_type')!r}"
        )
    return True


# Random codes take each of the 16 values equally often: mean square (0 + 0.5^2 + ... + 6^2) / 8.
_CODE_MEAN_SQUARE = sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES)


def dummy_pair(
    name: str, shape: tuple[int, ...], gen: torch.Generator, device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    """Random `<name>_blocks` / `<name>_scales` for an expert weight whose unquantized form is
    `shape` [E, K, rows] (Hugging Face's layout): uniform random codes, and per group a scale
    of 2^f or 2^(f+1), f chosen so that the weights' variance is near 1/K (the dummy loader's
    rule for every matrix). Both scales and all 16 codes occur, so a decoding slip shows."""
    e, k, rows = shape
    if k % GROUP:
        raise ValueError(f"MXFP4 dummy weights need the input width ({k}) in whole {GROUP}-groups")
    blocks = torch.randint(0, 256, (e, rows, k // GROUP, GROUP // 2), generator=gen, device=device, dtype=torch.uint8)
    # scale^2 * mean square = 1/K at scale 2^x, x = -log2(K * mean square) / 2; f = floor(x)
    low = SCALE_BIAS + math.floor(-0.5 * math.log2(k * _CODE_MEAN_SQUARE))
    scales = torch.randint(low, low + 2, (e, rows, k // GROUP), generator=gen, device=device, dtype=torch.uint8)
    return [(name + "_blocks", blocks), (name + "_scales", scales)]


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., G, 16] uint8 codes and [..., G] uint8 scales -> [..., G * 32] in `dtype` (exact:
    every MXFP4 value is representable in bf16 and fp32 unless its scale over- or underflows)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}")
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1)  # [..., G, 16, 2]: low nibble first
    return mxfp4_weights(codes.flatten(-2).long(), scales, dtype)  # codes [..., G, 32]


def dequantized(checkpoint: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype):
    """The checkpoint with each `<name>_blocks` / `<name>_scales` pair replaced by `<name>`
    [E, K, rows] in `dtype` (see the module docstring); other tensors pass unchanged. A pair's
    halves may come in any order and files apart; a half left without its partner is an error."""
    pending: dict[str, tuple[str, torch.Tensor]] = {}
    for name, tensor in checkpoint:
        for suffix in ("_blocks", "_scales"):
            if name.endswith(suffix):
                base = name[: -len(suffix)]
                other = pending.pop(base, None)
                if other is None:
                    pending[base] = (suffix, tensor)
                else:
                    blocks, scales = (tensor, other[1]) if suffix == "_blocks" else (other[1], tensor)
                    yield base, dequantize(blocks, scales, dtype).transpose(-1, -2)
                break
        else:
            yield name, tensor
    if pending:
        raise ValueError(f"MXFP4 tensors without their blocks or scales: {sorted(pending)[:4]}")
