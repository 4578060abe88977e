"""Tensor parallelism on GPUs: TP=N against TP=1 on the same dummy weights (issue 7).

    python benchmarks/tp_check.py --model llama-3.1-8b --tp 2

Each configuration runs in its own process (one TP engine per process) and reports:
greedy tokens of 16 random prompts x 32 new tokens, output throughput on nano-vllm's offline
workload (benchmarks/offline_throughput.py), and batch-1 time per output token (128-token
prompt; TPOT = (time for 65 tokens - time for 1 token) / 64, median of 3). The parent
prints how many prompts agree token for token and the speed ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def measure(model: str, tp: int, out: Path, dtype: str, quick: bool) -> None:
    from offline_throughput import workload

    from nanoserve import LLM, SamplingParams

    llm = LLM(model, load_format="dummy", tensor_parallel_size=tp, max_model_len=4096, dtype=dtype)
    rng = random.Random(0)
    prompts = [[rng.randrange(10000) for _ in range(rng.randint(64, 512))] for _ in range(16)]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    if quick:
        out.write_text(json.dumps({"tp": tp, "greedy": [o.outputs[0].token_ids for o in greedy]}))
        llm.shutdown()
        return

    def timed(prompt, n):
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    prompt = [(7 * i + 3) % 10000 for i in range(128)]
    timed(prompt, 8)  # warm-up
    tpots = [(timed(prompt, 65) - timed(prompt, 1)) / 64 for _ in range(3)]

    wl_prompts, wl_max = workload()
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in wl_max]
    start = time.perf_counter()
    outs = llm.generate(wl_prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.stats()
    out.write_text(
        json.dumps(
            {
                "tp": tp,
                "greedy": [o.outputs[0].token_ids for o in greedy],
                "tpot_ms": statistics.median(tpots) * 1e3,
                "throughput": produced / elapsed,
                "elapsed": elapsed,
                "graphs": llm.engine.runner.graphs is not None,
                "no_leaks": stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"],
            }
        )
    )
    llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quick", action="store_true", help="greedy agreement only")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        measure(args.model, args.child, Path(args.out), args.dtype, args.quick)
        return
    results = {}
    for tp in (1, args.tp):
        path = Path(f"/tmp/tp_check_{tp}.json")
        cmd = [sys.executable, __file__, "--model", args.model, "--dtype", args.dtype, "--child", str(tp), "--out", str(path)]
        subprocess.run(cmd + (["--quick"] if args.quick else []), check=True)
        results[tp] = json.loads(path.read_text())
    base, tpn = results[1], results[args.tp]
    same = sum(a == b for a, b in zip(base["greedy"], tpn["greedy"]))
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(base["greedy"], tpn["greedy"])]
    print(f"model {args.model} ({args.dtype}): TP={args.tp} vs TP=1")
    print(f"greedy: {same}/{len(base['greedy'])} prompts identical over 32 tokens; first differing position {first_diff}")
    if args.quick:
        return
    for r in (base, tpn):
        print(
            f"TP={r['tp']}: offline {r['throughput']:,.0f} output tok/s ({r['elapsed']:.1f} s), "
            f"batch-1 TPOT {r['tpot_ms']:.2f} ms, cuda graphs {'on' if r['graphs'] else 'off'}, no leaks {r['no_leaks']}"
        )
    print(
        f"throughput ratio {tpn['throughput'] / base['throughput']:.2f}x (target >= 1.6x), "
        f"TPOT ratio {tpn['tpot_ms'] / base['tpot_ms']:.2f}x (target <= 0.65x)"
    )


if __name__ == "__main__":
    main()
