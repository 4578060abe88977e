"""Several positions of a request as rows of one decode batch: how verify steps (and a
drafter's short catch-ups) run through the decode path and its CUDA graphs.

Owns: `PositionRow` (one position of a request, as `ModelRunner.prepare` reads a request: its
last token, how many positions precede it, its slot) and `position_batch`.

Why it is exact: a decode batch's rows are independent to attention. Row t of request r at
position p has seq_len p + 1 and r's page-table row, so it attends to positions 0..p of r.
Every row's K/V is stored (at its own slot) before any row's attention of the same layer
runs, so the rows of one request see each other causally, as an extend over those positions
would. The decode graphs then cover a verify step of B requests x (k + 1) positions as one
replay of the graph for B * (k + 1) rows, with logits for every row; the batch names its runs
(each request's row count), so attention may read a request's K/V once for all its rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.kvcache.pool import PageTable
from nanoserve.scheduler.scheduler import ScheduledBatch


@dataclass
class PositionRow:
    token_ids: list[int]  # only [-1] is read: the token at this position
    num_computed: int  # the position (positions before it are in the KV cache or in this batch)
    slot: int  # the request's slot: its page-table row


def position_batch(reqs: list, tokens: list[list[int]], first: list[int], page_table: PageTable) -> ScheduledBatch:
    """A decode batch of request i's tokens[i] at positions first[i], first[i] + 1, ... (in
    request order, then position order); the pages of all those positions must be held."""
    rows = [
        PositionRow([token], start + j, req.slot)
        for req, toks, start in zip(reqs, tokens, first)
        for j, token in enumerate(toks)
    ]
    return ScheduledBatch(rows, [1] * len(rows), True, page_table, len(rows), runs=[len(t) for t in tokens])
