"""Offline throughput on nano-vllm's workload, against the memory-traffic floor.

Workload (exactly nano-vllm's bench.py): 256 sequences, random.seed(0); for each, a prompt
of randint(100, 1024) token ids each randint(0, 10000); then for each, max_tokens =
randint(100, 1024); ignore_eos, temperature 0.6. Dummy weights of a bundled config.

Floor: every decode step streams the weights once, every sequence's KV once and, in models
with linear-attention layers (Qwen3.5), every sequence's recurrent and conv state, which the
step reads and writes back; at the device-to-device copy bandwidth measured in this run (bytes
read + written):
    floor = (weight bytes x decode steps + KV bytes read + 2 x state bytes x output tokens) / copy bandwidth
with decode steps = the longest max_tokens, KV bytes read = sum over sequences and their
decode steps of the context length x KV bytes per token, state bytes a request's row of
every linear layer as stored (`LinearStatePool.bytes_per_request`: the recurrent state fp32). Weight bytes are the parameters as
stored (--quantization fp8: one byte per linear weight plus fp32 scales). Mixture-of-experts
models: a step of B sequences reads E * (1 - (1 - k/E)^B) distinct experts per sparse layer
(the expected count under uniform routing), the rest of the weights in full, and step s
decodes the sequences with more than s output tokens.

    python benchmarks/offline_throughput.py [--model qwen3-0.6b] [--peer hf]

On one H200 (benchmarks/results/2026-11-25.md): qwen3-0.6b 27.0-28.0k output tok/s, ~74% of
the floor; llama-3.1-8b ~9.8k (bf16), ~11.4k with --quantization fp8.
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.compile_watch import CompileWatch
from nanoserve.kvcache.linear_state import LinearStatePool
from nanoserve.kvcache.pool import KVCache
from nanoserve.models.decoder import kv_heads_per_rank
from nanoserve.models.gpt_oss import GptOssMoE
from nanoserve.models.layers import ParallelLMHead, VocabParallelEmbedding
from nanoserve.models.moe import SparseMoE
from nanoserve.models.qwen3_5 import prefill_path

NUM_SEQS = 256
EXPECTED_PROMPT_TOKENS = 142_827
EXPECTED_OUTPUT_TOKENS = 133_966


def workload() -> tuple[list[list[int]], list[int]]:
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(NUM_SEQS)]
    max_tokens = [random.randint(100, 1024) for _ in range(NUM_SEQS)]
    return prompts, max_tokens


def warm_up(llm: LLM, prompts: list[list[int]]) -> None:
    """Warm-up on the workload's own first prompts (short outputs): Triton and torch.compile
    specialize on shapes, and a cold process otherwise compiles inside the timed run
    (measured on an H200: 8.8 s cold vs 5.7 s warm for qwen3-0.6b)."""
    warm_params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=8)
    llm.generate(prompts[:32], warm_params, use_tqdm=False)
    if llm.engine.prefix_cache is not None:
        llm.engine.prefix_cache.reset()  # the timed run must not reuse the warm-up's prompts


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second of a 1 GiB bf16 device-to-device copy."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(2**29, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(end) / 1e3 / reps
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 2**30 / seconds


def weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def expected_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected number of distinct experts that `batch` tokens, each routed uniformly to
    `top_k` of `num_experts`, read: E * (1 - (1 - k/E)^B)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def step_weight_bytes(model: torch.nn.Module, batch: int) -> float:
    """Weight bytes a decode step of `batch` sequences must read: every parameter once, except
    the routed experts of MoE layers (gpt-oss's with their biases), of which only the expected distinct experts
    (`expected_experts`); attention, embedding, LM head, routers and shared experts in full.
    Parameters count as stored: gpt-oss's packed MXFP4 experts half a byte a weight plus a
    scale byte per 32 (uint8 codes and scales), dequantized ones (the default)
    their dtype's bytes. For a dense model: weight_bytes(model)."""
    total = float(weight_bytes(model))
    for module in model.modules():
        if isinstance(module, (SparseMoE, GptOssMoE)):
            e = module.experts.w13.shape[0]
            per_expert = sum(p.numel() * p.element_size() for p in module.experts.parameters()) / e
            total -= per_expert * (e - expected_experts(e, module.top_k, batch))
    return total


def lookup_table_bytes(model: torch.nn.Module) -> int:
    """Bytes of the input embedding tables that no LM head shares. The floors count them in
    full (`step_weight_bytes`), though a step reads one row of them a token; a tied table is the
    LM head's, which a step reads whole."""
    heads = {m.weight.data_ptr() for m in model.modules() if isinstance(m, ParallelLMHead)}
    return sum(
        m.weight.numel() * m.weight.element_size()
        for m in model.modules()
        if type(m) is VocabParallelEmbedding and m.weight.data_ptr() not in heads
    )


def decode_weight_bytes(model: torch.nn.Module, max_tokens: list[int]) -> float:
    """Weight bytes of every decode step when all sequences run together: step s decodes the
    sequences with more than s output tokens (a dense model: weight bytes x the longest)."""
    return sum(step_weight_bytes(model, sum(m > s for m in max_tokens)) for s in range(max(max_tokens)))


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def run_hf_peer(model_name: str, prompts, mean_new: int, dtype, device) -> tuple[float, int]:
    from transformers import GenerationConfig

    from nanoserve.models.hf_reference import hf_dummy_model

    model = hf_dummy_model(model_name, 0, device, dtype)
    gen = GenerationConfig(max_new_tokens=mean_new, do_sample=True, temperature=0.6, eos_token_id=-1, pad_token_id=0)
    model.generate_batch(
        inputs=[p[:8] for p in prompts[:4]],
        generation_config=GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0),
    )
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=gen)
    torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - started
    produced = 0
    for v in out.values():
        ids = getattr(v, "generated_tokens", None)
        produced += len(ids) if ids is not None else mean_new
    del model
    torch.cuda.empty_cache()
    return elapsed, produced


class GCTimer:
    """Time the garbage collector spends in collections, by generation, since the last read
    (gc.callbacks: a collection's start and stop)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.counts = [0, 0, 0]
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._started
            self.counts[info["generation"]] += 1

    def read(self) -> str:
        text = ", ".join(f"gen{g} {n} x {1e3 * s:.1f} ms" for g, (n, s) in enumerate(zip(self.counts, self.seconds)))
        self.seconds, self.counts = [0.0, 0.0, 0.0], [0, 0, 0]
        return text


def timed_run(llm: LLM, prompts, params) -> tuple[list, float]:
    """One timed pass of the workload, the engine's host counters reset before it."""
    engine = llm.engine
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    engine.gpu_wait_s = engine.step_s = 0.0
    engine.num_steps = 0
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return outs, time.perf_counter() - started


def run_breakdown(engine, elapsed: float, gc_timer: GCTimer, compiles: CompileWatch) -> str:
    """Where a run's wall time went on the host: waiting for the GPU (GPU-bound), the rest
    of the engine's steps, outside them, and the garbage collector."""
    busy = engine.step_s - engine.gpu_wait_s
    return (
        f"elapsed {elapsed:.2f} s = host waiting for the GPU {engine.gpu_wait_s:.2f} s + other step work {busy:.2f} s "
        f"({engine.num_steps} steps, {1e3 * busy / max(engine.num_steps, 1):.3f} ms each: schedule, prepare, launch, "
        f"process; on CPU also the compute) + outside steps {elapsed - engine.step_s:.2f} s (LLM.generate); "
        f"collector: {gc_timer.read()}; compiled in the run: {compiles.read()}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--peer", choices=["hf"], default=None)
    ap.add_argument("--kv-cache-dtype", default="auto", help="fp8: float8 KV cache (the floor then counts its bytes)")
    ap.add_argument("--quantization", default=None, choices=["fp8"], help="fp8 weights (the floor counts their bytes)")
    ap.add_argument("--chunked-prefill-size", type=int, default=None, help="prefill token budget per step")
    ap.add_argument("--schedule-policy", default=None, choices=["prefill-first", "mixed"], help="default: the engine's")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="mixed: token budget of a decoding step")
    ap.add_argument("--num-seqs", type=int, default=NUM_SEQS, help="fewer for a smoke run (no total check)")
    ap.add_argument(
        "--repeat", type=int, default=1, help="time the workload this many times in the process; the last is reported"
    )
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after the warm-up (A/B for the spread)")
    args = ap.parse_args()

    prompts, max_tokens = workload()
    total_prompt, total_out = sum(map(len, prompts)), sum(max_tokens)
    assert (total_prompt, total_out) == (EXPECTED_PROMPT_TOKENS, EXPECTED_OUTPUT_TOKENS), (total_prompt, total_out)
    prompts, max_tokens = prompts[: args.num_seqs], max_tokens[: args.num_seqs]
    total_prompt, total_out = sum(map(len, prompts)), sum(max_tokens)

    # Before the engine: it takes most of the free memory for its KV cache, and a large model
    # (qwen3-30b-a3b on an 80 GB card) then left no room for the copy's 2 GiB.
    bw = copy_bandwidth(torch.device("cuda")) if torch.cuda.is_available() else float("nan")
    compiles = CompileWatch()
    llm = LLM(
        args.model,
        load_format="dummy",
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        overlap_schedule=not args.no_overlap,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        **({"chunked_prefill_size": args.chunked_prefill_size} if args.chunked_prefill_size else {}),
        **({"schedule_policy": args.schedule_policy} if args.schedule_policy else {}),
        **({"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}),
    )
    engine = llm.engine
    device = engine.device
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    warm_up(llm, prompts)
    print(f"compiled in the start-up and warm-up: {compiles.read()}")
    if args.gc_freeze:
        gc.collect()
        gc.freeze()  # the engine's long-lived objects leave the collector's scans
    gc_timer = GCTimer()
    for run in range(1, args.repeat):  # earlier runs (the last is reported in full below)
        _, elapsed = timed_run(llm, prompts, params)
        print(
            f"run {run} of {args.repeat}: {total_out / elapsed:,.0f} output tok/s; {run_breakdown(engine, elapsed, gc_timer, compiles)}",
            flush=True,
        )
        if engine.prefix_cache is not None:
            engine.prefix_cache.reset()  # the next run must not reuse these prompts' KV
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    outs, elapsed = timed_run(llm, prompts, params)
    host = run_breakdown(engine, elapsed, gc_timer, compiles)  # now: the collector's count must end with the run
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == total_out, (produced, total_out)

    stats = llm.stats()
    leak_free = stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    engine.check_invariants()
    wbytes = weight_bytes(engine.runner.model)
    cfg = engine.model_config
    kv_per_token = KVCache.bytes_per_token(  # layers that keep K/V only (not linear attention)
        cfg.num_kv_layers, kv_heads_per_rank(cfg, engine.runner.model.tp), cfg.head_dim, engine.kv_dtype
    )
    steps = max(max_tokens)
    kv_read = sum(sum(range(p, p + m)) for p, m in zip(map(len, prompts), max_tokens)) * kv_per_token
    step_bytes = decode_weight_bytes(engine.runner.model, max_tokens)  # MoE: the experts each step reads
    state_traffic = 2 * total_out * LinearStatePool.bytes_per_request(cfg.linear_state_shape, engine.dtype)
    floor = (step_bytes + kv_read + state_traffic) / bw
    graphs = engine.runner.graphs
    print(f"device: {device_name(device)}")
    print(
        f"model {args.model} (dummy, {str(engine.dtype).removeprefix('torch.')}, weights {args.quantization or 'unquantized'}, KV cache "
        f"{str(engine.kv_dtype).removeprefix('torch.')}), {len(prompts)} seqs, "
        f"{total_prompt} prompt + {total_out} output tokens, max_model_len {args.max_model_len}, "
        f"graphs {'off' if graphs is None else f'1..{graphs.max_bs} ({graphs.capture_seconds:.1f} s, {graphs.memory_bytes / 2**30:.2f} GiB)'}, "
        f"overlap {'on' if engine.overlap else 'off'}"
    )
    if cfg.linear is not None:
        print(f"Gated DeltaNet prefill: {prefill_path(device, engine.dtype, engine.config.switches)}")
    print(f"host: {host}")
    print(
        f"elapsed {elapsed:.2f} s | output {total_out / elapsed:,.0f} tok/s | total {(total_prompt + total_out) / elapsed:,.0f} tok/s"
    )
    print(
        f"floor: weights {wbytes / 1e9:.3f} GB, read over {steps} steps {step_bytes / 1e12:.2f} TB"
        f"{'' if cfg.moe is None else f' (MoE: expected distinct experts per step, {step_bytes / (wbytes * steps):.1%} of all weights x steps)'}"
        f" + KV reads {kv_read / 1e12:.2f} TB"
        f"{f' + linear-attention state read and written {state_traffic / 1e12:.2f} TB' if state_traffic else ''} "
        f"at copy {bw / 1e12:.2f} TB/s = {floor:.2f} s -> {floor / elapsed:.1%} of the floor"
    )
    kv_tokens = (engine.allocator.num_usable) * stats["page_size"]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    print(
        f"KV capacity {kv_tokens:,} tokens; peak allocated {peak:.1f} GiB; preemptions {stats['num_preemptions']}; "
        f"no leaks: {leak_free}"
    )
    if args.peer == "hf":
        mean_new = round(total_out / len(prompts))
        try:
            hf_elapsed, hf_out = run_hf_peer(args.model, prompts, mean_new, engine.dtype, device)
            hf_rate = hf_out / hf_elapsed
            print(
                f"peer transformers generate_batch: max_new_tokens={mean_new} for every prompt (the workload's mean; "
                f"its batch API takes one), {hf_out} tokens in {hf_elapsed:.1f} s = {hf_rate:,.0f} output tok/s; "
                f"nanoserve / transformers = {total_out / elapsed / hf_rate:.1f}x"
            )
        except Exception as exc:  # noqa: BLE001 - report, do not hide the engine's numbers
            print(f"peer transformers generate_batch failed: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
