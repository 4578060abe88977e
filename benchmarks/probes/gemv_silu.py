"""One-row MLPs (decode at batch 1): the gate_up GEMV, SiLU-and-mul and the down GEMV as the
engine ran them apart, against the gated GEMV (SiLU-and-mul in the gate_up GEMV's epilogue,
`small_m_linear(gated=True)`) with the rule's tile halved (`gated_config`, what the engine runs)
and other tiles, each followed by the rule's down GEMV.

    PYTHONUNBUFFERED=1 python benchmarks/probes/gemv_silu.py [--jobs 16]
    TRITON_INTERPRET=1 python benchmarks/probes/gemv_silu.py --smoke   # CPU: the flow on tiny shapes

Timing as gemv_stages.py (its `probe_timer`): one CUDA graph of back-to-back MLPs rotating over weight copies
together larger than 256 MB, median of 20 replays, under PDL as the engine launches (the
SiLU-and-mul apart is the layer's: the Triton kernel up to 4096 wide, else torch.compile's).
Each method's output is first checked against the fp32 reference (max |error| / max |ref| <
2e-2, else FAIL, not timed). Printed per model and weight dtype: µs per MLP, best first.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "probes")]

import argparse
import math

import torch
import triton
from gemv_stages import probe_timer

from nanoserve.kernels import fp8 as kfp8
from nanoserve.kernels import linear as klinear
from nanoserve.kernels.activation import silu_and_mul_reference
from nanoserve.kernels.linear import LinearConfig
from nanoserve.models import layers
from nanoserve.models.quantization import quantize_per_channel

DT = torch.bfloat16
MLPS = [("llama-3.1-8b", 14336, 4096), ("qwen3-8b", 12288, 4096), ("qwen3-0.6b", 3072, 1024)]  # (model, I, hidden)
TOL = 2e-2
TILES = [(2, 1024, 2), (4, 1024, 2), (4, 512, 2), (8, 256, 2), (4, 256, 2), (2, 512, 2), (8, 512, 4)]  # per half
STAGES = (3, 6)


def weights(inter: int, hidden: int, copies: int, device: str, fp8: bool):
    gen = torch.Generator(device=device).manual_seed(inter + hidden)
    found = []
    for _ in range(copies):
        pair = []
        for n, k in ((2 * inter, hidden), (hidden, inter)):
            w = (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(DT)
            pair.append(quantize_per_channel(w) if fp8 else (w, None))
        found.append(pair)
    return found


def product(x, w, s, config=None, gated=False):
    """x W^T through the rule's kernel (config None) or `config` (gated: SiLU-and-mul fused)."""
    if config is None:
        if s is None:
            return layers.linear(x, w)
        return layers.fp8_linear(x, w, layers.Fp8Weight(s, False))
    return klinear.small_m_linear(x, w, None, config, w_scale=s, gated=gated)


def methods(x, inter: int, hidden: int, fp8: bool):
    rule = (klinear.fp8_linear_config if fp8 else klinear.linear_config)(1, 2 * inter, hidden, DT)
    found = {"apart (product, SiLU, down)": lambda c: product(layers.silu_and_mul(product(x, *c[0])), *c[1])}
    gated = klinear.gated_config(rule)
    if gated is not None:
        found[f"gated, rule halved {gated.block_n}x{gated.block_k} st{gated.num_stages}"] = lambda c, g=gated: product(
            product(x, *c[0], config=g, gated=True), *c[1]
        )
    block_k = min(1024, triton.next_power_of_2(hidden))
    for bn, bk, warps in TILES:
        for st in STAGES:
            g = LinearConfig("fma", 1, bn, min(bk, block_k), num_warps=warps, num_stages=st)
            found.setdefault(
                f"gated {bn}x{g.block_k} w{warps} st{st}",
                lambda c, g=g: product(product(x, *c[0], config=g, gated=True), *c[1]),
            )
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device, rotate, timer = probe_timer(args.smoke)
    mlps = [("tiny", 24, 64)] if args.smoke else MLPS

    for model, inter, hidden in mlps:
        for fp8 in (False, True):
            nbytes = 3 * inter * hidden * (1 if fp8 else 2)
            ws = weights(inter, hidden, max(2, -(-rotate // nbytes)), device, fp8)
            x = torch.randn(1, hidden, generator=torch.Generator(device=device).manual_seed(1), device=device).to(DT)
            (wg, sg), (wd, sd) = ws[0]
            deq = (lambda w, s: kfp8.dequantize_weight(w, s, False, torch.float32)) if fp8 else (lambda w, s: w.float())
            ref = silu_and_mul_reference(x.float() @ deq(wg, sg).t()) @ deq(wd, sd).t()
            got = {}
            for name, call in methods(x, inter, hidden, fp8).items():
                got[name] = math.nan
                try:
                    err = ((call(ws[0]).float() - ref).abs().max() / ref.abs().max()).item()
                    if not err < TOL:
                        print(f"  {model} {name}: FAIL, error {err:.2e}", flush=True)
                        continue
                    got[name] = timer([lambda c=c, call=call: call(c) for c in ws])
                except Exception as exc:  # noqa: BLE001 - compile or resource errors: reported, not fatal
                    print(f"  {model} {name}: {type(exc).__name__}: {str(exc).strip()[:100]}", flush=True)
            ranked = sorted((v, k) for k, v in got.items() if not math.isnan(v))
            apart = next(v for k, v in got.items() if k.startswith("apart"))
            print(f"{model} MLP I={inter} {'fp8' if fp8 else 'bf16'} (apart {apart:.1f} us): " + " | ".join(
                f"{k} {v:.1f}" for v, k in ranked[:8]), flush=True)  # fmt: skip
            del ws
            if device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
