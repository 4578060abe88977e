"""`nanoserve bench latency` and `nanoserve bench offline`: the engine in this process, no server.

- latency (as `vllm bench latency`): one batch of `--batch-size` random prompts of
  `--input-len` tokens, each generating exactly `--output-len` tokens (greedy, ignore_eos),
  timed end to end `--num-iters` times after `--num-iters-warmup` untimed runs; reports the
  mean and percentiles of the batch latency.
- offline (as `vllm bench throughput`): `--num-prompts` such prompts at once, after one small
  untimed batch; reports requests/s and input, output and total tokens/s.

Every run gets fresh prompts (other random ids), so the prefix cache finds none of an earlier
run's. Engine flags are `nanoserve serve`'s. benchmarks/latency.py and
benchmarks/offline_throughput.py are the research versions (bundled model sweeps, weight
bandwidth floors, GPU profiling counters).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from nanoserve.config import add_engine_args, engine_config_from_args
from nanoserve.models.registry import DEFAULT_MODEL
from nanoserve.sampling_params import SamplingParams


def add_common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"model alias, GGUF file or HF directory ({DEFAULT_MODEL})")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--output-len", type=int, default=128, help="generated tokens per request (ignore_eos)")
    ap.add_argument("--output-json", default=None, help="write the results here")
    add_engine_args(ap)


def add_latency_args(ap: argparse.ArgumentParser) -> None:
    add_common_args(ap)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--num-iters-warmup", type=int, default=2)
    ap.add_argument("--num-iters", type=int, default=5)


def add_offline_args(ap: argparse.ArgumentParser) -> None:
    add_common_args(ap)
    ap.add_argument("--num-prompts", type=int, default=256)


def random_prompts(num: int, input_len: int, vocab: int, rng: random.Random) -> list[list[int]]:
    # The lowest ids are often special tokens (BOS/EOS/pad) in real vocabularies: skipped.
    low = min(1000, vocab // 2)
    return [[rng.randrange(low, vocab) for _ in range(input_len)] for _ in range(num)]


def _setup(args: argparse.Namespace):
    from nanoserve.llm import LLM

    for name in ("input_len", "output_len"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    llm = LLM(config=engine_config_from_args(args))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    return llm, params, random.Random(args.seed), llm.engine.model_config.vocab_size


def _write(path: str | None, report: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {path}")


def run_latency(args: argparse.Namespace) -> int:
    llm, params, rng, vocab = _setup(args)
    batch = args.batch_size

    def once() -> float:
        prompts = random_prompts(batch, args.input_len, vocab, rng)
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - started

    for _ in range(args.num_iters_warmup):
        once()
    latencies = sorted(once() for _ in range(args.num_iters))

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, round(q * (len(latencies) - 1)))]

    report = {
        "model": args.model,
        "batch_size": batch,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "latencies_s": latencies,
        "avg_latency_s": statistics.fmean(latencies),
        "percentiles_s": {str(q): pct(q / 100) for q in (10, 25, 50, 75, 90, 99)},
    }
    print(f"batch {batch}, {args.input_len} in / {args.output_len} out, {len(latencies)} runs")
    print(f"avg latency {report['avg_latency_s']:.4f} s  p50 {pct(0.5):.4f} s  p90 {pct(0.9):.4f} s")
    _write(args.output_json, report)
    llm.shutdown()
    return 0


def run_offline(args: argparse.Namespace) -> int:
    llm, params, rng, vocab = _setup(args)
    llm.generate(random_prompts(min(4, args.num_prompts), args.input_len, vocab, rng), params, use_tqdm=False)
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, rng)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(map(len, prompts))
    report = {
        "model": args.model,
        "num_prompts": len(prompts),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "elapsed_s": elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (in_tokens + out_tokens) / elapsed,
        "total_output_tokens": out_tokens,
    }
    print(
        f"{len(prompts)} requests in {elapsed:.2f} s: {report['requests_per_s']:.2f} req/s, "
        f"{report['output_tokens_per_s']:.1f} output tok/s, {report['total_tokens_per_s']:.1f} total tok/s"
    )
    _write(args.output_json, report)
    llm.shutdown()
    return 0
