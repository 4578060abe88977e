"""What every drafter offers the verify step (`step.make_proposer` picks the drafter).

Owns: `Draft` (one request's proposed tokens, and the distributions they were drawn from when
a model drew them), `DraftContext` (what a drafter is built from) and the `Proposer` interface:
- `kv_bytes_per_token`: the drafter's KV bytes per token position; a drafter with a model is
  built (weights loaded) before the engine plans its KV cache, whose pages hold the target's and
  the drafter's KV of the same positions: one memory budget;
- `attach(engine, plan)`: the engine is built; make what needs its KV plan and page table;
- `needs_pages`: True for drafters that run a model (they write K/V at the drafted positions,
  so the request's pages must be reserved first); False for look-ups, which draft before
  anything is scheduled;
- `propose(reqs, budgets)`: at most budgets[i] tokens for reqs[i] (each request's token_ids
  end with its last, not yet computed, token);
- `verified(reqs)`: the verify step has updated these requests (token_ids, num_computed);
- `finished(req)`: the request ended; drop what is kept for it.
A leaf of the package: the drafters import it, it imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), vocab]: the draft's distribution per token; None: deterministic

    def trim(self, n: int) -> None:
        if n < len(self.tokens):
            self.tokens = self.tokens[:n]
            if self.probs is not None:
                self.probs = self.probs[:n]


@dataclass(frozen=True)
class DraftContext:
    """The target's side of what a drafter is built from (before the engine's KV plan)."""

    config: object  # EngineConfig
    target_source: object  # ModelSource of the target
    tokenizer: object | None
    dtype: torch.dtype
    kv_dtype: torch.dtype
    device: torch.device
    max_len: int  # positions the target may reach


class Proposer(Protocol):
    needs_pages: bool
    kv_bytes_per_token: int

    def attach(self, engine, plan) -> None: ...

    def propose(self, reqs: list, budgets: list[int]) -> list[Draft]: ...

    def verified(self, reqs: list) -> None: ...

    def finished(self, req) -> None: ...
