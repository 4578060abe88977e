"""Continuous batching: which requests run in the next step, and with which KV pages.

Owns: the waiting queue, the running list, request slots, and every page a request holds
(through the `PageAllocator`, and the prefix cache when there is one); it keeps the host
`PageTable` (slot -> pages, read by the model runner) equal to the requests' page lists.

Policy ("prefill-first", the slow twin of "mixed"):
- a step is either a prefill/extend batch or a decode batch; prefill has priority while
  waiting requests can be admitted, within a token budget (`chunked_prefill_size`); a
  prompt longer than the budget is split across steps and stays at the head of the queue;
- a decode batch holds every running request (at most `max_num_seqs`, the number of
  slots), longest context first; when decode runs out of pages, the newest running request is preempted: its
  pages go back, it returns to the head of the queue and is recomputed later;
- "mixed" (`mixed_budget` set): while prompts wait and requests run, a step holds first a
  decode row for every running request (chosen and given pages as a decode batch, preemption
  included), then prompt chunks, chosen as a prefill batch, until the step holds
  `mixed_budget` tokens (decode rows count one each; prompts get none when the decode rows
  alone reach it; none when a running request had to be preempted). The budget grows while
  prompts queue, up to `MIXED_GROWTH` times, and is `chunked_prefill_size` during a burst:
  from when a crowd arrives (at least `BURST_MIN_CROWD` requests, and at least as many as
  run, added since the previous step) and more than `BURST_START_SHARE` of the queued
  requests wait for their first token, until no more than `BURST_END_SHARE` do (see there).
  A queue that grows a few requests at a time never begins one, however long it gets, so the
  running requests' steps stay short above capacity. With nothing running a step is a
  prefill batch of `chunked_prefill_size` tokens (throughput); with nothing waiting, a
  decode batch, scheduled exactly as under prefill-first (no extra host work on the decode
  path);
- a request with n > 1 samples is admitted with n slots and forked after its prompt is
  computed: the samples share its full pages; a partly filled last page is copied.

Prefix cache (optional, `RadixCache`): on admission a request takes the longest cached
page-aligned prefix of its tokens but the last (so a step always computes at least one
token and has logits to sample from), locks its node and retains its pages, and computes
only the rest; the cached pages then count as its own. Once its prompt is computed it
inserts the prompt's KV, so requests arriving while it decodes share it (inserting only at
the end would leave a burst of requests with a common prefix computing it each). When it
finishes or is preempted it inserts all the KV it computed (tokens [0, num_computed)),
then releases its pages and its lock, in that order; a preempted request thus usually
finds its own KV again. The lock stays on the node matched at admission: pages inserted
later are the request's own, so evicting them meanwhile frees nothing and is harmless.
Allocation evicts cache-only pages (LRU) before deferring or preempting anyone.

Invariants (checked by `check_invariants`, which tests call after every run):
- a request is in exactly one of waiting, running, or neither (finished);
- a queued request's pages hold every token it has computed (len(pages) * P >= num_computed);
- requests holding a slot <= max_num_seqs; a request without a slot holds no pages;
- pages held by requests + pages held only by the prefix cache + free pages == usable
  pages (a page both cached and held by a request counts once, as the request's);
- a request holds one lock on `prefix_node` while it has a slot, and no other lock; with
  no request queued no cache node is locked;
- `page_table` row of a held slot == the holder's pages (then zeros); a free slot's row is
  zeros: every change of `req.pages` while `req` holds a slot goes through `_grow`, or
  happens when the slot is given (`assign`) or given back (`clear`);
- `num_with_penalties` == queued or deferred-finish requests whose sampling has penalties
  (the engine then processes each step before scheduling the next).
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from nanoserve.kvcache.pool import PageAllocator, PageTable, pages_for
from nanoserve.kvcache.radix import RadixCache
from nanoserve.kvcache.window import WindowPager
from nanoserve.scheduler.request import Request, Status

# Mixed steps are kept short (`mixed_budget`) so that running requests' next tokens are not
# held up long by prompt chunks; two cases let a step grow (dummy llama-3.1-8b on H200s,
# 1024-token prompts, benchmarks/results/2026-11-26.md; each pair on one machine):
# - a queue: a step may hold as many tokens as would compute the waiting prompts in
#   QUEUE_DRAIN_STEPS steps, up to MIXED_GROWTH times `mixed_budget`. At 28 req/s fixed
#   512-token steps fell behind the arrivals (68% of requests within 500 ms to the first
#   token and 25 ms per token, against 93% when growing to 1024). On 2026-11-26 growing to
#   1024 took the inter-token p99 at 32 req/s to 42-46 ms, but those servers may have run
#   these steps eagerly (engine/piecewise_graph.py's KEEP_WITHIN). With their graphs kept
#   (2026-11-27, one machine): growth 1.5 / 2 / 2.5 met both bounds for 90% of requests up to
#   26 / 28 / 29 req/s (prefill-first: 28), at an inter-token p99 at 32 req/s of 28.2 /
#   32.7 / 40.4 ms (issue bound: 40), all draining the queue in 8 steps. How soon a step
#   grows counts as much: with growth 2, draining in 4 / 3 / 2 steps gave 30 / 30 / 31 req/s
#   on another H200 (prefill-first: 28 there too), but at 2 a step of 1024 tokens follows two
#   queued prompts, which took the inter-token p99 at 16 req/s to 25.5-26.1 ms (bound 25);
#   3 gave 22.0-24.1 ms in five runs on two H200s (2026-11-27, 16:17-16:50 UTC);
# - a burst: from when more than BURST_START_SHARE of the queued requests wait for a first
#   token (a crowd arrived at once) until no more than BURST_END_SHARE do, a step takes the
#   prefill budget, as a step with nothing running does. Short steps make every waiting
#   request pay the decode rows' per-step cost once per chunk: 200 requests at once gave
#   5,279 output tok/s with bursts down to half the queue, 5,845 down to a fifth
#   (prefill-first: 5,655-5,880); with the start at half, ending at a fifth gave 5,768 and
#   at a tenth 5,927 / 5,869 (prefill-first 5,941 / 5,884 on the same H200, 2026-11-27).
#   A burst begins only above half: a queue that builds up under overload passed a fifth
#   near the end of the arrivals at 32 req/s, and each burst step then held 126 decoding
#   requests for 280 ms, which took the inter-token p99 to 42.5 ms on one server (34.8 ms on
#   another without; bound 40). Beginning at half gave 32.7-33.9 ms in four runs. But a long
#   enough overload passes half too: at 32 req/s with steps grown 1.5 times, 600 prompts
#   queued 142 beside 153 running, and its burst steps (up to 210 ms with 255 decode rows)
#   took the engine's inter-token p99 to 203 ms (benchmarks/results/2026-12-02.md). So a
#   burst also needs a crowd: at least BURST_MIN_CROWD requests, and as many as run, added
#   since the previous step. Poisson arrivals add one or two per step (32 req/s, 35 ms steps);
#   200 requests sent at once arrive within a few steps.
BURST_START_SHARE = 0.5
BURST_END_SHARE = 0.1
BURST_MIN_CROWD = 4
QUEUE_DRAIN_STEPS = 3
MIXED_GROWTH = 2.0


@dataclass
class ScheduledBatch:
    """One step's requests. The first `num_decodes` decode one token each (running requests);
    the rest compute prompt chunks. A decode batch has only decode rows; a prefill batch (of
    prefill-first) none; a mixed batch both, decode rows first."""

    requests: list[Request]
    num_new_tokens: list[int]  # tokens computed this step, per request
    is_decode: bool
    page_table: PageTable  # the scheduler's slot -> pages table, current until its next change
    num_decodes: int = 0
    # A decode batch of several positions per request (nanoserve.engine.speculative.positions):
    # each request's row count, in order; None: one row per request.
    runs: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


_by_arrival = operator.attrgetter("arrival")
_by_context = operator.attrgetter("num_computed")


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        max_num_seqs: int,
        chunked_prefill_size: int,
        copy_page: Callable[[int, int], None],
        page_table: PageTable,
        prefix_cache: RadixCache | None = None,
        mixed_budget: int | None = None,
        copy_slot_state: Callable[[int, int], None] | None = None,
        windows: WindowPager | None = None,
    ):
        self.allocator = allocator
        self.page_table = page_table
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.chunk_budget = chunked_prefill_size
        self.mixed_budget = mixed_budget  # None: prefill-first policy
        self.copy_page = copy_page
        self.copy_slot_state = copy_slot_state  # per-slot model state (linear attention) a fork copies
        self.prefix_cache = prefix_cache
        # Window groups (nanoserve.kvcache.window): pages of windowed layers, given back once
        # out of the window. A position page then takes 1 + num_groups allocator pages.
        self.windows = windows
        self.pages_per_position_page = 1 + (windows.num_groups if windows is not None else 0)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0
        self.bursting = False  # see BURST_START_SHARE
        self.arrivals_since_step = 0  # requests added since the last `schedule` (a crowd begins a burst)
        self.num_prefill_tokens = 0  # tokens computed by prefill steps (cache hits excluded)
        self.num_with_penalties = 0

    # ---- queue -------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.arrivals_since_step += 1
        self.num_with_penalties += req.params.has_penalties

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> list[Request]:
        return [r for r in (*self.waiting, *self.running) if r.request_id == request_id]

    # ---- pages and slots ---------------------------------------------------------------

    def _ensure_free_pages(self, n: int) -> bool:
        short = n - self.allocator.num_free
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(short)
        return self.allocator.num_free >= n

    def _grow(self, req: Request, num_tokens: int) -> None:
        """Give `req` pages for its first `num_tokens` positions (caller checked room)."""
        have = len(req.pages)
        need = pages_for(num_tokens, self.page_size) - have
        if need > 0:
            new = self.allocator.alloc(need)
            req.pages.extend(new)
            self.page_table.extend(req.slot, have, new)
        if self.windows is not None:
            self.windows.grow(req, num_tokens)

    def _pages_to_grow(self, req: Request, num_tokens: int) -> int:
        """Allocator pages `_grow(req, num_tokens)` takes, after giving back what fell out of
        the window (window groups)."""
        need = max(0, pages_for(num_tokens, self.page_size) - len(req.pages))
        if self.windows is not None:
            self.windows.drop(req)
            need += self.windows.pages_needed(req, num_tokens)
        return need

    def _attach_prefix(self, req: Request) -> None:
        """Start `req` (no slot, no pages) from the longest cached prefix of its tokens.

        Peeks (no LRU touch, no hit counting: the request may not be admitted this step),
        but locks and retains at once so that evictions made to admit it cannot take
        the pages it counts on. Undone by `_detach_prefix`, or kept by `_count_prefix`.
        """
        m = self.prefix_cache.match_prefix(req.token_ids[:-1], peek=True)
        usable = len(m.pages) if self.windows is None else self.windows.usable_prefix(m.windows)
        if usable == 0:
            return
        pages = m.pages[:usable]
        self.prefix_cache.lock(m.node)  # (a deeper node than used pins a little more)
        self.allocator.retain(pages)
        req.prefix_node = m.node
        req.pages = pages
        req.num_computed = usable * self.page_size
        if self.windows is not None:
            self.windows.attach(req, m.windows)

    def _detach_prefix(self, req: Request) -> None:
        """Undo `_attach_prefix` for a request that is not admitted after all."""
        if req.pages:
            self.allocator.release(req.pages)
        if self.windows is not None:
            self.windows.release(req)
        if req.prefix_node is not None:
            self.prefix_cache.unlock(req.prefix_node)
        req.pages, req.prefix_node, req.num_computed = [], None, 0

    def _count_prefix(self, req: Request) -> None:
        """`req` is admitted: count its look-up in the cache's stats and mark the path recent."""
        # This match may be longer than the attached one if a request reclaimed meanwhile
        # inserted more of the same prefix; the request still uses what it attached.
        self.prefix_cache.match_prefix(req.token_ids[:-1])
        if not req.admitted:  # report the first admission's reuse, not a re-match of its own KV
            req.num_cached_tokens = req.num_computed

    def _cache_kv(self, req: Request) -> None:
        """Insert the KV `req` has computed so far (see RadixCache.insert: the cache
        retains what it newly stores; the request keeps its own references)."""
        n = req.num_computed
        if n:
            num_pages = pages_for(n, self.page_size)
            windows = req.window_pages[:num_pages] if self.windows is not None else ()
            self.prefix_cache.insert(req.token_ids[:n], req.pages[:num_pages], windows)

    def _release(self, req: Request) -> None:
        """Return the request's pages, cache lock and slot; with a prefix cache, first
        offer it the KV the request computed (insert before release, see RadixCache.insert)."""
        cache = self.prefix_cache
        if cache is not None:
            self._cache_kv(req)
        if req.pages:
            self.allocator.release(req.pages)
        req.pages = []
        if self.windows is not None:
            self.windows.release(req)
        if req.prefix_node is not None:
            cache.unlock(req.prefix_node)
            req.prefix_node = None
        if req.slot is not None:
            self.page_table.clear(req.slot)
            self.free_slots.append(req.slot)
            req.slot = None
        self.free_slots.extend(req.reserved_slots)
        req.reserved_slots = []

    def _reclaim_from_waiting(self, need: int, behind: Request) -> None:
        """Take back the pages of partly prefilled requests queued after `behind`, newest
        first, until `need` pages are free. Without this, several half-prefilled requests
        can hold the whole cache while none can finish: a deadlock."""
        for victim in reversed(self.waiting):
            # With a prefix cache the victim's pages go to the cache: evict to free them.
            if self._ensure_free_pages(need) or victim is behind:
                return
            if victim.pages:
                self._release(victim)
                victim.num_computed = 0
                victim.num_preemptions += 1
                self.num_preemptions += 1

    def dequeue(self, req: Request) -> None:
        """Take `req` out of the waiting or running queue (it keeps its pages and slot)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def finish(self, req: Request, reason: str) -> None:
        if req.is_finished:
            return
        self.dequeue(req)
        self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.num_with_penalties -= req.params.has_penalties

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed = 0
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # ---- scheduling --------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        self.bursting = self.burst_continues()
        self.arrivals_since_step = 0
        if self.mixed_budget is None or not self.waiting or not self.running:
            return self._schedule_prefill(self.chunk_budget) or self._schedule_decode()
        return self._schedule_mixed(self.mixed_step_tokens())

    def burst_continues(self) -> bool:
        """Whether the step scheduled now is part of a burst (see BURST_START_SHARE)."""
        queued = len(self.waiting) + len(self.running)
        share = len(self.waiting) / queued if queued else 0.0
        if self.bursting:
            return share > BURST_END_SHARE
        crowd = self.arrivals_since_step >= max(BURST_MIN_CROWD, len(self.running))
        return crowd and share > BURST_START_SHARE

    def mixed_step_tokens(self) -> int:
        """Tokens a mixed step scheduled now may hold, decode rows included: `mixed_budget`,
        more while prompts queue, the prefill budget during a burst (see BURST_START_SHARE)."""
        if self.bursting:
            return max(self.chunk_budget, self.mixed_budget)
        ceiling = min(int(MIXED_GROWTH * self.mixed_budget), self.chunk_budget)
        enough = ceiling * QUEUE_DRAIN_STEPS
        queued = 0
        for req in self.waiting:  # stops once the ceiling is reached: O(1) in a long queue
            queued += req.num_uncomputed
            if queued >= enough:
                break
        return max(self.mixed_budget, min(queued // QUEUE_DRAIN_STEPS, ceiling))

    def _schedule_mixed(self, budget: int) -> ScheduledBatch | None:
        """Every running request's decode row, then prompt chunks up to `budget` tokens."""
        preempted = self.num_preemptions
        decode = self._schedule_decode()
        if self.num_preemptions != preempted:
            # Pages ran short: no prompt joins this step, even when every running request
            # was preempted (decode is None). Re-admitting a victim now would also read its
            # last token, which the overlap loop may still be sampling for the slot it just
            # gave up, and cache its KV under the placeholder.
            return decode
        if decode is None:
            return self._schedule_prefill(self.chunk_budget)
        num_decodes = len(decode.requests)
        room = budget - num_decodes
        prefill = self._schedule_prefill(room) if room > 0 else None
        if prefill is None:
            return decode
        return ScheduledBatch(
            decode.requests + prefill.requests,
            decode.num_new_tokens + prefill.num_new_tokens,
            False,
            self.page_table,
            num_decodes,
        )

    def _schedule_prefill(self, budget: int) -> ScheduledBatch | None:
        chosen: list[Request] = []
        chunks: list[int] = []
        promised = 0  # free pages the forks of this batch will take after the forward
        for req in list(self.waiting):
            if budget == 0:
                break
            admitting = req.slot is None
            if admitting:
                slots = req.params.n if (req.params.n > 1 and not req.forked) else 1
                if len(self.free_slots) < slots:
                    break
                if self.prefix_cache is not None:
                    self._attach_prefix(req)
            chunk = min(req.num_uncomputed, budget)
            forks = req.params.n > 1 and not req.forked
            grow = self._pages_to_grow(req, req.num_computed + chunk)
            fork_pages = (
                (req.params.n - 1) * self.pages_per_position_page if forks and chunk == req.num_uncomputed else 0
            )
            need = promised + grow + fork_pages
            if not self._ensure_free_pages(need):
                self._reclaim_from_waiting(need, behind=req)
            if self.allocator.num_free < need:
                if admitting and self.prefix_cache is not None:
                    self._detach_prefix(req)
                break
            if admitting:
                if self.prefix_cache is not None:
                    self._count_prefix(req)
                req.slot = self.free_slots.pop()
                self.page_table.assign(req.slot, req.pages)  # the cached prefix's pages, if any
                req.admitted = True
                if req.params.n > 1 and not req.forked:
                    # Hold the children's slots now so the fork never waits for one.
                    req.reserved_slots = [self.free_slots.pop() for _ in range(req.params.n - 1)]
            self._grow(req, req.num_computed + chunk)
            promised += fork_pages
            chosen.append(req)
            chunks.append(chunk)
            budget -= chunk
        if not chosen:
            return None
        return ScheduledBatch(chosen, chunks, False, self.page_table)

    def _schedule_decode(self) -> ScheduledBatch | None:
        batch = sorted(self.running, key=_by_arrival)
        page_size = self.page_size
        if self.windows is not None:
            for req in batch:
                self.windows.drop(req)
        for req in [r for r in batch if r.num_computed >= len(r.pages) * page_size]:  # out of room
            if req.status is not Status.RUNNING:  # O(1), unlike `req in self.running`
                continue  # preempted while making room for an older request
            while not self._ensure_free_pages(self.pages_per_position_page):
                victim = max(self.running, key=_by_arrival)
                self.preempt(victim)
                batch.remove(victim)
                if victim is req:
                    break
            if req in self.running:
                self._grow(req, req.num_computed + 1)
        if not batch:
            return None
        # Longest context first: the decode attention kernel launches one program per request
        # in batch order, so the longest ones start first instead of finishing alone at the end
        # (measured on an H200: 2.4% less decode attention time on the offline workload).
        batch.sort(key=_by_context, reverse=True)
        return ScheduledBatch(batch, [1] * len(batch), True, self.page_table, len(batch))

    def reserve_lookahead(self, req: Request, num_tokens: int) -> int:
        """Pages for up to `num_tokens` positions past a decoding request's next one (the
        drafts a speculative verify step computes), as far as free or cache-only pages allow:
        nobody is preempted for a draft. Returns how many positions it has room for. The
        pages stay the request's (rejected drafts' KV is overwritten by the tokens that
        follow), so every invariant above holds as for any page `_grow` gives."""
        if self.windows is not None:
            raise RuntimeError("speculative lookahead with window groups")  # the engine never builds both
        base = req.num_computed + 1
        need = pages_for(base + num_tokens, self.page_size) - len(req.pages)
        if need > 0:
            self._ensure_free_pages(need)
            room = min(need, self.allocator.num_free)
            if room:
                self._grow(req, (len(req.pages) + room) * self.page_size)
        return max(0, min(num_tokens, len(req.pages) * self.page_size - base))

    # ---- after the forward -------------------------------------------------------------

    def complete_step(self, batch: ScheduledBatch) -> None:
        """Account the computed tokens; requests whose prompt is done start decoding."""
        if batch.is_decode:
            for req in batch.requests:
                req.num_computed += 1
            return
        first = batch.num_decodes  # decode rows of a mixed batch first: running requests, one token
        for req in batch.requests[:first]:
            req.num_computed += 1
        self.num_prefill_tokens += batch.num_tokens - first
        for req, chunk in zip(batch.requests[first:], batch.num_new_tokens[first:]):
            req.num_computed += chunk
            if req.num_uncomputed == 0 and req.status is Status.WAITING:
                self.waiting.remove(req)
                req.status = Status.RUNNING
                self.running.append(req)
                if self.prefix_cache is not None:
                    self._cache_kv(req)  # the prompt's KV, for requests arriving meanwhile

    def fork(self, parent: Request, make_child: Callable[[int], Request]) -> list[Request]:
        """Create samples 1..n-1 of `parent` after its prompt is computed; they share its
        full pages and get a copy of its partly filled last page. Each takes its own lock
        on the parent's cached prefix, as each releases its own pages when it ends."""
        children = []
        full = parent.num_computed // self.page_size
        partial = parent.num_computed % self.page_size != 0
        for i, slot in enumerate(parent.reserved_slots, start=1):
            child = make_child(i)
            shared = parent.pages[:full]
            self.allocator.retain(shared)
            child.pages = list(shared)
            if partial:
                (page,) = self.allocator.alloc(1)
                self.copy_page(parent.pages[full], page)
                child.pages.append(page)
            if self.windows is not None:
                self.windows.fork(parent, child, full)
            child.num_computed = parent.num_computed
            child.admitted = True  # its num_cached_tokens is the parent's
            if parent.prefix_node is not None:
                self.prefix_cache.lock(parent.prefix_node)
                child.prefix_node = parent.prefix_node
            child.slot = slot
            if self.copy_slot_state is not None:
                self.copy_slot_state(parent.slot, slot)
            self.page_table.assign(slot, child.pages)
            child.status = Status.RUNNING
            self.running.append(child)
            self.num_with_penalties += child.params.has_penalties
            children.append(child)
        parent.reserved_slots = []
        parent.forked = True
        return children

    # ---- checks ------------------------------------------------------------------------

    def num_pages_held_by_requests(self) -> int:
        held: set[int] = set()
        for req in (*self.waiting, *self.running):
            held.update(req.pages)
            if self.windows is not None:
                held.update(self.windows.held(req))
        return len(held)

    def check_page_table(self) -> None:
        """Rows of slots held by queued requests == their pages; rows of free slots are zeros.
        (Also holds mid-run in the overlap loop, where a finished request may keep its slot
        until the step in flight is processed: such rows are not checked.)"""
        rows = self.page_table.rows
        for r in (*self.waiting, *self.running):
            if r.slot is not None:
                n = len(r.pages)
                assert rows[r.slot, :n].tolist() == r.pages and not rows[r.slot, n:].any(), (
                    f"page table row {r.slot} differs from its request's pages"
                )
        assert not rows[self.free_slots].any(), "a free slot's page table row is not zero"

    def check_invariants(self, window_map=None) -> None:
        """`window_map`: the window groups' device map on the host (checked against the requests)."""
        reqs = [*self.waiting, *self.running]
        assert len({id(r) for r in reqs}) == len(reqs), "a request is queued twice"
        with_slot = sum(1 + len(r.reserved_slots) for r in reqs if r.slot is not None)
        assert with_slot + len(self.free_slots) == self.max_num_seqs, "request slots leaked"
        for r in reqs:
            assert r.slot is not None or not r.pages, "pages without a slot"
            assert len(r.pages) * self.page_size >= r.num_computed, "computed tokens without pages"
        for r in reqs:
            assert r.prefix_node is None or r.slot is not None, "cache lock without a slot"
            if self.windows is not None:
                self.windows.check(r, window_map)
        self.check_page_table()
        penalized = sum(r.params.has_penalties for r in reqs)
        assert penalized <= self.num_with_penalties, "requests with penalties miscounted"
        cache = self.prefix_cache
        cached = 0
        if cache is not None:
            cache.check_invariants()
            cached = cache.num_cache_only_pages()
            if not reqs:
                assert cache.num_protected_pages == 0, "prefix-cache lock leaked"
        assert self.num_pages_held_by_requests() + cached + self.allocator.num_free == self.allocator.num_usable, (
            "KV pages leaked"
        )
