"""Tensor parallelism on GPUs: TP=N against TP=1 on the same dummy weights (issue 7).

    python benchmarks/tp_check.py --model llama-3.1-8b --tp 2 [--dtypes bfloat16,float32] [--symm-off-too]

Each (dtype, TP size) runs in its own process (one TP engine per process). The first dtype
is measured in full, the others for greedy agreement only:
- greedy tokens of 16 random prompts x 32 new tokens, with the top-5 logprobs, twice in the
  same engine: with decode CUDA graphs and the overlap loop (the defaults), and with both
  off (the eager twin, by dropping rank 0's graphs: the workers follow rank 0's step);
- output throughput on nano-vllm's offline workload (benchmarks/offline_throughput.py),
  after a warm-up on all of the workload's prompts with 16 new tokens each (Triton and
  torch.compile specialize on shapes; the worker ranks compile too, as they run every step
  rank 0 sends);
- batch-1 time per output token (128-token prompt; TPOT = (time for 65 tokens - time for
  1 token) / 64, median of 3).
With --variant KEY=VAL[,KEY=VAL] (repeatable), TP=N runs once more per variant, last, with
those environment settings, measured like the first dtype's (e.g. NANOSERVE_TP_REDUCE_FP32=1:
fp32 partial sums). With --symm-off-too, TP=N runs once more with NANOSERVE_SYMM_MEM=0 (NCCL for every
all-reduce: the slow twin of the decode graphs' all-reduce + RMSNorm fused over symmetric
memory, which the first runs use by default), measured like the first dtype's, so both
paths' speed comes from one session.
The parent prints, for TP=N vs TP=1 and for graphs vs eager within each, how many prompts
agree token for token and whether the issue's criterion holds (at least 95% identical, and
where two runs part, each one's token is within the other's top-5 at that position), then
the speed ratios against the targets (throughput >= 1.6x, TPOT <= 0.65x).

Both sides run decode graphs only (piecewise prefill graphs off where the engine has them:
the workload's prefill chunks are above their sizes, and capture time is saved), without
the prefix cache (so the eager twin recomputes its prompts the same way).

In bfloat16 the dummy weights give logits with exact ties (a logprob gap of 0 between the
two best tokens), so any 1-ulp difference upstream flips a greedy choice: the TP=1 engine's
own graphs-vs-eager line is the noise floor that TP=N vs TP=1 should be read against;
float32 is the sharp check.

On H200s (benchmarks/results/2026-11-21.md): llama-3.1-8b TP=2 1.63x TP=1's offline throughput and
0.623x its batch-1 TPOT; TP=4 2.09x and 0.426x.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

NUM_PROMPTS, NEW_TOKENS = 16, 32
CHILD_TIMEOUT_S = {"full": 270, "quick": 150}
SHUTDOWN_GRACE_S = 25


def greedy(llm, prompts) -> dict:
    from nanoserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "top5": [[sorted(lp.top) for lp in o.outputs[0].logprobs] for o in outs],
    }


def measure(args, tp: int, dtype: str, out: Path, quick: bool) -> None:
    from offline_throughput import workload

    from nanoserve import LLM, SamplingParams
    from nanoserve.config import EngineConfig

    # No prefix cache: the eager twin re-runs the same prompts, which would otherwise be
    # cache hits computed by another kernel path (the workload's prompts share no prefixes).
    kw = {"max_model_len": 4096, "dtype": dtype, "enable_prefix_caching": False}
    kw.update({"device": args.device} if args.device else {})
    if "piecewise_cuda_graphs" in {f.name for f in dataclasses.fields(EngineConfig)}:
        kw["piecewise_cuda_graphs"] = False
    if quick:
        kw["cuda_graph_max_bs"] = NUM_PROMPTS  # greedy only: batches never exceed the prompts
    if tp > 1:
        kw["dist_timeout_s"] = 120  # a hung collective fails the run instead of stalling it
    started = time.perf_counter()

    def progress(what: str) -> None:
        print(f"[tp={tp} {dtype}] {what} at {time.perf_counter() - started:.1f} s", flush=True)

    llm = LLM(args.model, load_format="dummy", tensor_parallel_size=tp, **kw)
    result = {"tp": tp, "dtype": dtype, "ready_s": time.perf_counter() - started}
    progress("ready")
    engine = llm.engine
    local = getattr(engine.runner, "local", engine.runner)
    result["symm"] = getattr(local.model.tp, "symm", None) is not None  # decode sums over symmetric memory
    graphs = engine.runner.graphs
    result["graphs"] = graphs is not None
    result["graph_capture_s"] = graphs.capture_seconds if graphs is not None else 0.0
    result["overlap"] = engine.overlap
    vocab = min(10000, engine.model_config.vocab_size)
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(64, 512))] for _ in range(NUM_PROMPTS)]
    result["greedy"] = greedy(llm, prompts)
    progress("greedy done")
    # The eager twin in the same engine: rank 0 without graphs sends eager steps, which every
    # rank runs eagerly; the simple loop instead of the overlap loop.
    local.graphs, engine.overlap = None, False
    result["greedy_eager"] = greedy(llm, prompts)
    local.graphs, engine.overlap = graphs, result["overlap"]
    progress("eager greedy done")

    if not quick:

        def timed(prompt, n):
            start = time.perf_counter()
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
            return time.perf_counter() - start

        prompt = [(7 * i + 3) % vocab for i in range(128)]
        timed(prompt, 8)  # warm-up
        result["tpot_ms"] = statistics.median((timed(prompt, 65) - timed(prompt, 1)) / 64 for _ in range(3)) * 1e3
        progress(f"TPOT {result['tpot_ms']:.2f} ms")

        wl_prompts, wl_max = workload()
        wl_prompts = [[t % engine.model_config.vocab_size for t in p] for p in wl_prompts]  # tiny test models
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in wl_max]
        # Warm-up on every prompt of the workload (its prefill chunks are what the timed run
        # starts with; decode batches up to 256 come from graphs captured at start): 32 prompts
        # were not enough, the first TP=2 process of a session still compiled in its timed run.
        llm.generate(wl_prompts, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=16), use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate(wl_prompts, params, use_tqdm=False)
        result["elapsed"] = time.perf_counter() - start
        result["throughput"] = sum(len(o.outputs[0].token_ids) for o in outs) / result["elapsed"]
        stats = llm.stats()
        result["no_leaks"] = stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
        result["kv_tokens"] = stats["kv_pages_total"] * stats["page_size"]
        progress(f"offline {result['throughput']:,.0f} tok/s")
    out.write_text(json.dumps(result))  # before shutdown: the parent reads it even if shutdown stalls
    started = time.perf_counter()
    llm.shutdown()
    print(f"[tp={tp} {dtype}] shutdown took {time.perf_counter() - started:.1f} s", flush=True)


def compare(a: dict, b: dict) -> tuple[int, list[str]]:
    """(identical prompts, divergences that break the top-5 rule)."""
    same, bad = 0, []
    for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])):
        if x == y:
            same += 1
            continue
        j = next(j for j, (u, v) in enumerate(zip(x, y)) if u != v)
        if x[j] not in b["top5"][i][j] or y[j] not in a["top5"][i][j]:
            bad.append(f"prompt {i} at token {j}: {x[j]} vs {y[j]}")
    return same, bad


def report(what: str, a: dict, b: dict) -> bool:
    same, bad = compare(a, b)
    n = len(a["tokens"])
    ok = same >= 0.95 * n and not bad
    first = [next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), None) for x, y in zip(a["tokens"], b["tokens"])]
    print(f"{what}: {same}/{n} prompts identical over {NEW_TOKENS} tokens, top-5 rule broken at {bad or 'none'}")
    print(f"    first differing position per prompt: {first}; criterion {'MET' if ok else 'NOT MET'}")
    return ok


def run_child(args, tp: int, dtype: str, quick: bool, variant: dict[str, str] | None = None) -> dict | None:
    """One engine in its own process; `variant`: environment settings for it (None: as is)."""
    tag = "_".join(f"{k}={v}" for k, v in (variant or {}).items())
    path = Path(f"/tmp/tp_check_{tp}_{dtype}{'_' + tag if tag else ''}.json")
    path.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--model", args.model, "--child", str(tp), "--dtype", dtype, "--out", str(path)]
    cmd += ["--device", args.device] if args.device else []
    env = {**os.environ, **(variant or {})}
    proc = subprocess.Popen(cmd + (["--quick"] if quick else []), env=env)  # its worker ranks die with it
    _CHILDREN.append(proc)
    deadline = time.monotonic() + CHILD_TIMEOUT_S["quick" if quick else "full"]
    done_at = None
    while proc.poll() is None:
        if done_at is None and path.exists():
            done_at = time.monotonic()
        late = time.monotonic() > deadline or (done_at is not None and time.monotonic() - done_at > SHUTDOWN_GRACE_S)
        if late:
            print(f"[tp={tp} {dtype}] {'shutdown' if done_at else 'run'} did not end in time: killing it", flush=True)
            proc.kill()
            proc.wait()
            break
        time.sleep(0.5)
    if not path.exists():
        print(f"[tp={tp} {dtype}] failed (exit code {proc.returncode})", flush=True)
        return None
    return json.loads(path.read_text())


_CHILDREN: list[subprocess.Popen] = []


def _stop(signum, frame) -> None:
    for proc in _CHILDREN:
        proc.kill()
    sys.exit(f"stopped by signal {signum}")


def main() -> None:
    signal.signal(signal.SIGTERM, _stop)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtypes", default="bfloat16,float32", help="the first is measured in full, the rest greedy only")
    ap.add_argument("--quick", action="store_true", help="greedy agreement only, for every dtype")
    ap.add_argument(
        "--symm-off-too", action="store_true", help="TP=N once more with NANOSERVE_SYMM_MEM=0 (NCCL only), last"
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="KEY=VAL[,KEY=VAL]: TP=N once more with these environment settings (repeatable)",
    )
    ap.add_argument(
        "--device", default=None, help="default: the engine's (cuda if there is one); cpu to try the script"
    )
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        measure(args, args.child, args.dtype, Path(args.out), args.quick)
        return
    dtypes = args.dtypes.split(",")
    results = {}
    for k, dtype in enumerate(dtypes):
        for tp in (1, args.tp):
            results[tp, dtype] = run_child(args, tp, dtype, quick=args.quick or k > 0)
    variants = [{"NANOSERVE_SYMM_MEM": "0"}] if args.symm_off_too else []
    variants += [dict(kv.split("=", 1) for kv in v.split(",")) for v in args.variant]
    for variant in variants:
        r = run_child(args, args.tp, dtypes[0], quick=args.quick, variant=variant)
        if r is not None:
            r["variant"] = variant
        results[tuple(variant.items())] = r
    print(f"\nmodel {args.model}: TP={args.tp} vs TP=1 (dummy weights)")
    for dtype in dtypes:
        base, tpn = results[1, dtype], results[args.tp, dtype]
        for r in (base, tpn):
            if r is not None:
                describe(dtype, r)
                report(f"[{dtype}] TP={r['tp']} graphs+overlap vs eager+simple loop", r["greedy"], r["greedy_eager"])
        if base is not None and tpn is not None:
            report(f"[{dtype}] TP={args.tp} vs TP=1", base["greedy"], tpn["greedy"])
    runs = [results[tuple(v.items())] for v in variants]
    for variant, r in zip(variants, runs):
        if r is not None:
            describe(dtypes[0], r)
            report(f"[{dtypes[0]}] TP={args.tp} {comm(r)}: graphs+overlap vs eager", r["greedy"], r["greedy_eager"])
            if results[1, dtypes[0]] is not None:
                report(f"[{dtypes[0]}] TP={args.tp} {comm(r)} vs TP=1", results[1, dtypes[0]]["greedy"], r["greedy"])
    base, tpn = results[1, dtypes[0]], results[args.tp, dtypes[0]]
    if args.quick or base is None:
        return
    for r in (base, tpn, *runs):
        if r is not None:
            print(
                f"[{dtypes[0]}] TP={r['tp']}{' ' + comm(r) if r['tp'] > 1 else ''}: offline "
                f"{r['throughput']:,.0f} output tok/s ({r['elapsed']:.1f} s), batch-1 TPOT {r['tpot_ms']:.3f} ms, "
                f"KV {r['kv_tokens']:,} tokens, no leaks {r['no_leaks']}"
            )
    for r in (tpn, *runs):
        if r is not None:
            print(
                f"TP={r['tp']} {comm(r)}: throughput ratio {r['throughput'] / base['throughput']:.2f}x (target >= 1.6x), "
                f"TPOT ratio {r['tpot_ms'] / base['tpot_ms']:.3f}x (target <= 0.65x)"
            )


def comm(r: dict) -> str:
    what = "(decode sums: symmetric memory" if r.get("symm") else "(NCCL only"
    extra = ", ".join(f"{k}={v}" for k, v in r.get("variant", {}).items() if k != "NANOSERVE_SYMM_MEM")
    return what + (f"; {extra})" if extra else ")")


def describe(dtype: str, r: dict) -> None:
    print(
        f"[{dtype}] TP={r['tp']}{' ' + comm(r) if r['tp'] > 1 else ''}: ready in {r['ready_s']:.0f} s "
        f"(graph capture {r['graph_capture_s']:.1f} s), graphs {'on' if r['graphs'] else 'off'}, "
        f"overlap {'on' if r['overlap'] else 'off'}"
    )


if __name__ == "__main__":
    main()
