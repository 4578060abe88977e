"""What a batch-1 decode step runs on the GPU around its graph replay: the kernels and copies
between the LM head of one step and the first layers of the next, with the idle gap before
each, from a torch.profiler trace of 12 engine steps (a 128-token prompt, greedy, dummy
weights). Also printed: wall time per step (100 steps, no profiler) and the graph replay alone.
Found the 31 us of torch's fp32 copy + argmax and the copy engine's start-up between steps
(benchmarks/results/2026-11-27.md).

    python benchmarks/probes/step_timeline.py [--model llama-3.1-8b] [--quantization fp8]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import argparse

import torch
from latency import batch1_graph_ms, decode_wall_ms

from nanoserve import LLM

LM_HEAD_MIN_US = 150  # the step's longest kernel: the LM head GEMV (llama-3.1-8b: 242 us)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy", max_model_len=1024, kv_cache_tokens=16384, max_num_seqs=8,
              quantization=args.quantization)  # fmt: skip
    engine = llm.engine
    prompt = [(7 * i + 3) % 10000 for i in range(128)]
    wall_ms = decode_wall_ms(engine, prompt)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(12):
            engine.step()
        torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()} | {args.model} {args.quantization or 'bf16'}: wall {wall_ms:.3f} ms/step, "
          f"graph replay alone {batch1_graph_ms(engine):.3f} ms")  # fmt: skip
    events = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    t0, busy_until, rows = events[0][0], events[0][0], []
    for start, end, name in events:
        rows.append((start - t0, end - start, start - busy_until, name))
        busy_until = max(busy_until, end)
    heads = [i for i, r in enumerate(rows) if r[1] > LM_HEAD_MIN_US]
    for h in heads[-3:-1]:
        for at, dur, gap, name in rows[h : h + 14]:
            print(f"{at:10.1f} us  dur {dur:7.1f}  gap {gap:6.1f}  {name[:100]}")
        print("--")
    if len(heads) >= 3:
        print(f"step period {(rows[heads[-1]][0] - rows[heads[-3]][0]) / 2:.1f} us")
    for r in list(engine.scheduler.running):
        engine.abort_request(r.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    llm.shutdown()


if __name__ == "__main__":
    main()
