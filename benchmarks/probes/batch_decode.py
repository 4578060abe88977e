"""Decode time per step at batch 1-8 on one GPU: a dummy model, bf16 or FP8 weights.

Each batch size runs its prompts (128 random tokens) for 1 and for 257 greedy tokens, best of
two; a decode step's time is the difference over 256 steps. `--fp8-rule off` restores the FP8
rule before 057af93 (M = 2..8 through cuBLASLt's FP8 GEMM), for a comparison in one call.

    python benchmarks/probes/batch_decode.py [--model llama-3.1-8b] [--quantization fp8] [--fp8-rule off]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]

import argparse
import random
import time

import torch

from nanoserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    ap.add_argument("--fp8-rule", default="on", choices=["on", "off"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    args = ap.parse_args()
    if args.fp8_rule == "off":
        from nanoserve.kernels import linear

        linear._choose_fp8_few_rows = lambda *a: None  # the rule before 057af93
    llm = LLM(args.model, load_format="dummy", quantization=args.quantization, max_model_len=1024)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 30000) for _ in range(128)] for _ in range(max(args.batches))]

    def run(bs: int, n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts[:bs], [params] * bs, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    label = f"{args.model} {args.quantization or 'bf16'}" + (
        " (FP8 rule before 057af93)" if args.fp8_rule == "off" else ""
    )
    for bs in args.batches:
        run(bs, 8)  # warm-up
        first = min(run(bs, 1) for _ in range(2))
        full = min(run(bs, 257) for _ in range(2))
        print(f"{label}: batch {bs}: {(full - first) / 256 * 1e3:.3f} ms per decode step")


if __name__ == "__main__":
    main()
