"""Long contexts on a model with sliding-window layers: a batch of requests with long prompts
decoding together, its decode step against the floor (weight bytes plus the K/V the step must
read: every token for full layers, the window for sliding ones, over the device-to-device
copy bandwidth), and the KV capacity with window groups (the prefix cache off, pages out of
the window given back; nanoserve.kvcache.window) against the same memory with every layer
keeping every token.

    python benchmarks/long_context.py [--model gemma-3-12b] [--batch 8] [--context 16384] [--keep-pages] [--profile]

Capacity is counted in requests of `--context` tokens that fit at once, times that length, from
the pages each request of the batch holds while decoding (with window groups: its full
layers' pages for every token, each window group's for its window), measured in the run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import copy_bandwidth, device_name, step_weight_bytes

from nanoserve import LLM, SamplingParams

DECODE_STEPS = 64


def kv_read_bytes(cfg, context: int, kv_bytes_per_layer_token: int) -> int:
    """K/V bytes one decode step of a request at `context` reads: every token of a full
    layer, the window of a sliding one."""
    total = 0
    for i in range(cfg.num_layers):
        if cfg.is_linear_layer(i):
            continue
        window = cfg.window_of(i)
        total += (min(window, context) if window else context) * kv_bytes_per_layer_token
    return total


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma-3-12b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument(
        "--keep-pages", action="store_true", help="sliding layers keep every page (NANOSERVE_WINDOW_PAGES=0)"
    )
    ap.add_argument("--profile", action="store_true", help="print the kernels of 8 more decode steps by GPU time")
    args = ap.parse_args()
    if args.keep_pages:
        os.environ["NANOSERVE_WINDOW_PAGES"] = "0"
    llm = LLM(
        args.model,
        load_format="dummy",
        dtype="bfloat16",
        enable_prefix_caching=False,  # every prompt computed (the prompts differ anyway)
        max_model_len=args.context + 1024,
        max_num_seqs=max(args.batch, 8),
    )
    engine = llm.engine
    cfg = engine.model_config
    device = engine.device
    stats = llm.stats()
    ps = stats["page_size"]
    layout = engine.runner.kv_cache.layout
    print(
        f"{args.model} on {device_name(device)}: {stats['kv_pages_total']} pages of {ps} tokens x "
        f"{layout.num_tensors} layers, window groups {layout.num_window_groups}"
    )
    prompts = [[(7 * i + 13 * r + 1) % 5000 + 10 for i in range(args.context)] for r in range(args.batch)]
    # Long enough that the first requests still decode when the last prompt is in (then aborted).
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    for r, prompt in enumerate(prompts):
        engine.add_request(f"r{r}", prompt, params)
    sched = engine.scheduler
    started = time.perf_counter()
    while sched.waiting or len(sched.running) < args.batch:
        engine.step()
    prefill_s = time.perf_counter() - started
    for _ in range(4):  # the first decode steps of the whole batch (graphs warm)
        engine.step()
    assert len(sched.running) == args.batch and not sched.waiting, "the batch must decode whole"
    context = min(len(r.token_ids) for r in sched.running)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(DECODE_STEPS):
        engine.step()
    torch.cuda.synchronize(device)
    step_ms = (time.perf_counter() - started) * 1e3 / DECODE_STEPS
    # Capacity from what the decoding requests hold now (pages only the prefix cache holds aside).
    now = llm.stats()
    held = (now["kv_pages_total"] - now["kv_pages_free"] - now["kv_pages_cached"]) / args.batch
    fit = int(now["kv_pages_total"] // held)
    fit_full = now["kv_tokens_full_layout"] // args.context
    if args.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(8):
                engine.step()
            torch.cuda.synchronize(device)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70))
    for r in range(args.batch):
        engine.abort_request(f"r{r}")
    while engine.has_unfinished_requests():
        engine.step()
    kv_token_bytes = 2 * cfg.num_kv_heads * cfg.head_dim * engine.kv_dtype.itemsize
    kv_bytes = args.batch * kv_read_bytes(cfg, context + DECODE_STEPS // 2, kv_token_bytes)
    weights = step_weight_bytes(engine.runner.model, args.batch)
    bandwidth = copy_bandwidth(device)
    floor_ms = (weights + kv_bytes) / bandwidth * 1e3
    after = llm.stats()
    print(
        f"prefill of {args.batch} x {args.context} tokens {prefill_s:.1f} s; decode step at batch {args.batch}, "
        f"contexts {context}+ "
        f"{step_ms:.3f} ms, floor {floor_ms:.3f} ms (weights {weights / 2**30:.2f} GiB + KV read "
        f"{kv_bytes / 2**30:.2f} GiB at {bandwidth / 2**30:.0f} GiB/s): {floor_ms / step_ms:.1%} of the floor; "
        f"window pages given back {after['kv_window_pages_freed']}, pages free after {after['kv_pages_free']} "
        f"of {after['kv_pages_total']}"
    )
    print(
        f"KV capacity: a request decoding at {args.context} tokens holds {held:.0f} pages; {fit} such requests "
        f"fit ({fit * args.context} tokens) against {fit_full} ({fit_full * args.context}) with every layer "
        f"keeping every token: {fit / max(fit_full, 1):.2f}x"
    )


if __name__ == "__main__":
    main()
