"""Hybrid memory: sliding-window layers give back the pages that fell out of their window.

Owns: `WindowMap` (the
device table from a request's full-attention page to the pages its windowed layers use for
the same positions) and `WindowPager` (the scheduler's side: the window pages each request
holds, and giving back those no layer will read again).

Layout (`KVLayout.window_groups`, in nanoserve.kvcache.pool), as vLLM's hybrid allocator: with F full-attention layers and S >= F windowed ones, a
page of the one allocator holds the K/V of F layers for P tokens (F tensors of [num_pages, P,
kv_heads, head_dim]). Group 0 is the full layers: full layer j uses tensor j at the request's
`pages`, as every layer does without window groups. The windowed layers form ceil(S / F)
window groups of F layers (the last may have fewer): windowed layer i uses tensor i % F at the
pages of group 1 + i // F. Every page is the same size whichever group holds it, so the
budget needs no split between the kinds: a long request holds one page per P positions for
the full layers and only its window's worth for each window group.

Addressing: position page j of a request (positions jP .. jP + P - 1) has full page
`pages[j]` and, while a windowed layer may still read it, window page `map[g - 1, pages[j]]`
of group g. A windowed layer's page table is map[g - 1] gathered at the batch's page table,
its cache slots map[g - 1][slot // P] * P + slot % P: computed on the device from the batch's
own tensors (inside the decode graphs too), so a step carries nothing more. `map[:, 0]` is
0: padding rows and unused table columns stay in the reserved page.

Freeing: a request's next computed position is c = num_computed, and a windowed layer at c
reads positions c - W + 1 .. c. Position page j with (j + 1) * P <= c - W + 1 is never read
again: its window pages go back to the allocator. The map entry is left stale (no layer
reads it: the Triton kernels read the window only, the torch twin masks what lies before it,
and any page's contents are finite).

Invariants (`WindowPager.check` and the scheduler's page accounting):
- a request holding a slot has len(window_pages) <= len(pages); entries before
  `window_start` are None (given back), the rest are tuples of one page per window group,
  and map[:, pages[j]] equals entry j for every held entry (once the pending updates are
  flushed, which the runner does before every forward);
- window pages are allocator pages like any other: held by the requests whose entries name
  them (forks share them, each holding a reference) and by the prefix cache, which stores a
  request's entries with its pages (those not yet given back: a prompt's last window when
  its prompt is cached, its last window again when it ends). A cached prefix serves a request
  only as far as the window before its end is kept (`usable_prefix`): a conversation's next
  turn finds its previous turn's window, a prefix cut inside an old window finds less.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from nanoserve.kvcache.pool import KVLayout, PageAllocator, pages_for


class WindowMap:
    """The device table `map[g - 1, full page]` -> window page of group g (module docstring),
    updated from the host: the scheduler records changes (`set`), the runner applies them
    before a forward (`flush`) on the compute stream, after the forwards already queued."""

    def __init__(self, num_groups: int, num_pages: int, page_size: int, device: torch.device):
        self.page_size = page_size
        self.map = torch.zeros(num_groups, num_pages, dtype=torch.int32, device=device)
        self._pending: dict[int, tuple[int, ...]] = {}
        self._pinned = device.type == "cuda"

    def set(self, page: int, window_pages: tuple[int, ...]) -> None:
        self._pending[page] = window_pages

    def flush(self) -> None:
        if not self._pending:
            return
        pages = torch.tensor(list(self._pending), dtype=torch.long, pin_memory=self._pinned)
        values = torch.tensor(list(self._pending.values()), dtype=torch.int32, pin_memory=self._pinned)
        self._pending.clear()
        dev = self.map.device
        pages = pages.to(dev, non_blocking=True)
        self.map[:, pages] = values.to(dev, non_blocking=True).T

    def host_copy(self) -> np.ndarray:
        """The map with every recorded change applied, on the host (for invariant checks)."""
        self.flush()
        return self.map.cpu().numpy()

    def group_tables(
        self, page_table: torch.Tensor, slot_mapping: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per window group, the (page table, slot mapping) of a batch whose full pages are
        `page_table` [B, width] and new tokens' slots `slot_mapping` [T]."""
        ps = self.page_size
        flat = page_table.reshape(-1)
        page, offset = slot_mapping // ps, slot_mapping % ps
        out = []
        for row in self.map:
            table = row.index_select(0, flat).view(page_table.shape)
            slots = row.index_select(0, page).to(slot_mapping.dtype) * ps + offset
            out.append((table, slots))
        return out


class WindowPager:
    """The scheduler's side of window groups: per request `window_pages` (one entry per
    position page: a tuple of a page per window group, None once given back) and
    `window_start` (entries before it are given back). Every change of a held entry is
    recorded in the device map through `set_map`."""

    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        layout: KVLayout,
        set_map: Callable[[int, tuple[int, ...]], None],
        copy_page: Callable[[int, int], None],
    ):
        self.allocator = allocator
        self.page_size = page_size
        self.window = layout.window
        self.num_groups = layout.num_window_groups
        self.set_map = set_map
        self.copy_page = copy_page
        self.num_dropped = 0  # position pages given back early (each num_groups pages)

    def pages_needed(self, req, num_tokens: int) -> int:
        """Allocator pages `grow(req, num_tokens)` takes (after `drop(req)`)."""
        return self.num_groups * max(0, pages_for(num_tokens, self.page_size) - len(req.window_pages))

    def drop(self, req) -> None:
        """Give back the window pages no position from `req.num_computed` on reads."""
        end = (req.num_computed - self.window + 1) // self.page_size  # position pages [0, end) are out
        end = min(end, len(req.window_pages))
        for j in range(req.window_start, end):
            self.allocator.release(list(req.window_pages[j]))
            req.window_pages[j] = None
            self.num_dropped += 1
        req.window_start = max(req.window_start, end)

    def grow(self, req, num_tokens: int) -> None:
        """Window pages for `req`'s position pages up to `num_tokens` (its full pages exist)."""
        for j in range(len(req.window_pages), pages_for(num_tokens, self.page_size)):
            pages = tuple(self.allocator.alloc(self.num_groups))
            req.window_pages.append(pages)
            self.set_map(req.pages[j], pages)

    def usable_prefix(self, windows: list[tuple[int, ...] | None]) -> int:
        """Of a cached prefix whose position pages have these window pages (None: not kept),
        the most leading pages a request can take: those whose last window is kept whole
        (its windowed layers read positions end - W + 1 .. end - 1 before computing on)."""
        for k in range(len(windows), 0, -1):
            first = max(0, k * self.page_size - self.window + 1) // self.page_size
            if all(w is not None for w in windows[first:k]):
                return k
        return 0

    def attach(self, req, windows: list[tuple[int, ...] | None]) -> None:
        """`req` took a cached prefix of len(req.pages) pages whose window pages are `windows`:
        it holds those of its last window (retained), as if it had computed them."""
        k = len(req.pages)
        first = max(0, k * self.page_size - self.window + 1) // self.page_size
        req.window_start = first
        req.window_pages = [None] * first
        for j in range(first, k):
            entry = windows[j]
            self.allocator.retain(list(entry))
            req.window_pages.append(entry)
            self.set_map(req.pages[j], entry)  # unchanged while cached; restated for clarity

    def held(self, req) -> list[int]:
        return [p for entry in req.window_pages[req.window_start :] for p in entry]

    def release(self, req) -> None:
        held = self.held(req)
        if held:
            self.allocator.release(held)
        req.window_pages, req.window_start = [], 0

    def fork(self, parent, child, shared: int) -> None:
        """`child` shares `parent`'s first `shared` position pages and has its own copy of the
        partly filled page after them, if any (`child.pages` is set)."""
        child.window_start = min(parent.window_start, shared)
        child.window_pages = [None] * child.window_start
        for j in range(child.window_start, shared):
            entry = parent.window_pages[j]
            self.allocator.retain(list(entry))
            child.window_pages.append(entry)
        if len(child.pages) > shared:  # the copied partial page: copies of its window pages too
            pages = tuple(self.allocator.alloc(self.num_groups))
            for src, dst in zip(parent.window_pages[shared], pages):
                self.copy_page(src, dst)
            child.window_pages.append(pages)
            self.set_map(child.pages[shared], pages)

    def check(self, req, device_map: np.ndarray | None = None) -> None:
        """Invariants of one request's entries (module docstring); against the device map too
        when given (after a flush)."""
        assert len(req.window_pages) <= len(req.pages), "window pages beyond the request's pages"
        for j, entry in enumerate(req.window_pages):
            assert (entry is None) == (j < req.window_start), "window page given back out of order"
            if entry is not None and device_map is not None:
                assert tuple(device_map[:, req.pages[j]]) == entry, "window map differs from the request's pages"
