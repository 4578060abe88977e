"""Radix prefix cache: unit tests and a hypothesis state machine against a reference model."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nanoserve.kvcache.pool import PageAllocator
from nanoserve.kvcache.radix import RadixCache, RadixNode


def make(num_pages: int = 32, page_size: int = 1) -> tuple[PageAllocator, RadixCache]:
    alloc = PageAllocator(num_pages)
    return alloc, RadixCache(alloc, page_size)


def cache_seq(alloc: PageAllocator, cache: RadixCache, tokens: list[int]) -> list[int]:
    """Run a 'request' that computed all of tokens itself: alloc, insert, release."""
    pages = alloc.alloc(-(-len(tokens) // cache.page_size))
    cache.insert(tokens, pages)
    alloc.release(pages)
    return pages[: len(tokens) // cache.page_size]


# ---- unit tests ---------------------------------------------------------------


def test_empty_cache_matches_nothing():
    _, cache = make()
    m = cache.match_prefix([1, 2, 3])
    assert (m.pages, m.num_tokens) == ([], 0)
    cache.lock(m.node)  # the root: no-op
    cache.unlock(m.node)
    assert cache.evict(10) == 0
    cache.check_invariants()


def test_insert_then_match_exact_partial_and_longer():
    alloc, cache = make()
    pages = cache_seq(alloc, cache, [1, 2, 3, 4])
    assert alloc.num_free == alloc.num_usable - 4
    assert [alloc.refcount(p) for p in pages] == [1, 1, 1, 1]  # only the tree holds them
    assert cache.match_prefix([1, 2, 3, 4]).pages == pages
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).pages == pages
    m = cache.match_prefix([1, 2, 9])
    assert (m.pages, m.num_tokens) == (pages[:2], 2)
    assert cache.match_prefix([2, 1]).num_tokens == 0
    cache.check_invariants()


def test_split_on_match_and_on_insert():
    alloc, cache = make()
    pages = cache_seq(alloc, cache, [1, 2, 3, 4])
    assert cache.num_nodes == 1
    m = cache.match_prefix([1, 2, 7])  # ends inside the node: split at 2
    assert cache.num_nodes == 2 and m.node.key == (1, 2) and m.node.pages == pages[:2]
    new = alloc.alloc(4)
    assert cache.insert([1, 2, 7, 8], new) == 2  # first two already cached
    alloc.release(new)  # frees new[:2] (duplicates), new[2:] stay with the tree
    assert alloc.refcount(new[0]) == 0 and alloc.refcount(new[2]) == 1
    assert cache.match_prefix([1, 2, 7, 8]).pages == pages[:2] + new[2:]
    assert cache.match_prefix([1, 2, 3, 4]).pages == pages
    # a split inside an insert path: [1] is shared, [2, ...] diverges at the second node's middle
    n3 = alloc.alloc(3)
    assert cache.insert([1, 2, 3, 9], pages[:3] + [n3[0]]) == 3
    alloc.release(n3)
    assert cache.match_prefix([1, 2, 3, 9]).pages == pages[:3] + [n3[0]]
    assert cache.num_cached_pages == 4 + 2 + 1
    cache.check_invariants()


def test_page_alignment_with_page_size_16():
    P = 16
    alloc, cache = make(page_size=P)
    toks = list(range(40))  # 2 full pages + 8 tokens
    pages = alloc.alloc(3)
    assert cache.insert(toks, pages) == 0  # the partial third page is ignored
    alloc.release(pages)
    assert alloc.refcount(pages[2]) == 0 and cache.num_cached_pages == 2
    assert cache.match_prefix(toks).num_tokens == 32
    assert cache.match_prefix(toks[:35] + [99] * 12).pages == pages[:2]
    m = cache.match_prefix(toks[:20] + [99] * 12)  # diverges in page 2: rounds down, splits
    assert (m.pages, m.num_tokens) == (pages[:1], 16) and cache.num_nodes == 2
    assert cache.match_prefix(toks[:5] + [99] * 30).num_tokens == 0  # diverges in page 1
    assert cache.match_prefix(toks[:31]).num_tokens == 16  # a query shorter than a page
    with pytest.raises(ValueError):
        cache.insert(toks, pages[:1])  # too few pages
    with pytest.raises(ValueError):
        cache.insert(toks, pages + pages[:1])  # more than full + partial
    cache.check_invariants()


def test_insert_rejects_misuse_without_changing_contents():
    alloc, cache = make()
    pages = cache_seq(alloc, cache, [1, 2])
    held = alloc.alloc(2)
    with pytest.raises(ValueError):  # page already cached under [1]
        cache.insert([5, 6], [pages[0], held[0]])
    with pytest.raises(ValueError):  # repeated page
        cache.insert([5, 6], [held[0], held[0]])
    with pytest.raises(ValueError):  # reserved page
        cache.insert([5, 6], [0, held[0]])
    free_page = alloc.alloc(1)[0]
    alloc.release([free_page])
    with pytest.raises(ValueError):  # a free page: the caller does not hold it
        cache.insert([5, 6], [held[0], free_page])
    assert cache.num_cached_pages == 2 and [alloc.refcount(p) for p in held] == [1, 1]
    cache.check_invariants()


def test_ownership_protocol_example_from_docstring():
    alloc, cache = make(page_size=1)
    tree_pages = cache_seq(alloc, cache, [5, 6])
    m = cache.match_prefix([5, 6, 7, 8][:3])  # scheduler caps the match below the prompt
    cache.lock(m.node)
    alloc.retain(m.pages)  # the request keeps its own references on matched pages
    mine = m.pages + alloc.alloc(2)
    assert cache.insert([5, 6, 7, 8], mine) == 2
    alloc.release(mine)
    cache.unlock(m.node)
    assert [alloc.refcount(p) for p in mine] == [1, 1, 1, 1]
    assert cache.match_prefix([5, 6, 7, 8]).pages == mine and mine[:2] == tree_pages
    assert alloc.num_free + cache.num_cache_only_pages() == alloc.num_usable


def test_lock_protects_path_and_unlock_makes_it_evictable():
    alloc, cache = make()
    cache_seq(alloc, cache, [1, 2, 3])
    cache_seq(alloc, cache, [1, 2, 4])
    cache_seq(alloc, cache, [7, 8])
    m = cache.match_prefix([1, 2, 3])
    cache.lock(m.node)
    assert cache.num_protected_pages == 3 and cache.num_evictable_pages == 3
    assert cache.evict(100) == 3  # [4] then [7, 8]; [1, 2] still has the locked child
    assert cache.match_prefix([1, 2, 3]).pages == m.pages
    assert cache.num_evictable_pages == 0 and cache.num_cached_pages == 3
    cache.unlock(m.node)
    with pytest.raises(RuntimeError):
        cache.unlock(m.node)  # unbalanced
    assert cache.num_evictable_pages == 3
    assert cache.evict(100) == 3 and alloc.num_free == alloc.num_usable
    with pytest.raises(RuntimeError):
        cache.lock(m.node)  # evicted handle
    cache.check_invariants()


def test_handle_survives_a_split_above_it():
    alloc, cache = make()
    cache_seq(alloc, cache, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.lock(m.node)
    cache.match_prefix([1, 2, 9])  # splits the locked node; handle keeps the lower part
    assert cache.num_nodes == 2 and cache.num_protected_pages == 4
    assert cache.evict(100) == 0
    cache.unlock(m.node)
    assert cache.num_protected_pages == 0 and cache.evict(100) == 4
    cache.check_invariants()


def test_lru_order():
    alloc, cache = make()
    a = cache_seq(alloc, cache, [1, 1])
    b = cache_seq(alloc, cache, [2, 2])
    c = cache_seq(alloc, cache, [3, 3])
    cache.match_prefix([1, 1])  # a is now the most recent
    cache.match_prefix([3, 3], peek=True)  # peek does not refresh c
    assert cache.evict(1) == 2  # whole leaf b goes first
    assert all(alloc.refcount(p) == 0 for p in b)
    assert cache.evict(1) == 2 and all(alloc.refcount(p) == 0 for p in c)
    assert cache.match_prefix([1, 1]).pages == a


def test_parent_becomes_evictable_after_its_last_child():
    alloc, cache = make()
    cache_seq(alloc, cache, [1, 2, 3])
    cache_seq(alloc, cache, [1, 2, 4])  # splits: [1, 2] -> {[3], [4]}
    cache.match_prefix([1, 2, 4])  # [4] (and its parent) more recent than [3]
    assert cache.evict(1) == 1 and cache.match_prefix([1, 2, 3], peek=True).num_tokens == 2
    assert cache.evict(1) == 1 and cache.num_nodes == 1  # [4]; the parent stays: enough freed
    assert cache.evict(1) == 2 and cache.num_nodes == 0  # now the parent is a leaf
    assert alloc.num_free == alloc.num_usable


def test_evict_counts_only_pages_really_freed():
    alloc, cache = make()
    cache_seq(alloc, cache, [1, 2])
    cache_seq(alloc, cache, [1, 3])
    m = cache.match_prefix([1, 2])
    alloc.retain(m.pages)  # a request holds [1, 2]'s pages but did not lock them
    cache.match_prefix([1, 3])  # so [2] is the LRU leaf
    # [2] goes first (frees nothing: the request holds it), then [3] frees one page
    assert cache.evict(1) == 1 and cache.num_cached_pages == 1
    assert alloc.refcount(m.pages[1]) == 1  # still held by the request
    assert cache.evict(5) == 0  # [1] is also held by the request
    alloc.release(m.pages)
    assert alloc.num_free == alloc.num_usable


def test_stats_and_reset():
    alloc, cache = make(page_size=2)
    cache_seq(alloc, cache, [1, 2, 3, 4])
    cache.match_prefix([1, 2, 3, 4, 5])
    cache.match_prefix([1, 2, 9])
    cache.match_prefix([1, 2, 3, 4], peek=True)
    assert (cache.query_tokens, cache.hit_tokens) == (8, 6)
    assert cache.hit_rate == pytest.approx(0.75)
    m = cache.match_prefix([1, 2])
    cache.lock(m.node)
    cache.reset()
    assert alloc.num_free == alloc.num_usable and cache.num_cached_pages == 0
    assert (cache.query_tokens, cache.num_protected_pages, cache.num_nodes) == (0, 0, 0)
    with pytest.raises(RuntimeError):
        cache.unlock(m.node)
    cache.check_invariants()


# ---- state machine against a reference model ----------------------------------

# Page contents come from a few patterns so prefixes collide, siblings appear and
# nodes split. For P=16 two patterns differ only in their last token, one in its
# second half: a mismatch inside a page must round the match down.
PATTERNS = {
    1: [(0,), (1,), (2,), (3,)],
    16: [(0,) * 16, (0,) * 15 + (1,), (1,) * 16, (0,) * 8 + (2,) * 8],
}
# A sequence is a prefix of one seen before (so that matches hit and paths grow deep)
# followed by fresh pages and a tail that may leave a partial page.
token_args = {
    "base": st.integers(0, 1000),
    "keep": st.integers(0, 8),
    "pattern_ids": st.lists(st.integers(0, 3), max_size=4),
    "tail": st.lists(st.integers(0, 3), max_size=3),
}
MAX_PAGES_PER_SEQ = 8


@dataclass
class Req:
    tokens: tuple[int, ...]
    pages: list[int]  # one reference each, held by this request
    handle: RadixNode | None  # locked match node, if any
    locked_prefix: tuple[int, ...]


class RadixMachine(RuleBasedStateMachine):
    P = 1
    NUM_PAGES = 40

    def __init__(self):
        super().__init__()
        self.alloc = PageAllocator(self.NUM_PAGES)
        self.cache = RadixCache(self.alloc, self.P)
        # reference model: page-aligned prefix -> page holding its last P tokens
        self.model: dict[tuple[int, ...], int] = {}
        self.stamp: dict[tuple[int, ...], int] = {}  # prefix -> logical time of last touch
        self.clock = 0
        self.reqs: list[Req] = []
        self.raw: list[list[int]] = []  # pages held outside any request with tokens
        self.locks: list[tuple[RadixNode, tuple[int, ...]]] = []
        self.stale: list[tuple[RadixNode, tuple[int, ...]]] = []  # unlocked handles
        self.query = self.hit = 0
        self.seen: list[tuple[int, ...]] = []  # token sequences used so far

    # -- model helpers --

    def tokens(self, base: int, keep: int, pattern_ids: list[int], tail: list[int]) -> tuple[int, ...]:
        start = self.seen[base % len(self.seen)][: keep * self.P] if self.seen else ()
        tokens = start + tuple(t for i in pattern_ids for t in PATTERNS[self.P][i]) + tuple(tail)
        tokens = tokens[: MAX_PAGES_PER_SEQ * self.P]
        self.seen.append(tokens)
        return tokens

    def prefixes(self, tokens: tuple[int, ...], num_pages: int) -> list[tuple[int, ...]]:
        return [tokens[: (k + 1) * self.P] for k in range(num_pages)]

    def expected_match(self, tokens: tuple[int, ...]) -> list[int]:
        pages = []
        for prefix in self.prefixes(tokens, len(tokens) // self.P):
            if prefix not in self.model:
                break
            pages.append(self.model[prefix])
        return pages

    def touch(self, prefixes: list[tuple[int, ...]]) -> None:
        self.clock += 1
        for p in prefixes:
            self.stamp[p] = self.clock

    def protected(self) -> set[tuple[int, ...]]:
        locked = [p for _, p in self.locks] + [r.locked_prefix for r in self.reqs if r.handle is not None]
        return {q for p in locked for q in self.prefixes(p, len(p) // self.P)}

    def tree_content(self) -> dict[tuple[int, ...], tuple[int, int]]:
        out = {}
        stack = [(self.cache._root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                for i, page in enumerate(child.pages):
                    out[prefix + child.key[: (i + 1) * self.P]] = (page, child.last_access)
                stack.append((child, prefix + child.key))
        return out

    def do_match(self, tokens: tuple[int, ...], peek: bool):
        m = self.cache.match_prefix(tokens, peek=peek)
        expected = self.expected_match(tokens)
        assert m.pages == expected and m.num_tokens == len(expected) * self.P
        if not peek:
            self.touch(self.prefixes(tokens, len(expected)))
            self.query += len(tokens)
            self.hit += m.num_tokens
        return m

    def do_evict(self, n: int) -> int:
        before_free, before = self.alloc.num_free, dict(self.model)
        protected = self.protected()
        freed = self.cache.evict(n)
        assert freed == self.alloc.num_free - before_free
        after = {p: v for p, (v, _) in self.tree_content().items()}
        assert after.items() <= before.items()
        removed = before.keys() - after.keys()
        assert not removed & protected, "evicted a locked prefix"
        if freed < n:
            assert self.cache.num_evictable_pages == 0
        # LRU: nothing evicted is more recent than a surviving unlocked leaf
        parents = {q[: -self.P] for q in after}
        leaves = [p for p in after if p not in protected and p not in parents]
        if removed and leaves:
            assert max(self.stamp[p] for p in removed) <= min(self.stamp[p] for p in leaves)
        self.model = after
        for p in removed:
            del self.stamp[p]
        return freed

    # -- rules --

    @rule(**token_args, peek=st.booleans(), lock=st.booleans())
    def match(self, base, keep, pattern_ids, tail, peek, lock):
        tokens = self.tokens(base, keep, pattern_ids, tail)
        m = self.do_match(tokens, peek)
        prefix = tokens[: m.num_tokens]
        if lock:
            self.cache.lock(m.node)
            self.locks.append((m.node, prefix))
        else:
            self.stale.append((m.node, prefix))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        node, prefix = self.locks.pop(i % len(self.locks))
        self.cache.unlock(node)
        self.stale.append((node, prefix))

    @precondition(lambda self: self.stale)
    @rule(i=st.integers(0, 100))
    def relock_old_handle(self, i):
        node, prefix = self.stale.pop(i % len(self.stale))
        if node.detached:  # evicted since: must be refused
            try:
                self.cache.lock(node)
            except RuntimeError:
                return
            raise AssertionError("locked an evicted handle")
        self.cache.lock(node)  # still in the tree: still names exactly its prefix
        assert self.cache._path_pages(node) == [self.model[p] for p in self.prefixes(prefix, len(prefix) // self.P)]
        self.cache.unlock(node)

    @rule(**token_args, lock=st.booleans())
    def admit(self, base, keep, pattern_ids, tail, lock):
        """What the scheduler does: match, lock, retain, evict if short, allocate."""
        tokens = self.tokens(base, keep, pattern_ids, tail)
        m = self.do_match(tokens, peek=False)
        if lock:
            self.cache.lock(m.node)
        self.alloc.retain(m.pages)
        need = -(-len(tokens) // self.P) - len(m.pages)
        if self.alloc.num_free < need:
            self.do_evict(need - self.alloc.num_free)
        if self.alloc.num_free < need:  # cannot admit: undo
            self.alloc.release(m.pages)
            if lock:
                self.cache.unlock(m.node)
            else:
                self.stale.append((m.node, tokens[: m.num_tokens]))
            return
        pages = m.pages + self.alloc.alloc(need)
        self.reqs.append(Req(tokens, pages, m.node if lock else None, tokens[: m.num_tokens]))

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 100), full_pages_only=st.booleans())
    def insert(self, i, full_pages_only):
        req = self.reqs[i % len(self.reqs)]
        n = len(req.tokens) // self.P
        already = self.expected_match(req.tokens)
        got = self.cache.insert(req.tokens, req.pages[:n] if full_pages_only else req.pages)
        assert got == len(already) * self.P
        for prefix, page in zip(self.prefixes(req.tokens, n), req.pages):
            self.model.setdefault(prefix, page)
        self.touch(self.prefixes(req.tokens, n))

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 100), insert_first=st.booleans())
    def finish(self, i, insert_first):
        if insert_first:
            self.insert(i, False)
        req = self.reqs.pop(i % len(self.reqs))
        self.alloc.release(req.pages)
        if req.handle is not None:
            self.cache.unlock(req.handle)

    @rule(n=st.integers(0, 12))
    def evict(self, n):
        self.do_evict(n)

    @rule(n=st.integers(1, 4))
    def allocate(self, n):
        if self.alloc.num_free < n:
            self.do_evict(n - self.alloc.num_free)
        if self.alloc.num_free >= n:
            self.raw.append(self.alloc.alloc(n))

    @precondition(lambda self: self.raw)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        self.alloc.release(self.raw.pop(i % len(self.raw)))

    # -- invariants --

    @invariant()
    def consistent(self):
        cache, alloc = self.cache, self.alloc
        cache.check_invariants()
        content = self.tree_content()
        assert {p: v for p, (v, _) in content.items()} == self.model
        assert {p: t for p, (_, t) in content.items()} == self.stamp
        assert len(set(self.model.values())) == len(self.model)  # no page stored twice
        held = [p for r in self.reqs for p in r.pages] + [p for pages in self.raw for p in pages]
        tree_pages = set(self.model.values())
        for page in range(1, alloc.num_pages):
            assert alloc.refcount(page) == (page in tree_pages) + held.count(page), page
        request_only = set(held) - tree_pages
        assert alloc.num_free + cache.num_cached_pages + len(request_only) == alloc.num_usable
        protected = self.protected()
        assert cache.num_cached_pages == len(self.model)
        assert cache.num_protected_pages == len(protected)
        assert cache.num_evictable_pages == len(self.model) - len(protected)
        assert cache.num_cache_only_pages() == sum(1 for p in tree_pages if p not in held)
        assert cache.num_reclaimable_pages() == sum(
            1 for q, p in self.model.items() if q not in protected and p not in held
        )
        assert (cache.query_tokens, cache.hit_tokens) == (self.query, self.hit)

    def teardown(self):
        # drain like a shutting-down engine: no page may leak
        for req in self.reqs:
            self.alloc.release(req.pages)
            if req.handle is not None:
                self.cache.unlock(req.handle)
        for node, _ in self.locks:
            self.cache.unlock(node)
        for pages in self.raw:
            self.alloc.release(pages)
        assert self.alloc.num_free + self.cache.num_cache_only_pages() == self.alloc.num_usable
        cached = self.cache.num_cached_pages
        assert self.cache.evict(self.alloc.num_pages) == cached  # all cache-only by now
        assert self.cache.num_cached_pages == 0 and self.alloc.num_free == self.alloc.num_usable
        self.cache.check_invariants()


SETTINGS = settings(max_examples=200, stateful_step_count=50, deadline=None)


class RadixMachineP1(RadixMachine):
    P = 1


class RadixMachineP16(RadixMachine):
    P = 16


TestRadixMachineP1 = RadixMachineP1.TestCase
TestRadixMachineP1.settings = SETTINGS
TestRadixMachineP16 = RadixMachineP16.TestCase
TestRadixMachineP16.settings = SETTINGS
