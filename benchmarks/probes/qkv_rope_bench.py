"""The one-row qkv GEMV with the rotation in its epilogue (`kernels.qkv_rope`) against the
pair it replaces (the GEMV, then the rotary kernel with its K/V store), llama-3.1-8b's qkv
(32 q / 8 kv heads of 128, K = 4096), bf16 and FP8 weights, each variant in a CUDA graph of
back-to-back calls over weight copies larger than L2, under PDL (µs per call).

    python benchmarks/probes/qkv_rope_bench.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch
from attention import graph_ms

from nanoserve.kernels import linear as klinear
from nanoserve.kernels import qkv_rope, rotary
from nanoserve.kernels.linear import LinearConfig
from nanoserve.models.layers import RotaryEmbedding
from nanoserve.models.quantization import quantize_per_channel

HQ, HK, D, K = 32, 8, 128, 4096


def main() -> None:
    dev, dt = "cuda", torch.bfloat16
    rows = (HQ + 2 * HK) * D
    tables = RotaryEmbedding(D, 2048, 500000.0, None)
    cos, sin = tables.cos.to(dev), tables.sin.to(dev)
    kc = torch.zeros(512, 16, HK, D, device=dev, dtype=dt)
    vc = torch.zeros_like(kc)
    positions, slots = torch.tensor([300], device=dev), torch.tensor([300], device=dev)
    x = torch.randn(1, K, device=dev).to(dt)
    print(f"device {torch.cuda.get_device_name()}")
    for fp8 in (False, True):
        copies = []
        for _ in range(16 if fp8 else 8):
            w = torch.randn(rows, K, device=dev) / K**0.5
            copies.append(quantize_per_channel(w) if fp8 else (w.to(dt), None))
        rule = klinear.fp8_linear_config(1, rows, K, dt) if fp8 else klinear.linear_config(1, rows, K, dt)
        configs = [rule, LinearConfig("fma", 1, 4, 1024, num_warps=2, num_stages=3)]
        for config in dict.fromkeys(configs):

            def pair(w, s, config=config):
                y = klinear.small_m_linear(x, w, None, config, w_scale=s)
                q, k, v = y.view(1, HQ + 2 * HK, D).split([HQ, HK, HK], 1)
                rotary.qk_norm_rope(positions, q, k, cos, sin, kv_store=(v, kc, vc, slots))

            def gemv(w, s, config=config):
                klinear.small_m_linear(x, w, None, config, w_scale=s)

            def fused(w, s, config=config, early=False):
                qkv_rope.qkv_rope_gemv(
                    x, w, None, config, positions, cos, sin, HQ, HK, D, (kc, vc, slots), w_scale=s, early_tables=early
                )

            found = {}
            for name, fn in (("gemv alone", gemv), ("gemv + rotary", pair), ("fused", fused),
                             ("fused, early tables", lambda w, s: fused(w, s, early=True))):  # fmt: skip
                found[name] = graph_ms([lambda w=w, s=s, fn=fn: fn(w, s) for w, s in copies]) * 1e3
            print(f"{'fp8' if fp8 else 'bf16'} {config}: " + " | ".join(f"{k} {v:.2f} us" for k, v in found.items()))
        del copies
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
