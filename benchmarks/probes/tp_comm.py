"""What tensor parallelism's communication costs on this machine's GPUs (issue 7).

    python benchmarks/probes/tp_comm.py [--ranks 2] [--hidden 4096]

One process per GPU, joined as the engine's ranks are (nanoserve.distributed.process_group:
NCCL default group, gloo control group). It prints what one decode step pays, to decide
how the step is sent and how the row-parallel sums are reduced:
- the step's control message over gloo (what `TPModelRunner` sends), against the same ints
  sent over NCCL and read on the worker's host (a device sync: the alternative design);
- the step's NCCL payload broadcast (decode batch of 1 and of 256);
- one all-reduce of [batch, hidden] inside a CUDA graph (64 per graph, as one llama-8b
  step has), bf16 against fp32, and the eager all-reduce (host launch cost included);
- the row-parallel matmul of llama-3.1-8b at TP=2 with a bf16 output (`linear`) against
  an fp32 output (`linear(..., fp32_out=True)`, what TP > 1 uses) plus its rounding to bf16;
- the fused all-reduce + residual add + RMSNorm over symmetric memory that the decode graphs
  use (nanoserve.distributed.symm_all_reduce; NVLink multicast stays off) against NCCL's
  all-reduce followed by rms_norm, in a CUDA graph; results are checked against each other.
`--nccl-env NCCL_PROTO=LL,...` sets NCCL variables first, to compare its protocol choices.

These are each operation alone, back to back in a graph; inside a decode step the same
collectives cost differently (2 x H200: an NCCL fp32 all-reduce of one row took 6.3 us in
the step against 23 us here). benchmarks/probes/tp_profile.py measures them in the step.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the repository, and benchmarks/ for shared helpers

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEP_REPS = 300
GRAPH_OPS = 64  # all-reduces per captured graph: two per layer of a 32-layer model
BATCHES = (1, 8, 64, 256)


def _per_iter_us(fn, reps: int, device) -> float:
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / reps * 1e6


def _graph_us(graph: torch.cuda.CUDAGraph, ops: int, device, reps: int = 20) -> float:
    """Microseconds per op of a graph of `ops` ops, replayed `reps` times (median of 3)."""
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (reps * ops))
    return sorted(times)[1]


def _captured_us(fn, device) -> float:
    """Microseconds per call of fn, GRAPH_OPS calls captured back to back in one graph."""
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_OPS):
            fn()
    return _graph_us(graph, GRAPH_OPS, device)


def rank_main(rank: int, world: int, addr: str, hidden: int) -> None:
    from nanoserve.distributed.process_group import init_distributed
    from nanoserve.distributed.tp_runner import control_len

    device = torch.device(f"cuda:{rank}")
    ctx = init_distributed(rank, world, rank, addr, device, timeout_s=120)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(
        f"{world} ranks, {torch.cuda.get_device_name(device)}, torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}"
    )

    # ---- the step's control message ------------------------------------------------------
    n = control_len(256)
    msg = torch.zeros(n, dtype=torch.long)

    def gloo_control():
        if rank == 0:
            ctx.wait(dist.broadcast(msg, 0, group=ctx.control, async_op=True))
        else:
            dist.broadcast(msg, 0, group=ctx.control)
            msg[:12].tolist()

    dev_msg = torch.zeros(n, dtype=torch.long, device=device)
    values = list(range(n))

    def nccl_control():
        if rank == 0:
            dist.broadcast(torch.tensor(values).to(device, non_blocking=True), 0)
        else:
            dist.broadcast(dev_msg, 0)
            dev_msg[:12].tolist()  # the worker must read it on the host: a device sync

    for name, fn in (("gloo control message", gloo_control), ("NCCL control message + host read", nccl_control)):
        fn()
        us = _per_iter_us(fn, STEP_REPS, device)
        say(f"{name} ({n} ints): {us:.1f} us per step (rank 0)")

    # ---- the step's payload --------------------------------------------------------------
    for bs, width in ((1, 16), (256, 128)):
        payload = torch.zeros(6 * bs + 3 * bs + 1 + bs * width, dtype=torch.int32, device=device)
        us = _per_iter_us(lambda p=payload: dist.broadcast(p, 0), STEP_REPS, device)
        say(f"NCCL payload broadcast, decode batch {bs} ({payload.numel()} int32): {us:.1f} us per step")

    # ---- all-reduce in a CUDA graph, bf16 vs fp32 -------------------------------------------
    for bs in BATCHES:
        row = []
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.zeros(bs, hidden, dtype=dtype, device=device)
            dist.all_reduce(x)
            row.append(_captured_us(lambda x=x: dist.all_reduce(x), device))
        say(f"all-reduce in a graph, [{bs}, {hidden}]: bf16 {row[0]:.1f} us, fp32 {row[1]:.1f} us")
    x = torch.zeros(1, hidden, dtype=torch.bfloat16, device=device)
    us = _per_iter_us(lambda: dist.all_reduce(x), STEP_REPS, device)
    say(f"all-reduce eager, [1, {hidden}] bf16: {us:.1f} us per call (host launch included)")

    # ---- row-parallel matmul output dtype (rank 0 only) ---------------------------------------
    dist.barrier()
    if rank == 0:
        _matmuls(device, hidden)
    dist.barrier()
    _symm_mem_all_reduce(ctx, device, hidden, say)
    dist.barrier()
    dist.destroy_process_group()


def _symm_mem_all_reduce(ctx, device, hidden: int, say) -> None:
    """The engine's decode-sum path (nanoserve.distributed.symm_all_reduce: every rank's
    partials read over NVLink, summed, added to the residual and normalised in one kernel,
    no multicast) against what it replaces, NCCL's all-reduce then `rms_norm`, both inside a
    CUDA graph of GRAPH_OPS chained calls (slots alternating, as o_proj and down_proj do).
    The partials are rewritten before each call, as the matmul would. Results are checked
    against each other."""
    from nanoserve.distributed import TPGroup
    from nanoserve.distributed.symm_all_reduce import setup_symm_all_reduce
    from nanoserve.kernels.norm import rms_norm
    from nanoserve.switches import KernelSwitches

    symm = setup_symm_all_reduce(ctx, single_host=True, switches=KernelSwitches.from_env())
    if symm is None:
        say("symmetric-memory all-reduce: not set up (see the log above)")
        return
    tp = TPGroup(ctx.rank, ctx.world_size, symm)
    weight = torch.ones(hidden, dtype=torch.bfloat16, device=device)
    for bs in BATCHES:
        src = torch.randn(bs, hidden, device=device).bfloat16()
        residual = torch.randn(bs, hidden, device=device).bfloat16()

        def nccl_then_norm(res=residual, src=src):
            x = src.clone()
            dist.all_reduce(x)
            return rms_norm(x, weight, 1e-5, res)

        def fused(res=residual, src=src, bs=bs, slot=[0]):  # noqa: B006 - the slot alternates across calls
            part = symm._own_region(slot[0], bs, hidden, torch.bfloat16)
            slot[0] ^= 1
            part.copy_(src)
            return tp.reduce_rms_norm(part, res, weight, 1e-5)

        want, got = nccl_then_norm(), fused()
        if not (torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])):
            raise RuntimeError(f"fused all-reduce + RMSNorm of [{bs}, {hidden}] differs from NCCL + rms_norm")
        copy_us = _captured_us(lambda src=src: src.clone(), device)
        row = [_captured_us(fn, device) for fn in (nccl_then_norm, fused)]
        say(
            f"[{bs}, {hidden}] bf16 in a graph: NCCL all-reduce + rms_norm {row[0]:.1f} us, fused over "
            f"symmetric memory {row[1]:.1f} us (each with a {copy_us:.1f} us copy of the partials; results equal)"
        )


def _matmuls(device, hidden: int) -> None:
    from nanoserve.models.layers import linear

    def linear_fp32(x, w):
        return linear(x, w, fp32_out=True)

    for name, k in (("o_proj", hidden // 2), ("down_proj", 14336 // 2)):
        copies = max(2, (256 << 20) // (hidden * k * 2))  # weights streamed from memory, not L2
        weights = [torch.randn(hidden, k, device=device, dtype=torch.bfloat16) / 64 for _ in range(copies)]
        for bs in BATCHES:
            x = torch.randn(bs, k, device=device, dtype=torch.bfloat16)
            row = []
            for fn in (linear, linear_fp32, lambda x, w: linear_fp32(x, w).bfloat16()):
                for w in weights[:2]:
                    fn(x, w)  # warm-up: Triton JIT, cuBLAS handles
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for w in weights:
                        fn(x, w)
                row.append(_graph_us(graph, len(weights), device))
            print(
                f"{name} [{bs}, {k}] x [{hidden}, {k}]^T: bf16 out {row[0]:.1f} us, fp32 out {row[1]:.1f} us, "
                f"fp32 out + round {row[2]:.1f} us"
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--nccl-env", default="", help="KEY=VALUE,... set before NCCL starts (e.g. NCCL_PROTO=LL)")
    args = ap.parse_args()
    for item in filter(None, args.nccl_env.split(",")):
        key, _, value = item.partition("=")
        os.environ[key] = value
    from nanoserve.distributed.process_group import free_port

    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    mp.spawn(rank_main, args=(args.ranks, f"127.0.0.1:{free_port()}", args.hidden), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
