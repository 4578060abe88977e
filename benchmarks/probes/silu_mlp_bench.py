"""SiLU-and-mul and the decode MLP (run on a GPU machine): the Triton kernels vs the torch path.

    PYTHONUNBUFFERED=1 python benchmarks/probes/silu_mlp_bench.py [--ms 16 64 128 256] [--inter 3072]

Two timings per decode batch M, each inside a CUDA graph of back-to-back calls (median of 20
replays, `attention.graph_ms`), as the engine replays decode:
- SiLU-and-mul alone on gate_up [M, 2I] bf16: `kernels.activation.silu_and_mul` (under PDL, as the
  engine launches it) vs the torch.compile'd `silu_and_mul_reference`
  that the layers used before it (`layers._silu_and_mul_fused`). The input stays in L2, as the
  gate_up output the kernel reads in the engine has just been written;
- qwen3's MLP (gate_up 2I x H, SiLU-and-mul, down H x I, H = 1024), rotating over weight
  copies larger than 4x the L2 (decode streams each layer's weights from memory): the engine's
  path (`layers.linear` with its rule, the Triton SiLU) vs the old one (F.linear, compiled SiLU).
Also printed: how many bf16 outputs of the Triton SiLU differ from the eager torch reference
(torch's CUDA silu then the product) and from the compiled version.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the repository, and benchmarks/ for shared helpers

import argparse
import math

import torch
import torch.nn.functional as F
from attention import graph_ms

from nanoserve.kernels import activation, linear
from nanoserve.kernels.activation import silu_and_mul_reference
from nanoserve.models import layers

DT = torch.bfloat16
HIDDEN = 1024  # qwen3-0.6b


def silu_alone(M: int, inter: int) -> None:
    gate_up = 3 * torch.randn(M, 2 * inter, device="cuda", dtype=DT)
    fast = activation.silu_and_mul(gate_up)
    eager = silu_and_mul_reference(gate_up)
    compiled = layers._silu_and_mul_fused(gate_up)
    differ = (fast != eager).float().mean().item()
    differ_compiled = (fast != compiled).float().mean().item()
    reps = 32
    us_triton = graph_ms([lambda: activation.silu_and_mul(gate_up)] * reps) * 1e3
    us_compiled = graph_ms([lambda: layers._silu_and_mul_fused(gate_up)] * reps) * 1e3
    moved = 3 * M * inter * 2  # bytes read (gate, up) and written
    print(
        f"silu_and_mul M={M:<4} I={inter}: Triton {us_triton:5.2f} us ({moved / us_triton / 1e6:4.2f} TB/s) | "
        f"torch.compile {us_compiled:5.2f} us | Triton/compile {us_triton / us_compiled:.3f} | "
        f"outputs differing from eager torch {differ:.3%}, from compiled {differ_compiled:.3%}",
        flush=True,
    )


def mlp(M: int, inter: int) -> None:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    nbytes = 3 * inter * HIDDEN * 2
    copies = min(32, max(2, math.ceil(4 * l2 / nbytes)))
    gen = torch.Generator(device="cuda").manual_seed(M)
    weights = [
        (
            torch.randn(2 * inter, HIDDEN, device="cuda", dtype=DT, generator=gen).mul_(HIDDEN**-0.5),
            torch.randn(HIDDEN, inter, device="cuda", dtype=DT, generator=gen).mul_(inter**-0.5),
        )
        for _ in range(copies)
    ]
    x = torch.randn(M, HIDDEN, device="cuda", dtype=DT, generator=gen)

    def engine(w):
        return layers.linear(layers.silu_and_mul(layers.linear(x, w[0])), w[1])

    def old(w):
        return F.linear(layers._silu_and_mul_fused(F.linear(x, w[0])), w[1])

    err = ((engine(weights[0]).float() - old(weights[0]).float()).norm() / old(weights[0]).float().norm()).item()
    reps = max(1, math.ceil(16 / copies))
    us_engine = graph_ms([lambda w=w: engine(w) for w in weights] * reps) * 1e3
    us_old = graph_ms([lambda w=w: old(w) for w in weights] * reps) * 1e3
    rule = linear.linear_config(M, HIDDEN, inter, DT)
    down = "cuBLAS" if rule is None else f"split{rule.split_k} m{rule.block_m} n{rule.block_n}"
    print(
        f"MLP M={M:<4} I={inter}: engine {us_engine:6.2f} us (down: {down}) | old {us_old:6.2f} us | "
        f"saved {us_old - us_engine:5.2f} us per layer | rel diff {err:.1e}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", type=int, nargs="+", default=[16, 64, 128, 256])
    ap.add_argument("--inter", type=int, nargs="+", default=[3072])
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    for inter in args.inter:
        for M in args.ms:
            silu_alone(M, inter)
    for M in args.ms:
        mlp(M, 3072)


if __name__ == "__main__":
    main()
