"""Sampler time per step: the fused Triton kernel against the torch path (its slow twin).

For a few batch sizes of bf16 logits over qwen3's 151,936-word vocabulary, all rows
greedy or all at temperature 0.6: mean ms per `Sampler.sample` call (the batch plan
cached, as in a decode step), timed with CUDA events over back-to-back calls, and the
fused kernel's read rate of the logits. Greedy tokens of both paths are checked equal.

    python benchmarks/probes/sampler_bench.py [--batch 1 64 256] [--vocab 151936]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the repository, and benchmarks/ for shared helpers

import argparse

import torch

from nanoserve.engine.sampler import Sampler, SampleRow
from nanoserve.sampling_params import SamplingParams


def ms_per_call(sampler: Sampler, logits: torch.Tensor, rows: list[SampleRow], reps: int = 50) -> float:
    for _ in range(5):  # builds the plan, compiles
        sampler.sample(logits, rows)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        sampler.sample(logits, rows)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--vocab", type=int, default=151936)
    args = ap.parse_args()
    device = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(device)}; bf16 logits, vocabulary {args.vocab:,}")
    print(f"{'batch':>5} {'rows':<12} {'fused ms':>9} {'torch ms':>9} {'speed-up':>9} {'fused reads':>12}")
    for batch in args.batch:
        logits = torch.randn(batch, args.vocab, device=device).bfloat16()
        for label, temperature in (("greedy", 0.0), ("T=0.6", 0.6)):
            rows = [SampleRow(SamplingParams(temperature=temperature), None, [], []) for _ in range(batch)]
            fused, slow = Sampler(device, 0, fused=True), Sampler(device, 0, fused=False)
            fused_ms, slow_ms = ms_per_call(fused, logits, rows), ms_per_call(slow, logits, rows)
            if temperature == 0:
                assert torch.equal(fused.sample(logits, rows).tokens, slow.sample(logits, rows).tokens)
            rate = logits.numel() * logits.element_size() / fused_ms / 1e9
            print(
                f"{batch:>5} {label:<12} {fused_ms:>9.3f} {slow_ms:>9.3f} {slow_ms / fused_ms:>8.1f}x {rate:>7.2f} TB/s"
            )


if __name__ == "__main__":
    main()
