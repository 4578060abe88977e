"""Qwen3.5-35B-A3B's decode-step pieces at offline batch sizes, one layer each in a CUDA graph
over enough layers' states that they stream from memory: the Gated DeltaNet delta step over
tiles (`gated_delta.DELTA_BLOCK_V`, `DELTA_WARPS`), against the copy bandwidth on the bytes
it must move (the fp32 state read and written), and the MoE alignment (`moe.align`) at E = 256.

    python benchmarks/probes/linear_decode.py [--batches 64 256]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import argparse

import torch

from nanoserve.kernels import gated_delta, moe

HK, HV, DK, DV, W = 16, 32, 128, 128, 4
CONV = 2 * HK * DK + HV * DV


def graph_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[reps // 2]


def delta(batch: int, layers: int) -> None:
    dev = "cuda"
    proj = torch.randn(batch, CONV + HV * DV + 2 * HV, device=dev).bfloat16()
    qkv, z, ba = proj.split([CONV, HV * DV, 2 * HV], dim=-1)
    weight = torch.randn(CONV, W, device=dev).bfloat16()
    a_log, dt_bias, norm_w = (
        torch.randn(HV, device=dev),
        torch.randn(HV, device=dev),
        torch.ones(DV, device=dev).bfloat16(),
    )
    pools = [
        (torch.zeros(batch + 1, CONV, W - 1, device=dev).bfloat16(), torch.zeros(batch + 1, HV, DK, DV, device=dev))
        for _ in range(layers)
    ]
    rows = torch.arange(batch, device=dev)
    prefix = torch.full((batch,), 5, dtype=torch.int32, device=dev)
    moved = 2 * batch * HV * DK * DV * 4
    saved = gated_delta.DELTA_BLOCK_V, gated_delta.DELTA_BLOCK_V_ONE_ROW, gated_delta.DELTA_WARPS
    for bv in (16, 32, 64, 128):
        for warps in (2, 4, 8):
            gated_delta.DELTA_BLOCK_V = gated_delta.DELTA_BLOCK_V_ONE_ROW = bv
            gated_delta.DELTA_WARPS = warps

            def step():
                for conv, rec in pools:
                    gated_delta.decode_step(
                        qkv, z, ba, weight, a_log, dt_bias, norm_w, 1e-6, conv, rec, rows, prefix, HK, DK
                    )

            us = graph_us(step) / layers
            print(f"delta step B={batch} BV={bv} warps={warps}: {us:.1f} us a layer (3 launches), "
                  f"{moved / us / 1e6:.2f} TB/s on the state", flush=True)  # fmt: skip
    gated_delta.DELTA_BLOCK_V, gated_delta.DELTA_BLOCK_V_ONE_ROW, gated_delta.DELTA_WARPS = saved


def align(batch: int) -> None:
    ids = torch.stack([torch.randperm(256, device="cuda")[:8] for _ in range(batch)]).int()
    for block_m in (16, 64):
        us = graph_us(lambda m=block_m: moe.align(ids, 256, m))
        print(f"align T={batch} k=8 E=256 block_m={block_m}: {us:.1f} us", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    args = ap.parse_args()
    for b in args.batches:
        layers = max(2, int(40e9 // (b * HV * DK * DV * 4 * 2)) // 4)  # states well beyond L2
        delta(b, min(layers, 30))
        align(b)


if __name__ == "__main__":
    main()
