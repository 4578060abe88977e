"""Where batch-1 decode time goes on the GPU, and what the Triton decode kernels buy.

    python benchmarks/probes/profile_decode.py [--models qwen3-0.6b llama-3.1-8b] [--ops off on] [--quantization fp8]
    python benchmarks/probes/profile_decode.py --gemv [--gemv-models ...] [--json FILE]
    python benchmarks/probes/profile_decode.py --host [--models qwen3-0.6b]

Default: for each model and each setting of the Triton decode kernels (nanoserve/kernels,
KernelSwitches.triton_ops): a batch-1 request (128-token prompt, greedy) decodes from the captured
CUDA graph; torch.profiler (CUDA activities: CUPTI records the kernels inside graph replays)
covers 20 engine steps, and the kernels are grouped by name (launches and µs per step), then
by kind. Also printed: wall time per step (100 steps, no profiler) and one graph replay alone
(50 replays timed with events).

--gemv: the small-M linear microbenchmark behind `kernels.linear.linear_config`. For the decoder
shapes of the chosen models and M = 1, 2, 4, 8 it times cuBLAS (F.linear) and a sweep of
Triton configs, each inside a CUDA graph of back-to-back calls over weight copies that
together exceed L2 several times (as decode streams every layer's weights from memory).
Each config's output is checked against F.linear first.

--pdl off on: repeat the default profile with programmatic dependent launch of the Triton
decode kernels off and on (KernelSwitches.pdl).

--min-split-tokens N [N ...]: repeat the default profile with the Triton attention's
shortest decode split overridden (kernels/attention.py MIN_SPLIT_TOKENS).

--host: the older host-side view (cProfile over graph steps at batch 1 and 256, and the
eager GPU kernels) on one model.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the repository, and benchmarks/ for shared helpers

import argparse
import cProfile
import dataclasses
import io
import json
import math
import pstats
import random
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F
from latency import batch1_graph_ms, decode_wall_ms

from nanoserve import LLM, SamplingParams
from nanoserve.kernels import attention as tk
from nanoserve.switches import KernelSwitches

PROMPT = [(7 * i + 3) % 10000 for i in range(128)]

# (N, K) of the decoder's matrix products: qkv, o, gate_up, down, LM head
SHAPES = {
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
                   "lm_head": (151936, 1024)},
    "llama-3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                     "lm_head": (128256, 4096)},
}  # fmt: skip


# ------------------------------------------------------------------------ batch-1 kernel profile


def kernel_kind(name: str) -> str:
    n = name.lower()
    if "_linear_" in n or "gemm" in n or "gemv" in n or "nvjet" in n or "cutlass" in n or "splitk" in n:
        return "matmul"
    if "decode" in n or "store_kv" in n or "attn" in n:
        return "attention"
    if "memcpy" in n or "memset" in n:
        return "copy"
    if "norm" in n or "triton_" in n or "elementwise" in n or "reduce" in n:
        return "fused / elementwise"
    return "other"


def device_us(evt) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(evt, attr, None)
        if value is not None:
            return float(value)
    return 0.0


def profile_batch1(
    name: str, ops_on: bool, min_split: int | None = None, pdl: bool = True, steps: int = 20, quantization=None
) -> dict:
    if min_split is not None:  # an experiment on the attention backend's decode split policy
        tk.MIN_SPLIT_TOKENS = min_split
    # the environment's other switches too (NANOSERVE_MXFP4_EXPERTS=1: gpt-oss's experts kept packed)
    switches = dataclasses.replace(KernelSwitches.from_env(), triton_ops=ops_on, pdl=pdl)
    llm = LLM(
        name, load_format="dummy", max_model_len=1024, kv_cache_tokens=16384, max_num_seqs=8, switches=switches,
        quantization=quantization,
    )  # fmt: skip
    engine = llm.engine
    wall_ms = decode_wall_ms(engine, PROMPT)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    graph_ms = batch1_graph_ms(engine)
    for r in list(engine.scheduler.running):
        engine.abort_request(r.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    rows = [(e.key, e.count / steps, device_us(e) / steps) for e in prof.key_averages() if device_us(e) > 0]
    rows.sort(key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    launches = sum(r[1] for r in rows)
    split = f", PDL {'on' if pdl else 'off'}, decode MIN_SPLIT_TOKENS {tk.MIN_SPLIT_TOKENS}"
    print(
        f"\n== {name}{' (' + quantization + ' weights)' if quantization else ''}, Triton decode kernels {'on' if ops_on else 'off'}{split}: batch 1, graph decode, {steps} steps"
    )
    print(f"{'kernel':<72} {'launches/step':>13} {'µs/step':>9} {'share':>6}")
    for key, count, us in rows[:24]:
        print(f"{key[:72]:<72} {count:>13.1f} {us:>9.1f} {us / total:>6.1%}")
    if len(rows) > 24:
        rest = rows[24:]
        print(f"{'(' + str(len(rest)) + ' more)':<72} {sum(r[1] for r in rest):>13.1f} {sum(r[2] for r in rest):>9.1f}")
    kinds: dict[str, list[float]] = {}
    for key, count, us in rows:
        k = kinds.setdefault(kernel_kind(key), [0.0, 0.0])
        k[0] += count
        k[1] += us
    for kind, (count, us) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        print(f"  {kind:<22} {count:>6.1f} launches {us:>8.1f} µs/step")
    print(
        f"  kernels {launches:.0f}/step, kernel time {total / 1e3:.3f} ms/step | graph replay alone {graph_ms:.3f} ms"
        f" | wall {wall_ms:.3f} ms/step (100 steps, no profiler)"
    )
    del llm, engine
    torch.cuda.empty_cache()
    return {"model": name, "ops": ops_on, "min_split": tk.MIN_SPLIT_TOKENS, "pdl": pdl, "kernel_ms": total / 1e3, "launches": launches, "graph_ms": graph_ms,
            "wall_ms": wall_ms, "kinds": kinds}  # fmt: skip


# ------------------------------------------------------------------------ small-M linear sweep


def candidates(M: int, N: int, K: int) -> list:
    from nanoserve.kernels.linear import LinearConfig, linear_config

    out = []
    if M == 1:
        for bn in (2, 4, 8, 16):
            for bk in (256, 512, 1024, 2048):
                for warps in (2, 4, 8):
                    # fp32 accumulator registers per thread: at most 64
                    if bk <= K and bn * bk <= 64 * 32 * warps and bn * bk >= 32 * warps * 8:
                        out.append(LinearConfig("fma", 1, bn, bk, warps))
    else:
        bm = triton_next_pow2(M)
        for bn in (2, 4, 8):
            for bk in (256, 512):
                if bm * bn * bk <= 64 * 32 * 4:
                    out.append(LinearConfig("fma", bm, bn, bk, 4))
        for bn, bk, stages in ((16, 128, 3), (16, 256, 3), (32, 128, 3), (32, 128, 4), (32, 256, 3), (64, 128, 3),
                               (64, 256, 3), (16, 512, 2)):  # fmt: skip
            if bk <= K:
                out.append(LinearConfig("dot", 16, bn, bk, 4, stages))
    rule = linear_config(M, N, K, torch.bfloat16)
    if rule is not None and rule not in out:
        out.append(rule)
    return out


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def tb_per_s(nbytes: int, us: float) -> float:
    return nbytes / us / 1e6


def short(c) -> str:
    return f"{c.kernel} m{c.block_m} n{c.block_n} k{c.block_k} w{c.num_warps} s{c.num_stages}"


def graph_us(calls: list, reps: int = 10) -> float:
    """Median µs per call of `calls` captured back to back in one CUDA graph."""
    for c in calls[:2]:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (reps * len(calls)))
    del graph
    return statistics.median(times)


def gemv_sweep(models: list[str], json_path: str | None) -> None:
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from nanoserve.kernels import linear as triton_ops

    dev = torch.device("cuda")
    results = []
    print(
        f"\n== small-M linear: cuBLAS vs Triton, bf16, µs per call inside a CUDA graph ({torch.cuda.get_device_name()})"
    )
    head = f"{'model':<13} {'shape':<8} {'N x K':<13} {'M':>2} {'cuBLAS µs':>9} {'TB/s':>5} "
    print(head + f"{'best Triton':<30} {'µs':>6} {'TB/s':>5} {'x':>5} | {'rule':<30} {'µs':>6} {'x':>5}")
    for model in models:
        for label, (N, K) in SHAPES[model].items():
            nbytes = N * K * 2
            copies = max(1, min(64, math.ceil(400e6 / nbytes)))
            weights = [(torch.randn(N, K, device=dev) / K**0.5).bfloat16() for _ in range(copies)]
            for M in (1, 2, 4, 8):
                x = torch.randn(M, K, device=dev).bfloat16()
                ref = F.linear(x, weights[0])
                cublas = graph_us([lambda w=w, x=x: F.linear(x, w) for w in weights])
                timed = []
                for config in candidates(M, N, K):
                    try:
                        got = triton_ops.small_m_linear(x, weights[0], None, config)
                        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                        if not err < 2e-2:
                            print(f"  BAD {config}: relative error {err:.2e}")
                            continue
                        us = graph_us(
                            [lambda w=w, c=config, x=x: triton_ops.small_m_linear(x, w, None, c) for w in weights]
                        )
                    except (OutOfResources, CompilationError, RuntimeError) as exc:  # a config the compiler rejects
                        print(f"  skipped {config}: {type(exc).__name__}: {str(exc)[:100]}")
                        continue
                    timed.append((us, config))
                timed.sort(key=lambda t: t[0])
                rule = triton_ops.linear_config(M, N, K, torch.bfloat16)
                rule_us = next((us for us, c in timed if c == rule), float("nan"))
                best_us, best = timed[0]
                tbs = partial(tb_per_s, nbytes)
                rule_name = short(rule) if rule else "cuBLAS"
                rule_x = cublas / rule_us if rule else 1.0
                print(
                    f"{model:<13} {label:<8} {f'{N}x{K}':<13} {M:>2} {cublas:>9.2f} {tbs(cublas):>5.2f} "
                    f"{short(best):<30} {best_us:>6.2f} {tbs(best_us):>5.2f} {cublas / best_us:>5.2f} | "
                    f"{rule_name:<30} {rule_us if rule else cublas:>6.2f} {rule_x:>5.2f}",
                    flush=True,
                )
                results.append({
                    "model": model, "shape": label, "N": N, "K": K, "M": M, "cublas_us": cublas,
                    "triton": [{"config": c.__dict__, "us": us} for us, c in timed],
                })  # fmt: skip
            del weights
            torch.cuda.empty_cache()
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f)


# ------------------------------------------------------------------------------- host view


def host_view(name: str) -> None:
    def start(llm, batch: int):
        engine = llm.engine
        rng = random.Random(0)
        for i in range(batch):
            ids = [rng.randrange(10000) for _ in range(1000)]
            engine.add_request(f"p{i}", ids, SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.6))
        while engine.scheduler.waiting or any(r.num_output_tokens < 2 for r in engine.scheduler.running):
            engine.step()
        return engine

    for eager in (True, False):
        llm = LLM(name, load_format="dummy", max_model_len=4096, enforce_eager=eager, kv_cache_tokens=600_000)
        for batch in (1, 256):
            engine = start(llm, batch)
            steps = 30
            if eager:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(steps):
                        engine.step()
                    torch.cuda.synchronize()
                print(f"== eager decode, batch {batch}, ctx ~1000: GPU kernels over {steps} steps")
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
            else:
                torch.cuda.synchronize()
                t = time.perf_counter()
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(steps):
                    engine.step()
                prof.disable()
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t) / steps
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
                print(f"== graph decode, batch {batch}: {wall * 1e3:.2f} ms/step wall (under cProfile)")
                print(out.getvalue()[-6000:])
            for r in list(engine.scheduler.running):
                engine.abort_request(r.request_id)
            while engine.has_unfinished_requests():
                engine.step()
        del llm
        torch.cuda.empty_cache()


@torch.inference_mode()  # the engine's tensors are inference tensors; steps run outside generate()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    ap.add_argument("--ops", nargs="+", choices=["off", "on"], default=["off", "on"])
    ap.add_argument("--min-split-tokens", type=int, nargs="+", default=[None],
                    help="override the Triton attention's shortest decode split (an experiment)")  # fmt: skip
    ap.add_argument("--pdl", nargs="+", choices=["off", "on"], default=["on"], help="KernelSwitches.pdl settings")
    ap.add_argument("--gemv", action="store_true", help="run the small-M linear sweep instead")
    ap.add_argument("--gemv-models", nargs="+", default=list(SHAPES))
    ap.add_argument("--json", help="with --gemv: write every timing to this file")
    ap.add_argument("--host", action="store_true", help="host-side view (cProfile) of the first model")
    ap.add_argument("--quantization", choices=["fp8"], default=None, help="weights quantized at load")
    args = ap.parse_args()
    if args.gemv:
        gemv_sweep(args.gemv_models, args.json)
        return
    if args.host:
        host_view(args.models[0])
        return
    summary = [
        profile_batch1(m, ops == "on", split, pdl == "on", quantization=args.quantization)
        for m in args.models
        for ops in args.ops
        for split in args.min_split_tokens
        for pdl in args.pdl
    ]
    print("\n== summary (batch 1, ms per decode step)")
    for s in summary:
        print(
            f"{s['model']:<13} Triton ops {'on ' if s['ops'] else 'off'}, PDL {'on ' if s['pdl'] else 'off'}, "
            f"min split {s['min_split']}: kernels {s['launches']:.0f}, "
            f"kernel time {s['kernel_ms']:.3f}, graph replay {s['graph_ms']:.3f}, wall {s['wall_ms']:.3f}"
        )


if __name__ == "__main__":
    main()
