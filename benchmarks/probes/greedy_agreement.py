"""How often two correct implementations agree on greedy tokens, on dummy weights.

The GPU fast-path test (tests/test_gpu_fastpath.py) compares greedy outputs across kernels
(Triton attention, the torch backend's SDPA, transformers) on dummy qwen3-0.6b in bf16,
32 prompts x 64 tokens. This script asks what agreement to expect at all: it runs the same
prompts through correct attention implementations (SDPA as torch runs it, whose CUDA
flash kernels round the probabilities to the input dtype before the V product, as
FlashAttention and our Triton kernels do; an explicit fp32 softmax(QK^T)V rounded once; on
CUDA the Triton kernels with graphs and overlap) and counts the identical outputs of every pair, per dtype. Where two
runs part, it prints the position and each run's logprob gap between the two tokens. It
also counts outputs that repeat a single token after their first (the dummy model's
greedy outputs often do).

    python benchmarks/probes/greedy_agreement.py [--dtypes bfloat16 float32] [--prompts 32] [--new 64]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the repository, and benchmarks/ for shared helpers

import argparse
import itertools

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.attention.torch_backend import TorchAttentionBackend
from tests.test_gpu_fastpath import make_prompts  # the test's prompts, not a copy of them


def explicit_attention(q, k, v, attn_mask, scale):
    """softmax(q k^T * scale) v in fp32 from the inputs as given, rounded once to q's dtype."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~attn_mask, float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype)


class ExplicitAttentionBackend(TorchAttentionBackend):
    attend = staticmethod(explicit_attention)


VARIANTS = {
    # name: (LLM keyword arguments, replace the torch backend's attention)
    "triton+graphs+overlap": ({}, False),
    "torch (SDPA)": ({"attention_backend": "torch", "enforce_eager": True, "overlap_schedule": False}, False),
    "torch (explicit fp32)": ({"attention_backend": "torch", "enforce_eager": True, "overlap_schedule": False}, True),
}


def run(model: str, dtype: str, variant: str, prompts, new: int):
    """Greedy tokens and per-position top-5 logprobs (token -> logprob) of every prompt."""
    kwargs, explicit = VARIANTS[variant]
    llm = LLM(
        model, load_format="dummy", dtype=dtype, max_model_len=1024, kv_cache_tokens=65536, max_num_seqs=64, **kwargs
    )
    if explicit:
        llm.engine.runner.backend = ExplicitAttentionBackend()
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    tops = [[lp.top for lp in o.outputs[0].logprobs] for o in outs]
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return tokens, tops


def report(name_a: str, a, name_b: str, b) -> None:
    (ta, ka), (tb, kb) = a, b
    parts = []
    for i, (x, y) in enumerate(zip(ta, tb)):
        if x == y:
            continue
        j = next(j for j, (u, v) in enumerate(zip(x, y)) if u != v)
        gap_a = ka[i][j][x[j]] - ka[i][j].get(y[j], float("-inf"))
        gap_b = kb[i][j][y[j]] - kb[i][j].get(x[j], float("-inf"))
        parts.append(f"prompt {i} at {j} (gaps {gap_a:.3f} / {gap_b:.3f})")
    same = len(ta) - len(parts)
    print(f"  {name_a} vs {name_b}: {same}/{len(ta)} identical" + (": " + "; ".join(parts) if parts else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args()
    prompts = make_prompts(args.prompts)
    variants = [v for v in VARIANTS if torch.cuda.is_available() or "triton" not in v]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{args.model} dummy weights, {args.prompts} prompts x {args.new} greedy tokens, {device}")
    for dtype in args.dtypes:
        results = {v: run(args.model, dtype, v, prompts, args.new) for v in variants}
        print(f"{dtype}:")
        for a, b in itertools.combinations(variants, 2):
            report(a, results[a], b, results[b])
        tokens = results[variants[0]][0]
        stuck = sum(len(set(t[1:])) == 1 for t in tokens)
        print(f"  {variants[0]}: {stuck}/{len(tokens)} outputs repeat one token after their first")


if __name__ == "__main__":
    main()
