"""Cascade decode attention against plain decode (run on a GPU machine).

    python benchmarks/probes/cascade_decode.py [--sweep]

One layer's decode attention for a batch whose requests share prefixes in groups (the
prefix cache's pages, the same page ids in every member's table), bf16, page_size 16,
qwen3-0.6b's heads (16 query heads over 8 kv heads, head_dim 128) and llama-3.1-8b's (32
over 8). For each case: plain decode time (every request reads its whole KV), cascade time
(each group's prefix read once, nanoserve.attention.cascade), both as the engine runs them
(the cascade plan built on the host beforehand, as `ModelRunner.prepare` does), the host
time of the plan, the relative difference of the outputs, and the bytes each must read
over its time. `--sweep` also times the prefix kernel's launch configs on the first case.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the repository, and benchmarks/ for shared helpers

import argparse
import itertools
import time

import numpy as np
import torch
from triton.testing import do_bench

from nanoserve.attention.base import CascadeInputs
from nanoserve.attention.cascade import MAX_CASCADE_PARTS, max_cascade_items, plan_cascade
from nanoserve.kernels import attention as tk

DEV, PAGE, D, HKV = "cuda", 16, 128, 8
# (batch, groups, shared prefix tokens, own tokens per request)
CASES = [(256, 16, 2048, 192), (256, 32, 2048, 128), (256, 1, 4096, 256), (256, 64, 512, 64), (64, 4, 2048, 128)]


def build(batch, groups, shared, own, hq, gen):
    shared_pages, own_pages = shared // PAGE, -(-own // PAGE)
    num_pages = 1 + groups * shared_pages + batch * own_pages
    kc = torch.randn(num_pages, PAGE, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(num_pages, PAGE, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    perm = np.random.default_rng(0).permutation(num_pages - 1) + 1
    table = np.zeros((batch, shared_pages + own_pages), dtype=np.int32)
    group_pages = perm[: groups * shared_pages].reshape(groups, shared_pages)
    own_ids = perm[groups * shared_pages :].reshape(batch, own_pages)
    for b in range(batch):
        table[b, :shared_pages] = group_pages[b % groups]
        table[b, shared_pages:] = own_ids[b]
    seq = np.full(batch, shared + own, dtype=np.int64)
    q = torch.randn(batch, hq, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    return q, kc, vc, table, seq


def plan_inputs(table, seq, hq, sms):
    group = hq // HKV
    start = time.perf_counter()
    plan = plan_cascade(table, seq, PAGE, tk.cascade_max_members(group), max_cascade_items(len(seq)), 4 * sms // HKV)
    host_us = (time.perf_counter() - start) * 1e6
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(DEV)
    return CascadeInputs(t(plan.prefix_len), t(plan.num_parts), t(plan.members), t(plan.items)), plan, host_us


def run_case(case, hq, gen, sms, ceiling):
    batch, groups, shared, own = case
    q, kc, vc, table, seq = build(batch, groups, shared, own, hq, gen)
    pt, sl = torch.from_numpy(table).to(DEV), torch.from_numpy(seq.astype(np.int32)).to(DEV)
    cascade, plan, host_us = plan_inputs(table, seq, hq, sms)
    splits = tk.choose_num_splits(batch, HKV, shared + own, sms, 32)
    ws = torch.empty(tk.workspace_numel(batch, hq, D, splits + MAX_CASCADE_PARTS), device=DEV)
    out_p, out_c = torch.empty_like(q), torch.empty_like(q)
    plain = lambda: tk.paged_decode(q, kc, vc, pt, sl, D**-0.5, splits, ws, out_p)
    casc = lambda: tk.paged_decode(q, kc, vc, pt, sl, D**-0.5, splits, ws, out_c, cascade)
    plain(), casc()
    diff = ((out_c.float() - out_p.float()).norm() / out_p.float().norm()).item()
    ms_p, ms_c = do_bench(plain, return_mode="median"), do_bench(casc, return_mode="median")
    per_token = HKV * D * 2 * 2
    bytes_p = batch * (shared + own) * per_token
    bytes_c = (plan.num_groups * shared + batch * own) * per_token
    print(
        f"hq {hq} batch {batch} groups {groups} ({plan.num_groups} items groups, {int((plan.items[:, 1] > 0).sum())} "
        f"items) shared {shared} own {own}: plain {ms_p * 1e3:.1f} us ({bytes_p / ms_p / 1e9:.2f} TB/s), "
        f"cascade {ms_c * 1e3:.1f} us ({bytes_c / ms_c / 1e9:.2f} TB/s of its bytes, "
        f"{bytes_c / ms_c / 1e9 / ceiling:.0%} of copy), speedup {ms_p / ms_c:.2f}x, plan {host_us:.0f} us host, "
        f"rel diff {diff:.1e}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    src = torch.empty(2**28, dtype=torch.float32, device=DEV)
    dst = torch.empty_like(src)
    ceiling = 2 * src.numel() * 4 / do_bench(lambda: dst.copy_(src), return_mode="median") / 1e9
    print(f"device {torch.cuda.get_device_name(0)}, copy {ceiling:.2f} TB/s", flush=True)
    src = dst = None
    for hq in (16, 32):
        for case in CASES:
            run_case(case, hq, gen, sms, ceiling)
            torch.cuda.empty_cache()
    if args.sweep:  # the prefix kernel's launch config on the first case (the plan follows BLOCK_M)
        base = dict(tk.CASCADE_CONFIG)
        for hq in (16, 32):
            for bm, bn, warps, stages in itertools.product((32, 64, 128), (32, 64), (4, 8), (2, 3)):
                tk.CASCADE_CONFIG.update(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
                print(f"sweep BLOCK_M {bm} BLOCK_N {bn} warps {warps} stages {stages}: ", end="")
                try:
                    run_case(CASES[0], hq, gen, sms, ceiling)
                except Exception as exc:  # noqa: BLE001 (out of shared memory and the like: report, go on)
                    print(f"failed: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
        tk.CASCADE_CONFIG.update(base)


if __name__ == "__main__":
    main()
