"""Prefill time with and without piecewise CUDA graphs: 1, 4 and 16 requests of 32, 128 and
512 tokens, each batch prefilled in one step (max_tokens=1, prefix cache off), on dummy
weights. Also prints the graphs' capture time and memory.

Both modes run in one engine, alternating repeat by repeat: "eager" detaches the runner's
piecewise graphs (decode graphs stay, unused: one token is sampled from the prefill). The
time is the host's wall time from adding the requests until they have finished, synchronized
with the GPU: what time to first token sees.

    python benchmarks/prefill_graphs.py [--model qwen3-0.6b llama-3.1-8b] [--repeats 15]

On one H200 (benchmarks/results/2026-11-21.md): qwen3-0.6b, 1-16 prompts of <= 512 tokens prefill
3.4-4.1x faster with the piecewise graphs than eagerly.
"""

from __future__ import annotations

import argparse
import gc
import logging
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import device_name

from nanoserve import LLM, SamplingParams

NUM_REQUESTS = (1, 4, 16)
PROMPT_LENS = (32, 128, 512)
EXTRA = ((1, 4096),)  # the largest captured size, beyond the table


def prefill_seconds(engine, prompts: list[list[int]], tag: str) -> float:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for j, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{j}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def bench_model(name: str, repeats: int) -> None:
    llm = LLM(
        name,
        load_format="dummy",
        max_model_len=8192,
        kv_cache_tokens=65536,
        max_num_seqs=16,
        cuda_graph_max_bs=16,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    runner = engine.runner
    pw = runner.piecewise
    if pw is None:
        raise SystemExit("piecewise graphs are off (no CUDA, --no-piecewise-graphs or the torch backend)")
    print(
        f"{device_name(engine.device)} | {name} (dummy, {str(engine.dtype).removeprefix('torch.')}) | piecewise graphs: "
        f"{len(pw.sizes) + len(pw.dropped)} token counts x {runner.model.num_pieces} pieces, "
        f"captured in {pw.capture_seconds:.1f} s, {pw.memory_bytes / 2**30:.2f} GiB; replayed up to "
        f"{pw.max_tokens} tokens (sizes measured slower than eager at start, dropped: {pw.dropped or 'none'})",
        flush=True,
    )
    rng = random.Random(0)
    rows = []
    for num, length in [(n, m) for n in NUM_REQUESTS for m in PROMPT_LENS] + list(EXTRA):
        prompts = [[rng.randrange(10000) for _ in range(length)] for _ in range(num)]
        times: dict[str, list[float]] = {"eager": [], "piecewise": []}
        for rep in range(repeats + 2):  # the first two are warm-up
            for mode, measured in times.items():
                runner.piecewise = pw if mode == "piecewise" else None
                seconds = prefill_seconds(engine, prompts, f"{mode}{num}x{length}r{rep}")
                if rep >= 2:
                    measured.append(seconds)
        runner.piecewise = pw
        tokens = num * length
        padded = pw.padded_size(tokens)
        eager_ms = statistics.median(times["eager"]) * 1e3
        graph_ms = statistics.median(times["piecewise"]) * 1e3
        rows.append((num, length, tokens, padded, eager_ms, graph_ms))
    print(f"\n{name}: prefill time, median of {repeats} (ms)")
    print("| requests | tokens each | tokens | graph size | eager ms | piecewise ms | speedup |")
    print("|---|---|---|---|---|---|---|")
    for num, length, tokens, padded, eager_ms, graph_ms in rows:
        size = "eager (above the largest kept)" if padded is None else str(padded)
        print(
            f"| {num} | {length} | {tokens} | {size} | {eager_ms:.2f} | {graph_ms:.2f} | {eager_ms / graph_ms:.2f}x |"
        )
    stats = llm.stats()
    leak_free = stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    print(f"no leaks: {leak_free}\n", flush=True)
    llm.shutdown()
    del llm, engine, runner, pw
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    for name in args.model:
        bench_model(name, args.repeats)


if __name__ == "__main__":
    main()
