"""How far greedy outputs move when only the weights are rounded: the embedded SmolLM2-135M run
in fp32 (every kernel and activation exact as in the fp32 reference), its decoder linears'
weights rounded to bf16, or to FP8 e4m3 with per-tensor, per-channel (as `--quantization
fp8`) or 128x128 block scales and dequantized again; embedding and LM head untouched, except
in the last variant, which also rounds the LM head per channel (a copy: the embedding, tied
to it in SmolLM2, stays unrounded). Each
variant's mean common-prefix length with the unrounded fp32 run separates the format's own
rounding from anything the engine's kernels add; for comparison, the whole model in bf16 (the
class fp8_quality.py's criterion measures against).

    python benchmarks/probes/fp8_rounding.py [--prompts 48] [--new 48] [--device cpu]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import argparse
import statistics

import torch
from fp8_quality import common_prefix, prompts

from nanoserve import LLM, SamplingParams
from nanoserve.kernels.fp8 import FP8_DTYPE
from nanoserve.models.quantization import quantize_per_channel

FP8_MAX = torch.finfo(FP8_DTYPE).max


def per_tensor(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().max().clamp(min=1e-12) / FP8_MAX
    return (w / scale).to(FP8_DTYPE).float() * scale


def per_channel(w: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_per_channel(w)
    return q.float() * scale[:, None]


def per_block(w: torch.Tensor, block: int = 128) -> torch.Tensor:
    out = torch.empty_like(w)
    for i in range(0, w.shape[0], block):
        for j in range(0, w.shape[1], block):
            out[i : i + block, j : j + block] = per_tensor(w[i : i + block, j : j + block])
    return out


ROUNDINGS = {
    "none": None,
    "bf16 weights": lambda w: w.bfloat16().float(),
    "e4m3 per-tensor": per_tensor,
    "e4m3 per-channel": per_channel,
    "e4m3 128x128 blocks": per_block,
}


def greedy(device: str, dtype: str, texts: list[str], new: int, rounding=None, lm_head=None) -> list[list[int]]:
    llm = LLM("smollm2-135m", device=device, dtype=dtype, max_num_seqs=len(texts))
    model = llm.engine.runner.model
    with torch.no_grad():
        if rounding is not None:
            for name, p in model.named_parameters():
                if p.dim() == 2 and "embed" not in name and "lm_head" not in name:
                    p.copy_(rounding(p.float()).to(p.dtype))
        if lm_head is not None:  # a rounded copy, untied from the embedding
            w = model.lm_head.weight
            model.lm_head.weight = torch.nn.Parameter(lm_head(w.float()).to(w.dtype), requires_grad=False)
    outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True), use_tqdm=False)
    del llm
    return [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    texts = prompts(args.prompts)
    ref = greedy(args.device, "float32", texts, args.new)
    runs = {
        f"fp32 compute, {name}": greedy(args.device, "float32", texts, args.new, r) for name, r in ROUNDINGS.items()
    }
    runs["fp32 compute, e4m3 per-channel + LM head"] = greedy(
        args.device, "float32", texts, args.new, per_channel, per_channel
    )
    runs["bf16 compute, bf16 weights"] = greedy(args.device, "bfloat16", texts, args.new)
    print(f"SmolLM2-135M, {len(texts)} prompts x {args.new} greedy tokens, {args.device}: against fp32 unrounded")
    for name, outs in runs.items():
        lengths = [common_prefix(a, b) for a, b in zip(ref, outs)]
        same = sum(n == args.new for n in lengths)
        print(f"  {name:<36} mean common prefix {statistics.fmean(lengths):5.1f}, identical {same}/{len(ref)}")


if __name__ == "__main__":
    main()
