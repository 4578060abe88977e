"""Cascade decode attention: plan, on the host, how a decode batch reads shared prefixes once.

Owns: finding the requests of a decode batch that hold the same pages for a common prefix
(`plan_cascade`), and the work items that the cascade prefix kernel runs
(`nanoserve.attention.triton_kernels`).

Why: with the prefix cache, many running requests hold the very same pages for a long
common prefix (a system prompt, few-shot examples, `n` > 1 samples). Plain decode reads a
request's whole KV for each request, so at batch 256 over 2k-token shared prompts the same
prefix is read 256 times per step, and that traffic is the step. Here each group's prefix is
read once by one pass whose query tile holds every member's heads; each request's own
suffix goes through the usual split kernel; the reduce merges the two by log-sum-exp.

Why the result does not change: a page id names one place in the cache, so two requests
whose page tables agree on a column read the same K/V there. A group's `prefix_len` covers
only columns on which all members' tables agree and positions below every member's own
length, so each member's attention over positions < prefix_len is the same computation;
splitting a softmax into parts and merging them by log-sum-exp is exact up to rounding.

Invariants of a plan for a batch of B requests:
- a group has at least 2 and at most `max_members` members; its members' table rows are
  equal on the first ceil(prefix_len / page_size) columns and prefix_len < seq_len of each
  member (the new token is always in the suffix); prefix_len >= `min_tokens`;
- prefix_len[b] is b's group's prefix length, 0 for a request in no group; num_parts[b] is
  the number of its group's items;
- the items of a group cover [0, prefix_len) in order without overlap, with parts
  0..k-1 (k <= MAX_CASCADE_PARTS); there are at most `max_items` items and the unused ones
  are all zeros (count 0: the kernel skips them);
- `members` lists each group's batch rows contiguously; the rows of requests in no group
  are not listed (entries past the listed ones are 0).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from nanoserve.kernels.attention import ITEM_FIELDS, MAX_CASCADE_PARTS  # the kernel's work-item format

# A prefix shorter than this is not worth a separate pass: a member reading it again costs
# less than the pass's launch and merge.
MIN_CASCADE_TOKENS = 256
# Parts are at least this long and start at multiples of it (whole K/V tiles per part).
PART_ALIGN = 64
# Decode batches smaller than this do not use cascade (graphs for them have no variant).
MIN_CASCADE_BATCH = 8


def max_cascade_items(batch: int) -> int:
    """Work items a batch of `batch` rows may use: a group has >= 2 members, so there are at
    most batch // 2 groups; the rest of the room lets long prefixes be split."""
    return max(16, batch // 2)


@dataclass
class CascadePlan:
    prefix_len: np.ndarray  # int32 [B]
    num_parts: np.ndarray  # int32 [B]
    members: np.ndarray  # int32 [B]
    items: np.ndarray  # int32 [max_items, len(ITEM_FIELDS)]
    num_groups: int


def plan_cascade(
    table: np.ndarray,
    seq_lens: np.ndarray,
    page_size: int,
    max_members: int,
    max_items: int,
    target_items: int,
    min_tokens: int = MIN_CASCADE_TOKENS,
) -> CascadePlan | None:
    """Group the requests of a decode batch by shared prefix pages; None if no group is worth it.

    table: [B, width] the requests' page-table rows (zeros past their pages); seq_lens: [B]
    each request's length after this step. `max_members`: most requests one item serves
    (the prefix kernel's tile); `target_items`: how many items would fill the GPU (they are
    spread over groups by prefix length, within `max_items` and MAX_CASCADE_PARTS per group).
    """
    n = len(seq_lens)
    if n < 2 or max_members < 2:
        return None
    first_page = table[:, 0]
    order = np.argsort(first_page, kind="stable")
    keys = first_page[order]
    run_start = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    run_len = np.diff(np.r_[run_start, n])
    if not (run_len >= 2).any():  # no two requests even share a first page: the common case
        return None
    rows = table[order]
    leader = np.repeat(run_start, run_len)
    same = np.logical_and.accumulate(rows == rows[leader], axis=1)
    # Columns equal to the leader's, in tokens, kept below each member's new token.
    member_tokens = np.minimum(same.sum(axis=1) * page_size, seq_lens[order].astype(np.int64) - 1)
    run_tokens = np.minimum.reduceat(member_tokens, run_start)

    groups: list[tuple[int, int, int]] = []  # (start in `order`, members, prefix tokens)
    for start, length, tokens, key in zip(run_start, run_len, run_tokens, keys[run_start]):
        if length < 2 or tokens < min_tokens or key == 0:  # page 0: no page (padding)
            continue
        chunks = -(-length // max_members)
        sizes = np.full(chunks, length // chunks) + (np.arange(chunks) < length % chunks)
        offset = start
        for size in sizes:
            if size >= 2:
                groups.append((int(offset), int(size), int(tokens)))
            offset += size
    if not groups:
        return None

    parts = _parts_per_group([g[2] for g in groups], max_items, target_items)
    prefix_len = np.zeros(n, dtype=np.int32)
    num_parts = np.zeros(n, dtype=np.int32)
    members = np.zeros(n, dtype=np.int32)
    items = np.zeros((max_items, len(ITEM_FIELDS)), dtype=np.int32)
    listed = 0
    item = 0
    for (start, size, tokens), k in zip(groups, parts):
        batch_rows = order[start : start + size]
        members[listed : listed + size] = batch_rows
        prefix_len[batch_rows] = tokens
        part_len = _round_up(-(-tokens // k), PART_ALIGN)
        bounds = list(range(0, tokens, part_len)) + [tokens]
        num_parts[batch_rows] = len(bounds) - 1
        for part, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            items[item] = (listed, size, batch_rows[0], lo, hi, part)
            item += 1
        listed += size
    return CascadePlan(prefix_len, num_parts, members, items, len(groups))


def _parts_per_group(tokens: list[int], max_items: int, target_items: int) -> list[int]:
    """Parts for each group's prefix: `target_items` spread in proportion to prefix length,
    at least one each, at most MAX_CASCADE_PARTS and one per PART_ALIGN tokens, and no more
    than `max_items` in all (callers guarantee len(tokens) <= max_items)."""
    total = sum(tokens)
    target = min(max(target_items, len(tokens)), max_items)
    parts = [max(1, min(MAX_CASCADE_PARTS, -(-t // PART_ALIGN), round(target * t / total))) for t in tokens]
    while sum(parts) > max_items:
        parts[parts.index(max(parts))] -= 1
    return parts


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
