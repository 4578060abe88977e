"""Tensor-parallel process group: which rank this process is, how many there are, and the
collectives the sharded layers call.

Owns: `TPGroup`. With size 1 (the default) every collective is the identity, so the model
code is the same with and without tensor parallelism. The collectives run on the default
torch.distributed group (NCCL on CUDA, gloo on CPU); they read no device data on the host,
so CUDA graphs capture them (every rank must then capture and replay the same graphs in
the same order: see nanoserve.distributed.tp_runner). On one host's GPUs the row-parallel
layers' sums captured in CUDA graphs (decode) are instead fused with the RMSNorm after them
over symmetric memory (`symm`, see nanoserve.distributed.symm_all_reduce; NANOSERVE_SYMM_MEM=0
turns it off); every rank makes the same choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nanoserve.distributed.symm_all_reduce import SymmAllReduce

# torch >= 2.12 renames all_gather_into_tensor (and warns on the old name).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    symm: SymmAllReduce | None = field(default=None, compare=False, repr=False)  # decode sums' fast path

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (NCCL, gloo); returns x."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def partial_out(self, rows: int, width: int, dtype: torch.dtype, slot: int) -> torch.Tensor | None:
        """Where a row-parallel layer should write its partial sums [rows, width] so that the
        norm after it can sum them in place (`reduce_rms_norm`), or None: any new tensor."""
        if self.size == 1 or self.symm is None:
            return None
        return self.symm.partial_out(rows, width, dtype, slot)

    def ll_push(self, part: torch.Tensor | None):
        """The symmetric path's offer to let the matmul writing `part` send it to the peers
        itself (symm_all_reduce.SymmAllReduce.ll_push), or None."""
        return None if self.symm is None else self.symm.ll_push(part)

    def reduce_rms_norm(
        self, part: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(RMSNorm(s), s) for s = sum over ranks of `part` (+ residual), in one fused launch
        when `part` came from `partial_out`; None when it did not (the caller then sums with
        `all_reduce` and normalises itself)."""
        if self.size == 1 or self.symm is None or not self.symm.holds(part):
            return None
        return self.symm.all_reduce_rms_norm(part, residual, weight, eps)

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x concatenated along the last dim, rank order (one collective into a
        [size, ...] buffer, then one copy to put the rank axis last)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        gathered = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(gathered, x)  # rank r's x at rows [r * len(x), (r + 1) * len(x))
        stacked = gathered.view(self.size, *x.shape)
        return stacked.movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def agree_min(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (all ranks call it; it reads the result on
        the host, so never inside a CUDA graph)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def agree_all(self, value: bool, device: torch.device) -> bool:
        """True where every rank's `value` is (all ranks call it; host-side, as `agree_min`)."""
        return bool(self.agree_min(int(value), device))


SINGLE = TPGroup()
