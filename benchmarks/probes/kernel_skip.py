"""What a batch-1 decode step would gain if some of its small kernels were fused away: the
decode graph's replay time with the RMSNorms and/or the rotary (+ K/V store) kernels of
one-row steps left out (their inputs passed through unchanged), against the full step. An
upper bound on what fusing them into a neighbouring kernel could save (the fused kernel
would still do their work); the outputs of a skipped run are meaningless.

    python benchmarks/probes/kernel_skip.py [--models qwen3-0.6b llama-3.1-8b] [--quantization fp8]
        [--skip none norm rotary norm,rotary]

Per (model, variant): the batch-1 graph's replay time (median of 5 rounds of 50 replays)
after capture with the patched layers, and TPOT of one 128 + 64-token run.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import argparse
import gc
import statistics

import torch
from latency import batch1_graph_ms

from nanoserve import LLM, SamplingParams
from nanoserve.models import layers

_NORM, _ROTARY = layers.RMSNorm.forward, layers.RotaryEmbedding.forward


def _norm_skipped(self, x, residual=None, reduce_over=layers.SINGLE):
    if isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] == 1 and x.is_cuda:
        return x if residual is None else (x, residual)
    return _NORM(self, x, residual, reduce_over)


def _rotary_skipped(self, positions, q, k, *args, **kw):
    if q.shape[0] == 1 and q.is_cuda:
        return q, k
    return _ROTARY(self, positions, q, k, *args, **kw)


def patch(skip: set[str]) -> None:
    layers.RMSNorm.forward = _norm_skipped if "norm" in skip else _NORM
    layers.RotaryEmbedding.forward = _rotary_skipped if "rotary" in skip else _ROTARY


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    ap.add_argument("--skip", nargs="+", default=["none", "norm", "rotary", "norm,rotary"])
    args = ap.parse_args()
    for name in args.models:
        for variant in args.skip:
            patch(set(variant.split(",")) - {"none"})
            llm = LLM(
                name, load_format="dummy", max_model_len=1024, kv_cache_tokens=16384, max_num_seqs=8,
                quantization=args.quantization, piecewise_cuda_graphs=False,
            )  # fmt: skip
            prompt = [(7 * i + 3) % 10000 for i in range(128)]
            params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
            llm.generate([prompt], params, use_tqdm=False)
            replay = statistics.median(batch1_graph_ms(llm.engine) for _ in range(5))
            print(
                f"{torch.cuda.get_device_name()} | {name} {args.quantization or 'bf16'} | skipped: {variant:12s} | "
                f"batch-1 graph replay {replay:.3f} ms",
                flush=True,
            )
            llm.shutdown()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    patch(set())


if __name__ == "__main__":
    main()
