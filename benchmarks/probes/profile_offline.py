"""Where the GPU time of the offline benchmark goes: busy vs idle, kernels by category,
the top kernels, and the GPU time of a step by batch size.

Runs benchmarks/offline_throughput.py's workload after its warm-up: once without the
profiler (the reference wall time), then again under torch.profiler with CUDA activity
(CUPTI records every kernel, also inside CUDA-graph replays). Printed:
- wall time vs GPU busy time (the union of kernel and copy intervals), and the idle gaps;
- kernel time (summed durations: may exceed busy time where kernels overlap under PDL)
  by category, and the top kernels;
- per engine step, the GPU span of its forward, from an event recorded before the forward
  is queued to one after (its kernels and any idle time while the host launches them;
  sampling and the input copy not included), by decode batch-size bucket and for prefill /
  mixed steps.

    python benchmarks/probes/profile_offline.py [--model qwen3-0.6b] [--quantization fp8] [--trace FILE.json]
    python benchmarks/probes/profile_offline.py --smoke   # CPU: tiny model, 4 sequences, CPU ops
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the repository, and benchmarks/ for shared helpers

import argparse
import re
import tempfile
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from nanoserve import LLM, SamplingParams

from host_overhead import VOCAB, tiny_model_dir  # isort: skip (benchmarks/ is on sys.path)
from offline_throughput import warm_up, workload  # isort: skip

# First match wins; names are lower-cased. Triton kernels carry their function's name,
# torch.compile's are triton_{poi,red,per}_fused_<ops>.
CATEGORIES = [
    ("decode attention split", r"_decode_split"),
    ("decode attention reduce", r"_decode_reduce"),
    ("extend/prefill attention", r"_extend_kernel"),
    ("FA2 / flash", r"flash|fmha"),
    ("Gated DeltaNet", r"_delta_|_conv_step|chunk_|l2norm|gated_norm|fused_recurrent|solve_tril|wy_fast"),
    ("fused MoE", r"moe|_grouped_|_decode_(gate_up|down)|_route|_align"),
    ("store_kv", r"store_kv"),
    ("Triton linear/GEMV", r"_linear_(fma|dot)"),
    ("GEMM/cuBLAS", r"gemm|gemv|nvjet|cutlass|xmma|splitk"),
    ("sampling", r"_sample_|argmax|exponential|distribution|topk|sort|softmax"),
    ("norms/rotary", r"norm|rope|rotary|rsqrt"),
    ("SiLU-and-mul", r"silu"),
    ("NCCL", r"nccl"),
    ("elementwise/copies", r"memcpy|memset|elementwise|copy|index|gather|scatter|cat|fill|triton_"),
    ("other", r""),
]
DECODE_BUCKETS = [1, 8, 32, 64, 128, 192, 256]  # upper bounds of the decode batch-size buckets


def category(name: str) -> str:
    low = name.lower()
    return next(label for label, pattern in CATEGORIES if re.search(pattern, low))


def device_events(prof: profile, on_gpu: bool) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of every kernel and copy on the GPU; in a CPU run, of the
    CPU ops (nested ones too, so their categories overlap: the smoke run checks plumbing)."""
    wanted = torch.autograd.DeviceType.CUDA if on_gpu else torch.autograd.DeviceType.CPU
    out = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == wanted and e.duration_ns() > 0:
            out.append((e.name(), e.start_ns() / 1e3, (e.start_ns() + e.duration_ns()) / 1e3))
    return out


def busy_and_gaps(events: list[tuple[str, float, float]]) -> tuple[float, list[float]]:
    """Union of the intervals (µs) and the idle gaps between them."""
    busy, gaps, end = 0.0, [], None
    for _, s, e in sorted(events, key=lambda ev: ev[1]):
        if end is None or s > end:
            if end is not None:
                gaps.append(s - end)
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy, gaps


class StepTimer:
    """Wraps LLMEngine._forward: the GPU span (CUDA events; on CPU wall time) of each step's
    forward, with its kind and size. Events are read after the run, so no step waits for them."""

    def __init__(self, engine):
        self.engine, self.forward, self.steps = engine, engine._forward, []
        self.cuda = engine.device.type == "cuda"
        engine._forward = self._timed

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _timed(self, batch, prepared):
        start = self._mark()
        found = self.forward(batch, prepared)
        self.steps.append((batch.is_decode, len(batch.requests), batch.num_tokens, start, self._mark()))
        return found

    def report(self) -> None:
        groups: dict[str, list[tuple[float, int]]] = defaultdict(list)
        for is_decode, size, tokens, start, end in self.steps:
            ms = start.elapsed_time(end) if self.cuda else (end - start) * 1e3
            lower = max([0] + [b for b in DECODE_BUCKETS if b < size])
            upper = next((b for b in DECODE_BUCKETS if size <= b), "")
            key = f"decode bs {lower + 1}-{upper}" if is_decode else "prefill / mixed"
            groups[key].append((ms, size if is_decode else tokens))
        print(f"\n{'step kind':<22} {'steps':>6} {'mean ms':>8} {'total s':>8} {'mean bs / tokens':>17}")
        for key, rows in sorted(groups.items(), key=lambda kv: (kv[0].startswith("prefill"), min(r[1] for r in kv[1]))):
            total = sum(ms for ms, _ in rows)
            print(f"{key:<22} {len(rows):>6} {total / len(rows):>8.3f} {total / 1e3:>8.2f} "
                  f"{sum(n for _, n in rows) / len(rows):>17.1f}")  # fmt: skip
        self.engine._forward = self.forward


def run(llm: LLM, prompts, params) -> float:
    if llm.engine.prefix_cache is not None:  # each run computes every prompt
        llm.engine.prefix_cache.reset()
    sync = torch.cuda.synchronize if llm.engine.device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    sync()
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--quantization", default=None, choices=["fp8"], help="fp8 weights")
    ap.add_argument("--trace", help="also write the Chrome trace here (large)")
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check: tiny model, 4 short sequences")
    args = ap.parse_args()

    prompts, max_tokens = workload()
    prompts, max_tokens = prompts[: args.num_seqs], max_tokens[: args.num_seqs]
    tmp = tempfile.TemporaryDirectory()  # the smoke run's config (removed at exit)
    if args.smoke:
        prompts = [[t % VOCAB for t in p[:48]] for p in prompts[:4]]
        max_tokens = [min(m, 6) for m in max_tokens[:4]]
        llm = LLM(str(tiny_model_dir(Path(tmp.name))), device="cpu", load_format="dummy", max_model_len=256)
    else:
        llm = LLM(args.model, load_format="dummy", max_model_len=args.max_model_len, quantization=args.quantization)
    engine = llm.engine
    on_gpu = engine.device.type == "cuda"
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    warm_up(llm, prompts)
    reference = run(llm, prompts, params)

    timer = StepTimer(engine)
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        wall = run(llm, prompts, params)
    started = time.perf_counter()
    events = device_events(prof, on_gpu)
    if args.trace:
        prof.export_chrome_trace(args.trace)
    busy, gaps = busy_and_gaps(events)
    span = (max(e for _, _, e in events) - min(s for _, s, _ in events)) / 1e3 if events else 0.0
    out_tokens = sum(max_tokens)
    device = torch.cuda.get_device_name(engine.device) if on_gpu else "cpu (smoke: CPU ops, not kernels)"
    print(f"device: {device}; model {args.model if not args.smoke else 'tiny'}; {len(prompts)} seqs, "
          f"{out_tokens} output tokens; {len(timer.steps)} engine steps profiled")  # fmt: skip
    print(f"wall: {reference:.2f} s without the profiler ({out_tokens / reference:,.0f} tok/s), "
          f"{wall:.2f} s profiled; {len(events):,} events, analysed in {time.perf_counter() - started:.1f} s")  # fmt: skip
    print(f"GPU busy {busy / 1e6:.3f} s = {busy / 1e3 / max(span, 1e-9):.1%} of the {span / 1e3:.3f} s from the first "
          f"kernel to the last; idle {(span * 1e3 - busy) / 1e6:.3f} s in {len(gaps):,} gaps")  # fmt: skip
    for low, high in ((0, 5), (5, 20), (20, 100), (100, 1e3), (1e3, float("inf"))):
        sel = [g for g in gaps if low <= g < high]
        print(f"  gaps {low:>5.0f}-{high:<5.0f} µs: {len(sel):>7,} totalling {sum(sel) / 1e3:>8.1f} ms")

    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, s, e in events:
        by_name[name][0] += 1
        by_name[name][1] += e - s
    kernel_total = sum(t for _, t in by_name.values())
    by_cat: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, (count, total) in by_name.items():
        by_cat[category(name)][0] += count
        by_cat[category(name)][1] += total
    print(f"\n{'category':<26} {'calls':>9} {'ms':>9} {'% kernel time':>14}  (sum {kernel_total / 1e3:.1f} ms)")
    for cat, (count, total) in sorted(by_cat.items(), key=lambda kv: -kv[1][1]):
        print(f"{cat:<26} {count:>9,} {total / 1e3:>9.1f} {total / kernel_total:>14.1%}")
    print(f"\n{'top kernels':<90} {'calls':>8} {'ms':>8} {'µs/call':>8} {'share':>6}  category")
    for name, (count, total) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"{name[:90]:<90} {count:>8,} {total / 1e3:>8.1f} {total / count:>8.1f} "
              f"{total / kernel_total:>6.1%}  {category(name)}")  # fmt: skip
    timer.report()


if __name__ == "__main__":
    main()
