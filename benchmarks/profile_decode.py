"""Where decode time goes: GPU kernels (torch.profiler on eager steps) and host time
(cProfile on graph steps), at batch 1 and batch 256 on dummy qwen3-0.6b.

    python benchmarks/profile_decode.py [--model qwen3-0.6b]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import time

import torch

from nanoserve import LLM, SamplingParams


def start(llm, batch: int, prompt_len: int):
    engine = llm.engine
    rng = random.Random(0)
    for i in range(batch):
        engine.add_request(f"p{i}", [rng.randrange(10000) for _ in range(prompt_len)], SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.6))
    while engine.scheduler.waiting or any(r.num_output_tokens < 2 for r in engine.scheduler.running):
        engine.step()
    return engine


def finish(engine):
    for r in list(engine.scheduler.running):
        engine.abort_request(r.request_id)
    while engine.has_unfinished_requests():
        engine.step()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    args = ap.parse_args()
    for eager in (True, False):
        llm = LLM(args.model, load_format="dummy", max_model_len=4096, enforce_eager=eager, kv_cache_tokens=600_000)
        for batch in (1, 256):
            engine = start(llm, batch, 1000)
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
                print(f"== graph decode, batch {batch}: {wall * 1e3:.2f} ms/step wall (under cProfile), host waited {engine.gpu_wait_s:.2f} s total")
                print(out.getvalue()[-6000:])
            finish(engine)
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
