"""What the engine and the tensor-parallel ranks exchange, in one module both import (neither
imports the other's modules for it): `ForwardInputs`, the device tensors one forward pass
reads (rank 0 broadcasts them to the workers each step), and `KVPlan`, the KV cache's size
(each rank plans its own; `distributed.tp_runner.agree_kv_plan` takes the minimum).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.attention.base import AttentionMetadata


@dataclass(frozen=True)
class KVPlan:
    num_pages: int
    page_size: int
    bytes_per_token: int

    @property
    def num_tokens(self) -> int:
        return (self.num_pages - 1) * self.page_size  # page 0 is reserved


@dataclass
class ForwardInputs:
    """Everything one forward pass reads: a plain bundle of device tensors, so it can be
    handed to other ranks or copied into a CUDA graph's static buffers."""

    input_ids: torch.Tensor  # long [T]
    positions: torch.Tensor  # long [T]
    meta: AttentionMetadata
    logit_rows: torch.Tensor | None  # long [R]: rows of the hidden states to project; None: all
    graph_bs: int | None = None  # padded size of the decode graph to replay, None: eager
    num_reqs: int = 0  # real requests (rows past it are padding)
    req_slots: torch.Tensor | None = None  # long [num_reqs]: each request's slot (rank 0 only, not broadcast)
    req_slots_host: list[int] | None = None  # the same on the host (extend batches only)
    # Input ids still being sampled (rank 0 only): `ModelRunner.read_pending_tokens` reads them
    # from the token pool. It runs when the forward is launched, not when the inputs are
    # prepared, so a step can be prepared before the sampling that produces them is queued.
    pending: PendingTokens | None = None
    # Set in a decode graph's inputs on one GPU: the graph's embedding reads the ids < 0 from
    # the token pool at these entries itself (long [T]), so `pending` is not read before it.
    pool_index: torch.Tensor | None = None
    # Whether a prefill/extend batch runs the piecewise graphs: None lets the runner decide
    # (`ModelRunner.uses_piecewise`); tensor-parallel rank 0 decides and its workers follow.
    piecewise: bool | None = None


@dataclass
class PendingTokens:
    """Rows of `input_ids` whose token is in the token pool (a placeholder id < 0 on the host)."""

    ids: torch.Tensor  # long [n]: the real rows of input_ids (a view: written in place)
    pool_index: torch.Tensor  # long [n]: each row's token-pool entry
    every_row: bool  # all n rows are pending (one gather); else the ids < 0 say which
