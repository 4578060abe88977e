"""Radix-tree prefix cache: reuse the KV pages of token prefixes computed before.

Owns: a tree whose keys are token ids and whose values are KV pages, one allocator
reference on every page stored in it, the lock counts that pin the paths running
requests use, LRU eviction of unpinned leaves, and hit/query counters.
Does not own: the allocator, the pages' contents (`KVCache`), or any request's
references on its own pages.

Granularity: with page size P the tree stores whole pages only. A node's key is a
tuple of k*P tokens (k >= 1) and its value the k pages that hold their KV, page i
for key[i*P:(i+1)*P]. The path root..node spells a page-aligned prefix whose pages
are the values along the path, in order. A match is the longest cached prefix rounded
down to whole pages; a partial tail page is never cached.

Ownership protocol (see `insert` for the worked example):
- the tree takes its own reference (`retain`) on each page it newly stores and drops
  it (`release`) when it evicts the page; it never consumes a caller's reference;
- callers keep exactly the references they had: whoever allocated or retained a page
  releases it, whether or not the tree also stores it.

Invariants (`check_invariants` verifies them; tests/test_radix_cache.py drives it):
 1. Structure: the root has an empty key and no pages; every other node has a
    nonempty key with len(key) == P * len(pages) and sits in parent.children under
    key[:P]. So siblings differ in their first page, and a page-aligned prefix has at
    most one place in the tree.
 2. Ownership: the tree holds exactly one reference on each page it stores, so
    refcount(p) == 1 + (requests holding p) for a stored page, and a page no request
    holds has refcount 1. No page is stored twice (in two nodes or twice in one); the
    reserved page 0 is never stored.
 3. Accounting: every usable page is exactly one of free, stored in the tree, or held
    only by requests (R of them), so
        allocator.num_free + num_cached_pages + R == allocator.num_usable,
        num_cached_pages == num_evictable_pages + num_protected_pages.
    With no request running, R == 0 and every stored page is cache-only.
 4. Locks: node.lock_ref == outstanding lock() calls on the node or any descendant
    == its own locks + sum(child.lock_ref), hence >= each child's lock_ref. A locked
    node's ancestors are locked; protected pages are those of nodes with lock_ref > 0.
 5. Recency: node.last_access >= child.last_access, because every touch stamps the
    whole path root..node.
 6. Eviction removes only leaves with lock_ref == 0, least recently used first; a
    parent becomes a candidate when its last child goes. By 4 a locked path is never
    evicted; by 5 a parent is never less recent than its descendants.
Splitting a node never changes what is cached, which pages are protected, or any
handle's meaning: the original node object keeps the lower part, so a handle taken
before the split still names the same prefix.

Window groups (nanoserve.kvcache.window): a node may also hold, per page of its key, the
windowed layers' pages of those positions (`windows[i]`: a tuple of one page per window
group, or None where the inserting request had given them back). They are stored pages like
the others for invariants 2, 3 and 6 (counted, retained, evicted with their node); a match
returns them along the path (`PrefixMatch.windows`) and the caller uses only as much of the
match as has its last window's pages.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from nanoserve.kvcache.pool import PageAllocator


@dataclass(eq=False)
class RadixNode:
    """One tree node. Callers treat it as an opaque handle for `lock`/`unlock`."""

    key: tuple[int, ...]  # k*P tokens; the path root..node spells the cached prefix
    pages: list[int]  # k pages, page i holds the KV of key[i*P:(i+1)*P]
    parent: RadixNode | None
    node_id: int  # tie-breaker for the eviction heap, unique per cache
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)  # by key[:P]
    lock_ref: int = 0  # invariant 4
    last_access: int = 0  # logical clock of the last touch (invariant 5)
    detached: bool = False  # evicted or reset: no longer a valid handle
    # Window groups: [] (none), or per page the windowed layers' pages of its positions (None: not kept).
    windows: list[tuple[int, ...] | None] = field(default_factory=list)

    def stored(self) -> list[int]:
        """Every page the node holds: its pages, then its window pages."""
        if not self.windows:
            return self.pages
        return self.pages + [p for w in self.windows if w is not None for p in w]

    def __repr__(self) -> str:
        return f"RadixNode(id={self.node_id}, tokens={len(self.key)}, pages={self.pages}, lock_ref={self.lock_ref})"


@dataclass(frozen=True)
class PrefixMatch:
    """Result of `match_prefix`: the cached pages of the longest page-aligned prefix.

    `pages` is a fresh list (the caller may keep or mutate it); `node` is the handle to
    lock while the pages are in use. `num_tokens == len(pages) * page_size`.
    """

    pages: list[int]
    num_tokens: int
    node: RadixNode
    windows: list[tuple[int, ...] | None] = field(default_factory=list)  # per page, with window groups


class RadixCache:
    """Prefix cache over a `PageAllocator`; see the module docstring for invariants."""

    def __init__(self, allocator: PageAllocator, page_size: int):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self._ids = itertools.count()
        self._root = RadixNode(key=(), pages=[], parent=None, node_id=next(self._ids))
        self._clock = 0
        self._pages: set[int] = set()  # every page stored in the tree (invariant 2)
        self._num_evictable = 0
        self._num_protected = 0
        self.query_tokens = 0  # tokens passed to counted match_prefix calls
        self.hit_tokens = 0  # of those, tokens found cached

    # ---- counters -------------------------------------------------------------

    @property
    def num_cached_pages(self) -> int:
        """Pages the tree holds a reference on (some may also be held by requests)."""
        return len(self._pages)

    @property
    def num_evictable_pages(self) -> int:
        """Pages in unlocked nodes. Evicting them frees only those no request holds."""
        return self._num_evictable

    @property
    def num_protected_pages(self) -> int:
        """Pages in locked nodes (on the path of some running request's match)."""
        return self._num_protected

    @property
    def num_nodes(self) -> int:
        """Nodes other than the root. O(nodes)."""
        return sum(1 for _ in self._nodes())

    def num_cache_only_pages(self) -> int:
        """Pages held by the tree and nobody else (refcount 1). O(1): the allocator
        keeps the count, since the tree marks the pages it stores.

        This is what `kv_pages_cached` should report: with no request running,
        allocator.num_free + num_cache_only_pages() == allocator.num_usable.
        """
        return self.allocator.num_cache_only

    def num_reclaimable_pages(self) -> int:
        """Pages `evict` would return to the free list if it evicted everything it
        may: cache-only pages in unlocked nodes. O(cached pages)."""
        return sum(
            1 for node in self._nodes() if node.lock_ref == 0 for p in node.stored() if self.allocator.refcount(p) == 1
        )

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    # ---- lookup ---------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], *, peek: bool = False) -> PrefixMatch:
        """Longest cached prefix of token_ids, rounded down to whole pages.

        Splits the node the match ends inside, so `result.node`'s path is exactly the
        matched prefix. Takes no references: a request that uses the pages locks
        `result.node` (so the tree keeps the entry and `evict` skips it) and
        `allocator.retain`s the pages (so they are its own, like freshly allocated
        ones, and its usual release at the end is balanced). Do both before the next
        `evict`; a request that is then not admitted after all releases and unlocks.

        Unless peek, stamps the matched path as most recently used and adds to
        query_tokens (len(token_ids)) and hit_tokens (result.num_tokens); peek=True is
        for internal look-ups that should leave LRU order and statistics alone.
        """
        key = self._page_aligned(token_ids)
        node, matched = self._walk(key)
        if not peek:
            self._touch(node)
            self.query_tokens += len(token_ids)
            self.hit_tokens += matched
        return PrefixMatch(self._path_pages(node), matched, node, self._path_pages(node, "windows"))

    # ---- locking --------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        """Pin the path root..node against eviction (counted; pair with `unlock`).

        Locking the root (an empty match) is a no-op. Raises if the node was evicted.
        """
        self._check_handle(node)
        while node is not self._root:
            if node.lock_ref == 0:
                n = len(node.stored())
                self._num_evictable -= n
                self._num_protected += n
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one `lock(node)`."""
        self._check_handle(node)
        if node is not self._root and node.lock_ref <= 0:
            raise RuntimeError(f"unlock of unlocked {node!r}")
        while node is not self._root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                n = len(node.stored())
                self._num_protected -= n
                self._num_evictable += n
            node = node.parent

    # ---- insertion ------------------------------------------------------------

    def insert(
        self, token_ids: Sequence[int], pages: Sequence[int], windows: Sequence[tuple[int, ...] | None] = ()
    ) -> int:
        """Cache the KV of token_ids' whole pages; return how many tokens were cached already.

        `pages[i]` must hold the KV of token_ids[i*P:(i+1)*P]; pass either exactly the
        len(token_ids)//P full pages or those plus the partial tail page (ignored), so
        a request can pass its whole page list. Only pass tokens whose KV has been
        written (not the last sampled token, whose KV nobody computed yet).

        Ownership: the tree retains each page it newly stores (those past the already
        cached prefix). It never takes over the caller's references, so the caller's
        bookkeeping does not depend on what happened here: afterwards the caller
        releases all of its pages exactly as it would without a cache. Pages newly
        stored survive on the tree's reference; caller pages that duplicate an already
        cached prefix (computed twice, e.g. two identical prompts running together)
        are freed by that release.

        Example (P=1, tree caches [5, 6] on pages [3, 4], a request holds [3, 4, 9, 10]
        for tokens [5, 6, 7, 8], having retained 3 and 4 when it matched them):
            n = cache.insert([5, 6, 7, 8], [3, 4, 9, 10])  # n == 2; tree retains 9, 10
            allocator.release([3, 4, 9, 10])  # refcounts back to 1: all held by the tree
            cache.unlock(match.node)
        Had the request computed [5, 6] itself on pages [1, 2], it would pass [1, 2, 9, 10]:
        n == 2 still, the tree keeps 3 and 4 and retains 9, 10, and the release frees 1, 2.

        `windows` (window groups): per page of `pages`, the caller's window pages of its
        positions or None; stored with the pages they belong to, on the same terms.

        Raises ValueError (before changing what is cached) if the page count does not
        fit, or a page to store is already in the tree, repeated, reserved, or not
        held by the caller.
        """
        P = self.page_size
        num_full = len(token_ids) // P
        if not num_full <= len(pages) <= -(-len(token_ids) // P):
            raise ValueError(
                f"{len(token_ids)} tokens need {num_full} full pages (+1 partial allowed), got {len(pages)}"
            )
        key = self._page_aligned(token_ids)
        node, cached = self._walk(key)
        new_pages = [int(p) for p in pages[cached // P : num_full]]
        if new_pages:
            leaf = RadixNode(key=key[cached:], pages=new_pages, parent=node, node_id=next(self._ids))
            if windows:
                leaf.windows = list(windows[cached // P : num_full])
            stored = leaf.stored()
            self._check_adoptable(stored)
            self.allocator.retain(stored)
            self.allocator.mark_cached(stored, True)
            node.children[leaf.key[:P]] = leaf
            self._pages.update(stored)
            self._num_evictable += len(stored)  # a new leaf is unlocked
            node = leaf
        self._touch(node)
        return cached

    # ---- eviction -------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Evict LRU unlocked leaves until num_pages pages were freed or none is left.

        Returns the pages actually returned to the allocator's free list. Evicting a
        page some request also holds (refcount > 1) drops the tree's reference but
        frees nothing, so it does not count; it still has to go to reach its parent.
        """
        if num_pages <= 0:
            return 0
        heap = [(n.last_access, n.node_id, n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key[: self.page_size]]
            freed += self._drop(node)
            if parent is not self._root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed

    def reset(self) -> None:
        """Release every page the tree holds and forget everything, counters included.

        For shutdown and tests. Outstanding handles become invalid (lock/unlock on
        them raise); requests keep their own references on their pages.
        """
        for node in list(self._nodes()):
            self._drop(node)
        self._root.children.clear()
        self._num_evictable = self._num_protected = 0
        self.query_tokens = self.hit_tokens = 0

    # ---- checking -------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if invariants 1, 2, 4, 5 or the cache's own counters break."""

        def fail(msg: str) -> None:
            raise AssertionError(msg)

        P = self.page_size
        root = self._root
        if root.key or root.pages or root.parent is not None or root.detached:
            fail("corrupt root")
        seen: set[int] = set()
        evictable = protected = 0
        for node in self._nodes():
            if node.detached or not node.key or len(node.key) != P * len(node.pages):
                fail(f"bad node shape {node!r}")
            if node.windows and len(node.windows) != len(node.pages):
                fail(f"{node!r} has window pages for {len(node.windows)} of its {len(node.pages)} pages")
            if node.parent.children.get(node.key[:P]) is not node:
                fail(f"{node!r} not filed under its first page")
            if node.parent is not root and node.last_access > node.parent.last_access:
                fail(f"{node!r} more recent than its parent")
            if node.lock_ref < sum(c.lock_ref for c in node.children.values()) or node.lock_ref < 0:
                fail(f"{node!r} lock_ref below its children's")
            for p in node.stored():
                if p in seen or p == PageAllocator.RESERVED_PAGE:
                    fail(f"page {p} stored twice or reserved")
                if self.allocator.refcount(p) < 1:
                    fail(f"cached page {p} is free")
                seen.add(p)
            if node.lock_ref:
                protected += len(node.stored())
            else:
                evictable += len(node.stored())
        if seen != self._pages:
            fail("page set out of sync with the tree")
        if (evictable, protected) != (self._num_evictable, self._num_protected):
            fail(f"counters {(self._num_evictable, self._num_protected)} != tree {(evictable, protected)}")
        cache_only = sum(1 for p in seen if self.allocator.refcount(p) == 1)
        if cache_only != self.allocator.num_cache_only:
            fail(f"allocator counts {self.allocator.num_cache_only} cache-only pages, the tree {cache_only}")

    # ---- internals ------------------------------------------------------------

    def _page_aligned(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        n = len(token_ids) // self.page_size * self.page_size
        return tuple(map(int, token_ids[:n]))  # int(): tensors/numpy ints hash by value too

    def _walk(self, key: tuple[int, ...]) -> tuple[RadixNode, int]:
        """Follow key (page-aligned) down the tree as far as whole pages match.

        Returns (node, matched tokens), node's path being exactly key[:matched]: where
        the match ends inside a node, that node is split there.
        """
        P = self.page_size
        node, pos = self._root, 0
        while pos < len(key):
            child = node.children.get(key[pos : pos + P])
            if child is None:
                break
            n = self._common_tokens(child.key, key, pos)  # >= P: the first page matched
            if n < len(child.key):
                child = self._split(child, n)
            node, pos = child, pos + n
        return node, pos

    def _common_tokens(self, node_key: tuple[int, ...], key: tuple[int, ...], pos: int) -> int:
        """Length of the common prefix of node_key and key[pos:], rounded down to pages."""
        n = min(len(node_key), len(key) - pos)  # both page multiples
        if node_key[:n] == key[pos : pos + n]:  # fast path: whole overlap equal
            return n
        i = 0
        while node_key[i] == key[pos + i]:
            i += 1
        return i - i % self.page_size

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut node after `at` tokens (a page multiple); return the new upper part.

        The original object keeps the lower part so outstanding handles stay valid;
        the upper part inherits lock_ref (every lock below node passes through it) and
        last_access, so counters and invariants 4-5 are unchanged.
        """
        P = self.page_size
        upper = RadixNode(
            key=node.key[:at],
            pages=node.pages[: at // P],
            parent=node.parent,
            node_id=next(self._ids),
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        if node.windows:
            upper.windows, node.windows = node.windows[: at // P], node.windows[at // P :]
        upper.parent.children[upper.key[:P]] = upper  # same first page: replaces node
        node.key, node.pages, node.parent = node.key[at:], node.pages[at // P :], upper
        upper.children[node.key[:P]] = node
        return upper

    def _touch(self, node: RadixNode) -> None:
        self._clock += 1
        while node is not self._root:
            node.last_access = self._clock
            node = node.parent

    def _path_pages(self, node: RadixNode, attr: str = "pages") -> list:
        """The `pages` (or `windows`) of the path root..node, in order ([] for windows when
        the tree keeps none)."""
        parts: list[list] = []
        while node is not self._root:
            parts.append(getattr(node, attr))
            node = node.parent
        if attr == "windows" and not all(parts):
            return []
        return [p for part in reversed(parts) for p in part]

    def _nodes(self) -> Iterator[RadixNode]:
        """Every node but the root, parents before children."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _drop(self, node: RadixNode) -> int:
        """Release the tree's reference on node's pages (node already unlinked or being
        reset); return how many went back to the free list."""
        stored = node.stored()
        freed = sum(1 for p in stored if self.allocator.refcount(p) == 1)
        self.allocator.mark_cached(stored, False)
        self.allocator.release(stored)
        self._pages.difference_update(stored)
        if node.lock_ref == 0:
            self._num_evictable -= len(stored)
        node.detached = True
        node.parent = None
        return freed

    def _check_handle(self, node: RadixNode) -> None:
        if node.detached:
            raise RuntimeError(f"{node!r} was evicted; match again instead of reusing an old handle")

    def _check_adoptable(self, pages: list[int]) -> None:
        if len(set(pages)) != len(pages):
            raise ValueError(f"page repeated in {pages}")
        for p in pages:
            if p in self._pages:
                raise ValueError(f"page {p} is already cached under another prefix")
            if p == PageAllocator.RESERVED_PAGE or self.allocator.refcount(p) < 1:
                raise ValueError(f"page {p} is reserved or free: the caller must hold it")
