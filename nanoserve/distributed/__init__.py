"""Tensor-parallel process group: which rank this process is, how many there are, and the
collectives the sharded layers call.

Owns: `TPGroup`. With size 1 (the default) every collective is the identity, so the model
code is the same with and without tensor parallelism. The collectives run on the default
torch.distributed group (NCCL on CUDA, gloo on CPU); they read no device data on the host,
so CUDA graphs capture them (every rank must then capture and replay the same graphs in
the same order: see nanoserve.distributed.tp_runner). With NANOSERVE_SYMM_MEM=1, on one
host's GPUs, the small sums captured in CUDA graphs (decode) go through torch's symmetric
memory instead of NCCL (`symm`, see nanoserve.distributed.symm_all_reduce); every rank
makes the same choice.
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
        """Sum over ranks. Returns the sum: x itself, summed in place (NCCL, gloo), or a new
        tensor (the symmetric-memory path, which leaves x as it was): use the result."""
        if self.size == 1:
            return x
        if self.symm is not None and self.symm.takes(x):
            return self.symm.all_reduce(x)
        dist.all_reduce(x)
        return x

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


SINGLE = TPGroup()
