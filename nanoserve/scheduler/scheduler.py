"""Continuous batching: which requests run in the next step, and with which KV pages.

Owns: the waiting queue, the running list, request slots, and every page a request holds
(through the `PageAllocator`, and the prefix cache when there is one).

Policy:
- a step is either a prefill/extend batch or a decode batch; prefill has priority while
  waiting requests can be admitted, within a token budget (`chunked_prefill_size`); a
  prompt longer than the budget is split across steps and stays at the head of the queue;
- a decode batch holds every running request (at most `max_num_seqs`, the number of
  slots); when decode runs out of pages, the newest running request is preempted: its
  pages go back, it returns to the head of the queue and is recomputed later;
- a request with n > 1 samples is admitted with n slots and forked after its prompt is
  computed: the samples share its full pages; a partly filled last page is copied.

Invariants (checked by `check_invariants`, which tests call after every run):
- a request is in exactly one of waiting, running, or neither (finished);
- requests holding a slot <= max_num_seqs; a request without a slot holds no pages;
- pages held by requests + pages held by the prefix cache + free pages == usable pages.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from nanoserve.kvcache.pool import PageAllocator
from nanoserve.scheduler.request import Request, Status


@dataclass
class ScheduledBatch:
    requests: list[Request]
    num_new_tokens: list[int]  # tokens computed this step, per request
    is_decode: bool

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        max_num_seqs: int,
        chunked_prefill_size: int,
        copy_page: Callable[[int, int], None],
        prefix_cache=None,
    ):
        self.allocator = allocator
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.chunk_budget = chunked_prefill_size
        self.copy_page = copy_page
        self.prefix_cache = prefix_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0

    # ---- queue -------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.waiting.append(req)

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
        need = pages_for(num_tokens, self.page_size) - len(req.pages)
        if need > 0:
            req.pages.extend(self.allocator.alloc(need))

    def _release(self, req: Request) -> None:
        """Return the request's pages and slot."""
        if req.pages:
            self.allocator.release(req.pages)
        req.pages = []
        if req.slot is not None:
            self.free_slots.append(req.slot)
            req.slot = None
        self.free_slots.extend(req.reserved_slots)
        req.reserved_slots = []

    def finish(self, req: Request, reason: str) -> None:
        if req.is_finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed = 0
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # ---- scheduling --------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.chunk_budget
        chosen: list[Request] = []
        chunks: list[int] = []
        for req in list(self.waiting):
            if budget == 0:
                break
            if req.slot is None:
                slots = req.params.n if (req.params.n > 1 and not req.forked) else 1
                if len(self.free_slots) < slots:
                    break
            chunk = min(req.num_uncomputed, budget)
            forks = req.params.n > 1 and not req.forked
            need = pages_for(req.num_computed + chunk, self.page_size) - len(req.pages)
            if not self._ensure_free_pages(need + (req.params.n - 1 if forks and chunk == req.num_uncomputed else 0)):
                # Take what fits; a prompt whose fork does not fit yet stops one token short.
                room = (len(req.pages) + self.allocator.num_free) * self.page_size - req.num_computed
                chunk = min(chunk, room)
                if forks and chunk == req.num_uncomputed:
                    chunk -= 1
                if chunk <= 0:
                    break
            if req.slot is None:
                req.slot = self.free_slots.pop()
                if req.params.n > 1 and not req.forked:
                    # Hold the children's slots now so the fork never waits for one.
                    req.reserved_slots = [self.free_slots.pop() for _ in range(req.params.n - 1)]
            self._grow(req, req.num_computed + chunk)
            chosen.append(req)
            chunks.append(chunk)
            budget -= chunk
        if not chosen:
            return None
        return ScheduledBatch(chosen, chunks, is_decode=False)

    def _schedule_decode(self) -> ScheduledBatch | None:
        batch = sorted(self.running, key=lambda r: r.arrival)
        for req in list(batch):
            if req not in self.running:
                continue  # preempted while making room for an older request
            if req.num_computed + 1 <= len(req.pages) * self.page_size:
                continue
            while not self._ensure_free_pages(1):
                victim = max(self.running, key=lambda r: r.arrival)
                self.preempt(victim)
                batch.remove(victim)
                if victim is req:
                    break
            if req in self.running:
                self._grow(req, req.num_computed + 1)
        if not batch:
            return None
        return ScheduledBatch(batch, [1] * len(batch), is_decode=True)

    # ---- after the forward -------------------------------------------------------------

    def complete_step(self, batch: ScheduledBatch) -> None:
        """Account the computed tokens; requests whose prompt is done start decoding."""
        for req, chunk in zip(batch.requests, batch.num_new_tokens):
            req.num_computed += chunk
            if not batch.is_decode and req.num_uncomputed == 0 and req.status is Status.WAITING:
                self.waiting.remove(req)
                req.status = Status.RUNNING
                self.running.append(req)

    def fork(self, parent: Request, make_child: Callable[[int], Request]) -> list[Request]:
        """Create samples 1..n-1 of `parent` after its prompt is computed; they share its
        full pages and get a copy of its partly filled last page."""
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
            child.num_computed = parent.num_computed
            child.slot = slot
            child.status = Status.RUNNING
            self.running.append(child)
            children.append(child)
        parent.reserved_slots = []
        parent.forked = True
        return children

    # ---- checks ------------------------------------------------------------------------

    def num_pages_held_by_requests(self) -> int:
        held: set[int] = set()
        for req in (*self.waiting, *self.running):
            held.update(req.pages)
        return len(held)

    def check_invariants(self) -> None:
        reqs = [*self.waiting, *self.running]
        assert len({id(r) for r in reqs}) == len(reqs), "a request is queued twice"
        with_slot = sum(1 + len(getattr(r, "reserved_slots", [])) for r in reqs if r.slot is not None)
        assert with_slot + len(self.free_slots) == self.max_num_seqs, "request slots leaked"
        for r in reqs:
            assert r.slot is not None or not r.pages, "pages without a slot"
        cached = self.prefix_cache.num_pages_only_cached() if self.prefix_cache is not None else 0
        assert self.num_pages_held_by_requests() + cached + self.allocator.num_free == self.allocator.num_usable, (
            "KV pages leaked"
        )
