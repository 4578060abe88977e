"""Where a constrained decode step's host time goes (one GPU): the structured benchmark's
workload (qwen3-0.6b dummy, 64 x 256, SmolLM2's tokenizer) free, all and half constrained,
with timers around the engine's parts. Prints per kind the throughput, the median step time
in the steady decode middle (and its p90), the GPU wait per step, and each part's median.

    python benchmarks/probes/constrained_steps.py --tokenizer <SmolLM2's tokenizer directory>
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the repository, and benchmarks/ for shared helpers

import argparse
import functools
import random
import statistics
import time

import torch
from structured import SCHEMA, SCHEMA_MAX_LENGTH, params_for

from nanoserve import LLM

PARTS = ("_prepare", "_forward", "_launch_sampling", "_sample_later", "_sample", "_process", "_fill_host_masks")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default="smollm2-135m")
    ap.add_argument("--kinds", nargs="+", default=["free", "all", "half"], help="also allML, halfML (maxLength)")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    llm = LLM("qwen3-0.6b", load_format="dummy", tokenizer=args.tokenizer, max_model_len=400)
    engine = llm.engine
    rng = random.Random(0)
    vocab = min(engine.model_config.vocab_size, len(llm.tokenizer))
    prompts = [[rng.randrange(vocab) for _ in range(128)] for _ in range(64)]
    times: dict[str, list[float]] = {}

    def timer(obj, name: str, key: str) -> None:
        if not hasattr(obj, name):
            return
        inner = getattr(obj, name)

        @functools.wraps(inner)
        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                times.setdefault(key, []).append(time.perf_counter() - start)

        setattr(obj, name, timed)

    for name in PARTS:
        timer(engine, name, name)
    timer(engine.scheduler, "schedule", "schedule")
    timer(engine, "step", "step")
    for kind in args.kinds * args.repeat:
        times.clear()
        waited = engine.gpu_wait_s
        schema = SCHEMA_MAX_LENGTH if kind.endswith("ML") else SCHEMA
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params_for(kind.removesuffix("ML"), 64, 256, schema), use_tqdm=False)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        steps = times["step"]
        middle = sorted(steps[len(steps) // 8 : len(steps) * 5 // 8])
        print(
            f"{kind:6s}: {tokens / elapsed:8,.0f} tok/s, {len(steps)} steps, median step "
            f"{statistics.median(middle) * 1e3:.3f} ms (p90 {middle[int(len(middle) * 0.9)] * 1e3:.3f}), "
            f"GPU wait {(engine.gpu_wait_s - waited) * 1e3 / len(steps):.3f} ms a step"
        )
        for key, values in times.items():
            if key != "step":
                print(f"        {key:18s} median {statistics.median(values) * 1e3:7.3f} ms x {len(values)}")


if __name__ == "__main__":
    main()
