"""The one-row qkv GEMV with the rotation in its epilogue (`kernels.qkv_rope`) against the
pair it replaces (the GEMV, then the rotary kernel with its K/V store), llama-3.1-8b's qkv
(32 q / 8 kv heads of 128, K = 4096), bf16 and FP8 weights, each variant in a CUDA graph of
back-to-back calls over weight copies larger than L2, under PDL (µs per call).
--rows M ...: the same at M rows (speculative verify steps) through the rule's split-K config:
the product with its sum kernel, then the rotary kernel, against `qkv_rope_rows` (the partials
summed, rotated and stored by one epilogue kernel), bf16, llama-3.1-8b's or (--model smollm2)
SmolLM2-135M's qkv (9 q / 3 kv heads of 64, K = 576).

    python benchmarks/probes/qkv_rope_bench.py
    python benchmarks/probes/qkv_rope_bench.py --rows 5 8 13 16 [--model smollm2]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import argparse

import torch
from attention import graph_ms

from nanoserve.kernels import linear as klinear
from nanoserve.kernels import qkv_rope, rotary
from nanoserve.kernels.linear import LinearConfig
from nanoserve.models.layers import RotaryEmbedding
from nanoserve.models.quantization import quantize_per_channel

HQ, HK, D, K = 32, 8, 128, 4096
QKV_SHAPES = {"llama": (32, 8, 128, 4096), "smollm2": (9, 3, 64, 576)}  # (q heads, kv heads, head_dim, K)


def rows_main(model: str, ms: list[int]) -> None:
    """--rows: the product + sum + rotary kernels against `qkv_rope_rows`, M rows, bf16."""
    dev, dt = "cuda", torch.bfloat16
    hq, hk, d, k = QKV_SHAPES[model]
    n = (hq + 2 * hk) * d
    tables = RotaryEmbedding(d, 2048, 500000.0, None)
    cos, sin = tables.cos.to(dev), tables.sin.to(dev)
    kc = torch.zeros(512, 16, hk, d, device=dev, dtype=dt)
    vc = torch.zeros_like(kc)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    copies = [(torch.randn(n, k, device=dev) / k**0.5).to(dt) for _ in range(max(2, -(-4 * l2 // (n * k * 2))))]
    print(f"device {torch.cuda.get_device_name()}, {model} qkv {n}x{k}, {len(copies)} weight copies")
    for m in ms:
        x = torch.randn(m, k, device=dev).to(dt)
        positions = torch.arange(300, 300 + m, device=dev)
        slots = torch.arange(300, 300 + m, device=dev)
        config = klinear.linear_config(m, n, k, dt)
        if not qkv_rope.fuses_rope_in_sum(config):
            print(f"M={m}: the rule gives {config}: not fused")
            continue

        def apart(w, x=x, positions=positions, slots=slots, config=config):
            y = klinear.small_m_linear(x, w, None, config)
            q, kk, v = y.view(-1, hq + 2 * hk, d).split([hq, hk, hk], 1)
            rotary.qk_norm_rope(positions, q, kk, cos, sin, kv_store=(v, kc, vc, slots))

        def fused(w, x=x, positions=positions, slots=slots, config=config):
            qkv_rope.qkv_rope_rows(x, w, None, config, positions, cos, sin, hq, hk, d, (kc, vc, slots))

        found = {
            name: graph_ms([lambda w=w, fn=fn: fn(w) for w in copies] * max(1, 16 // len(copies))) * 1e3
            for name, fn in (("product + sum + rotary", apart), ("qkv_rope_rows", fused))
        }
        tile = f"{config.kernel} {config.block_m}x{config.block_n}x{config.block_k} split {config.split_k}"
        print(f"M={m:<3} {tile}: " + " | ".join(f"{name} {us:.2f} us" for name, us in found.items()))


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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", help="time the 2..16-row fusion at these row counts")
    ap.add_argument("--model", choices=list(QKV_SHAPES), default="llama", help="--rows: whose qkv")
    args = ap.parse_args()
    if args.rows:
        rows_main(args.model, args.rows)
    else:
        main()
