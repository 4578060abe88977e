"""The grammar state of one constrained sample, and the host bitmask its masks go into.

Owns `GrammarMatcher`: wraps an xgrammar matcher for one request (one per sample: forks of
an n > 1 request get their own), counting the output tokens it has accepted. With a
`ReasoningGate` it passes a reasoning model's thinking through unconstrained and starts the
grammar after the thinking's end token (phases: undecided -> thinking -> answer, or
undecided -> answer when the output does not begin with the start token).

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

import time
import weakref

import torch
import xgrammar as xgr

from nanoserve.sampling_params import ReasoningGate

_live: weakref.WeakSet = weakref.WeakSet()


def live_matchers() -> int:
    return len(_live)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


# xgrammar's batch fill on one thread, or on its pool (a thread per two cores). The pool's
# hand-offs cost more than they save on ordinary grammars: inside a JSON string a row takes
# 6-8 us on one thread of an H200's host, and the pool paid ~350 us a call there (64 rows in
# 396 us that one thread filled in 45; benchmarks/results/2026-12-02.md); helper threads of our
# own, each filling a chunk, did not help either (2026-12-03). A grammar whose fills are slow
# (bounded repetition: ~67 us a row on average, single fills up to ~5 ms) gains from it: a
# one-thread fill slower than SLOW_ROW_S a row sends the next POOL_FILLS fills to the pool,
# then one thread is measured again (a single slow step, a GC pause or a preemption, costs at
# most POOL_FILLS pool fills).
SLOW_ROW_S = 30e-6
POOL_FILLS = 32
_fillers: dict[bool, xgr.BatchGrammarMatcher] = {}  # on the pool -> its batch matcher
_pool_fills_left = 0


def _batch_fill(matchers: list[xgr.GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
    global _pool_fills_left
    on_pool = _pool_fills_left > 0
    if on_pool not in _fillers:
        _fillers[on_pool] = xgr.BatchGrammarMatcher("auto" if on_pool else 1)
    started = time.perf_counter()
    _fillers[on_pool].batch_fill_next_token_bitmask(matchers, bitmask, rows)
    if on_pool:
        _pool_fills_left -= 1
    elif time.perf_counter() - started > SLOW_ROW_S * len(matchers):
        _pool_fills_left = POOL_FILLS


def fill_masks(matchers: list[GrammarMatcher], bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Write matcher i's allowed next tokens into `bitmask[rows[i]]` (rows default: 0, 1, ...)
    in one call into xgrammar (`_batch_fill`: on one thread, or its pool for slow grammars).
    The rows equal `fill_mask`'s, one matcher at a time."""
    if not matchers:
        return
    rows = list(range(len(matchers))) if rows is None else rows
    if len(matchers) == 1:
        matchers[0].fill_mask(bitmask, rows[0])
        return
    _batch_fill([m._matcher for m in matchers], bitmask, rows)
    for row, m in zip(rows, matchers):
        if m.phase == _UNDECIDED:
            _allow(bitmask, row, m.gate.start_token)


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
