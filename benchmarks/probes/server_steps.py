"""Where a served stream's inter-token gaps come from: the engine process's own token times
against what the HTTP client sees.

Starts `nanoserve serve MODEL --load-format dummy` in-process (`run_server`, the serving
config) with an engine factory that wraps `LLMEngine.step`: at each step's return it notes the
time and every request that got tokens (the moment the engine process sends them to the API
server). Then `benchmarks/serving.py` runs against it once per `--runs` entry (rate x prompts),
and at shutdown the engine writes its notes to `$SERVER_STEPS_OUT` (the probe's --trace file).
Printed per run: the engine-side inter-token p50 / p90 / p99 and per-request maximum, the
client's, and the steps whose wall time (step return to step return) was over `--bound` ms,
each split into the loop's work before the step (messages in, outputs out) and the step()
call, that by part (schedule, prepare, forward launch, sample, and the processing of the step
in flight, which waits for its sampled tokens: a long one means a long device step), with the
device and pinned allocations it made, the queue's length and the batch it scheduled.
If the engine side has the client's long gaps, they come from the engine's loop; if not, from
the API server or the client. Found with it (2026-12-02): the first step at each new count of
running requests took twice a step, until the warm-up ran every row count.

    python benchmarks/probes/server_steps.py --runs 16x200 32x200 32x300 32x600
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repository, run from anywhere


PARTS = ("schedule", "prepare", "forward", "sample", "process")  # timed calls inside step()


def traced_engine(config):
    """The engine factory: an LLMEngine whose steps note their return time and token updates."""
    from nanoserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(config)
    import torch

    # Per step: (return time, [(request, new tokens)], entry time, waiting, running, then ms in
    # each part of step() (PARTS), device allocations and allocator retries (cudaMalloc, after
    # freeing the cache), pinned host allocations, decode rows and prompt tokens scheduled).
    notes: list[tuple] = []
    sched, runner = engine.scheduler, engine.runner
    spent = dict.fromkeys(PARTS, 0.0)
    scheduled = [(0, 0)]

    def timed(owner, name: str, part: str, after=None):
        inner = getattr(owner, name)

        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                result = inner(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - t
            if after is not None:
                after(result)
            return result

        setattr(owner, name, call)

    def note_batch(batch):
        if batch is not None:
            decodes = len(batch.requests) if batch.is_decode else batch.num_decodes
            scheduled[0] = (decodes, batch.num_tokens - decodes)

    timed(sched, "schedule", "schedule", note_batch)
    timed(runner, "prepare", "prepare")
    timed(runner, "execute", "forward")
    timed(engine.sampler, "sample", "sample")
    timed(engine, "_process", "process")

    def counters() -> tuple[int, int, int]:
        if not torch.cuda.is_available():
            return -1, -1, -1
        dev = torch.cuda.memory_stats()
        host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
        return dev.get("num_device_alloc", -1), dev.get("num_alloc_retries", -1), host.get("num_host_alloc", -1)

    step = engine.step

    def traced_step():
        entered, waiting, running = time.perf_counter(), len(sched.waiting), len(sched.running)
        for part in spent:
            spent[part] = 0.0
        scheduled[0] = (0, 0)
        before = counters()
        updates = step()
        after = counters()
        got = [(u.request_id, len(u.new_token_ids)) for u in updates if u.new_token_ids]
        parts = [round(spent[p] * 1e3, 3) for p in PARTS]
        grew = [b - a for a, b in zip(before, after)]
        notes.append((time.perf_counter(), got, entered, waiting, running, parts, grew, *scheduled[0]))
        return updates

    shutdown = engine.shutdown

    def traced_shutdown():
        with open(os.environ["SERVER_STEPS_OUT"], "w") as f:
            json.dump(notes, f)
        shutdown()

    engine.step, engine.shutdown = traced_step, traced_shutdown
    return engine


def serve(model: str, port: int) -> None:
    from nanoserve.cli import build_parser
    from nanoserve.config import engine_config_from_args
    from nanoserve.server.launch import run_server

    args = build_parser().parse_args(["serve", "--model", model, "--load-format", "dummy"])
    sys.exit(run_server(engine_config_from_args(args), model, port=port, engine_factory="server_steps:traced_engine"))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else float("nan")


def engine_gaps(notes, start: float, end: float) -> tuple[list[float], dict[str, float]]:
    """Inter-token gaps (ms) of requests whose tokens fall within [start, end], and each one's largest."""
    times: dict[str, list[float]] = {}
    for t, got, *_ in notes:
        if start <= t <= end:
            for rid, n in got:
                times.setdefault(rid, []).extend([t] * n)
    gaps, largest = [], {}
    for rid, ts in times.items():
        g = [(b - a) * 1e3 for a, b in itertools.pairwise(ts)]
        gaps.extend(g)
        if g:
            largest[rid] = max(g)
    return gaps, largest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--runs", nargs="+", default=["32x200", "32x300"], help="RATExPROMPTS, one client run each")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--bound", type=float, default=40.0)
    ap.add_argument("--port", type=int, default=8377)
    ap.add_argument(
        "--trace", default="/tmp/server_steps.json", help="the engine's notes (on a GPU machine: under $OUT)"
    )
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server child
    args = ap.parse_args()
    if args.serve:
        serve(args.model, args.port)
    env = {**os.environ, "SERVER_STEPS_OUT": args.trace, "PYTHONPATH": f"{REPO}:{Path(__file__).parent}"}
    env["PYTHONPATH"] += os.pathsep + os.environ.get("PYTHONPATH", "")
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--model", args.model, "--port", str(args.port)], env=env
    )
    url = f"http://127.0.0.1:{args.port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(1)
    windows = []
    for i, run in enumerate(args.runs):
        rate, prompts = run.split("x")
        out = f"/tmp/server_steps_client_{i}.json"
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, str(REPO / "benchmarks/serving.py"), "--base-url", url, "--dataset", "random",
             "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
             "--num-prompts", prompts, "--request-rate", rate, "--seed", str(300 + i), "--output-json", out],
            check=False,
        )  # fmt: skip
        windows.append((run, t0, time.perf_counter(), out))
    server.send_signal(signal.SIGINT)
    server.wait(60)
    notes = json.loads(Path(args.trace).read_text())
    for run, t0, t1, out in windows:
        gaps, largest = engine_gaps(notes, t0, t1)
        client = json.loads(Path(out).read_text())["results"][0]
        steps = [(b[0] - a[0]) * 1e3 for a, b in itertools.pairwise(n for n in notes if t0 <= n[0] <= t1)]
        print(f"== {run}: engine side ITL p50 {pct(gaps, .5):.1f} p90 {pct(gaps, .9):.1f} p99 {pct(gaps, .99):.1f} ms, "
              f"per-request max median {statistics.median(largest.values()):.1f} ms; client ITL p99 "
              f"{client['itl_ms']['p99']:.1f} ms, per-request max median "
              f"{statistics.median(r['max_itl_ms'] for r in client['requests']):.1f} ms")  # fmt: skip
        long = [s for s in steps if s > args.bound]
        print(f"   steps (return to return) {len(steps)}, p50 {pct(steps, .5):.1f} p99 {pct(steps, .99):.1f} ms, "
              f"{len(long)} over {args.bound:g} ms: {sorted(long)[-8:]}")  # fmt: skip
        # Each long gap split into the engine loop's own work before the step (messages in,
        # outputs out) and the step() call (schedule, prepare, launch, wait for the tokens).
        window = [n for n in notes if t0 <= n[0] <= t1]
        for prev, cur in itertools.pairwise(window):
            gap = (cur[0] - prev[0]) * 1e3
            if gap > args.bound:
                parts = ", ".join(f"{p} {ms:.1f}" for p, ms in zip(PARTS, cur[5]))
                print(f"   at {cur[0] - t0:6.2f} s: {gap:5.1f} ms = loop {(cur[2] - prev[0]) * 1e3:5.1f} + step() "
                      f"{(cur[0] - cur[2]) * 1e3:5.1f} ({parts}; device allocs +{cur[6][0]}, retries "
                      f"+{cur[6][1]}, pinned allocs +{cur[6][2]}); waiting {cur[3]}, running {cur[4]}, "
                      f"{len(cur[1])} got tokens; scheduled {cur[7]} decode rows + {cur[8]} prompt tokens, "
                      f"the step before {prev[7]} + {prev[8]}")  # fmt: skip
        allocs = [n[6] for n in window]
        print(f"   over the run: device allocs +{sum(a[0] for a in allocs)}, retries +{sum(a[1] for a in allocs)}, "
              f"pinned allocs +{sum(a[2] for a in allocs)}")  # fmt: skip


if __name__ == "__main__":
    main()
