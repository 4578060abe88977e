"""Decode-sized all-reduces over torch's symmetric memory: a one-shot all-reduce that every
rank's GPU runs by reading its peers' buffers directly over NVLink. Measured on 2 H200s
(llama-3.1-8b, benchmarks/tp_profile.py): inside a decode step it costs about what NCCL's
does (6.9 against 6.3 us for one fp32 row), but the step's first collective waits far less
for the other rank (11 against 54 us), so batch-1 steps take 3.15 instead of 3.27 ms; at
256 rows the two tie. (Alone, back to back, NCCL's looks 3x slower: tp_comm.py.)

Opt-in (NANOSERVE_SYMM_MEM=1; NCCL for every sum by default): the gain is small (3% at
batch 1) and a peer that dies inside this kernel leaves the others spinning with no timeout
of their own, a failure mode not yet tried on GPUs (see the last invariant).

Owns: `SymmAllReduce` (one symmetric buffer and the rule for which sums use it) and
`setup_symm_all_reduce` (the collective set-up that every rank runs, with its fallback).

When a sum takes this path (`SymmAllReduce.takes`): a CUDA tensor, fp32 or bf16, of at most
`max_bytes` (NANOSERVE_SYMM_MEM_MAX_BYTES, default 4 MiB = 256 rows x 4096 x fp32) and a
multiple of 16 bytes, summed while a CUDA graph is being captured (the decode graphs). Every
other sum, eager forwards (prefill, decode batches above the largest graph, the eager twin)
included, goes to NCCL, as on CPU (gloo), across hosts, without NANOSERVE_SYMM_MEM=1 (NCCL
is the slow twin) and after any set-up failure. Why captures only: capture is where the small per-layer
sums of decode live, and a replay does no host work, while an eager call of torch's op looks
the buffer up again on the host (and newer torch versions check it through the store).

Invariants:
- The rule reads only the tensor's dtype, size and the capture state, which are the same on
  every rank for a given call (all ranks run the same forward and capture the same graphs in
  the same order), so every rank takes the same path for every call: a rank that went to
  NCCL while its peer waited in the symmetric kernel would hang both.
- One buffer of `max_bytes` per process, allocated and exchanged once at start, before the
  KV cache is sized. Every call stages its input there: torch's kernel copies this rank's
  input into its own buffer, waits until every peer has done the same (a per-block flag
  exchange), reads all ranks' buffers and adds them in rank order (rank 0 first), and waits
  again before it returns, so the next call may overwrite the buffer. Calls are therefore
  serial on the current stream, in the same order on every rank, like NCCL's.
- The sum is the same bits on every rank (same operands, same order), and for 2 ranks it is
  exactly NCCL's: a + b with one rounding in the tensor's dtype. Row-parallel partials are
  summed in the model dtype, or with NANOSERVE_TP_REDUCE_FP32=1 in fp32 and rounded once
  afterwards by the caller (models/layers.py).
- The result is a new tensor from the current allocator (the graph's pool under capture);
  the input is not modified.
- NVLink multicast is never used: TORCH_SYMM_MEM_DISABLE_MULTICAST defaults to 1 here (the
  one-shot kernel needs only peer-to-peer loads, and multicast objects cost set-up and, on
  shared hosts, risk).
- The kernel's waits have no timeout of their own: a peer that dies mid-step leaves this
  rank's kernel spinning, as a captured NCCL kernel would wait for it. The next step's NCCL
  payload broadcast, queued behind it, is then expected to time out in NCCL's watchdog after
  `dist_timeout_s` (not tried on GPUs; the CPU tests of a dead rank run on gloo).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger("nanoserve")

DEFAULT_MAX_BYTES = 256 * 4096 * 4  # 256 decode rows of a 4096-wide fp32 partial sum
_DTYPES = (torch.float32, torch.bfloat16)
_ALIGN = 16  # torch's kernel needs the input and its buffer view equally aligned; 16 B is its widest


def fits(nbytes: int, dtype: torch.dtype, max_bytes: int) -> bool:
    """The size and dtype part of the rule (pure, so CPU tests check it)."""
    return dtype in _DTYPES and 0 < nbytes <= max_bytes and nbytes % _ALIGN == 0


class SymmAllReduce:
    """Sum over the default group's ranks through one symmetric buffer (see module)."""

    def __init__(self, buffer: torch.Tensor, group_name: str, max_bytes: int):
        self.buffer = buffer  # uint8 [max_bytes], rendezvoused on every rank
        self.group_name = group_name
        self.max_bytes = max_bytes

    def takes(self, x: torch.Tensor) -> bool:
        return (
            x.is_cuda
            and fits(x.numel() * x.element_size(), x.dtype, self.max_bytes)
            and torch.cuda.is_current_stream_capturing()
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x, as a new tensor (x is left as it was). Any size that
        `fits`, captured or not (the tests call it eagerly); every rank must call it."""
        if not x.is_contiguous() or (x.storage_offset() * x.element_size()) % _ALIGN:
            x = x.clone(memory_format=torch.contiguous_format)  # torch's kernel: same alignment as the buffer
        staged = self.buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staged, x, "sum", self.group_name)


def setup_symm_all_reduce(ctx, single_host: bool) -> SymmAllReduce | None:
    """Every rank calls this right after joining (`ctx`: process_group.DistContext). Returns
    the fast path, or None (NCCL for everything) on every rank alike. Each step's outcome is
    agreed over the gloo control group before the next: no rank launches a symmetric kernel
    unless every rank has its buffer, and the trial sum's values are checked on every rank."""
    if ctx.device.type != "cuda" or ctx.world_size < 2:
        return None
    if os.environ.get("NANOSERVE_SYMM_MEM", "0") != "1" or not single_host:
        # The same on every rank (the environment is inherited; --nnodes is one setting), so
        # no agreement is needed. Peer-to-peer loads reach only the GPUs of one host.
        if ctx.rank == 0:
            why = "NANOSERVE_SYMM_MEM=1 turns the symmetric-memory path on" if single_host else "ranks on several hosts"
            log.info("tensor parallel: NCCL for every all-reduce (%s)", why)
        return None
    reason = None
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
        reason = f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_copy"
    symm = None
    if reason is None:
        try:
            symm = _allocate(ctx.device)
        except Exception as exc:  # noqa: BLE001 - any failure falls back to NCCL
            reason = _failed("set-up", exc)
    if not all(_gather_flags(ctx, reason is None)):
        _fallback(ctx, reason or "another rank could not set it up")
        return None
    sums, reason = [], None
    try:
        sums = _launch_trial(symm, ctx)
    except Exception as exc:  # noqa: BLE001
        reason = _failed("the trial sum", exc)
    launched = _gather_flags(ctx, reason is None)
    if any(launched) and not all(launched):
        # The ranks that launched wait in their kernel for the others for ever: their GPUs
        # cannot go on, so the start fails rather than falling back.
        raise RuntimeError(f"symmetric-memory trial sum launched on ranks {launched} only: {reason or 'see rank logs'}")
    if not all(launched):
        _fallback(ctx, reason)
        return None
    reason = _check_trial(sums, ctx.world_size)
    if not all(_gather_flags(ctx, reason is None)):
        _fallback(ctx, reason or "the trial sum was wrong on another rank")
        return None
    if ctx.rank == 0:
        log.info(
            "tensor parallel: sums of up to %d bytes captured in CUDA graphs use the symmetric-memory "
            "one-shot all-reduce; NCCL for the rest",
            symm.max_bytes,
        )
    return symm


def _allocate(device: torch.device) -> SymmAllReduce:
    import torch.distributed._symmetric_memory as symm_mem

    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    get_backend = getattr(symm_mem, "get_backend", None)
    if get_backend is not None and get_backend(device) not in (None, "CUDA"):
        # torch's own CUDA backend: peer mappings of plain device memory, freed locally (the
        # NVSHMEM backend's free is a collective, which an exit on one rank could hang).
        symm_mem.set_backend("CUDA")
    max_bytes = int(os.environ.get("NANOSERVE_SYMM_MEM_MAX_BYTES", DEFAULT_MAX_BYTES))
    max_bytes -= max_bytes % _ALIGN
    group = dist.group.WORLD
    buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
    symm_mem.rendezvous(buffer, group)
    return SymmAllReduce(buffer, group.group_name, max_bytes)


def _launch_trial(symm: SymmAllReduce, ctx) -> list[torch.Tensor]:
    """One eager sum of known values in each dtype (checked by `_check_trial`)."""
    return [
        symm.all_reduce(torch.full((2, 64), float(ctx.rank + 1), dtype=dtype, device=ctx.device)) for dtype in _DTYPES
    ]


def _check_trial(sums: list[torch.Tensor], n: int) -> str | None:
    want = n * (n + 1) / 2
    for got in sums:
        if not bool((got == want).all()):
            return f"the trial sum in {got.dtype} gave {got.flatten()[:2].tolist()}, want {want}"
    return None


def _gather_flags(ctx, ok: bool) -> list[bool]:
    """Every rank's `ok`, rank order (over the gloo control group, bounded by the timeout)."""
    mine = torch.tensor([int(ok)], dtype=torch.long)
    flags = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
    ctx.wait(dist.all_gather(flags, mine, group=ctx.control, async_op=True))
    return [bool(f.item()) for f in flags]


def _failed(what: str, exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    return f"{what} failed ({type(exc).__name__}: {first})"


def _fallback(ctx, reason: str) -> None:
    log.warning(
        "tensor parallel rank %d: symmetric-memory all-reduce not used, NCCL for every sum: %s", ctx.rank, reason
    )
