"""Tensor parallelism at run time: rank processes, the step broadcast, failure and shutdown.

Process layout (N = tensor_parallel_size, L = N / nnodes ranks per host):
- rank 0 lives in the engine's process (the `LLM`'s, or the server's engine process). It
  spawns ranks 1..L-1 (multiprocessing, spawn context) before it loads anything, so every
  rank loads its shard at the same time; on hosts 1..nnodes-1, `run_worker_node` (the same
  command with `--node-rank k`) spawns that host's ranks. All join torch.distributed at
  `dist_init_addr` (default: a free port on 127.0.0.1).
- Every rank builds the same `LLMEngine` (worker ranks are marked by `_WORKER`; the engine
  hands `init_tensor_parallel` the function a worker runs, so this module never imports the
  engine, and both meet only in nanoserve/step.py's types), so the
  model shard (`TPGroup(rank, N)`: each layer's weight_loader keeps its slice), the KV plan
  and the runner are built by one code path. Each rank plans its KV capacity from its own
  memory; `agree_kv_plan` gathers the page counts, every rank takes the minimum, and
  unequal counts are logged as unbalanced ranks.
- Only rank 0 schedules and samples. Each step it broadcasts the step's `ForwardInputs`
  (token ids, positions, attention metadata, logit rows) plus the KV page copies the
  scheduler made since the last step (forks of n > 1 requests); every rank then runs the
  same forward, whose collectives shard the work. The LM head gathers full logits on
  every rank; rank 0 samples, the others drop them.
- All-reduces: NCCL (gloo on CPU), except the row-parallel and embedding sums captured in
  decode CUDA graphs on one host's GPUs, which are fused with the RMSNorm after them over symmetric
  memory (set up here right after the rendezvous, identically on every rank:
  nanoserve.distributed.symm_all_reduce; NANOSERVE_SYMM_MEM=0 turns it off).
- CUDA graphs: every rank captures the same decode graphs in the same order while the
  engine starts (`ModelRunner.setup_cuda_graphs`, run by every rank's `LLMEngine`), so each
  captured collective has its peers; a step names the graph to replay (`graph_bs`) and
  every rank replays that one. Rank 0's overlap loop needs nothing more: it launches step
  N+1 (broadcast included) before it processes step N, and the workers never wait on
  their GPU on the host, so they queue step N+1 while the GPUs still run step N.

Why broadcast rather than every rank running the same scheduler: the schedule depends on
state that only rank 0 sees or can see consistently: request arrival order and timing
(the server's socket), aborts from disconnecting clients and stop strings found by the
detokenizer, the sampled tokens themselves (which decide when requests finish), and the
prefix cache's contents. Replicating all of that would need the same broadcast of events
plus a lock-step guarantee that two schedulers never diverge; a divergence would corrupt
the KV cache silently. Broadcasting the scheduler's output makes worker ranks stateless
executors at the cost of two messages per step:
- a control message on the CPU gloo group, fixed length (`control_len`): a `StepHeader`
  then the batch's host-side per-request lengths (the ints `AttentionMetadata` keeps on the
  host). The worker reads every size it needs from it without touching its GPU, so it
  never syncs with its device. (The header cannot ride in the NCCL payload: reading it
  would make the worker wait for its GPU every step, and the worker could no longer run
  ahead of it.) KV page copies, rare, go in COPY_PAGES control messages before the step;
- one payload on the model's group (NCCL on CUDA): every device tensor of the step packed
  into one int32 tensor (`pack_step`; int64 tensors travel as pairs of int32 and are
  viewed back, no conversion), which workers unpack into views (`unpack_step`). A decode
  step that replays a CUDA graph is already packed in rank 0's graph static buffer: those
  bytes travel as they are, straight into each worker's static buffer (header `in_place`),
  so neither side packs or copies (copying the fields into place put seven small copies
  between the broadcast and each worker's graph).

Timeouts: the model's group has `dist_timeout_s`; rank 0 bounds its control-group sends
by the same; so a rank that dies (its sockets close: the next collective fails at once) or
hangs (the collective times out) makes rank 0's `execute` raise `TensorParallelError`
within `dist_timeout_s`, and the group is then dead: the local worker processes are killed
and every later call raises at once. Worker ranks die with their parent (PR_SET_PDEATHSIG)
and when rank 0's sockets close.

Shutdown: `TPModelRunner.shutdown()` (also `LLMEngine.shutdown()` / `LLM.shutdown()`, run
as well when the runner is garbage-collected and at interpreter exit) broadcasts a
shutdown header; then every rank drops its CUDA graphs. By default (tp_teardown "abort",
process_group.destroy_distributed) the workers abort their communicators, which is local, and exit; rank 0
joins them (killing any still alive after a grace period) and then aborts its own groups,
waiting at most ABORT_GRACE_S. With NANOSERVE_TP_TEARDOWN=destroy (KernelSwitches.tp_teardown) every rank destroys its
groups at the same time instead (NCCL's finalize may need the peers; rank 0 waits at most
the grace period): on 2 x H200 that took 20.2 s, the abort 1.2 s. After a failure rank 0
kills the workers first and then tears down alone. One tensor-parallel engine per process
at a time (a rank-0 teardown that outlived its wait leaves the groups to the process's exit).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from nanoserve.attention.base import AttentionMetadata
from nanoserve.distributed import SINGLE, TPGroup
from nanoserve.distributed.process_group import (
    DistContext,
    cpu_threads_per_rank,
    destroy_distributed,
    free_port,
    init_distributed,
)
from nanoserve.distributed.symm_all_reduce import setup_symm_all_reduce
from nanoserve.step import ForwardInputs, KVPlan

log = logging.getLogger("nanoserve")

EXECUTE, SHUTDOWN, COPY_PAGES = 1, 2, 3
SHUTDOWN_GRACE_S = 10.0
ABORT_GRACE_S = 2.0


class StepHeader(NamedTuple):
    """The fixed part of a control message (ints on the gloo control group)."""

    cmd: int
    tokens: int = 0  # T: rows of input_ids / positions / slot_mapping (graph padding included)
    rows: int = 0  # B: rows of seq_lens / prefix_lens / page_table (graph padding included)
    table_width: int = 0  # page-table columns
    logit_rows: int = -1  # R: rows projected to logits; -1: all (ForwardInputs.logit_rows None)
    is_decode: int = 0
    num_decode_rows: int = 0  # mixed batch: leading decode rows (AttentionMetadata.num_decode_rows)
    max_query_len: int = 0
    max_seq_len: int = 0
    num_reqs: int = 0  # ForwardInputs.num_reqs: real requests, padding excluded
    graph_bs: int = -1  # decode graph to replay; -1: eager
    piecewise: int = -1  # 1: the piecewise graphs run this batch, 0: eager, -1: the worker decides
    host_reqs: int = 0  # EXECUTE: length of the host lists after the header (seq, then prefix)
    in_place: int = 0  # EXECUTE: 1 if the payload is the decode graphs' packed static inputs
    count: int = 0  # COPY_PAGES: (src, dst) page pairs after the header


HEADER_LEN = len(StepHeader._fields)


def control_len(max_num_seqs: int) -> int:
    """Ints in every control message: the header, then room for two ints per request (a
    batch holds at most max_num_seqs requests; page copies are sent that many at a time)."""
    return HEADER_LEN + 2 * max_num_seqs


def pack_step(
    inputs: ForwardInputs, graph_bytes: torch.Tensor | None = None
) -> tuple[StepHeader, list[int], torch.Tensor]:
    """The header, the host ints and the device payload that describe `inputs`. With
    `graph_bytes` (the runner's `graph_step_bytes`: a decode step prepared in the graphs'
    static buffer) the payload is those bytes as they are, and the header says so."""
    meta = inputs.meta
    rows = inputs.logit_rows
    header = StepHeader(
        EXECUTE,
        tokens=inputs.input_ids.numel(),
        rows=meta.seq_lens.numel(),
        table_width=meta.page_table.shape[1],
        logit_rows=-1 if rows is None else rows.numel(),
        is_decode=int(meta.is_decode),
        num_decode_rows=meta.num_decode_rows,
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
        num_reqs=inputs.num_reqs,
        graph_bs=-1 if inputs.graph_bs is None else inputs.graph_bs,
        piecewise=-1 if inputs.piecewise is None else int(inputs.piecewise),
        host_reqs=len(meta.seq_lens_host),
        in_place=int(graph_bytes is not None),
    )
    host = [*meta.seq_lens_host, *meta.prefix_lens_host]
    if graph_bytes is not None:
        return header, host, graph_bytes
    # int64 parts first: each is an even number of int32s, so every int64 part starts
    # 8-byte aligned and the receiver can view it back as int64.
    longs = [inputs.input_ids, inputs.positions, meta.slot_mapping, *([] if rows is None else [rows])]
    ints = [meta.seq_lens, meta.prefix_lens, meta.cu_query_lens, meta.page_table]
    payload = torch.cat(
        [t.reshape(-1).to(torch.long).view(torch.int32) for t in longs] + [t.reshape(-1).to(torch.int32) for t in ints]
    )
    return header, host, payload


def payload_size(h: StepHeader) -> list[int]:
    """int32 lengths of the payload's parts, in `pack_step`'s order."""
    t, b = h.tokens, h.rows
    return [2 * t, 2 * t, 2 * t, 2 * max(h.logit_rows, 0), b, b, b + 1, b * h.table_width]


def unpack_step(h: StepHeader, host: list[int], payload: torch.Tensor) -> ForwardInputs:
    """`pack_step`'s inputs again, as views into `payload`."""
    ids, pos, slots, rows, seq, pre, cu, table = payload.split(payload_size(h))
    n = h.host_reqs
    meta = AttentionMetadata(
        is_decode=bool(h.is_decode),
        num_decode_rows=h.num_decode_rows,
        seq_lens=seq,
        prefix_lens=pre,
        cu_query_lens=cu,
        page_table=table.view(h.rows, h.table_width),
        slot_mapping=slots.view(torch.long),
        seq_lens_host=host[:n],
        prefix_lens_host=host[n : 2 * n],
        max_query_len=h.max_query_len,
        max_seq_len=h.max_seq_len,
    )
    return ForwardInputs(
        ids.view(torch.long),
        pos.view(torch.long),
        meta,
        None if h.logit_rows < 0 else rows.view(torch.long),
        None if h.graph_bs < 0 else h.graph_bs,
        h.num_reqs,
        piecewise=None if h.piecewise < 0 else bool(h.piecewise),
    )


def control_message(header: StepHeader, body: list[int], length: int) -> torch.Tensor:
    values = [*header, *body]
    if len(values) > length:
        raise ValueError(f"a tensor-parallel control message of {len(values)} ints exceeds its {length}")
    return torch.tensor(values + [0] * (length - len(values)), dtype=torch.long)


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or hung; the group cannot be used any more."""


_WORKER: tuple[int, str] | None = None  # (rank, init address) in a worker rank's process
_RUNTIME: _Runtime | None = None  # this process's tensor-parallel state


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    if os.getppid() != parent_pid:
        os._exit(1)


def rank_config(config, local_rank: int):
    """A worker rank's config: its own GPU on CUDA (base index + local rank)."""
    device = config.torch_device()
    if device.type != "cuda":
        return config
    return dataclasses.replace(config, device=f"cuda:{(device.index or 0) + local_rank}")


class _Runtime:
    """This process's ranks and groups; rank 0 also owns the local worker processes."""

    def __init__(self, ctx: DistContext, procs: list, config):
        self.ctx = ctx
        self.procs = procs  # [(rank, Process)] spawned by this process
        self.timeout_s = config.dist_timeout_s
        self.teardown = config.switches.tp_teardown
        self.control_len = control_len(config.max_num_seqs)
        self.failed: str | None = None
        self.closed = False
        self.announced = False  # rank 0 sent SHUTDOWN

    def dead_workers(self) -> list[str]:
        return [f"rank {r} (pid {p.pid}, exit code {p.exitcode})" for r, p in self.procs if p.exitcode is not None]

    def fail(self, what: str, exc: BaseException | None = None) -> TensorParallelError:
        dead = self.dead_workers()
        msg = f"tensor parallelism failed: {what}"
        if dead:
            msg += f"; dead worker ranks: {', '.join(dead)}"
        if exc is not None:
            msg += f" ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''})"
        msg += f". The group is unusable (collective timeout {self.timeout_s:g} s)."
        if self.failed is None:
            self.failed = msg
            log.error("%s", msg)
            self.kill_workers(grace_s=0.0)
        return TensorParallelError(msg)

    def kill_workers(self, grace_s: float) -> None:
        for _, p in self.procs:
            if grace_s > 0:
                p.join(grace_s)
            if p.exitcode is None:
                p.kill()
            p.join(5)

    @property
    def healthy(self) -> bool:
        return self.failed is None and not self.closed and not self.dead_workers()

    def announce_shutdown(self) -> bool:
        """Rank 0: tell the workers to stop (once). True if they were told."""
        if self.announced or self.ctx.rank != 0 or not self.healthy:
            return self.announced
        self.announced = True
        try:
            msg = control_message(StepHeader(SHUTDOWN), [], self.control_len)
            work = dist.broadcast(msg, 0, group=self.ctx.control, async_op=True)
            work.wait(timeout=datetime.timedelta(seconds=min(SHUTDOWN_GRACE_S, self.timeout_s)))
            return True
        except Exception:  # noqa: BLE001 - a peer already gone; it is killed in shutdown
            return False

    def shutdown(self) -> None:
        global _RUNTIME
        if self.closed:
            return
        told = self.announce_shutdown()
        self.closed = True
        destroy = functools.partial(destroy_distributed, self.teardown)
        if told and self.teardown == "abort":
            # Aborting is local: the workers abort theirs and exit, then this rank aborts its own
            # (2 x H200: 0.7 s, then 0.5 s). Still bounded: should an abort hang, the groups
            # stay until this process exits rather than hang the caller.
            started = time.monotonic()
            self.kill_workers(grace_s=SHUTDOWN_GRACE_S)
            log.info("tensor parallel: workers exited in %.1f s", time.monotonic() - started)
            if not _within(destroy, ABORT_GRACE_S):
                log.warning("tensor parallel: aborting rank 0's groups took over %g s; left to exit", ABORT_GRACE_S)
        elif told:
            # The workers tear their communicators down now too. Do it at the same time: NCCL's
            # teardown (of buffers registered by captured collectives, say) may need the peers,
            # so destroying only after the workers are gone could wait on them for ever. Bounded,
            # so a stuck teardown cannot hang the caller.
            if not _within(destroy, SHUTDOWN_GRACE_S):
                log.warning("tensor parallel: tearing down the process groups took over %g s", SHUTDOWN_GRACE_S)
            self.kill_workers(grace_s=SHUTDOWN_GRACE_S)
        else:
            self.kill_workers(grace_s=SHUTDOWN_GRACE_S)
            destroy()  # the workers are gone by now, so teardown cannot wait on them
        if _RUNTIME is self:
            _RUNTIME = None


def _within(fn, timeout_s: float) -> bool:
    """Run fn in a daemon thread; True if it returned within timeout_s."""
    thread = threading.Thread(target=fn, name="nanoserve-tp-teardown", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()


def init_tensor_parallel(config, serve_rank: Callable) -> TPGroup:
    """This process's TPGroup; at rank 0 spawns the local worker ranks and joins them.
    `serve_rank(config)` is what a spawned worker rank runs (the engine's
    `serve_worker_rank`: build the same engine, then execute rank 0's steps until shutdown);
    it must be a module-level function (spawned processes import it by name)."""
    global _RUNTIME
    n = config.tensor_parallel_size
    if n == 1:
        return SINGLE
    local_world = n // config.nnodes
    procs = []
    if _WORKER is not None:
        rank, addr = _WORKER
    else:
        if config.node_rank != 0:
            raise ValueError(
                "node_rank > 0 runs only worker ranks: use nanoserve.distributed.tp_runner.run_worker_node"
            )
        if _RUNTIME is not None or dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine is already running in this process: shut it down first")
        rank, addr = 0, config.dist_init_addr or f"127.0.0.1:{free_port()}"
        procs = _spawn_ranks(config, range(1, local_world), addr, serve_rank)
    local_rank = rank % local_world
    # A worker's config already names its own GPU (worker_main applied rank_config);
    # rank 0's may say just "cuda", which rank_config turns into its first GPU.
    device = (config if _WORKER is not None else rank_config(config, 0)).torch_device()
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(local_world))
    try:
        ctx = init_distributed(rank, n, local_rank, addr, device, config.dist_timeout_s, lambda: _check_started(procs))
    except BaseException as exc:
        for _, p in procs:
            p.kill()
            p.join(5)
        raise TensorParallelError(f"tensor-parallel rendezvous at {addr} failed: {exc}") from exc
    _RUNTIME = _Runtime(ctx, procs, config)
    try:
        symm = setup_symm_all_reduce(ctx, single_host=config.nnodes == 1, switches=config.switches)
    except BaseException as exc:
        if rank != 0:
            raise
        err = _RUNTIME.fail("setting up the symmetric-memory all-reduce failed", exc)
        _RUNTIME.shutdown()
        raise err from exc
    if rank == 0:
        log.info(
            "tensor parallel: %d ranks (%d per host, %d hosts), %s, rendezvous %s, worker pids %s",
            n, local_world, config.nnodes, dist.get_backend(), addr, [p.pid for _, p in procs],
        )  # fmt: skip
    return TPGroup(rank, n, symm)


def _check_started(procs) -> None:
    dead = [f"rank {r} (pid {p.pid}, exit code {p.exitcode})" for r, p in procs if p.exitcode is not None]
    if dead:
        raise RuntimeError(f"worker ranks exited while starting: {', '.join(dead)} (see their log above)")


def _spawn_ranks(config, ranks, addr: str, serve_rank: Callable, parent_pid: int | None = None) -> list:
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for r in ranks:
        p = ctx.Process(
            target=worker_main,
            args=(config, r, addr, os.getpid() if parent_pid is None else parent_pid, serve_rank),
            name=f"nanoserve-tp-rank{r}",
            daemon=True,
        )
        p.start()
        procs.append((r, p))
    return procs


def agree_kv_plan(plan: KVPlan, tp: TPGroup) -> KVPlan:
    """Every rank planned from its own memory; all take the minimum page count (gathered
    rather than only min-reduced, so unbalanced ranks can be reported)."""
    if tp.size == 1:
        return plan
    ctx = _RUNTIME.ctx
    mine = torch.tensor([plan.num_pages], dtype=torch.long)
    parts = [torch.zeros_like(mine) for _ in range(tp.size)]
    try:
        ctx.wait(dist.all_gather(parts, mine, group=ctx.control, async_op=True))
    except Exception as exc:
        if tp.rank != 0:
            raise
        err = _RUNTIME.fail("a rank failed while loading its shard", exc)
        _RUNTIME.shutdown()
        raise err from exc
    pages = [int(p) for p in parts]
    low = min(pages)
    if tp.rank == 0 and max(pages) > low:
        log.warning(
            "tensor-parallel ranks are unbalanced: KV pages each rank could hold %s (free memory differs); "
            "all use the minimum %d, %.0f%% less than the largest",
            pages,
            low,
            100 * (1 - low / max(pages)),
        )
    return KVPlan(low, plan.page_size, plan.bytes_per_token)


def wrap_runner(runner, tp: TPGroup):
    """The engine's runner: the local one at TP=1, else a `TPModelRunner` around it."""
    return runner if tp.size == 1 else TPModelRunner(runner, _RUNTIME)


class _SyncedKVCache:
    """The local KV cache, whose page copies (made by the scheduler at rank 0) are
    recorded so the next step replays them on the other ranks before their forward."""

    def __init__(self, local):
        self._local = local
        self.pending: list[tuple[int, int]] = []

    def copy_page(self, src: int, dst: int) -> None:
        self._local.copy_page(src, dst)
        self.pending.append((src, dst))

    def __getattr__(self, name):
        return getattr(self._local, name)


class TPModelRunner:
    """A `ModelRunner` for one rank of a tensor-parallel group. At rank 0, `execute`
    broadcasts the inputs and runs the local forward; at other ranks `serve` loops on
    broadcast inputs. Everything else is the local runner's."""

    def __init__(self, local, runtime: _Runtime):
        self.local = local
        self._rt = runtime
        self.rank = runtime.ctx.rank
        self.kv_cache = _SyncedKVCache(local.kv_cache)
        # Rank 0 ends the group when the engine goes away (garbage collection, exit).
        self._finalizer = weakref.finalize(self, runtime.shutdown) if self.rank == 0 else (lambda: None)

    def __getattr__(self, name):
        if name == "local":
            raise AttributeError(name)
        return getattr(self.local, name)

    def prepare(self, batch, sample_rows):
        return self.local.prepare(batch, sample_rows)

    def forward(self, batch, sample_rows) -> torch.Tensor:
        return self.execute(self.prepare(batch, sample_rows))

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the worker ranks this process spawned."""
        return [p.pid for _, p in self._rt.procs]

    # ---- rank 0 ------------------------------------------------------------------------

    def execute(self, inputs: ForwardInputs) -> torch.Tensor:
        rt = self._rt
        if rt.failed is not None:
            raise TensorParallelError(rt.failed)
        if rt.closed:
            raise TensorParallelError("the tensor-parallel engine was shut down")
        if rt.dead_workers():
            raise rt.fail("a worker rank exited")
        copies, self.kv_cache.pending = self.kv_cache.pending, []
        self.local.read_pending_tokens(inputs)  # the workers receive finished input ids
        inputs.piecewise = self.local.uses_piecewise(inputs)  # every rank runs the same kernels
        try:
            self._broadcast(inputs, copies)
        except Exception as exc:
            raise rt.fail("sending a step to the worker ranks failed", exc) from exc
        try:
            return self.local.execute(inputs)
        except Exception as exc:
            text = str(exc).lower()
            if (
                isinstance(exc, getattr(dist, "DistError", ()))
                or rt.dead_workers()
                or any(
                    s in text for s in ("timed out", "timeout", "connection closed", "connection reset", "gloo", "nccl")
                )
            ):
                raise rt.fail("a collective in the forward pass failed (a rank died or hung)", exc) from exc
            raise

    def _broadcast(self, inputs: ForwardInputs, copies: list[tuple[int, int]]) -> None:
        """Page copies (if any), then the step: one control message and one payload."""
        ctx, length = self._rt.ctx, self._rt.control_len
        per_msg = (length - HEADER_LEN) // 2
        for i in range(0, len(copies), per_msg):
            chunk = copies[i : i + per_msg]
            body = [x for pair in chunk for x in pair]
            msg = control_message(StepHeader(COPY_PAGES, count=len(chunk)), body, length)
            ctx.wait(dist.broadcast(msg, 0, group=ctx.control, async_op=True))
        header, host, payload = pack_step(inputs, self.local.graph_step_bytes(inputs))
        msg = control_message(header, host, length)
        ctx.wait(dist.broadcast(msg, 0, group=ctx.control, async_op=True))
        dist.broadcast(payload, 0)

    def shutdown(self) -> None:
        """Rank 0: stop the workers, then drop this rank's graphs while they drop theirs, then
        end the groups (the finalizer, `_Runtime.shutdown`)."""
        if self.rank == 0 and self._rt.announce_shutdown():
            _release_graphs(self.local)
        self._finalizer()

    # ---- ranks 1..N-1 ------------------------------------------------------------------

    def serve(self) -> None:
        """Run broadcast steps until rank 0 says shut down (or its sockets close). Nothing
        here reads device data on the host, so this loop runs ahead of the GPU."""
        ctx = self._rt.ctx
        msg = torch.zeros(self._rt.control_len, dtype=torch.long)
        while True:
            dist.broadcast(msg, 0, group=ctx.control)  # idle wait: the control group's long timeout
            h = StepHeader(*msg[:HEADER_LEN].tolist())
            if h.cmd == SHUTDOWN:
                break
            if h.cmd == COPY_PAGES:
                pairs = msg[HEADER_LEN : HEADER_LEN + 2 * h.count].tolist()
                for src, dst in zip(pairs[0::2], pairs[1::2]):
                    self.local.kv_cache.copy_page(src, dst)
                continue
            host = msg[HEADER_LEN : HEADER_LEN + 2 * h.host_reqs].tolist()
            if h.in_place:  # straight into the graphs' static inputs: nothing to copy there
                width, n = h.table_width, h.host_reqs
                dist.broadcast(self.local.graphs.step_bytes(h.graph_bs, width), 0)
                inputs = self.local.graph_step_in_place(h.graph_bs, width, h.num_reqs, host[n : 2 * n], h.max_seq_len)
            else:
                payload = torch.empty(sum(payload_size(h)), dtype=torch.int32, device=ctx.device)
                dist.broadcast(payload, 0)
                inputs = unpack_step(h, host, payload)
            self.local.execute(inputs)
        _release_graphs(self.local)


def _release_graphs(runner) -> None:
    """Drop the runner's CUDA graphs (after its work is done), so that none that captured
    a collective outlives the communicator, which is destroyed next."""
    if runner.device.type != "cuda":
        return
    torch.cuda.synchronize(runner.device)
    runner.graphs = runner.piecewise = None


def worker_main(config, rank: int, init_addr: str, parent_pid: int | None, serve_rank: Callable) -> None:
    """Entry point of a worker rank's process (spawned): runs `serve_rank(config)`."""
    global _WORKER
    if parent_pid is not None:
        _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 (or the node's launcher) decides when we stop
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s rank{rank}: %(message)s")
    local_world = config.tensor_parallel_size // config.nnodes
    config = rank_config(config, rank % local_world)
    _WORKER = (rank, init_addr)
    code = 0
    try:
        serve_rank(config)
    except BaseException:
        log.exception("tensor-parallel rank %d failed", rank)
        code = 1
    finally:
        if _RUNTIME is not None and code == 0:
            destroy_distributed(config.switches.tp_teardown)
    os._exit(code)


def run_worker_node(config, serve_rank: Callable) -> int:
    """Host `node_rank` > 0 of a multi-host group: run this host's ranks (each
    `serve_rank(config)`, see init_tensor_parallel) until rank 0 ends them (same command as
    node 0, plus --node-rank). Returns the worst exit code."""
    local_world = config.tensor_parallel_size // config.nnodes
    first = config.node_rank * local_world
    procs = _spawn_ranks(config, range(first, first + local_world), config.dist_init_addr, serve_rank)

    def stop(signum, frame):
        for _, p in procs:
            p.kill()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    codes = []
    for _, p in procs:
        p.join()
        codes.append(p.exitcode or 0)
    return max(abs(c) for c in codes)
