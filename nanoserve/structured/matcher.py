"""The grammar state of one constrained sample, and the host bitmask its masks go into.

Owns `GrammarMatcher`: wraps an xgrammar matcher for one request (one per sample: forks of
an n > 1 request get their own), counting the output tokens it has accepted. With a
`ReasoningGate` it passes a reasoning model's thinking through unconstrained and starts the
grammar after the thinking's end token (phases: undecided -> thinking -> answer, or
undecided -> answer when the output does not begin with the start token). Owns
`MaskFiller`, a batch fill split across the calling thread and helper threads.

Invariants:
- `num_accepted` output tokens of the request have been accepted, in order, and no other
  token: the engine accepts each sampled token once, when it processes the step that sampled
  it, and fills the next mask only after that;
- a mask row has bit j of word i set iff token 32 * i + j may come next (int32 words, the
  layout of nanoserve.kernels.sampling's bitmask input); stop tokens are allowed only where
  the grammar can end; while thinking (`needs_mask` False) no row is filled: every token may
  come; before the first token of a gated request the start token is allowed besides the
  grammar's;
- `live_matchers()` counts matchers still referenced anywhere: 0 once every constrained
  request has finished (tests assert it).
"""

from __future__ import annotations

import functools
import os
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch
import xgrammar as xgr

from nanoserve.sampling_params import ReasoningGate

_live: weakref.WeakSet = weakref.WeakSet()


def live_matchers() -> int:
    return len(_live)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


# How a batch fill splits across threads. xgrammar's fill releases the GIL and scales: two
# threads filled 1.8x the rows of one (the structured benchmark's schema, dev machine). Its own
# pool ("auto") paid ~350 us a call on an H200's 16-core host (396 us for 64 rows that one
# thread filled in 45 us), so the split is ours: chunks of at least MIN_ROWS_PER_THREAD rows
# (a hand-off costs tens of microseconds, a row 2-7 us inside a JSON string), the first on the
# calling thread, the others on persistent helper threads.
MIN_ROWS_PER_THREAD = 16


def default_fill_threads() -> int:
    """A thread per four cores, at most four: one on a dev machine or a CI runner."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


class MaskFiller:
    """Batch mask fills (`fill`) on `threads` threads: the calling one and `threads - 1`
    helpers, which only ever run xgrammar's fill on rows of their own chunk (each chunk
    writes disjoint rows of the bitmask, and the call returns once every chunk has)."""

    def __init__(self, threads: int = 1):
        if threads < 1:
            raise ValueError(f"mask fill threads must be >= 1, got {threads}")
        self.threads = threads
        self._batchers = [xgr.BatchGrammarMatcher(1) for _ in range(threads)]
        self._helpers = ThreadPoolExecutor(threads - 1, thread_name_prefix="nanoserve-mask") if threads > 1 else None

    def fill(self, matchers: list[xgr.GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        n = len(matchers)
        parts = max(1, min(self.threads, n // MIN_ROWS_PER_THREAD))
        bounds = [n * i // parts for i in range(parts + 1)]
        pending = [
            self._helpers.submit(batcher.batch_fill_next_token_bitmask, matchers[a:b], bitmask, rows[a:b])
            for batcher, a, b in zip(self._batchers[1:], bounds[1:-1], bounds[2:])
        ]
        self._batchers[0].batch_fill_next_token_bitmask(matchers[: bounds[1]], bitmask, rows[: bounds[1]])
        for done in pending:
            done.result()

    def shutdown(self) -> None:
        if self._helpers is not None:
            self._helpers.shutdown(wait=False)


def fill_masks(
    matchers: list[GrammarMatcher], bitmask: torch.Tensor, rows: list[int] | None = None, filler: MaskFiller | None = None
) -> None:
    """Write matcher i's allowed next tokens into `bitmask[rows[i]]` (rows default: 0, 1, ...)
    in one batch fill (`filler`'s threads; default one thread). The rows equal `fill_mask`'s,
    one matcher at a time."""
    if not matchers:
        return
    rows = list(range(len(matchers))) if rows is None else rows
    if len(matchers) == 1:
        matchers[0].fill_mask(bitmask, rows[0])
        return
    (filler or _one_thread()).fill([m._matcher for m in matchers], bitmask, rows)
    for row, m in zip(rows, matchers):
        if m.phase == _UNDECIDED:
            _allow(bitmask, row, m.gate.start_token)


@functools.cache
def _one_thread() -> MaskFiller:
    return MaskFiller(1)


_UNDECIDED, _THINKING, _ANSWER = "undecided", "thinking", "answer"


def _allow(bitmask: torch.Tensor, row: int, token: int) -> None:
    word, bit = divmod(token, 32)
    value = int(bitmask[row, word]) | (1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value  # as an int32


class GrammarMatcher:
    def __init__(self, compiled: xgr.CompiledGrammar, gate: ReasoningGate | None = None):
        self.compiled = compiled  # kept to build fresh matchers for forks
        self.gate = gate
        self._matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0
        self._fed = 0  # tokens the xgrammar matcher itself accepted (the answer's)
        # xgrammar's matcher terminates only by accepting a stop token: is_terminated asks it
        # only after one (saves a call into xgrammar per token).
        self._stop_ids = frozenset(self._matcher.stop_token_ids)
        self._terminated = False
        if gate is None:
            self.phase = _ANSWER
        else:
            self.phase = _THINKING if gate.starts_open else _UNDECIDED
        _live.add(self)

    def fork(self) -> GrammarMatcher:
        """A matcher in the start state for another sample of the same request (forks are
        made before any output token, so the start state is the right one)."""
        return GrammarMatcher(self.compiled, self.gate)

    @property
    def needs_mask(self) -> bool:
        """False while thinking: the next token is free."""
        return self.phase != _THINKING

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (state unchanged) if the grammar does not allow it."""
        if self.phase == _THINKING:
            if token == self.gate.end_token:
                self.phase = _ANSWER
        elif self.phase == _UNDECIDED and token == self.gate.start_token:
            self.phase = _THINKING
        else:
            if not self._matcher.accept_token(token):
                return False
            self._fed += 1
            if token in self._stop_ids:
                self._terminated = self._matcher.is_terminated()
            self.phase = _ANSWER
        self.num_accepted += 1
        return True

    def checkpoint(self) -> tuple[str, int, int]:
        """The state to come back to with `rollback` (speculative decoding walks drafts
        through the grammar, then rolls them back before the accepted tokens are accepted)."""
        return self.phase, self.num_accepted, self._fed

    def rollback(self, mark: tuple[str, int, int]) -> None:
        phase, num_accepted, fed = mark
        if self._fed > fed:
            self._matcher.rollback(self._fed - fed)
            self._terminated = self._matcher.is_terminated()
        self.phase, self.num_accepted, self._fed = phase, num_accepted, fed

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (an int32 CPU tensor); only
        called while `needs_mask`."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self.phase == _UNDECIDED:
            _allow(bitmask, row, self.gate.start_token)

    @property
    def is_terminated(self) -> bool:
        """The grammar has ended (it accepted a stop token): nothing may follow."""
        return self.phase == _ANSWER and self._terminated
