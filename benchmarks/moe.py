"""The fused MoE layer (nanoserve/kernels/moe.py) on a GPU: route + fused_moe against the torch
reference and against a dense MLP of the same active FLOPs.

    PYTHONUNBUFFERED=1 python benchmarks/moe.py [--models qwen3-30b-a3b mixtral-8x7b]
        [--tokens 1 2 4 8 16 64 256 1024 4096] [--tune]

Shapes: qwen3-30b-a3b (H 2048, I 768, E 128, k 8) and mixtral-8x7b (H 4096, I 14336, E 8,
k 2), bf16, random weights and router logits. For each token count T it prints, per layer:
- fused: route + fused_moe, captured in one CUDA graph over --layers layers, each with its own
  weights (so batch-1 decode streams its experts from memory, not from L2), median of 20 replays;
- ref: `fused_moe_reference` (eager: it reads the routing on the host, so no graph);
- dense: gate_up GEMM [T, H] x [H, 2*k*I], SiLU-and-mul, down GEMM (cuBLAS, in a graph): the
  same FLOPs as the k experts, on one dense weight;
- TB/s on the bytes of the distinct experts read, E*(1-(1-k/E)^T) expected (the measured count
  from the routing beside it), and TFLOP/s on the routed FLOPs (T*k*6*H*I).
What to expect on an H200 (HBM3e 4.8 TB/s, ~990 dense bf16 TFLOP/s): at small T the layer is
bound by reading the chosen experts, so fused should reach roughly 3.5-4.3 TB/s (batch 1:
qwen3 ~75 MB in ~20 us, mixtral ~700 MB in ~170 us); at T >= 1024 it is a grouped GEMM and
should reach a large fraction of the dense GEMM's TFLOP/s. These are targets, not results:
record measured figures in benchmarks/RESULTS.md.

--tune measures the block sizes of both GEMMs (gate_up, then down with gate_up's best) for each
shape and T and prints `TUNED` entries to paste into nanoserve/kernels/moe.py.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nanoserve.kernels import moe
from nanoserve.kernels.activation import silu_and_mul

MODELS = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)}
DT = torch.bfloat16


def graph_us(fn, reps: int = 20) -> float:
    """Median microseconds of one replay of fn captured in a CUDA graph."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del graph
    return sorted(times)[len(times) // 2]


def eager_us(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


class Layers:
    """`n` MoE layers of one shape, each with its own weights and router logits."""

    def __init__(self, H: int, inter: int, E: int, k: int, T: int, n: int, seed: int = 0):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.k = k
        self.hidden = torch.randn(T, H, generator=gen, device="cuda").to(DT)
        self.w13 = [(torch.randn(E, 2 * inter, H, generator=gen, device="cuda") / H**0.5).to(DT) for _ in range(n)]
        self.w2 = [(torch.randn(E, H, inter, generator=gen, device="cuda") / inter**0.5).to(DT) for _ in range(n)]
        self.logits = [torch.randn(T, E, generator=gen, device="cuda") for _ in range(n)]

    def fused(self, configs=None):
        for w13, w2, logits in zip(self.w13, self.w2, self.logits):
            w, ids = moe.route(logits, self.k, True)
            moe.fused_moe(self.hidden, w13, w2, w, ids, configs=configs)

    def reference(self):
        w, ids = moe.route_reference(self.logits[0], self.k, True)
        moe.fused_moe_reference(self.hidden, self.w13[0], self.w2[0], w, ids)

    def distinct_experts(self) -> float:
        return sum(len(torch.unique(moe.route_reference(lg, self.k, True)[1])) for lg in self.logits) / len(self.logits)


def layers_for(H: int, inter: int, E: int, T: int, k: int, wanted: int) -> int:
    """Enough layers that one graph replay reads 4x the L2 of weights, at most `wanted`."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    per_layer = 3 * inter * H * 2 * min(E, T * k)
    return max(1, min(wanted, -(-4 * l2 // per_layer)))


def bench(name: str, T: int, n_layers: int, with_ref: bool) -> None:
    H, inter, E, k = MODELS[name]
    n = layers_for(H, inter, E, T, k, n_layers)
    layers = Layers(H, inter, E, k, T, n)
    fused = graph_us(layers.fused) / n
    ref = eager_us(layers.reference) if with_ref else float("nan")
    w13 = (torch.randn(2 * k * inter, H, device="cuda") / H**0.5).to(DT)
    w2 = (torch.randn(H, k * inter, device="cuda") / (k * inter) ** 0.5).to(DT)
    dense = graph_us(lambda: F.linear(silu_and_mul(F.linear(layers.hidden, w13)), w2))
    expected = E * (1 - (1 - k / E) ** T)
    expert_bytes = 3 * H * inter * 2
    flops = T * k * 6 * H * inter
    print(
        f"{name:14s} T={T:<5d} fused {fused:9.1f} us  ref {ref:10.1f} us  dense {dense:9.1f} us | "
        f"experts {expected:6.1f} expected ({layers.distinct_experts():6.1f} measured) "
        f"{expected * expert_bytes / fused / 1e6:5.2f} TB/s | {flops / fused / 1e6:6.1f} TFLOP/s "
        f"(dense {flops / dense / 1e6:6.1f}) | ref/fused {ref / fused:6.1f}x",
        flush=True,
    )


def candidates(T: int, k: int, E: int) -> list[moe.MoEConfig]:
    if T * k <= moe.DECODE_MAX_PAIRS:
        return [
            moe.MoEConfig(1, bn, bk, w, s)
            for bn, bk, w, s in itertools.product((16, 32, 64, 128), (64, 128, 256), (2, 4, 8), (2, 3))
        ]
    rows = T * k / E
    ms = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * rows)]
    return [
        moe.MoEConfig(m, bn, bk, w, s)
        for m, bn, bk, w, s in itertools.product(ms, (64, 128), (64, 128), (4, 8), (3, 4))
        if m * bn <= 128 * 128
    ]


def tune(name: str, T: int, n_layers: int) -> None:
    H, inter, E, k = MODELS[name]
    n = layers_for(H, inter, E, T, k, n_layers)
    layers = Layers(H, inter, E, k, T, n)
    fallback = moe.get_configs(H, inter, E, T, k)[1]

    def timed(cfgs):
        try:
            return graph_us(lambda: layers.fused(cfgs), reps=10) / n
        except OutOfResources as exc:  # a config that does not fit in shared memory
            print(f"  skipped {cfgs[0]} / {cfgs[1]}: {type(exc).__name__}", file=sys.stderr)
            return float("inf")

    base = timed(moe.get_configs(H, inter, E, T, k))
    options = candidates(T, k, E)
    best13 = min(options, key=lambda c: timed((c, fallback)))
    best2 = min([c for c in options if c.block_m == best13.block_m], key=lambda c: timed((best13, c)))
    best = timed((best13, best2))
    print(f"    ({H}, {inter}, {E}, {moe._bucket(T)}): ({best13!r}, {best2!r}),  # {best:.1f} us (was {base:.1f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8, 16, 64, 256, 1024, 4096])
    ap.add_argument("--layers", type=int, default=8, help="layers per graph at most (own weights each)")
    ap.add_argument("--no-ref", action="store_true", help="skip the torch reference")
    ap.add_argument("--tune", action="store_true", help="measure block sizes, print TUNED entries")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/moe.py needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | bf16", flush=True)
    for name in args.models:
        for T in args.tokens:
            torch.cuda.empty_cache()  # the previous shape's layers are gone with its call
            if args.tune:
                tune(name, T, args.layers)
            else:
                bench(name, T, args.layers, not args.no_ref)
    assert torch.cuda.memory_allocated() < 2**30, "the benchmark left tensors behind"


if __name__ == "__main__":
    main()
