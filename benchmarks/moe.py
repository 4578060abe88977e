"""The fused MoE layer (nanoserve/kernels/moe.py) on a GPU: route + fused_moe against the torch
reference and against a dense MLP of the same active FLOPs.

    PYTHONUNBUFFERED=1 python benchmarks/moe.py [--models qwen3-30b-a3b mixtral-8x7b mixtral-8x7b-tp2]
        [--tokens 1 2 4 8 16 64 256 1024 4096] [--tune] [--fp8 | --mxfp4]

Shapes: qwen3-30b-a3b (H 2048, I 768, E 128, k 8), qwen3.5-35b-a3b (H 2048, I 512, E 256, k 8), mixtral-8x7b (H 4096, I 14336, E 8, k 2)
and one TP=2 rank of it (I 7168), gpt-oss-20b / -120b (H 2880, I 2880, E 32 / 128, k 4; with
their biases and clamped SwiGLU), bf16, random weights and router logits. For each token count
T it prints, per layer:
- fused: route + fused_moe_partials + the next RMSNorm, which adds the fp32 planes the experts
  leave (the layer as the engine runs it; the norm's read of the planes is counted, so a depth
  split pays for its extra planes), captured in one CUDA graph over --layers layers, each with
  its own weights (so batch-1 decode streams its experts from memory, not from L2), median of
  20 replays;
- ref: `fused_moe_reference` (eager: it reads the routing on the host, so no graph);
- dense: gate_up GEMM [T, H] x [H, 2*k*I], SiLU-and-mul, down GEMM (cuBLAS, in a graph): the
  same FLOPs as the k experts, on one dense weight;
- TB/s on the bytes of the distinct experts read, E*(1-(1-k/E)^T) expected (the measured count
  from the routing beside it), and TFLOP/s on the routed FLOPs (T*k*6*H*I).
What to expect on an H200 (HBM3e 4.8 TB/s, ~990 dense bf16 TFLOP/s): at small T the layer is
bound by reading the chosen experts, so fused should reach roughly 3.5-4.3 TB/s (batch 1:
qwen3 ~75 MB in ~20 us, mixtral ~700 MB in ~170 us); at T >= 1024 it is a grouped GEMM and
should reach a large fraction of the dense GEMM's TFLOP/s. These are targets, not results:
record measured figures in benchmarks/results/ (headline rows in RESULTS.md).

--fp8: the experts in e4m3 with 128x128 block scales (the Qwen3-30B-A3B-FP8 layout), the
layout's kernels with the bf16 block sizes; TB/s counts one byte per weight.
--mxfp4: the experts as MXFP4 (random codes, e8m0 scales per 32, as gpt-oss ships them; the
kernels' MXFP4 path, `TUNED_MXFP4` or its fallback); TB/s counts 17/32 byte per weight (half a
byte of code, a scale byte per 32). With --tune: entries for `TUNED_MXFP4`.

--tune measures, for each shape and T bucket, the block sizes of both GEMMs on each path that
T may take (gate_up with the fallback down, then down with gate_up's best; the decode path's
down also over depth splits), keeps the faster path, and prints `TUNED` entries to paste into
nanoserve/kernels/moe.py. Every candidate is compiled first, in parallel worker processes
(--workers), so the timing loop only loads kernels from Triton's cache. --paths decode (or
grouped) tunes that path alone.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import gc
import itertools
import multiprocessing
import os
import sys

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nanoserve.kernels import moe
from nanoserve.kernels.activation import silu_and_mul
from nanoserve.kernels.norm import rms_norm
from nanoserve.models.moe import MOE_PDL_MAX_INTER

MODELS = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "mixtral-8x7b-tp2": (4096, 7168, 8, 2),  # one rank's expert slices at TP=2
    "qwen3.5-35b-a3b": (2048, 512, 256, 8),
    "gpt-oss-20b": (2880, 2880, 32, 4),
    "gpt-oss-120b": (2880, 2880, 128, 4),
}
GPT_OSS = ("gpt-oss-20b", "gpt-oss-120b")  # biased experts, clamped SwiGLU (alpha 1.702, limit 7)
DT = torch.bfloat16
MXFP4_BYTES = 17 / 32  # a weight's bytes: half a byte of code, a scale byte per 32


def weight_bytes(fp8: bool, mxfp4: bool) -> float:
    return MXFP4_BYTES if mxfp4 else 1 if fp8 else 2


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

    def __init__(
        self, H: int, inter: int, E: int, k: int, T: int, n: int, seed: int = 0, fp8: bool = False,
        mxfp4: bool = False, gpt_oss: bool = False,
    ):  # fmt: skip
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.k = k
        self.hidden = torch.randn(T, H, generator=gen, device="cuda").to(DT)
        self.scales = [None] * n
        if mxfp4:  # random codes, scales 2^-8 or 2^-7 per group (weights of variance ~1/2880)

            def u8(low: int, high: int, *shape: int) -> torch.Tensor:
                return torch.randint(low, high, shape, generator=gen, device="cuda", dtype=torch.uint8)

            self.w13 = [u8(0, 256, E, 2 * inter, H // 2) for _ in range(n)]
            self.w2 = [u8(0, 256, E, H, inter // 2) for _ in range(n)]
            self.scales = [
                moe.Mxfp4Scales(u8(119, 121, E, 2 * inter, H // 32), u8(119, 121, E, H, inter // 32)) for _ in range(n)
            ]
        else:
            self.w13 = [(torch.randn(E, 2 * inter, H, generator=gen, device="cuda") / H**0.5).to(DT) for _ in range(n)]
            self.w2 = [(torch.randn(E, H, inter, generator=gen, device="cuda") / inter**0.5).to(DT) for _ in range(n)]
        self.act = None
        if gpt_oss:
            b13 = 0.1 * torch.randn(E, 2 * inter, generator=gen, device="cuda").to(DT)
            self.act = moe.ClampedSwiGLU(b13, 0.1 * torch.randn(E, H, generator=gen, device="cuda").to(DT), 1.702, 7.0)
        if fp8:  # e4m3 experts with 128x128 block scales (the Qwen3-30B-A3B-FP8 layout)
            for i in range(n):
                (self.w13[i], s13), (self.w2[i], s2) = (
                    moe.quantize_experts(w, 128, 128) for w in (self.w13[i], self.w2[i])
                )
                self.scales[i] = moe.ExpertScales(s13, s2, 128, 128, 128)
        self.logits = [torch.randn(T, E, generator=gen, device="cuda") for _ in range(n)]
        self.residual = torch.randn(T, H, generator=gen, device="cuda").to(DT)
        self.norm_weight = torch.ones(H, device="cuda", dtype=DT)

    def fused(self, configs=None, path=None):
        pdl = self.w2[0].shape[2] <= MOE_PDL_MAX_INTER  # as the engine's MoE block launches them
        for w13, w2, logits, scales in zip(self.w13, self.w2, self.logits, self.scales):
            w, ids = moe.route(logits, self.k, True, pdl=pdl)
            planes = moe.fused_moe_partials(
                self.hidden, w13, w2, w, ids, configs=configs, path=path, pdl=pdl, scales=scales, act=self.act
            )
            rms_norm(planes, self.norm_weight, 1e-6, self.residual)  # the next layer's input norm

    def reference(self):
        w, ids = moe.route_reference(self.logits[0], self.k, True)
        w13, w2, scales = self.w13[0], self.w2[0], self.scales[0]
        if isinstance(scales, moe.ExpertScales):
            w13, w2, scales = *scales.dequantized(w13, w2, DT), None
        moe.fused_moe_reference(self.hidden, w13, w2, w, ids, self.act, scales)  # MXFP4: per expert on the fly

    def distinct_experts(self) -> float:
        return sum(len(torch.unique(moe.route_reference(lg, self.k, True)[1])) for lg in self.logits) / len(self.logits)


def layers_for(H: int, inter: int, E: int, T: int, k: int, wanted: int, per_weight: float = 2) -> int:
    """Enough layers that one graph replay reads 4x the L2 of weights, at most `wanted`."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    per_layer = 3 * inter * H * per_weight * min(E, T * k)
    return max(1, min(wanted, int(-(-4 * l2 // per_layer))))


def bench(name: str, T: int, n_layers: int, with_ref: bool, fp8: bool = False, mxfp4: bool = False) -> None:
    H, inter, E, k = MODELS[name]
    n = layers_for(H, inter, E, T, k, n_layers, weight_bytes(fp8, mxfp4))
    layers = Layers(H, inter, E, k, T, n, fp8=fp8, mxfp4=mxfp4, gpt_oss=name in GPT_OSS)
    fused = graph_us(layers.fused) / n
    ref = eager_us(layers.reference) if with_ref else float("nan")
    w13 = (torch.randn(2 * k * inter, H, device="cuda") / H**0.5).to(DT)
    w2 = (torch.randn(H, k * inter, device="cuda") / (k * inter) ** 0.5).to(DT)
    dense = graph_us(lambda: F.linear(silu_and_mul(F.linear(layers.hidden, w13)), w2))
    expected = E * (1 - (1 - k / E) ** T)
    expert_bytes = 3 * H * inter * weight_bytes(fp8, mxfp4)
    flops = T * k * 6 * H * inter
    label = name + (" fp8" if fp8 else " mxfp4" if mxfp4 else "")
    print(
        f"{label:18s} T={T:<5d} fused {fused:9.1f} us  ref {ref:10.1f} us  dense {dense:9.1f} us | "
        f"experts {expected:6.1f} expected ({layers.distinct_experts():6.1f} measured) "
        f"{expected * expert_bytes / fused / 1e6:5.2f} TB/s | {flops / fused / 1e6:6.1f} TFLOP/s "
        f"(dense {flops / dense / 1e6:6.1f}) | ref/fused {ref / fused:6.1f}x",
        flush=True,
    )


def decode_candidates(mxfp4: bool = False) -> list[moe.MoEConfig]:
    """Decode-path configs: tiles of at most 16k elements and 64 per thread (no spills);
    num_stages is the K loop's pipelining depth (1: none). MXFP4: 1 to 32 words of eight codes
    a thread, single warps included."""
    if mxfp4:
        return [
            moe.MoEConfig(1, bn, bk, w, s)
            for bn, bk, w, s in itertools.product((4, 8, 16, 32), (256, 512, 1024), (1, 2, 4, 8), (1, 2, 3))
            if 1 <= bn * bk // 8 // (32 * w) <= 32
        ]
    return [
        moe.MoEConfig(1, bn, bk, w, s)
        for bn, bk, w, s in itertools.product((8, 16, 32, 64), (128, 256, 512), (2, 4, 8), (1, 2, 3, 4))
        if bn * bk <= 16384 and bn * bk <= 64 * 32 * w
    ]


def grouped_candidates(T: int, k: int, E: int, mxfp4: bool = False) -> list[moe.MoEConfig]:
    """Grouped-path configs; MXFP4 steps up to 256 deep (a quarter of bf16's bytes a step)."""
    rows = T * k / E
    ms = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * rows)]
    return [
        moe.MoEConfig(m, bn, bk, w, s)
        for m, bn, bk, w, s in itertools.product(ms, (64, 128), (64, 128, 256) if mxfp4 else (64, 128), (4, 8), (3, 4))
        if m * bn <= 128 * 128
    ]


SPLITS = (2, 4, 8)  # the decode path's depth splits tried on its best down configs
GROUPS = (4, 8, 16)  # the grouped path's block groups tried where experts get several blocks
GROUPS_MIN_ROWS = 256  # ... i.e. where the mean rows per expert reach this


def grouped_variants(c: moe.MoEConfig, T: int, k: int, E: int) -> list[moe.MoEConfig]:
    """c in block groups (`MoEConfig.group_m`), where an expert's rows span several blocks."""
    if T * k / E < GROUPS_MIN_ROWS:
        return []
    return [dataclasses.replace(c, group_m=g) for g in GROUPS]


PATHS = ("decode", "grouped")  # the paths --tune may time (--paths)


def paths_for(T: int, k: int, E: int, mxfp4: bool = False) -> list[str]:
    """The paths timed at T: decode while the pairs are few (it reads an expert once per pair,
    grouped once per distinct expert), grouped from 9 pairs on; for MXFP4 experts at every T
    (its dots run on tensor cores, the decode path's products on the FMA units); of PATHS."""
    grouped = T * k > 8 or mxfp4
    paths = (["decode"] if T * k <= min(moe.DECODE_MAX_PAIRS, 2 * E) else []) + (["grouped"] if grouped else [])
    return [p for p in paths if p in PATHS]


def _compile_worker(name: str, jobs: list[tuple[str, moe.MoEConfig, moe.MoEConfig]], mxfp4: bool = False) -> int:
    """Compile each (path, gate_up config, down config) by running it once on small inputs
    (uninitialised weights: only the kernels matter); returns how many did not fit."""
    H, inter, E, k = MODELS[name]
    torch.cuda.set_device(0)
    layers = Layers(H, inter, E, k, 1, 1, mxfp4=mxfp4, gpt_oss=name in GPT_OSS)
    w13, w2, scales, act = layers.w13[0], layers.w2[0], layers.scales[0], layers.act
    failed = 0
    for path, c13, c2 in jobs:
        T = 1 if path == "decode" else 4 * E
        hidden = torch.randn(T, H, device="cuda").to(DT)
        w, ids = moe.route_reference(torch.randn(T, E, device="cuda"), k, True)
        try:
            moe.fused_moe_partials(
                hidden, w13, w2, w, ids, configs=(c13, c2), path=path, pdl=inter <= MOE_PDL_MAX_INTER,
                scales=scales, act=act,
            )  # fmt: skip
        except OutOfResources:
            failed += 1
    torch.cuda.synchronize()
    return failed


def precompile(jobs: dict[str, list], workers: int, mxfp4: bool = False) -> None:
    """Every candidate of every shape compiled in `workers` processes (spawned: each has its
    own CUDA context), into Triton's on-disk cache."""
    chunks = [(name, part[i::workers]) for name, part in jobs.items() for i in range(workers) if part[i::workers]]
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        failed = sum(pool.map(_compile_worker, *zip(*chunks), [mxfp4] * len(chunks)))
    print(
        f"compiled {sum(map(len, jobs.values()))} candidates in {workers} processes ({failed} do not fit)", flush=True
    )


def tuning_jobs(name: str, tokens: list[int], mxfp4: bool = False) -> list[tuple[str, moe.MoEConfig, moe.MoEConfig]]:
    H, inter, E, k = MODELS[name]
    jobs = set()
    for T in tokens:
        for path in paths_for(T, k, E, mxfp4):
            fb13, fb2 = moe.get_configs(H, inter, E, T, k, path, mxfp4)
            if path == "decode":  # one split compiles the split variant of every down config
                ups = decode_candidates(mxfp4)
                downs = ups + [dataclasses.replace(c, split_k=SPLITS[0]) for c in ups]
            else:
                ups = grouped_candidates(T, k, E, mxfp4)
                ups = downs = ups + [v for c in ups if c.block_m >= 64 for v in grouped_variants(c, T, k, E)]
            jobs |= {(path, c, fb2) for c in ups} | {(path, fb13, c) for c in downs}
    return sorted(jobs, key=repr)


def tune(name: str, T: int, n_layers: int, mxfp4: bool = False) -> None:
    H, inter, E, k = MODELS[name]
    n = layers_for(H, inter, E, T, k, n_layers, weight_bytes(False, mxfp4))
    layers = Layers(H, inter, E, k, T, n, mxfp4=mxfp4, gpt_oss=name in GPT_OSS)

    def timed(cfgs, path):
        try:
            return graph_us(lambda: layers.fused(cfgs, path), reps=10) / n
        except OutOfResources as exc:  # a config that does not fit in shared memory
            print(f"  skipped {cfgs[0]} / {cfgs[1]}: {type(exc).__name__}", file=sys.stderr)
            return float("inf")

    base = timed(moe.get_configs(H, inter, E, T, k, mxfp4=mxfp4), None)
    results = []
    for path in paths_for(T, k, E, mxfp4):
        _, fb2 = moe.get_configs(H, inter, E, T, k, path, mxfp4)
        options = decode_candidates(mxfp4) if path == "decode" else grouped_candidates(T, k, E, mxfp4)
        best13 = min(options, key=lambda c: timed((c, fb2), path))
        if path == "grouped":
            options = [c for c in options if c.block_m == best13.block_m]
        ranked = sorted(options, key=lambda c: timed((best13, c), path))
        if path == "decode":  # depth splits of the best few down configs
            ranked = [ranked[0], *(dataclasses.replace(c, split_k=s) for c in ranked[:6] for s in SPLITS)]
        best2 = min(ranked, key=lambda c: timed((best13, c), path))
        if path == "grouped":  # block groups for the best of each GEMM
            best13 = min([best13, *grouped_variants(best13, T, k, E)], key=lambda c: timed((c, best2), path))
            best2 = min([best2, *grouped_variants(best2, T, k, E)], key=lambda c: timed((best13, c), path))
        us = min(timed((best13, best2), path) for _ in range(2))
        print(f"  {name} T={T} {path}: {us:.1f} us", flush=True)
        results.append((us, best13, best2))
    us, best13, best2 = min(results, key=lambda r: r[0])
    print(
        f"    ({H}, {inter}, {E}, {moe._bucket(T)}): ({best13!r}, {best2!r}),  # {us:.1f} us (was {base:.1f})",
        flush=True,
    )


def main() -> None:
    global PATHS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=[m for m in MODELS if m not in GPT_OSS], choices=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8, 16, 64, 256, 1024, 4096])
    ap.add_argument("--layers", type=int, default=8, help="layers per graph at most (own weights each)")
    ap.add_argument("--no-ref", action="store_true", help="skip the torch reference")
    ap.add_argument("--fp8", action="store_true", help="e4m3 experts with 128x128 block scales (TB/s on their bytes)")
    ap.add_argument("--mxfp4", action="store_true", help="MXFP4 experts, as gpt-oss's (TB/s on their bytes)")
    ap.add_argument("--tune", action="store_true", help="measure block sizes, print TUNED entries")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="--tune: compile processes")
    ap.add_argument("--paths", nargs="+", choices=PATHS, default=PATHS, help="--tune: the paths to time")
    args = ap.parse_args()
    PATHS = tuple(args.paths)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/moe.py needs a CUDA GPU")
    if args.fp8 and args.mxfp4 or args.tune and args.fp8:
        sys.exit("benchmarks/moe.py: --fp8 and --mxfp4 are exclusive, and --tune measures bf16 or MXFP4 experts")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | bf16", flush=True)
    if args.tune:
        precompile({name: tuning_jobs(name, args.tokens, args.mxfp4) for name in args.models}, args.workers, args.mxfp4)
        if args.mxfp4:
            print("MXFP4 experts: the entries below go into TUNED_MXFP4", flush=True)
    for name in args.models:
        for T in args.tokens:
            torch.cuda.empty_cache()  # the previous shape's layers are gone with its call
            if args.tune:
                tune(name, T, args.layers, args.mxfp4)
            else:
                bench(name, T, args.layers, not args.no_ref, args.fp8, args.mxfp4)
    gc.collect()  # a config that did not fit keeps its frames, and a shape's layers, in a cycle
    assert torch.cuda.memory_allocated() < 2**30, "the benchmark left tensors behind"


if __name__ == "__main__":
    main()
