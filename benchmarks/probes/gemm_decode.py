"""Decode-GEMM benchmark (run on a GPU machine): cuBLAS vs cuBLASLt vs the engine's Triton kernels.

    PYTHONUNBUFFERED=1 python benchmarks/probes/gemm_decode.py [--model qwen3|smollm2|llama] [--ms 16 32 ...]
        [--shapes qkv lm_head] [--full] [--no-sweep] [--jobs 16]
    PYTHONUNBUFFERED=1 python benchmarks/probes/gemm_decode.py --gated --model llama --ms 5 8 13 16
    TRITON_INTERPRET=1 python benchmarks/probes/gemm_decode.py --smoke     # CPU check of the kernels

For each weight shape [N, K] (bf16) of a model's decoder layer and LM head and each decode
batch M, times y = x W^T per call, as the engine runs it: inside a CUDA graph of back-to-back
calls that rotate over distinct weight copies together larger than 4x the L2, so every call
streams its weights from HBM (median of 20 replays, `attention.graph_ms`). Methods:
- cuBLAS and cuBLASLt: F.linear under `torch.backends.cuda.preferred_blas_library("cublas")`
  and ("cublaslt") (the default, printed first, may pick either by heuristics);
- the engine's rule: what `layers.linear` runs for this shape (`triton_ops.linear_config`:
  a Triton config, or cuBLAS under the default library where the rule returns None);
- unless --no-sweep, a config sweep (`candidates`) of `triton_ops.small_m_linear`'s
  tensor-core kernel, the engine's own launches, each checked against F.linear first (max abs
  difference over max abs output < 2e-2, else a FAIL line and the config is skipped):
  * "dot": no split;
  * "split<S>": split-K, S programs along K each store fp32 partials into a workspace
    [S, M, N]; a second kernel sums them in split order and rounds once (deterministic).
Per call it reports µs, weight TB/s (N*K*2 bytes over time), TFLOP/s (2*M*N*K over time) and
the floor (weight bytes over the copy ceiling: a 1 GiB device-to-device copy, read + write).
The Triton kernels compile up front in a thread pool (Triton's AsyncCompileMode, when present).
They launch with programmatic dependent launch, as the engine's do.
At the end a markdown table per (shape, M) and the GEMM time per decode step (layers x
(qkv + o + gate_up + down) + lm_head) per method, also written to $OUT/gemm_decode.md.
--gated: the model's gate_up product followed by SiLU-and-mul instead (output [M, I]): the
columns "cuBLAS" / "cuBLASLt" are F.linear under that library then the layer's SiLU-and-mul
(`layers.silu_and_mul`, what the engine runs apart), "apart" the engine's product rule then
that SiLU-and-mul (what runs with `NANOSERVE_FUSED_16_ROWS=0`, the default), "rule" the gated dot kernel with
`gated_dot_config`'s tiles (the apart time where it returns None), and the sweep
(`gated_candidates`) the gated dot kernel's tiles; each checked against the fp32 reference.
--smoke (CPU, TRITON_INTERPRET=1): the kernels against F.linear on tiny shapes for 1-4 splits,
repeat runs bit-identical, the gated dot kernel against its reference, and the sweep's config counts.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the repository, and benchmarks/ for shared helpers

import argparse
import functools
import itertools
import math
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
from attention import copy_ceiling, graph_ms
from compile_ahead import precompile

from nanoserve.kernels import linear as triton_ops
from nanoserve.kernels.activation import silu_and_mul_reference
from nanoserve.kernels.launch import INTERPRET
from nanoserve.kernels.linear import LinearConfig
from nanoserve.models import layers

DT = torch.bfloat16
# (label, N, K) of the weights [N, K]; layer count; the decoder-layer shapes repeat per layer.
MODELS: dict[str, tuple[int, list[tuple[str, int, int]]]] = {
    "qwen3": (28, [("qkv", 4096, 1024), ("o_proj", 1024, 2048), ("gate_up", 6144, 1024),
                   ("down", 1024, 3072), ("lm_head", 151936, 1024)]),
    "smollm2": (30, [("qkv", 960, 576), ("o_proj", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
                     ("lm_head", 49152, 576)]),
    "llama": (32, [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096),
                   ("down", 4096, 14336), ("lm_head", 128256, 4096)]),
    "gemma": (48, [("qkv", 8192, 3840), ("o_proj", 3840, 4096), ("gate_up", 30720, 3840),
                   ("down", 3840, 15360), ("lm_head", 262208, 3840)]),
}  # fmt: skip
BMS, BNS, BKS, WARPS, STAGES = (16, 32, 64, 128), (32, 64, 128), (64, 128), (4, 8), (3, 4)
SPLITS = (1, 2, 4)
SMEM_LIMIT = 200 * 1024  # bytes of pipelined x and W tiles; H200 has 227 KB per block
MIN_PROGRAMS, MAX_PROGRAMS = 32, 4096
TOL = 2e-2


def describe(c: LinearConfig) -> str:
    name = "dot" if c.split_k == 1 else f"split{c.split_k}"
    return f"{name} m{c.block_m} n{c.block_n} k{c.block_k} w{c.num_warps} s{c.num_stages}"


def launch(
    cfg: LinearConfig, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, warmup: bool = False, gated: bool = False
) -> None:
    """out [M, N] (dense) = x W^T with the engine's kernels (`gated`: out [M, N/2] = silu(gate) *
    up, one launch); with `warmup` only compile them."""
    if warmup:
        triton_ops.compile_linear(x, w, None, cfg, out, gated=gated)
    else:
        triton_ops.small_m_linear(x, w, None, cfg, out=out, gated=gated)


# ------------------------------------------------------------------------------ sweep


def candidates(M: int, N: int, K: int, full: bool = False) -> list[LinearConfig]:
    """The configs timed for one (M, N, K). Always: BLOCK_M in [16, next_pow2(M)], pipelined tiles
    within SMEM_LIMIT, 32..4096 programs (fewer leave SMs idle, more re-read W too often), K
    covers every split. Unless `full`: only the two largest BLOCK_M, 8 warps only on tiles of
    >= 64x64 outputs and 4 warps only up to 128x64 (halves the compiles)."""
    bms = [b for b in BMS if b <= max(16, triton.next_power_of_2(M))]
    if not full:
        bms = bms[-2:]
    out = []
    for bm, bn, bk, warps, stages, split in itertools.product(bms, BNS, BKS, WARPS, STAGES, SPLITS):
        tile = bm * bn
        if not full and (tile < 4096 if warps == 8 else tile > 8192):
            continue
        programs = triton.cdiv(N, bn) * triton.cdiv(M, bm) * split
        if (bm + bn) * bk * 2 * stages > SMEM_LIMIT or bk * split > K:
            continue
        if MIN_PROGRAMS <= programs <= MAX_PROGRAMS:
            out.append(LinearConfig("dot", bm, bn, bk, warps, stages, split))
    return out


def gated_candidates(M: int, N: int, K: int, full: bool = False) -> list[LinearConfig]:
    """The gated dot kernel's configs timed for x [M, K] times a gate_up weight [N = 2I, K]:
    16-row tiles (M <= 16; more rows: BLOCK_M up to next_pow2(M)), block_n the width of each
    of the gate and up tiles, unsplit; two W tiles and an x tile per pipelined stage within
    SMEM_LIMIT, 32..4096 programs. Unless `full`, 8 warps only on tiles >= 64 wide."""
    out = []
    for bm in (b for b in BMS if b <= max(16, triton.next_power_of_2(M))):
        for bn, bk, warps, stages in itertools.product((16, *BNS), BKS, WARPS, STAGES):
            if not full and warps == 8 and bn < 64:
                continue
            programs = triton.cdiv(N // 2, bn) * triton.cdiv(M, bm)
            if (bm + 2 * bn) * bk * 2 * stages > SMEM_LIMIT or bk > K:
                continue
            if MIN_PROGRAMS <= programs <= MAX_PROGRAMS:
                out.append(LinearConfig("dot", bm, bn, bk, warps, stages))
    return out


def compile_keys(cfgs: list[LinearConfig], K: int) -> set[tuple]:
    """What distinguishes the compiled product kernels among `cfgs` (the sum kernels: one per
    split count)."""
    return {(c, K % (c.block_k * c.split_k) == 0) for c in cfgs}


def compile_launches(plan: list[tuple[int, int, int, list[LinearConfig]]], gated: bool = False):
    """(label, launch) of every (M, N, K, configs) of `plan`, for `precompile`."""
    for M, N, K, cfgs in plan:
        x = torch.empty(M, K, device="cuda", dtype=DT)
        w = torch.empty(N, K, device="cuda", dtype=DT)
        out = torch.empty(M, N // 2 if gated else N, device="cuda", dtype=DT)
        for cfg in cfgs:
            yield describe(cfg), functools.partial(launch, cfg, x, w, out, warmup=True, gated=gated)


@contextmanager
def blas(name: str):
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


@dataclass
class Row:
    shape: str
    N: int
    K: int
    M: int
    floor_us: float
    cublas_us: float
    cublaslt_us: float
    rule_us: float  # what layers.linear runs: the rule's Triton config, or F.linear
    rule_cfg: str
    triton_us: float  # best of the sweep (nan with --no-sweep)
    triton_cfg: str
    apart_us: float = math.nan  # --gated: the engine's product rule, then its SiLU-and-mul


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def per_call(us: float, N: int, K: int, M: int) -> str:
    return f"{us:7.2f} us {N * K * 2 / us / 1e6:5.2f} TB/s {2 * M * N * K / us / 1e6:6.1f} TF"


def sweep_shape(
    label: str, N: int, K: int, ms: list[int], sweep: bool, full: bool, ceiling: float, gated: bool = False
) -> list[Row]:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    nbytes = N * K * 2
    copies = min(64, max(2, math.ceil(4 * l2 / nbytes)))
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(N, K, device="cuda", dtype=DT, generator=gen).mul_(K**-0.5) for _ in range(copies)]
    print(f"\n## {label} N={N} K={K}: {copies} weight copies ({copies * nbytes / 2**20:.0f} MiB)", flush=True)
    m_sweep = sweep_gated_m if gated else sweep_m
    return [m_sweep(label, M, weights, gen, sweep, full, nbytes / ceiling / 1e6) for M in ms]


def sweep_m(
    label: str, M: int, weights: list[torch.Tensor], gen: torch.Generator, sweep: bool, full: bool, floor: float
) -> Row:
    N, K = weights[0].shape
    dev = weights[0].device
    x = torch.randn(M, K, device=dev, dtype=DT, generator=gen)
    ref = F.linear(x, weights[0]).float()
    reps = max(1, math.ceil(16 / len(weights)))  # at least 16 calls per graph

    def timed(call: Callable[[torch.Tensor], object]) -> float:
        return graph_ms([lambda w=w: call(w) for w in weights] * reps) * 1e3

    with blas("cublas"):
        cublas = timed(lambda w: F.linear(x, w))
    with blas("cublaslt"):
        if not (err := rel_err(F.linear(x, weights[0]), ref)) < TOL:
            print(f"  FAIL cuBLASLt M={M}: rel err {err:.2e}", flush=True)
        cublaslt = timed(lambda w: F.linear(x, w))
    out = torch.empty(M, N, device=dev, dtype=DT)

    def time_config(cfg: LinearConfig) -> float:
        """µs per call, or nan (printed) where the config fails its check or does not run."""
        try:
            launch(cfg, x, weights[0], out)
            if not (err := rel_err(out, ref)) < TOL:
                print(f"  FAIL {describe(cfg)} M={M}: rel err {err:.2e}", flush=True)
                return math.nan
            return timed(lambda w: launch(cfg, x, w, out))
        except Exception as exc:  # noqa: BLE001 - out of resources, compile or launch errors
            print(f"  error {describe(cfg)} M={M}: {type(exc).__name__}: {str(exc).strip()[:120]}", flush=True)
            return math.nan

    rule = triton_ops.linear_config(M, N, K, DT)
    rule_us = time_config(rule) if rule is not None else timed(lambda w: F.linear(x, w))
    rule_cfg = describe(rule) if rule is not None else "F.linear (default BLAS)"
    best: dict[str, tuple[float, LinearConfig]] = {}
    for cfg in candidates(M, N, K, full) if sweep else []:
        us = time_config(cfg)
        name = describe(cfg).split()[0]
        if not math.isnan(us) and (name not in best or us < best[name][0]):
            best[name] = (us, cfg)
    line = f"{label} M={M:<3} floor {floor:6.2f} us | cuBLAS {per_call(cublas, N, K, M)}"
    print(line + f" | cuBLASLt {per_call(cublaslt, N, K, M)}", flush=True)
    print(f"    {'rule':<8} {per_call(rule_us, N, K, M)}  {rule_cfg}", flush=True)
    for name, (us, cfg) in sorted(best.items(), key=lambda kv: kv[1][0]):
        print(f"    {name:<8} {per_call(us, N, K, M)}  {describe(cfg)}", flush=True)
    top_us, top_cfg = min(best.values(), key=lambda t: t[0]) if best else (math.nan, None)
    top = describe(top_cfg) if top_cfg is not None else "-"
    return Row(label, N, K, M, floor, cublas, cublaslt, rule_us, rule_cfg, top_us, top)


def sweep_gated_m(
    label: str, M: int, weights: list[torch.Tensor], gen: torch.Generator, sweep: bool, full: bool, floor: float
) -> Row:
    """--gated: silu(gate) * up of x W^T [M, N/2] by each method (see the module docstring)."""
    N, K = weights[0].shape
    dev = weights[0].device
    x = torch.randn(M, K, device=dev, dtype=DT, generator=gen)
    ref = silu_and_mul_reference(F.linear(x.float(), weights[0].float()))
    reps = max(1, math.ceil(16 / len(weights)))

    def timed(call: Callable[[torch.Tensor], object]) -> float:
        return graph_ms([lambda w=w: call(w) for w in weights] * reps) * 1e3

    def checked(name: str, got: torch.Tensor) -> bool:
        if not (err := rel_err(got, ref)) < TOL:
            print(f"  FAIL {name} M={M}: rel err {err:.2e}", flush=True)
        return err < TOL

    apart = {}
    for name in ("cublas", "cublaslt"):
        with blas(name):
            checked(name, layers.silu_and_mul(F.linear(x, weights[0])))
            apart[name] = timed(lambda w: layers.silu_and_mul(F.linear(x, w)))
    checked("apart", layers.silu_and_mul(layers.linear(x, weights[0])))
    engine_apart = timed(lambda w: layers.silu_and_mul(layers.linear(x, w)))
    out = torch.empty(M, N // 2, device=dev, dtype=DT)

    def time_config(cfg: LinearConfig) -> float:
        try:
            launch(cfg, x, weights[0], out, gated=True)
            if not checked(describe(cfg), out):
                return math.nan
            return timed(lambda w: launch(cfg, x, w, out, gated=True))
        except Exception as exc:  # noqa: BLE001 - out of resources, compile or launch errors
            print(f"  error {describe(cfg)} M={M}: {type(exc).__name__}: {str(exc).strip()[:120]}", flush=True)
            return math.nan

    rule = triton_ops.gated_dot_config(M, N, K, DT)
    rule_us = time_config(rule) if rule is not None else engine_apart
    rule_cfg = f"gated {describe(rule)}" if rule is not None else "apart (no gated config)"
    found = []
    for cfg in gated_candidates(M, N, K, full) if sweep else []:
        us = time_config(cfg)
        if not math.isnan(us):
            found.append((us, cfg))
    found.sort(key=lambda t: t[0])
    print(f"{label} gated M={M:<3} floor {floor:6.2f} us | cuBLAS + SiLU {per_call(apart['cublas'], N, K, M)}"
          f" | cuBLASLt + SiLU {per_call(apart['cublaslt'], N, K, M)}", flush=True)  # fmt: skip
    print(f"    {'apart':<8} {per_call(engine_apart, N, K, M)}  the engine's product rule + SiLU-and-mul", flush=True)
    print(f"    {'rule':<8} {per_call(rule_us, N, K, M)}  {rule_cfg}", flush=True)
    for us, cfg in found[:8]:
        print(f"    {'gated':<8} {per_call(us, N, K, M)}  {describe(cfg)}", flush=True)
    top_us, top_cfg = found[0] if found else (math.nan, None)
    top = f"gated {describe(top_cfg)}" if top_cfg is not None else "-"
    return Row(label, N, K, M, floor, apart["cublas"], apart["cublaslt"], rule_us, rule_cfg, top_us, top, engine_apart)


def best_us(r: Row) -> float:
    """The fastest method of a row (a sweep that did not run, or failed, counts as absent)."""
    return min(u for u in (r.cublas_us, r.cublaslt_us, r.rule_us, r.triton_us) if not math.isnan(u))


def report(model: str, rows: list[Row], ceiling: float, device: str) -> str:
    def tbs(r: Row, us: float) -> float:
        return r.N * r.K * 2 / us / 1e6

    head = f"Device: {device}; copy ceiling {ceiling:.2f} TB/s (1 GiB D2D copy, read+write); bf16"
    cols = ["shape", "N x K", "M", "floor µs", "cuBLAS µs", "TB/s", "cuBLASLt µs", "rule µs", "rule / cuBLAS"]
    cols += ["rule config", "best Triton µs", "TB/s", "TFLOP/s", "Triton config", "best / floor"]
    lines = [head + "; µs per call in a CUDA graph over weight copies > 4x L2 (median of 20 replays)", ""]
    lines += ["| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
    for r in rows:
        best = best_us(r)
        lines.append(
            f"| {r.shape} | {r.N}x{r.K} | {r.M} | {r.floor_us:.2f} | {r.cublas_us:.2f} | {tbs(r, r.cublas_us):.2f} "
            f"| {r.cublaslt_us:.2f} | {r.rule_us:.2f} | {r.rule_us / r.cublas_us:.3f} | {r.rule_cfg} "
            f"| {r.triton_us:.2f} | {tbs(r, r.triton_us):.2f} | {2 * r.M * r.N * r.K / r.triton_us / 1e6:.0f} "
            f"| {r.triton_cfg} | {best / r.floor_us:.2f} |"
        )
    layers, shapes = MODELS[model]
    weight = {label: 1 if label == "lm_head" else layers for label, _, _ in shapes}
    by_m: dict[int, dict[str, Row]] = {}
    for r in rows:
        by_m.setdefault(r.M, {})[r.shape] = r
    if not all(set(got) == set(weight) for got in by_m.values()):
        return "\n".join([*lines, "", "(per-step totals need every shape of the model)"])
    methods: dict[str, Callable[[Row], float]] = {
        "floor": lambda r: r.floor_us,
        "cuBLAS": lambda r: r.cublas_us,
        "cuBLASLt": lambda r: r.cublaslt_us,
        "engine rule": lambda r: r.rule_us,
        "best Triton": lambda r: r.triton_us,
        "best per shape": best_us,
    }
    lines += ["", f"GEMM µs per decode step ({model}: {layers} x (qkv + o_proj + gate_up + down) + lm_head)", ""]
    lines += ["| M | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for M, got in by_m.items():
        cells = [sum(weight[s] * f(r) for s, r in got.items()) for f in methods.values()]
        lines.append(f"| {M} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ CPU smoke


def smoke() -> None:
    """Interpreter check (TRITON_INTERPRET=1, CPU) of the engine's kernels as the sweep launches
    them (1-4 splits, ragged M, N and K) and of the sweep's config counts."""
    if not INTERPRET:
        sys.exit("--smoke runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(0)
    for M, N, K in ((5, 48, 256), (16, 64, 200), (33, 40, 96)):
        x = torch.randn(M, K, generator=gen).to(DT)
        w = torch.randn(N, K, generator=gen).mul_(K**-0.5).to(DT)
        ref = (x.float() @ w.float().T).to(DT).float()
        for split in (1, 2, 3, 4):
            cfg = LinearConfig("dot", 16, 32, 64, 4, 3, split)
            out = torch.empty(M, N, dtype=DT)
            launch(cfg, x, w, out)
            again = torch.empty(M, N, dtype=DT)
            launch(cfg, x, w, again)
            err = rel_err(out, ref)
            assert err < TOL and torch.equal(out, again), (M, N, K, cfg, err)
            print(f"ok  M={M} N={N} K={K} {describe(cfg)}: rel err {err:.1e}, repeat bit-identical", flush=True)
        gated = LinearConfig("dot", 16, 16, 64, 4, 3)
        out = torch.empty(M, N // 2, dtype=DT)
        launch(gated, x, w, out, gated=True)
        err = rel_err(out, silu_and_mul_reference(x.float() @ w.float().T))
        assert err < TOL, (M, N, K, gated, err)
        print(f"ok  M={M} N={N} K={K} gated {describe(gated)}: rel err {err:.1e}", flush=True)
    for model, (_, shapes) in MODELS.items():
        keys: set[tuple] = set()
        for label, N, K in shapes:
            counts = [len(candidates(M, N, K)) for M in (16, 32, 64, 128, 192, 256)]
            assert all(counts), (model, label, counts)
            keys |= set().union(*(compile_keys(candidates(M, N, K), K) for M in (16, 32, 64, 128, 192, 256)))
            print(f"{model} {label} {N}x{K}: configs per M 16..256 = {counts}", flush=True)
        _, N, K = next(shape for shape in shapes if shape[0] == "gate_up")
        counts = [len(gated_candidates(M, N, K)) for M in (5, 8, 13, 16)]
        assert all(counts), (model, counts)
        print(f"{model} gate_up {N}x{K}: gated configs per M 5, 8, 13, 16 = {counts}", flush=True)
        print(f"{model}: {len(keys)} distinct kernel compiles (+1 sum kernel per split count)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=list(MODELS), default="qwen3")
    ap.add_argument("--ms", type=int, nargs="+", default=[16, 32, 64, 128, 192, 256])
    ap.add_argument("--shapes", nargs="+", help="subset of the model's shape labels (default all)")
    ap.add_argument("--full", action="store_true", help="every BLOCK_M and warp count, not the pruned set")
    ap.add_argument("--no-sweep", action="store_true", help="time cuBLAS and the engine's rule only")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile threads (1: serial)")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter check of the kernels, then exit")
    ap.add_argument("--gated", action="store_true", help="gate_up + SiLU-and-mul: apart against the gated dot kernel")
    args = ap.parse_args()
    if args.smoke:
        smoke()
        return
    _, shapes = MODELS[args.model]
    if args.gated:
        shapes = [s for s in shapes if s[0] == "gate_up"]
    if args.shapes:
        unknown = set(args.shapes) - {s for s, _, _ in shapes}
        if unknown:
            ap.error(f"unknown shapes {sorted(unknown)}; {args.model} has {[s for s, _, _ in shapes]}")
        shapes = [s for s in shapes if s[0] in args.shapes]
    device = torch.cuda.get_device_name(0)
    print(f"device: {device}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    print(f"default BLAS: {torch.backends.cuda.preferred_blas_library()}, "
          f"L2 {torch.cuda.get_device_properties(0).L2_cache_size / 2**20:.0f} MiB", flush=True)  # fmt: skip
    start = time.perf_counter()
    ceiling = copy_ceiling()
    print(f"copy ceiling: {ceiling:.2f} TB/s", flush=True)
    sweep = not args.no_sweep
    plan = []
    for _, N, K in shapes:
        for M in args.ms:
            if args.gated:
                rule = triton_ops.gated_dot_config(M, N, K, DT)
                cfgs = gated_candidates(M, N, K, args.full) if sweep else []
            else:
                rule = triton_ops.linear_config(M, N, K, DT)
                cfgs = candidates(M, N, K, args.full) if sweep else []
            plan.append((M, N, K, cfgs + ([rule] if rule is not None and rule not in cfgs else [])))
    keys = set().union(*(compile_keys(cfgs, K) for _, _, K, cfgs in plan))
    print(f"{sum(len(p[3]) for p in plan)} (shape, M, config) timings, {len(keys)} kernel compiles", flush=True)
    precompile(compile_launches(plan, args.gated), args.jobs)
    torch.cuda.empty_cache()
    rows = []
    for label, N, K in shapes:
        rows += sweep_shape(label, N, K, args.ms, sweep, args.full, ceiling, args.gated)
        torch.cuda.empty_cache()
        print(f"  ({time.perf_counter() - start:.0f} s so far)", flush=True)
    table = report(args.model, rows, ceiling, device)
    print("\n" + table, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gemm_decode.md"), "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
