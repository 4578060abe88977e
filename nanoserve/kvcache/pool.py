"""KV storage and page ownership.

Owns: the preallocated K/V tensors (`KVCache`) and which of them each layer uses
(`KVLayout`), the page allocator
(`PageAllocator`) and the host-side page table of the request slots (`PageTable`).

Layout: each K/V tensor is [num_pages, page_size, num_kv_heads, head_dim]; a cache slot is
page * page_size + offset. A layer uses the tensor its `KVLayout` names: its own one, or with
window groups (nanoserve.kvcache.window) one shared by a layer of each page group.

Invariants of the allocator:
- every page is either free (refcount 0, on the free list exactly once) or owned
  (refcount >= 1, not on the free list);
- a page's refcount is the number of holders (requests sharing it, the prefix cache);
  a page returns to the free list when its last holder releases it;
- page 0 is reserved (never handed out): padded or dummy work writes there, so its
  contents are garbage and no request ever reads it;
- `num_cache_only` == the number of pages marked cached (stored by the prefix cache)
  whose refcount is 1, i.e. held by the cache alone; kept up to date on every change so
  that reporting it costs nothing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


@dataclass(frozen=True)
class KVLayout:
    """Per layer the K/V tensor it uses (-1: none, a linear-attention layer) and its page group
    (0: the request's pages; g >= 1: window group g)."""

    tensor_of_layer: tuple[int, ...]
    group_of_layer: tuple[int, ...]
    num_tensors: int
    num_window_groups: int = 0
    window: int = 0

    @staticmethod
    def per_layer(windows: list[int]) -> KVLayout:
        """Every layer with K/V its own tensor on the request's pages (`windows[i]` < 0: no K/V)."""
        tensors, n = [], 0
        for w in windows:
            tensors.append(-1 if w < 0 else n)
            n += w >= 0
        return KVLayout(tuple(tensors), (0,) * len(windows), n)

    @staticmethod
    def window_groups(windows: list[int]) -> KVLayout | None:
        """Window groups for layers of `windows` (0: full attention, > 0: that window, < 0:
        no K/V), or None where they do not apply: no full or no windowed layer, more full
        layers than windowed ones (a page of F layers would mostly pad the windowed ones), or
        windows of different sizes."""
        full = [i for i, w in enumerate(windows) if w == 0]
        windowed = [i for i, w in enumerate(windows) if w > 0]
        if not full or len(windowed) < len(full) or len({windows[i] for i in windowed}) != 1:
            return None
        f = len(full)
        tensors, groups = [-1] * len(windows), [0] * len(windows)
        for j, layer in enumerate(full):
            tensors[layer] = j
        for i, layer in enumerate(windowed):
            tensors[layer], groups[layer] = i % f, 1 + i // f
        return KVLayout(tuple(tensors), tuple(groups), f, pages_for(len(windowed), f), windows[windowed[0]])

    def window_pages_per_request(self, page_size: int, chunk: int) -> int:
        """Position pages a request's window groups hold at most: its window and a chunk of
        `chunk` new tokens, one page more where they straddle page boundaries."""
        return pages_for(self.window - 1 + chunk, page_size) + 1 if self.num_window_groups else 0

    def max_tokens(self, num_pages: int, page_size: int, chunk: int) -> int:
        """The longest request the pages can hold alone (the reserved page aside)."""
        held_by_windows = self.num_window_groups * self.window_pages_per_request(page_size, chunk)
        return max(num_pages - 1 - held_by_windows, 0) * page_size


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        layout: KVLayout | None = None,
    ):
        """`layout`: which tensor each layer uses (default: one per layer); a layer without
        one (linear attention) gets empty tensors."""
        self.num_pages = num_pages
        self.page_size = page_size
        self.layout = layout or KVLayout.per_layer([0] * num_layers)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        n = self.layout.num_tensors
        self.tensors_k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
        self.tensors_v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
        empty = torch.zeros(0, dtype=dtype, device=device)
        tensor_of = self.layout.tensor_of_layer
        self.k = [empty if t < 0 else self.tensors_k[t] for t in tensor_of]  # per layer
        self.v = [empty if t < 0 else self.tensors_v[t] for t in tensor_of]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    def copy_page(self, src: int, dst: int) -> None:
        for cache in (*self.tensors_k, *self.tensors_v):
            cache[dst].copy_(cache[src])


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    RESERVED_PAGE = 0

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError("the KV cache needs at least 2 pages (one is reserved)")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        self._refcount = [0] * num_pages
        self._cached = [False] * num_pages
        self.num_cache_only = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        """Pages that requests can ever hold (all but the reserved one)."""
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refcount[p] = 1
        return pages

    def _cache_only(self, page: int) -> bool:
        return self._cached[page] and self._refcount[page] == 1

    def mark_cached(self, pages: list[int], cached: bool) -> None:
        """The prefix cache says it stores (or stopped storing) these pages."""
        for p in pages:
            self.num_cache_only -= self._cache_only(p)
            self._cached[p] = cached
            self.num_cache_only += self._cache_only(p)

    def retain(self, pages: list[int]) -> None:
        """Add a holder to pages that are already owned."""
        for p in pages:
            if self._refcount[p] <= 0:
                raise RuntimeError(f"retain of free page {p}")
            self.num_cache_only -= self._cache_only(p)
            self._refcount[p] += 1
            self.num_cache_only += self._cache_only(p)

    def release(self, pages: list[int]) -> None:
        """Drop one holder from each page; pages with no holder left become free."""
        for p in pages:
            if self._refcount[p] <= 0:
                raise RuntimeError(f"double free of page {p}")
            self.num_cache_only -= self._cache_only(p)
            self._refcount[p] -= 1
            self.num_cache_only += self._cache_only(p)
            if self._refcount[p] == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refcount[page]


class PageTable:
    """Host copy of every request slot's pages: row `slot` of `rows` lists, in order, the
    pages of the request holding that slot, then zeros.

    Why: building each step's page table from the requests' Python lists costs time per
    request and per page on every step; with this table a step's inputs are a numpy
    gather by slot. The scheduler, which alone changes a request's pages, keeps it current.

    Invariants (checked by the scheduler's `check_invariants`):
    - a slot held by a request: rows[slot, :len(pages)] == pages, rows[slot, len(pages):] == 0;
    - a free slot's row is all zeros;
    - a request holds at most `max_pages` pages (max_model_len / page_size, rounded up).
    """

    def __init__(self, num_slots: int, max_pages: int):
        self.rows = np.zeros((num_slots, max_pages), dtype=np.int32)
        self.max_pages = max_pages

    def assign(self, slot: int, pages: list[int]) -> None:
        """`slot` was just given to a request (a free slot's row is zeros) holding `pages`."""
        self.extend(slot, 0, pages)

    def extend(self, slot: int, start: int, pages: list[int]) -> None:
        """The request at `slot` got `pages`, its pages number `start` and on."""
        if slot is None:  # numpy would read rows[None] as every row
            raise ValueError("page table update for a request without a slot")
        if start + len(pages) > self.max_pages:
            raise ValueError(f"a request needs {start + len(pages)} pages, the table has {self.max_pages} per slot")
        self.rows[slot, start : start + len(pages)] = pages

    def clear(self, slot: int) -> None:
        """`slot` is free again."""
        self.rows[slot] = 0
