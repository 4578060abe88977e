"""Where a tensor-parallel decode step's time goes, on rank 0's GPU (issue 7).

    python benchmarks/probes/tp_profile.py --model llama-3.1-8b [--tp 2] [--batches 1 256] [--with-tp1]
    python benchmarks/probes/tp_profile.py --runs 1 2 1:NANOSERVE_GEMV_PREFETCH_MB=16 2:NANOSERVE_GEMV_PREFETCH_MB=16

Each run is its own process: by default TP=N as the environment says (the decode sums
fused with their RMSNorm over symmetric memory), TP=N with NCCL only
(NANOSERVE_SYMM_MEM=0), and with --with-tp1 TP=1; `--runs` lists them instead, each as a
TP size with optional environment settings (TP[:KEY=VAL[,KEY=VAL]]). In each, for
every batch size B: B requests (128-token prompts, greedy) are decoded from the captured
graph; after a few warm steps, 100 (B=1) or 30 engine steps are timed (wall ms per step,
and how much of it rank 0's host spent waiting for the GPU: near the whole step means
GPU-bound), then torch.profiler (CUDA activities, rank 0 only) covers 10 steps and the
kernels are grouped by name and by kind (communication, then profile_decode.py's kinds). A
communication kernel's time includes its wait for the peer rank, so a rank that lags shows
up there. The TP children end with os._exit after writing their results (their workers die
with them): teardown is not what is measured here.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the repository, and benchmarks/ for shared helpers

import argparse
import json
import os
import subprocess
import time

PROMPT_LEN, WARM_STEPS, PROFILE_STEPS = 128, 6, 10


def kind(name: str) -> str:
    n = name.lower()
    if "all_reduce" in n or "nccl" in n or "allreduce" in n or "allgather" in n or "broadcast" in n:
        return "communication"
    from profile_decode import kernel_kind

    return kernel_kind(name)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure_batch(llm, batch: int) -> dict:
    import torch

    from nanoserve import SamplingParams

    engine = llm.engine
    vocab = min(10000, engine.model_config.vocab_size)
    timed = 100 if batch == 1 else 30
    params = SamplingParams(temperature=0, max_tokens=WARM_STEPS + timed + PROFILE_STEPS + 40, ignore_eos=True)
    for i in range(batch):
        prompt = [(31 * i + 7 * j + 3) % vocab for j in range(PROMPT_LEN)]
        engine.add_request(f"b{batch}-{i}", prompt, params, stream=False)
    while any(r.num_computed < PROMPT_LEN for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill (in chunks)
    for _ in range(WARM_STEPS):
        engine.step()
    assert len(engine.scheduler.running) == batch, (len(engine.scheduler.running), batch)
    _sync()
    wait0, step0 = engine.gpu_wait_s, engine.step_s
    started = time.perf_counter()
    for _ in range(timed):
        engine.step()
    _sync()
    wall_ms = (time.perf_counter() - started) * 1e3 / timed
    wait_ms = (engine.gpu_wait_s - wait0) * 1e3 / timed
    host_ms = (engine.step_s - step0) * 1e3 / timed - wait_ms
    activity = torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[activity.CUDA if torch.cuda.is_available() else activity.CPU]) as prof:
        for _ in range(PROFILE_STEPS):
            engine.step()
        _sync()
    for r in list(engine.scheduler.running):
        engine.abort_request(r.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    from profile_decode import device_us

    rows = [(e.key, e.count / PROFILE_STEPS, device_us(e) / PROFILE_STEPS) for e in prof.key_averages()]
    rows = sorted((r for r in rows if r[2] > 0), key=lambda r: -r[2])
    kinds: dict[str, list[float]] = {}
    for key, count, us in rows:
        k = kinds.setdefault(kind(key), [0.0, 0.0])
        k[0] += count
        k[1] += us
    return {
        "batch": batch,
        "wall_ms": wall_ms,
        "gpu_wait_ms": wait_ms,
        "host_ms": host_ms,
        "kernels": rows[:16],
        "kinds": kinds,
    }


def child(args) -> None:
    from nanoserve import LLM

    started = time.perf_counter()
    kw = {"tensor_parallel_size": args.child} if args.child > 1 else {}
    kw.update({"device": args.device} if args.device else {})
    llm = LLM(
        args.model, load_format="dummy", dtype="bfloat16", max_model_len=1024, max_num_seqs=max(args.batches),
        cuda_graph_max_bs=max(args.batches), piecewise_cuda_graphs=False, enable_prefix_caching=False, **kw,
    )  # fmt: skip
    local = getattr(llm.engine.runner, "local", llm.engine.runner)
    result = {
        "tp": args.child,
        "symm": getattr(local.model.tp, "symm", None) is not None,
        "ready_s": time.perf_counter() - started,
        "batches": [measure_batch(llm, b) for b in args.batches],
    }
    Path(args.out).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # the worker ranks die with this process (PR_SET_PDEATHSIG)


def show(r: dict) -> None:
    name = f"TP={r['tp']}" + ("" if r["tp"] == 1 else (" symmetric memory" if r["symm"] else " NCCL only"))
    name += "".join(f" {k}={v}" for k, v in r["settings"].items() if k != "NANOSERVE_SYMM_MEM")
    for b in r["batches"]:
        total = sum(us for _, _, us in b["kernels"])
        print(
            f"\n== {name}, batch {b['batch']}: wall {b['wall_ms']:.3f} ms/step, rank 0 waits for its GPU "
            f"{b['gpu_wait_ms']:.3f} ms/step (host busy {b['host_ms']:.3f} ms/step)"
        )
        for key, count, us in b["kernels"]:
            print(f"  {key[:70]:<70} {count:>6.1f}/step {us:>8.1f} us/step {us / count if count else 0:>7.1f} us each")
        kinds = ", ".join(
            f"{k} {us / 1e3:.3f} ms ({n:.0f})" for k, (n, us) in sorted(b["kinds"].items(), key=lambda kv: -kv[1][1])
        )
        print(f"  by kind (top 16 kernels shown, {total / 1e3:.3f} ms of them): {kinds}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--with-tp1", action="store_true")
    ap.add_argument(
        "--runs", nargs="+", default=None, help="TP[:KEY=VAL[,KEY=VAL]] per run (replaces the default runs)"
    )
    ap.add_argument("--device", default=None, help="default: the engine's; cpu to try the script on a tiny model")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args)
        return
    if args.runs:
        runs = [parse_run(spec) for spec in args.runs]
    else:
        runs = [(args.tp, {}), (args.tp, {"NANOSERVE_SYMM_MEM": "0"})] + ([(1, {})] if args.with_tp1 else [])
    results = []
    for i, (tp, settings) in enumerate(runs):
        out = Path(f"/tmp/tp_profile_{i}.json")
        out.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--model", args.model, "--child", str(tp), "--out", str(out)]
        cmd += (["--device", args.device] if args.device else []) + ["--batches", *map(str, args.batches)]
        try:
            code = subprocess.run(cmd, check=False, env={**os.environ, **settings}, timeout=240).returncode
        except subprocess.TimeoutExpired:
            code = "timed out"
        if out.exists():
            results.append(json.loads(out.read_text()) | {"settings": settings})
            show(results[-1])
        else:
            print(f"TP={tp} {settings or ''}: failed (exit code {code})", flush=True)
    print("\n== summary (ms per decode step, wall | rank 0 waiting for its GPU)")
    for r in results:
        name = f"TP={r['tp']}" + ("" if r["tp"] == 1 else (" symm" if r["symm"] else " NCCL"))
        name += "".join(f" {k}={v}" for k, v in r["settings"].items() if k != "NANOSERVE_SYMM_MEM")
        cells = [f"batch {b['batch']}: {b['wall_ms']:.3f} | {b['gpu_wait_ms']:.3f}" for b in r["batches"]]
        print(f"{name:<10} ready {r['ready_s']:.0f} s; " + "; ".join(cells))


def parse_run(spec: str) -> tuple[int, dict[str, str]]:
    """ "2" -> (2, {}); "2:A=1,B=x" -> (2, {"A": "1", "B": "x"})."""
    tp, _, settings = spec.partition(":")
    return int(tp), dict(kv.split("=", 1) for kv in settings.split(",") if kv)


if __name__ == "__main__":
    main()
