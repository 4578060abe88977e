"""FP8 weights' quality on real weights: the embedded SmolLM2-135M (GGUF, dequantized at
load), run in fp32, in bf16, and in bf16 with its linear weights quantized per output channel
(`quantization="fp8"`), greedy, the same prompts.

Reports:
- mean |logprob difference| of the chosen tokens, FP8 vs bf16: at every position of every
  prompt up to and including the first where the two greedy outputs part, bf16's chosen
  token's logprob in both runs (at the parting position it is looked up in FP8's top-20;
  positions where it is not there are counted apart);
- mean common-prefix length with the fp32 output, for bf16 and for FP8, and the issue's
  criterion: FP8's mean at least 85% of bf16's (closeness to fp32 within 15%).

On CUDA the FP8 run takes the GPU FP8 kernels (Triton at decode sizes, cuBLASLt FP8 with
per-token activation quantization for prefill); on CPU the weights are quantized and
dequantized again at load (the same rounded weights, activations unquantized). Slow on CPU:
use fewer prompts there for a smoke run.

    python benchmarks/fp8_quality.py [--prompts 48] [--new 48] [--device auto]

On an H200 (benchmarks/results/2026-11-27.md): mean |logprob difference| 0.130; FP8 keeps
9.2 tokens of common prefix with fp32 against bf16's 27.2 (probes/fp8_rounding.py: the e4m3
weight rounding alone keeps 11-14).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from nanoserve import LLM, SamplingParams

SUBJECTS = [
    "the moon",
    "a small village",
    "photosynthesis",
    "the French revolution",
    "prime numbers",
    "a rainy afternoon",
    "the human heart",
    "volcanoes",
    "learning to cook",
    "the history of the bicycle",
    "how computers store numbers",
    "a friendly dog",
]
TEMPLATES = [
    "Write a short paragraph about {}.",
    "Here is an interesting fact about {}:",
    "Explain {} to a ten-year-old.",
    "Once upon a time, there was a story about {}. It",
]
TOP = 20  # logprobs kept per position (the engine's maximum)


def prompts(n: int) -> list[str]:
    every = [t.format(s) for t in TEMPLATES for s in SUBJECTS]
    if n > len(every):
        raise SystemExit(f"--prompts at most {len(every)}")
    return every[:n]


def run(model: str, device: str, new: int, texts: list[str], **engine_args):
    llm = LLM(model, device=device, max_num_seqs=len(texts), **engine_args)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=TOP)
    start = time.perf_counter()
    outs = llm.generate(texts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = llm.stats()
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"], stats
    result = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result, seconds


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def logprob_diffs(ref, other) -> tuple[list[float], int]:
    """|logprob| differences of ref's chosen tokens up to the first parting (see the docstring)."""
    diffs, missing = [], 0
    for (ta, la), (tb, lb) in zip(ref, other):
        end = min(common_prefix(ta, tb) + 1, len(ta))
        for j in range(end):
            got = lb[j].top.get(ta[j])
            if got is None:
                missing += 1
            else:
                diffs.append(abs(la[j].logprob - got))
    return diffs, missing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--new", type=int, default=48)
    args = ap.parse_args()
    texts = prompts(args.prompts)
    runs = {}
    for name, extra in (
        ("fp32", {"dtype": "float32"}),
        ("bf16", {"dtype": "bfloat16"}),
        ("fp8", {"dtype": "bfloat16", "quantization": "fp8"}),
    ):
        runs[name], seconds = run(args.model, args.device, args.new, texts, **extra)
        print(f"{name}: {len(texts)} prompts x {args.new} tokens in {seconds:.1f} s", flush=True)
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    print(f"device {name}, model {args.model} (GGUF dequantized; fp8 = per-channel weights, bf16 compute)")
    diffs, missing = logprob_diffs(runs["bf16"], runs["fp8"])
    print(
        f"fp8 vs bf16: mean |logprob difference| of bf16's chosen tokens {statistics.fmean(diffs):.4f} "
        f"(max {max(diffs):.4f}) over {len(diffs)} positions up to the first parting; {missing} not in fp8's top-{TOP}"
    )
    ref = [t for t, _ in runs["fp32"]]
    means = {}
    for name in ("bf16", "fp8"):
        lengths = [common_prefix(a, b) for a, b in zip(ref, (t for t, _ in runs[name]))]
        same = sum(n == args.new for n in lengths)
        means[name] = statistics.fmean(lengths)
        print(f"{name} vs fp32: mean common prefix {means[name]:.1f} tokens, identical on {same}/{len(ref)} prompts")
    ratio = means["fp8"] / means["bf16"] if means["bf16"] else float("nan")
    verdict = "met" if ratio >= 0.85 else "MISSED"
    print(f"criterion (fp8's mean common prefix with fp32 >= 85% of bf16's): {ratio:.1%} -> {verdict}")


if __name__ == "__main__":
    main()
