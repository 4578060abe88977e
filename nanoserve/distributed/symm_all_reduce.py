"""The decode path's all-reduces fused with the RMSNorm after them, over symmetric memory: the
row-parallel layers (o_proj, down_proj) and the embedding write their partial sums straight
into a buffer that every GPU of the host can reach, and one Triton kernel per reduction
exchanges them with the peers over NVLink, adds them (and the residual) and normalises
(`triton_ops.all_reduce_rms_norm` / `ll_all_reduce_rms_norm`). NCCL's all-reduce plus the
norm took two launches, the first of which cannot start early under PDL.

Owns: `SymmAllReduce` (one symmetric buffer: two slots for partial sums, one flag array and
the LL receive buffers; the rule for which sums use it and over which protocol; the fused
call) and `setup_symm_all_reduce` (the collective set-up that every rank runs, with its
fallback to NCCL).

Two protocols (KernelSwitches.symm_protocol, NANOSERVE_SYMM_PROTOCOL): "pull" publishes a flag per program
and then reads the peers' slots over NVLink (a release, a flag's trip, a read's round trip);
"ll" (low latency) stores this rank's partials into every peer's receive buffer as 64-bit
words, 32 bits of data under the call count, and polls its own receive buffer until every
word it needs carries this call's count (one trip of stores, no fence, no remote read, twice
the bytes). "auto" (default) takes LL for sums of at most LL_MAX_BYTES and pull above, as
measured (see LL_MAX_BYTES).

When a sum takes this path: a row-parallel layer asks `partial_out(rows, width, dtype, slot)`
for its output; it gets a view of this rank's slot when a CUDA graph is being captured on a
CUDA device and the partials fit (`fits`: fp32, bf16 or fp16, at most `max_bytes`,
NANOSERVE_SYMM_MEM_MAX_BYTES, default 4 MiB = 256 rows x 4096 x fp32), else None (a normal
tensor, summed by NCCL). The norm that consumes the partials (layers.RMSNorm with
`reduce_over`) runs the fused kernel when `holds(x)` says x is such a view, NCCL's
all-reduce and the plain norm otherwise. So the decode graphs take it; eager forwards
(prefill, decode batches above the largest graph, the eager twin), CPU (gloo), several hosts
and NANOSERVE_SYMM_MEM=0 use NCCL, which is the slow twin.

Invariants:
- The rule reads only shapes, dtypes and the capture state, which are the same on every rank
  for a given call (all ranks run the same forward and capture the same graphs in the same
  order), so every rank takes the same path: a rank that went to NCCL while its peer waited
  in the fused kernel would hang both.
- Calls are serial on the stream and made in the same order, with the same row count, on
  every rank. Program p of each call counts its calls (`epochs[p]`, device memory, so graph
  replays count too). Pull: it publishes the count in every rank's flag array once its own partials
  are complete (the kernel starts only after the matmul that wrote them finished; a
  system-scope release), and reads the peers' partials only after every rank's flag for p
  has reached that count (an acquire).
- LL: a 64-bit store is seen whole or not at all, so a word tagged with this call's count
  holds this call's data. Row r is always handled by program r % MAX_PROGRAMS (at most
  MAX_PROGRAMS programs, one per row while there are fewer rows), whose count only grows, so
  a word left by an earlier call never carries the count awaited now.
- A slot is rewritten only after a reduction on the other slot: o_proj uses slot 0 and
  down_proj slot 1, which alternate, and both take or skip the path together (same rows,
  width and dtype). A rank can only finish the reduction on slot 1 once every peer has
  started it, i.e. has finished the previous reduction on slot 0, so nobody still reads a
  slot that its owner's next matmul overwrites, nor an LL receive buffer (per slot) that a
  peer's next call on that slot overwrites. (Sums that skip the path do not touch it.)
- One-row LL sums of 2-byte partials (batch-1 decode: `ll_push`, NANOSERVE_SYMM_PUSH=0 turns
  it off): the matmul that computes the partials stores the words itself, each program as it
  finishes, under the count the sum's kernel will take (program 0's next: no fused call runs
  in between), and the sum's kernel only waits. Both sides decide from shapes, dtypes and the
  matmul's config, so every rank pushes or none. The argument for slots above holds as is:
  the matmul runs after this rank's previous reduction, on the other slot, has completed.
  A `partial_out` voids any earlier offer for its slot, so a sum never skips a send nobody made.
- Senders skip their own rank by the store's mask, not by a branch: a branch on the runtime
  rank there failed to compile in Triton 3.6 at 4 ranks.
- The embedding's partials (a step's first sum, normalised by the first layer's input norm)
  use slot 1 too, right after the previous step's last down_proj sum on slot 1: between
  those two, the logits all-gather and the next step's broadcast (NCCL) hold every rank
  until all have finished that sum.
- The sum is the same bits on every rank (same operands, added in rank order, rounded once
  to the model dtype), for 2 ranks NCCL's; the residual add and the norm then round as
  `rms_norm` does. Partials are in the model dtype, or in fp32 with
  NANOSERVE_TP_REDUCE_FP32=1 (models/layers.py).
- One buffer of 2 x `max_bytes` + the flags + 2 x world x 2 x `max_bytes` of LL receive
  buffers per process (40 MiB at 2 ranks), allocated, zeroed and exchanged once at start,
  before the KV cache is sized.
- NVLink multicast is never used: TORCH_SYMM_MEM_DISABLE_MULTICAST defaults to 1 here (the
  kernel needs only peer-to-peer loads and stores, and multicast risks shared hosts).
- The kernel's waits have no timeout of their own: a peer that dies mid-step leaves this
  rank's kernel spinning, as a captured NCCL kernel would wait for it. The next step's NCCL
  payload broadcast, queued behind it, is then expected to time out in NCCL's watchdog after
  `dist_timeout_s` (not tried on GPUs; the CPU tests of a dead rank run on gloo).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanoserve.kernels.all_reduce import all_reduce_rms_norm, ll_all_reduce_rms_norm
from nanoserve.switches import KernelSwitches

log = logging.getLogger("nanoserve")

DEFAULT_MAX_BYTES = KernelSwitches.symm_mem_max_bytes  # 256 decode rows of a 4096-wide fp32 partial sum
SLOTS = 2  # o_proj's partials in slot 0, down_proj's in slot 1 (see the module docstring)
MAX_PROGRAMS = 128  # programs per fused call (each takes rows p, p + 128, ...): all co-resident
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ALIGN = 256  # slot and flag offsets in the buffer


def fits(nbytes: int, dtype: torch.dtype, max_bytes: int) -> bool:
    """The size and dtype part of the rule (pure, so CPU tests check it)."""
    return dtype in _DTYPES and 0 < nbytes <= max_bytes


# How the fused kernel exchanges partials (KernelSwitches.symm_protocol): "ll", each rank
# pushes its partials into its peers' receive buffers as 64-bit words tagged with the call
# count (no flags, no reads over NVLink; twice the bytes on the wire); "pull", flags then
# reads of the peers' slots; "auto" (default), LL for partials of at most LL_MAX_BYTES,
# pull above (see LL_MAX_BYTES).
# Measured on 2 x H200 (benchmarks/results/2026-11-21.md, series 7; one sum in a graph of 64, [rows, 4096] bf16,
# us): LL 4.5 / 4.9 / 7.4 / 16.9 vs pull 6.4 / 6.7 / 8.2 / 13.5 at 1 / 8 / 64 / 256 rows; in the
# engine (llama-3.1-8b TP=2 decode step) LL 2.78 vs 2.91 ms at batch 1, 6.15 vs 5.98 at 256.
LL_MAX_BYTES = 64 * 4096 * 2


# A one-row LL sum's words are stored by the matmul that computes the partials, as each of
# its programs finishes (`push_in_matmul`, KernelSwitches.symm_push; off: by the sum's
# kernel, after the whole matmul).


@dataclass
class LLPush:
    """Where a matmul sends its one output row as LL words (`SymmAllReduce.ll_push`): the
    slot's destinations in every rank's receive buffer, the call counts and this rank;
    `sent` is set by the matmul that did."""

    dst_addrs: torch.Tensor
    epochs: torch.Tensor
    rank: int
    sent: bool = False

    def args(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.dst_addrs, self.epochs, self.rank


class SymmAllReduce:
    """This rank's symmetric buffer and the fused reduce + norm over it (see module).
    Layout: SLOTS slots of `max_bytes`, the flag array ([MAX_PROGRAMS, world] int64), then
    the LL protocol's receive buffers: per slot, per source rank, 2 x `max_bytes` (each
    4 bytes of partials travel in an 8-byte word)."""

    def __init__(
        self,
        buffer: torch.Tensor,
        peer_bases: list[int],
        rank: int,
        max_bytes: int,
        protocol: str = "auto",
        push_in_matmul: bool = True,
        pdl: bool = True,
    ):
        self.buffer = buffer  # uint8 [buffer_bytes(max_bytes, world)], rendezvoused on every rank
        self.rank = rank
        self.max_bytes = max_bytes
        self.protocol = protocol
        self.push_in_matmul = push_in_matmul
        self.pdl = pdl
        world = len(peer_bases)
        device = buffer.device
        self.slot_addrs = [  # per slot: its address in every rank's buffer, rank order
            torch.tensor([base + s * max_bytes for base in peer_bases], dtype=torch.int64, device=device)
            for s in range(SLOTS)
        ]
        flags = SLOTS * max_bytes
        self.flag_addrs = torch.tensor([base + flags for base in peer_bases], dtype=torch.int64, device=device)
        recv, per_source = self._recv_offset(max_bytes, world), 2 * max_bytes
        self.ll_dst_addrs = [  # per slot: where this rank's words go in every rank's buffer
            torch.tensor(
                [base + recv + (s * world + rank) * per_source for base in peer_bases], dtype=torch.int64, device=device
            )
            for s in range(SLOTS)
        ]
        self.ll_recv = [  # per slot: this rank's receive buffer, one row per source rank
            buffer[recv + s * world * per_source : recv + (s + 1) * world * per_source]
            .view(torch.int64)
            .view(world, -1)
            for s in range(SLOTS)
        ]
        self.epochs = torch.zeros(MAX_PROGRAMS, dtype=torch.int64, device=device)
        self._pushes: dict[int, LLPush] = {}  # per slot: the push offered to its current partials

    @staticmethod
    def _recv_offset(max_bytes: int, world: int) -> int:
        flags_end = SLOTS * max_bytes + MAX_PROGRAMS * world * 8
        return -(-flags_end // _ALIGN) * _ALIGN

    @staticmethod
    def buffer_bytes(max_bytes: int, world: int) -> int:
        return SymmAllReduce._recv_offset(max_bytes, world) + SLOTS * world * 2 * max_bytes

    def _own_region(self, slot: int, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        start = slot * self.max_bytes
        return self.buffer[start : start + rows * width * dtype.itemsize].view(dtype).view(rows, width)

    def partial_out(self, rows: int, width: int, dtype: torch.dtype, slot: int) -> torch.Tensor | None:
        """Where a row-parallel layer writes its partial sums [rows, width]: a view of this
        rank's slot when the fused path takes this sum, else None."""
        self._pushes.pop(slot, None)  # new partials: any earlier offer is void
        if fits(rows * width * dtype.itemsize, dtype, self.max_bytes) and torch.cuda.is_current_stream_capturing():
            return self._own_region(slot, rows, width, dtype)
        return None

    def ll_push(self, part: torch.Tensor | None) -> LLPush | None:
        """An offer to the matmul about to write `part` (a `partial_out` view) to send the words
        itself (`kernels.linear.small_m_linear(push=...)`, which sets `sent`): for one-row LL sums of
        2-byte partials, or None. The sum then only waits (`all_reduce_rms_norm`)."""
        if part is None or not self.push_in_matmul or part.shape[0] != 1 or part.element_size() != 2:
            return None
        slot = self._slot_of(part)
        if slot is None or not self.uses_ll(part):
            return None
        self._pushes[slot] = push = LLPush(self.ll_dst_addrs[slot], self.epochs, self.rank)
        return push

    def _slot_of(self, x: torch.Tensor) -> int | None:
        if not x.is_cuda or x.dim() != 2 or not x.is_contiguous() or x.device != self.buffer.device:
            return None
        offset = x.data_ptr() - self.buffer.data_ptr()
        return offset // self.max_bytes if offset in [s * self.max_bytes for s in range(SLOTS)] else None

    def holds(self, x: torch.Tensor) -> bool:
        """Whether x is a view that `partial_out` handed out (so its peers' copies exist)."""
        return self._slot_of(x) is not None

    def uses_ll(self, part: torch.Tensor) -> bool:
        """Whether the sum of `part` takes the LL protocol (shapes and dtype only, as the rule)."""
        nbytes = part.numel() * part.element_size()
        if self.protocol == "pull" or (part.shape[1] * part.element_size()) % 4:  # LL: whole 32-bit words
            return False
        return self.protocol == "ll" or nbytes <= LL_MAX_BYTES

    def all_reduce_rms_norm(
        self, part: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(s), s) for s = sum over ranks of `part` (+ residual, if any); `part` must
        be held. Every rank must call it for the same slot, in the same order."""
        slot = self._slot_of(part)
        push = self._pushes.pop(slot, None)
        if self.uses_ll(part):
            sent = push is not None and push.sent
            return ll_all_reduce_rms_norm(
                part,
                self.ll_dst_addrs[slot],
                self.ll_recv[slot],
                self.epochs,
                self.rank,
                residual,
                weight,
                eps,
                sent,
                pdl=self.pdl,
            )
        return all_reduce_rms_norm(
            part, self.slot_addrs[slot], self.flag_addrs, self.epochs, self.rank, residual, weight, eps, pdl=self.pdl
        )


def setup_symm_all_reduce(ctx, single_host: bool, switches: KernelSwitches) -> SymmAllReduce | None:
    """Every rank calls this right after joining (`ctx`: process_group.DistContext). Returns
    the fast path, or None (NCCL for everything) on every rank alike. Each step's outcome is
    agreed over the gloo control group before the next: no rank launches the fused kernel
    unless every rank has its buffer, and the trial sum's values are checked on every rank."""
    if ctx.device.type != "cuda" or ctx.world_size < 2:
        return None
    if not switches.symm_mem or not single_host:
        # The same on every rank (the environment is inherited; --nnodes is one setting), so
        # no agreement is needed. Peer-to-peer loads reach only the GPUs of one host.
        if ctx.rank == 0:
            why = "the symm_mem switch is off" if single_host else "ranks on several hosts"
            log.info("tensor parallel: NCCL for every all-reduce (%s)", why)
        return None
    symm, reason = None, None
    try:
        symm = _allocate(ctx, switches)
    except Exception as exc:  # noqa: BLE001 - any failure falls back to NCCL
        reason = _failed("set-up", exc)
    if not all(_gather_flags(ctx, reason is None)):  # also the barrier after the flags' zeroing
        _fallback(ctx, reason or "another rank could not set it up")
        return None
    sums = []
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
            "tensor parallel: decode sums of up to %d bytes captured in CUDA graphs are fused with their "
            "RMSNorm over symmetric memory; NCCL for the rest",
            symm.max_bytes,
        )
    return symm


def _allocate(ctx, switches: KernelSwitches) -> SymmAllReduce:
    import torch.distributed._symmetric_memory as symm_mem

    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    get_backend = getattr(symm_mem, "get_backend", None)
    if get_backend is not None and get_backend(ctx.device) not in (None, "CUDA"):
        # torch's own CUDA backend: peer mappings of plain device memory, freed locally (the
        # NVSHMEM backend's free is a collective, which an exit on one rank could hang).
        symm_mem.set_backend("CUDA")
    max_bytes = switches.symm_mem_max_bytes
    max_bytes -= max_bytes % _ALIGN
    group = dist.group.WORLD
    buffer = symm_mem.empty(SymmAllReduce.buffer_bytes(max_bytes, ctx.world_size), dtype=torch.uint8, device=ctx.device)
    handle = symm_mem.rendezvous(buffer, group)
    buffer.zero_()  # the flags start at 0, as the epochs do
    torch.cuda.synchronize(ctx.device)  # zeroed before any peer can signal (the caller's gather follows)
    peers = [int(p) for p in handle.buffer_ptrs]
    return SymmAllReduce(buffer, peers, ctx.rank, max_bytes, switches.symm_protocol, switches.symm_push, switches.pdl)


def _launch_trial(symm: SymmAllReduce, ctx) -> list[torch.Tensor]:
    """One eager fused call per partial dtype on known values (checked by `_check_trial`):
    partials rank + 1, residual 1, so the sum is n(n+1)/2 + 1 everywhere."""
    sums = []
    for slot, dtype in enumerate((torch.bfloat16, torch.float32)):
        part = symm._own_region(slot, 2, 64, dtype)
        part.fill_(float(ctx.rank + 1))
        residual = torch.ones(2, 64, dtype=torch.bfloat16, device=ctx.device)
        weight = torch.ones(64, dtype=torch.bfloat16, device=ctx.device)
        sums.append(symm.all_reduce_rms_norm(part, residual, weight, 1e-6)[1])
    return sums


def _check_trial(sums: list[torch.Tensor], n: int) -> str | None:
    want = n * (n + 1) / 2 + 1
    for got in sums:
        if not bool((got == want).all()):
            return f"the trial sum gave {got.flatten()[:2].tolist()}, want {want}"
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
