"""Attention kernel benchmark (run on a GPU machine): `python benchmarks/attention.py [--sweep]`.

Measures in one run:
- the copy ceiling: a 1 GiB device-to-device copy, bytes read plus written over time;
- decode (Triton paged decode, split + reduce kernels, store excluded): KV bytes read over time,
  head_dim 128, 32 query heads over 8 kv heads, bf16, page_size 16, shuffled pages, for batch
  {8, 64, 128, 256} x context {1k, 2k, 4k, 8k}, as % of the copy ceiling;
- extend: TFLOP/s (causal pairs only) of the Triton extend kernel and torch's FlashAttention-2
  varlen at 4 x 2048 new tokens without prefix, and with a 2048-token prefix + 512 new tokens per
  request (FA2 there reads a contiguous K/V of the same lengths, for comparison only).
Decode is timed as the engine runs it, in a CUDA graph of back-to-back calls rotating over
KV copies that together exceed 4x the L2 (median of 20 replays); the eager time
(triton.testing.do_bench, L2 flushed before each call, CPU launch cost can show) is listed too.
Extend times are do_bench medians (warm-up, L2 flushed before every call).
Prints a markdown table at the end and writes it to $OUT/attention.md when OUT is set.
`--sweep` first times decode split counts. `--ragged` times only the decode batches of the
offline workload (ragged context lengths, qwen3-0.6b's 16 query heads by default) under
several launch configs (sums over its steps 0, 100, ..., 1000). `--wide` times head_dim 256
(gemma-3-12b's 16k-context decode, full and sliding layers) over launch configs and splits.

On one H200 (benchmarks/results/2026-11-21.md): paged decode at 97-107% of the measured copy bandwidth
(batch 64-256 x context 1k-8k, Llama-3.1-8B heads); extend 4 x 2048 at 374 TFLOP/s, 1.36x
torch's FlashAttention-2.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from nanoserve.kernels import attention as tk

DEV = "cuda"
HQ, HKV, D, PAGE = 32, 8, 128, 16
DT = torch.bfloat16
KV_DT = torch.bfloat16  # the decode caches' dtype (--kv-dtype fp8: float8 e4m3)


def bench(fn) -> float:
    """Median milliseconds."""
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_ms(calls: list) -> float:
    """Median milliseconds per call of `calls` captured back to back in one CUDA graph (how the
    engine runs decode: no CPU launch cost, ~1 us between kernels), over 20 replays."""
    for fn in calls:
        fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    del graph
    return sorted(times)[len(times) // 2]


def copy_ceiling() -> float:
    n = 1 << 29  # 1 GiB of bf16
    src = torch.randn(n, device=DEV, dtype=DT)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    src = dst = None  # free the GiB before the next measurement
    return 2 * n * 2 / ms / 1e9  # TB/s


def decode_case(lens: list[int], gen: torch.Generator, hq: int = HQ):
    """A decode batch with context lengths `lens`, each request on shuffled pages."""
    pages = [-(-n // PAGE) for n in lens]
    num_pages = 1 + sum(pages)
    k_cache = torch.randn(num_pages, PAGE, HKV, D, device=DEV, dtype=DT, generator=gen).to(KV_DT)
    v_cache = torch.randn(num_pages, PAGE, HKV, D, device=DEV, dtype=DT, generator=gen).to(KV_DT)
    perm = (torch.randperm(num_pages - 1, device=DEV, generator=gen) + 1).to(torch.int32)
    page_table = torch.zeros(len(lens), max(pages), dtype=torch.int32, device=DEV)
    taken = 0
    for i, n in enumerate(pages):
        page_table[i, :n] = perm[taken : taken + n]
        taken += n
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(len(lens), hq, D, device=DEV, dtype=DT, generator=gen)
    return q, k_cache, v_cache, page_table, seq_lens


def time_decode(
    lens: list[int],
    gen: torch.Generator,
    num_splits: int | None = None,
    hq: int = HQ,
    window: int = 0,
    graph_len: int = 4096,
) -> tuple[float, float, int]:
    """(graph ms, eager do_bench ms, splits). The graph rotates over enough KV copies that
    together they exceed 4x the L2, so each call reads its KV from memory. `window` > 0: a
    sliding-window layer's decode (only the last `window` positions are read)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    copies = min(8, max(1, -(-4 * l2 // decode_bytes(lens, window))))
    cases = [decode_case(lens, gen, hq) for _ in range(copies)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # as the engine's decode graphs choose it (their max_seq_len: the engine's max_model_len)
    read = min(graph_len, window) if window else graph_len
    splits = num_splits or tk.choose_num_splits(len(lens), HKV, read, sms, 32)
    ws = torch.empty(tk.workspace_numel(len(lens), hq, D, splits), device=DEV, dtype=torch.float32)
    out = torch.empty_like(cases[0][0])

    def call(case):
        q, kc, vc, pt, sl = case
        return lambda: tk.paged_decode(q, kc, vc, pt, sl, D**-0.5, splits, ws, out, window=window)

    calls = [call(c) for c in cases] * max(1, 8 // copies)
    g_ms = graph_ms(calls)
    e_ms = bench(calls[0])
    cases = ws = out = calls = None  # free the copies before the next measurement
    return g_ms, e_ms, splits


def decode_bytes(lens: list[int], window: int = 0) -> int:
    return sum(min(n, window) if window else n for n in lens) * HKV * D * 2 * KV_DT.itemsize


def extend_case(num_reqs: int, prefix: int, new: int, gen: torch.Generator):
    pages_per_req = triton.cdiv(prefix + new, PAGE)
    num_pages = 1 + num_reqs * pages_per_req
    kc = torch.randn(num_pages, PAGE, HKV, D, device=DEV, dtype=DT, generator=gen)
    vc = torch.randn(num_pages, PAGE, HKV, D, device=DEV, dtype=DT, generator=gen)
    perm = torch.randperm(num_pages - 1, device=DEV, generator=gen) + 1
    pt = perm.view(num_reqs, pages_per_req).to(torch.int32)
    total = num_reqs * new
    q = torch.randn(total, HQ, D, device=DEV, dtype=DT, generator=gen)
    k = torch.randn(total, HKV, D, device=DEV, dtype=DT, generator=gen)
    v = torch.randn(total, HKV, D, device=DEV, dtype=DT, generator=gen)
    cu = torch.arange(0, total + 1, new, dtype=torch.int32, device=DEV)
    prefix_lens = torch.full((num_reqs,), prefix, dtype=torch.int32, device=DEV)
    return q, k, v, kc, vc, cu, prefix_lens, pt


def extend_flops(num_reqs: int, prefix: int, new: int) -> float:
    pairs = new * prefix + new * (new + 1) / 2  # (query, key) pairs a causal kernel must do
    return 4.0 * D * HQ * pairs * num_reqs


def time_extend_triton(num_reqs: int, prefix: int, new: int, gen) -> float:
    q, k, v, kc, vc, cu, pl, pt = extend_case(num_reqs, prefix, new, gen)
    out = torch.empty_like(q)
    return bench(lambda: tk.paged_extend(q, k, v, kc, vc, cu, pl, pt, new, D**-0.5, out))


def time_fa2(num_reqs: int, prefix: int, new: int, gen) -> float:
    total_q, total_k = num_reqs * new, num_reqs * (prefix + new)
    q = torch.randn(total_q, HQ, D, device=DEV, dtype=DT, generator=gen)
    k = torch.randn(total_k, HKV, D, device=DEV, dtype=DT, generator=gen)
    v = torch.randn(total_k, HKV, D, device=DEV, dtype=DT, generator=gen)
    cu_q = torch.arange(0, total_q + 1, new, dtype=torch.int32, device=DEV)
    cu_k = torch.arange(0, total_k + 1, prefix + new, dtype=torch.int32, device=DEV)
    fa = torch.ops.aten._flash_attention_forward
    return bench(lambda: fa(q, k, v, cu_q, cu_k, new, prefix + new, 0.0, True, False, scale=D**-0.5))


def check_extend_matches_fa2(gen) -> float:
    """Relative difference of the Triton extend kernel and FA2 on one no-prefix batch."""
    q, k, v, kc, vc, cu, pl, pt = extend_case(2, 0, 1000, gen)
    out = torch.empty_like(q)
    tk.paged_extend(q, k, v, kc, vc, cu, pl, pt, 1000, D**-0.5, out)
    ref = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, 1000, 1000, 0.0, True, False, scale=D**-0.5)[0]
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def sweep(gen, ceiling: float) -> None:
    print("## decode split sweep, CUDA-graph timing (% of copy)", flush=True)
    for b, c in [(8, 1024), (8, 2048), (8, 4096), (16, 2048), (32, 2048), (64, 1024)]:
        res = []
        for s in (1, 2, 4, 6, 8, 12, 16):
            ms, _, _ = time_decode([c] * b, gen, s)
            res.append(f"s{s}:{decode_bytes([c] * b) / ms / 1e9 / ceiling * 100:.0f}%")
        print(f"decode splits b{b} c{c}: " + " ".join(res), flush=True)
        torch.cuda.empty_cache()


def wide_sweep(gen, ceiling: float, configs: list[tuple[int, int, int]], batch: int, context: int) -> None:
    """head_dim 256 (gemma-3-12b: 16 query heads over 8 kv heads) at `batch` x `context`: a
    full layer and a 1,024-token sliding one, for launch configs (BLOCK_N before the kernel
    halves it for 512-byte rows, warps, stages) and split counts (0: the engine's choice)."""
    global HQ, D
    HQ, D = 16, 256
    wide = (tk.WIDE_DECODE_CONFIG, tk.WIDE_WINDOW_DECODE_CONFIG)
    base = [dict(c) for c in wide]
    max_splits, tk.WIDE_MAX_SPLITS = tk.WIDE_MAX_SPLITS, 32  # the configs under test at every split count swept
    for block_n, warps, stages in configs:
        for c in wide:  # the config under test for both kinds of layer
            c.update(BLOCK_N=block_n, num_warps=warps, num_stages=stages)
        for window in (0, 1024):
            res = []
            for splits in (0, 4, 8, 12, 16, 24, 32):
                try:
                    ms, _, used = time_decode([context] * batch, gen, splits or None, HQ, window, context + 512)
                except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is reported
                    res.append(f"s{splits}: {type(exc).__name__}")
                    break
                pct = decode_bytes([context] * batch, window) / ms / 1e9 / ceiling * 100
                res.append(f"s{used}{'*' if not splits else ''}:{ms * 1e3:.1f}us/{pct:.0f}%")
                torch.cuda.empty_cache()
            print(
                f"wide d256 b{batch} c{context} w{window} cfg {block_n},{warps},{stages}: " + " ".join(res), flush=True
            )
    for c, b in zip(wide, base):
        c.update(b)
    tk.WIDE_MAX_SPLITS = max_splits


def workload_batches(every: int = 100) -> list[list[int]]:
    """Decode batches of the offline workload (benchmarks/offline_throughput.py: 256 requests,
    prompts and outputs of 100..1024 tokens) every `every` steps: the context lengths of the
    requests still running, as the engine decodes them all at once."""
    rng = random.Random(0)
    prompts = [rng.randint(100, 1024) for _ in range(256)]
    outputs = [rng.randint(100, 1024) for _ in range(256)]
    return [[p + step + 1 for p, o in zip(prompts, outputs) if o > step] for step in range(0, 1024, every)]


def ragged_sweep(gen, ceiling: float, hq: int, configs: list[tuple[int, int, int]] | None = None) -> None:
    """Launch configs on the offline workload's ragged decode batches: the sum of one layer's
    decode attention time over steps 0, 100, ..., 1000, and the same batches with the
    requests ordered longest first (do long programs finishing last cost time?)."""

    def total(batches: list[list[int]], label: str) -> float:
        per_step = [time_decode(lens, gen, None, hq)[0] for lens in batches]
        ms, nbytes = sum(per_step), sum(decode_bytes(lens) for lens in batches)
        steps = " ".join(f"{len(lens)}:{t * 1e3:.0f}" for lens, t in zip(batches, per_step))
        print(
            f"ragged hq {hq} {label}: {ms * 1e3:.0f} us summed, {nbytes / ms / 1e9:.2f} TB/s "
            f"({nbytes / ms / 1e9 / ceiling:.1%} of copy); per step (batch:us) {steps}",
            flush=True,
        )
        torch.cuda.empty_cache()
        return ms

    batches = workload_batches()
    if KV_DT.itemsize == 1:
        print("fp8 caches: the kernel runs blocks of twice the BLOCK_N below (_decode_block_n)", flush=True)
    total(batches, f"config {tk.DECODE_CONFIG}")
    total([sorted(lens, reverse=True) for lens in batches], "requests sorted by length, longest first")
    base = dict(tk.DECODE_CONFIG)
    if not configs and KV_DT.itemsize == 1:  # BLOCK_N is doubled for fp8 caches: these are 64-256 token blocks
        configs = [(64, 8, 3), (64, 8, 4), (128, 8, 3), (32, 4, 3), (64, 4, 4), (64, 4, 2), (32, 8, 3)]
    elif not configs:
        configs = [(128, 4, 2), (128, 4, 3), (64, 4, 4), (128, 4, 4), (256, 4, 2)]
    for block_n, warps, stages in configs:
        tk.DECODE_CONFIG.update(BLOCK_N=block_n, num_warps=warps, num_stages=stages)
        try:
            total(batches, f"config {tk.DECODE_CONFIG}")
        except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is reported
            print(f"ragged config {tk.DECODE_CONFIG} failed: {type(exc).__name__}: {exc}"[:300], flush=True)
    tk.DECODE_CONFIG.clear()
    tk.DECODE_CONFIG.update(base)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--ragged", action="store_true", help="only the ragged-batch config sweep")
    parser.add_argument("--hq", type=int, default=16, help="query heads for --ragged (16: qwen3-0.6b)")
    parser.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16", help="decode caches' dtype")
    parser.add_argument(
        "--configs", nargs="*", default=None, help="--ragged: BLOCK_N,warps,stages triples to time (default: a set)"
    )
    parser.add_argument(
        "--wide", action="store_true", help="only the head_dim-256 sweep (gemma-3-12b, 8 x 16k; --configs as --ragged)"
    )
    args = parser.parse_args()
    global KV_DT
    KV_DT = torch.float8_e4m3fn if args.kv_dtype == "fp8" else torch.bfloat16
    name = torch.cuda.get_device_name(0)
    print(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    ceiling = copy_ceiling()
    print(f"copy ceiling: {ceiling:.2f} TB/s", flush=True)
    if args.ragged:
        configs = [tuple(int(v) for v in c.split(",")) for c in args.configs] if args.configs else None
        ragged_sweep(gen, ceiling, args.hq, configs)
        return
    if args.wide:
        configs = [tuple(int(v) for v in c.split(",")) for c in args.configs] if args.configs else None
        configs = configs or [(64, 4, 3), (64, 8, 2), (64, 4, 2), (64, 8, 3), (32, 4, 3), (128, 8, 2), (64, 4, 4)]
        wide_sweep(gen, ceiling, configs, 8, 16389)
        return
    if args.sweep:
        sweep(gen, ceiling)

    rows = [f"Device: {name}; copy ceiling {ceiling:.2f} TB/s (1 GiB D2D copy, read+write)", ""]
    rows += ["| decode batch | ctx | splits | graph us | KV TB/s | % of copy | target | eager us (do_bench) |"]
    rows += ["|---|---|---|---|---|---|---|---|"]
    for batch in (8, 64, 128, 256):
        for ctx in (1024, 2048, 4096, 8192):
            ms, eager_ms, splits = time_decode([ctx] * batch, gen)
            tbs = decode_bytes([ctx] * batch) / ms / 1e9
            pct = tbs / ceiling * 100
            target = 75 if batch >= 64 else (60 if ctx == 2048 else None)
            verdict = "-" if target is None else (f">= {target}%: " + ("met" if pct >= target else "MISSED"))
            rows.append(
                f"| {batch} | {ctx} | {splits} | {ms * 1e3:.1f} | {tbs:.2f} | {pct:.0f}% | {verdict} "
                f"| {eager_ms * 1e3:.1f} |"
            )
            print(rows[-1], flush=True)
            torch.cuda.empty_cache()

    diff = check_extend_matches_fa2(gen)
    print(f"extend vs FA2 relative difference: {diff:.2e}", flush=True)
    rows += ["", "| extend (bf16, 32/8 heads, d128) | Triton TFLOP/s | FA2 TFLOP/s | Triton / FA2 |"]
    rows += ["|---|---|---|---|"]
    for num_reqs, prefix, new in ((4, 0, 2048), (4, 2048, 512)):
        flops = extend_flops(num_reqs, prefix, new)
        t_tr = flops / time_extend_triton(num_reqs, prefix, new, gen) / 1e9
        t_fa = flops / time_fa2(num_reqs, prefix, new, gen) / 1e9
        label = f"{num_reqs} x {new} new" + (f" + {prefix} prefix" if prefix else ", no prefix")
        note = " (target >= 60%: " + ("met" if t_tr >= 0.6 * t_fa else "MISSED") + ")" if prefix == 0 else ""
        fa_label = f"{t_fa:.0f}" + (" (contiguous KV)" if prefix else "")
        rows.append(f"| {label} | {t_tr:.0f} | {fa_label} | {t_tr / t_fa * 100:.0f}%{note} |")
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()

    table = "\n".join(rows)
    print("\n" + table)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "attention.md"), "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
