"""Batch-1 latency: time to first token (TTFT) and time per output token (TPOT) for a
128-token prompt and 256 output tokens (greedy, ignore_eos), on dummy weights, against the
weights-bandwidth floor (weight bytes / device-to-device copy bandwidth of this run). Weight
bytes are the parameters as stored: with --quantization fp8 the linears count one byte per
weight plus their fp32 scales (embedding and LM head stay bf16); gpt-oss's MXFP4 experts, kept
packed with NANOSERVE_MXFP4_EXPERTS=1, half a byte per weight plus a scale byte per 32 (by default
dequantized to bf16 at load, and counted so). Mixture-of-experts models (qwen3-30b-a3b,
mixtral-8x7b, gpt-oss): the floor counts the top-k experts of each sparse layer (the batch-1
case of E * (1 - (1 - k/E)^B)), the rest of the weights in full. The input embedding table is
one of them, though a token reads one row of it: where no LM head shares it, the share of the
floor without it is printed too.

    python benchmarks/latency.py [--models qwen3-0.6b llama-3.1-8b qwen3-30b-a3b mixtral-8x7b] [--repeats 3] [--triton-ops off on] [--quantization fp8]

On one H200 (benchmarks/results/2026-11-27.md, 7f98f24): TPOT qwen3-0.6b 0.712 ms, llama-3.1-8b
3.924 ms (97% of its floor), llama-3.1-8b with --quantization fp8 2.409 ms.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import copy_bandwidth, device_name, lookup_table_bytes, step_weight_bytes, weight_bytes

from nanoserve import LLM, SamplingParams
from nanoserve.engine.cuda_graph import PLAIN
from nanoserve.switches import KernelSwitches

PROMPT_LEN = 128
OUTPUT_LEN = 256


def fresh_prompt(run: int) -> list[int]:
    """Run `run`'s prompt: PROMPT_LEN tokens, its first one unlike any other run's, so that
    the prefix cache (on by default) finds nothing and TTFT times the whole prefill. Until
    2026-11-27 every run sent the warm-up's prompt and TTFT timed a 16-token extend over 112
    cached tokens (benchmarks/results/2026-11-27.md, 10:53-12:10)."""
    return [(7 * i + 3 + 1009 * run) % 10000 for i in range(PROMPT_LEN)]


def one_run(engine, prompt: list[int], rid: str) -> tuple[float, float]:
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda *a: None)
    sync()
    started = time.perf_counter()
    engine.add_request(rid, prompt, params)
    first = last = None
    count = 0
    while engine.has_unfinished_requests():
        for up in engine.step():
            if up.new_token_ids:
                now = time.perf_counter()
                if first is None:
                    first = now
                count += len(up.new_token_ids)
                last = now
    assert count == OUTPUT_LEN, count
    return first - started, (last - first) / (OUTPUT_LEN - 1)


def decode_wall_ms(engine, prompt: list[int], steps: int = 100) -> float:
    """Wall ms per engine step of one greedy request decoding alone (it keeps running, up to 700
    tokens: the caller aborts it): 8 steps first (the prefill, then decode from the graph)."""
    engine.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=700, ignore_eos=True))
    for _ in range(8):
        engine.step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3 / steps


def batch1_graph_ms(engine, reps: int = 50) -> float:
    """GPU time of one batch-1 decode step: the captured graph replayed alone (NaN without graphs)."""
    graphs = engine.runner.graphs
    key = (1, PLAIN)  # batch 1, the plain graph (no cascade or runs twin at one row)
    if graphs is None or key not in graphs.graphs:
        return float("nan")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graphs.graphs[key].replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


@torch.inference_mode()  # the engine's tensors are inference tensors; steps run outside generate()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--quantization", default=None, choices=["fp8"], help="fp8 weights (the floor counts their bytes)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (floor: one rank's weight shard)")
    ap.add_argument("--triton-ops", choices=["on", "off"], nargs="+", default=["on"],
                    help="the Triton decode kernels (nanoserve/kernels); 'off on' measures both")  # fmt: skip
    args = ap.parse_args()
    for name, ops in ((n, o) for n in args.models for o in args.triton_ops):
        llm = LLM(
            name,
            load_format="dummy",
            max_model_len=1024,
            kv_cache_tokens=16384,
            max_num_seqs=8,
            enforce_eager=args.enforce_eager,
            overlap_schedule=not args.no_overlap,
            quantization=args.quantization,
            tensor_parallel_size=args.tp,
            switches=dataclasses.replace(KernelSwitches.from_env(), triton_ops=ops == "on"),
        )
        engine = llm.engine
        device = engine.device
        bw = copy_bandwidth(device)
        wbytes = weight_bytes(engine.runner.model)
        one_run(engine, fresh_prompt(0), "warm")
        runs = [one_run(engine, fresh_prompt(i + 1), f"r{i}") for i in range(args.repeats)]
        ttft = statistics.median(r[0] for r in runs)
        tpot = statistics.median(r[1] for r in runs)
        active = step_weight_bytes(engine.runner.model, 1)  # MoE: only the top-k experts of each layer
        floor = active / bw
        lookup = lookup_table_bytes(engine.runner.model)  # counted in `active`, read one row a token
        lookup_note = f" ({(active - lookup) / bw / tpot:.0%} without the untied embedding table)" if lookup else ""
        # Replaying rank 0's graph alone would wait forever in its all-reduce under TP.
        graph_ms = batch1_graph_ms(engine) if args.tp == 1 else float("nan")
        stats = llm.stats()
        leak_free = stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
        print(
            f"{device_name(device)} | {name} (dummy, {str(engine.dtype).removeprefix('torch.')}, weights "
            f"{args.quantization or 'unquantized'}), graphs "
            f"{'off' if engine.runner.graphs is None else 'on'}, overlap {'on' if engine.overlap else 'off'}, "
            f"Triton decode kernels {ops}{f', TP={args.tp}' if args.tp > 1 else ''} | "
            f"TTFT {ttft * 1e3:.2f} ms | TPOT {tpot * 1e3:.3f} ms (graph replay alone {graph_ms:.3f} ms) | weights {wbytes / 1e9:.2f} GB"
            f"{'' if active == wbytes else f', read per token {active / 1e9:.2f} GB'} at {bw / 1e12:.2f} TB/s "
            f"-> floor {floor * 1e3:.3f} ms/token, TPOT = {floor / tpot:.0%} of floor{lookup_note} | runs {[(round(a * 1e3, 2), round(b * 1e3, 3)) for a, b in runs]} "
            f"| no leaks: {leak_free}",
            flush=True,
        )
        llm.shutdown()  # TP: stops the worker ranks
        del llm, engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
