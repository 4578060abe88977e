"""Prefix-cache benchmark: the same workloads with the radix prefix cache on and off.

    python benchmarks/prefix_cache.py [--model qwen3-0.6b] [--scale 1.0] [--workloads shared,chat,random]
    python benchmarks/prefix_cache.py --model /path/to/tiny --device cpu --scale 0.05   # smoke run

Workloads (token-id prompts over the model's vocabulary, `ignore_eos` greedy outputs, dummy
weights unless --load-format says otherwise; sizes are multiplied by --scale):
- shared: 32 groups x 16 requests; each request is its group's 2048-token prefix plus a
  128-token suffix of its own and generates 128 tokens; all requests in one call, shuffled;
- chat: 64 conversations x 6 turns; each turn resends the conversation so far plus 128 new
  user tokens and generates 128; turn k of every conversation goes in one call, after
  turn k-1's answers came back;
- random: as many requests of the same lengths as `shared`, with no common prefix (the
  cache can only cost here).
Each mode runs in a fresh process (so both get the same KV capacity), warms up, and then
runs every workload from an empty cache (`--repeat N`: N times, the last one reported; the
time, step count and GPU wait of each run are printed, so that a first run paying for
kernel compilation shows). Reported per workload and mode: prompt tokens,
prefill tokens actually computed, prefix-cache hit rate, output tokens/s and wall time;
then the on/off throughput ratio. Prints a markdown table and writes it to
$OUT/prefix_cache.md when OUT is set.

On one H200 (benchmarks/results/2026-11-21.md): shared 2048-token prefixes, cache + cascade on vs off:
3.16x (qwen3-0.6b) and 4.65x (llama-3.1-8b) the throughput; no sharing: 1.00-1.01x.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import random
import sys
import threading
import time
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from nanoserve import LLM, SamplingParams
from nanoserve.config import add_engine_args, engine_config_from_args

Generate = Callable[[list[list[int]]], list[list[int]]]  # prompts -> output token ids


def scaled(n: int, scale: float, least: int = 1) -> int:
    return max(least, round(n * scale))


def shared_prefix(gen: Generate, rng: random.Random, vocab: int, scale: float) -> None:
    groups, per_group = scaled(32, scale), scaled(16, scale, least=2)
    prefix_len, suffix_len = scaled(2048, scale, least=16), scaled(128, scale)
    prompts = []
    for _ in range(groups):
        prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
        prompts += [prefix + [rng.randrange(vocab) for _ in range(suffix_len)] for _ in range(per_group)]
    rng.shuffle(prompts)
    gen(prompts)


def multi_turn_chat(gen: Generate, rng: random.Random, vocab: int, scale: float) -> None:
    conversations, user_len = scaled(64, scale), scaled(128, scale)
    history: list[list[int]] = [[] for _ in range(conversations)]
    for _turn in range(6):
        for conv in history:
            conv += [rng.randrange(vocab) for _ in range(user_len)]
        for conv, answer in zip(history, gen(history)):
            conv += answer


def random_prompts(gen: Generate, rng: random.Random, vocab: int, scale: float) -> None:
    num = scaled(32, scale) * scaled(16, scale, least=2)
    length = scaled(2048, scale, least=16) + scaled(128, scale)
    gen([[rng.randrange(vocab) for _ in range(length)] for _ in range(num)])


WORKLOADS = {"shared": shared_prefix, "chat": multi_turn_chat, "random": random_prompts}


def run_mode(args: argparse.Namespace, cache_on: bool) -> list[dict]:
    """Every workload on one fresh engine with the cache on or off; one result per workload."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())  # its default, a multiprocessing lock, leaks a semaphore in this worker
    config = dataclasses.replace(engine_config_from_args(args), enable_prefix_caching=cache_on)
    llm = LLM(config=config)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=scaled(128, args.scale, least=2), ignore_eos=True)
    counts = {"prompt": 0, "output": 0}

    def gen(prompts: list[list[int]]) -> list[list[int]]:
        outs = llm.generate(prompts, params, use_tqdm=False)
        counts["prompt"] += sum(len(p) for p in prompts)
        counts["output"] += sum(len(o.outputs[0].token_ids) for o in outs)
        return [o.outputs[0].token_ids for o in outs]

    # Warm-up (kernel compilation, allocator): a few prompts of the workloads' lengths, then
    # each workload at a tenth of its size, so that cache hits (extend over a cached prefix)
    # compile their kernels here and not inside a timed run (a cold process spent ~2.4 s of
    # the shared workload's first run compiling on an H200).
    warm = random.Random(-1)
    gen([[warm.randrange(vocab) for _ in range(scaled(2176, args.scale, least=17))] for _ in range(4)])
    for name in args.workloads:
        WORKLOADS[name](gen, random.Random(-2), vocab, args.scale / 10)
    results = []
    for name in args.workloads:
        for rep in range(args.repeat):  # the last repetition is reported
            if engine.prefix_cache is not None:
                engine.prefix_cache.reset()  # engine idle: every workload starts from an empty cache
            counts.update(prompt=0, output=0)
            before = llm.stats()
            steps, wait_s = engine.num_steps, engine.gpu_wait_s
            start = time.perf_counter()
            WORKLOADS[name](gen, random.Random(args.seed), vocab, args.scale)
            elapsed = time.perf_counter() - start
            print(
                f"{name:>7} run {rep + 1}/{args.repeat}: {elapsed:.2f} s, {engine.num_steps - steps} steps, "
                f"host waited {engine.gpu_wait_s - wait_s:.2f} s for the GPU",
                flush=True,
            )
        after = llm.stats()
        assert after["kv_pages_free"] + after["kv_pages_cached"] == after["kv_pages_total"], after
        queries = after["prefix_cache_query_tokens"] - before["prefix_cache_query_tokens"]
        hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
        results.append(
            {
                "workload": name,
                "cache": "on" if cache_on else "off",
                "prompt_tokens": counts["prompt"],
                "prefill_tokens": after["prefill_tokens_computed"] - before["prefill_tokens_computed"],
                "hit_rate": hits / queries if queries else 0.0,
                "output_tokens": counts["output"],
                "seconds": elapsed,
                "output_tok_s": counts["output"] / elapsed,
                "preemptions": after["num_preemptions"] - before["num_preemptions"],
                "cascade_steps": after["cascade_decode_steps"] - before["cascade_decode_steps"],
                "kv_tokens": after["kv_pages_total"] * after["page_size"],
            }
        )
        r = results[-1]
        print(
            f"{name:>7} cache {r['cache']:>3}: prefill {r['prefill_tokens']}/{r['prompt_tokens']} tokens, "
            f"hit rate {r['hit_rate']:.1%}, {r['output_tok_s']:.1f} output tok/s, {elapsed:.2f} s, "
            f"{r['cascade_steps']} cascade decode steps",
            flush=True,
        )
    return results


def table(results: list[dict], model: str, device: str) -> str:
    lines = [
        f"Prefix cache, {model} on {device}, KV capacity {results[0]['kv_tokens']} tokens",
        "",
        "| workload | cache | prompt tokens | prefill computed | hit rate | output tok/s | time (s) | preemptions | on/off |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    by_key = {(r["workload"], r["cache"]): r for r in results}
    for r in results:
        off = by_key.get((r["workload"], "off"))
        ratio = f"{r['output_tok_s'] / off['output_tok_s']:.2f}x" if r["cache"] == "on" and off else ""
        lines.append(
            f"| {r['workload']} | {r['cache']} | {r['prompt_tokens']} | {r['prefill_tokens']} | {r['hit_rate']:.1%} "
            f"| {r['output_tok_s']:.1f} | {r['seconds']:.2f} | {r['preemptions']} | {ratio} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the workload sizes (e.g. 0.05 on CPU)")
    parser.add_argument("--workloads", default="shared,chat,random", help="comma-separated: shared, chat, random")
    parser.add_argument("--modes", default="on,off", help="cache modes to run: on, off or both")
    parser.add_argument("--repeat", type=int, default=1, help="run each workload this many times, report the last")
    add_engine_args(parser)
    parser.set_defaults(load_format="dummy")
    args = parser.parse_args()
    args.workloads = args.workloads.split(",")
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}; known: {sorted(WORKLOADS)}")
    modes = [m == "on" for m in args.modes.split(",")]
    # One fresh process per mode: the second engine then sizes its KV cache from the same
    # free memory as the first, and nothing of the first (cache, compiled graphs) lingers.
    ctx = multiprocessing.get_context("spawn")
    results = []
    for on in modes:
        with ctx.Pool(1) as pool:
            results += pool.apply(run_mode, (args, on))
    device = engine_config_from_args(args).torch_device()
    text = table(results, args.model, str(device))
    print()
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "prefix_cache.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
