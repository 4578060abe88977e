"""A step's grammar bitmasks: which sampling rows get one, their host buffer, the fill and the
device mask the sampler applies; and the grammars' advance by a processed step's tokens
(`grammar_end`, `StepMasks.advance`). All of it runs on the engine's thread: xgrammar's calls
release the GIL, so on a second thread every call traded it with the engine's thread (a
64-row fill took 0.5-0.6 ms there against tens of microseconds here, and the accepts 0.74 ms
against 0.14; benchmarks/results/2026-12-02.md).

Owns the pinned host buffer (int32 [rows, words of the tokenizer's ids], grown on demand and
reused step after step), the per-row word of the last half-constrained step, and the fill
counters that benchmarks/structured.py reads.

Invariants:
- the host buffer is rewritten only after the copy of the step that used it has completed: the
  engine waits for a step's sampled tokens (which follow its mask's copy on the device) before
  it fills the next step's masks;
- constrained rows never allow ids past the tokenizer's (a model's padding rows); rows without
  a grammar in a half-constrained step allow every id, as in a step without one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Container

import torch

from nanoserve.structured.matcher import GrammarMatcher, bitmask_words, fill_masks

log = logging.getLogger("nanoserve")


def grammar_end(req, token: int) -> str | None:
    """Advance `req`'s grammar by `token`: "stop" if the grammar has ended (the output is
    complete, even at max_tokens), "abort" if it refuses the token (the mask makes that
    impossible; the request ends rather than return text that breaks its grammar), else None."""
    if not req.matcher.accept(token):
        log.warning("request %s: sampled token %d is outside its grammar; aborting it", req.request_id, token)
        return "abort"
    return "stop" if req.matcher.is_terminated else None


class StepMasks:
    def __init__(self, device: torch.device):
        self.device = device
        self._host: torch.Tensor | None = None
        self._free_rows: tuple[tuple | None, torch.Tensor | None] = (None, None)  # (n, rows) -> per-row word
        self.fill_s = 0.0  # host time filling masks
        self.num_filled = 0  # fills (one per masked step)

    @staticmethod
    def advance(reqs, positions: list[int], tokens: list[int]) -> dict[int, str]:
        """Each live constrained request of a processed step takes its token (`grammar_end`),
        before the rest of the processing; returns id(request) -> "stop" / "abort" for those
        whose grammar ended. Skipped as the processing skips them: finished since the launch."""
        ended = {}
        for req, pos, token in zip(reqs, positions, tokens):
            if req.matcher is None or req.finish_reason is not None or pos >= len(req.token_ids):
                continue
            end = grammar_end(req, token)
            if end is not None:
                ended[id(req)] = end
        return ended

    def rows(self, reqs, grammar_vocab_size: int, ended: Container[int] = ()) -> tuple[list[int], torch.Tensor]:
        """The sampling rows of `reqs` that get a mask this step (not those whose grammar has
        just ended, `ended`), and the host buffer (a row per sampling request) they are filled into."""
        rows = [
            i
            for i, r in enumerate(reqs)
            if r.matcher is not None and r.finish_reason is None and r.matcher.needs_mask and id(r) not in ended
        ]
        words = bitmask_words(grammar_vocab_size)
        host = self._host
        if host is None or host.shape[0] < len(reqs) or host.shape[1] != words:
            size = max(len(reqs), 2 * (host.shape[0] if host is not None else 8))
            host = torch.empty(size, words, dtype=torch.int32, pin_memory=self.device.type == "cuda")
            self._host = host
        return rows, host

    def fill(self, matchers: list[GrammarMatcher], rows: list[int], host: torch.Tensor) -> None:
        """Matcher i's mask into row rows[i] of `host`; other rows keep whatever they held
        (`device_mask` overrides them)."""
        started = time.perf_counter()
        fill_masks(matchers, host, rows)
        self.fill_s += time.perf_counter() - started
        self.num_filled += 1

    def device_mask(self, n: int, rows: list[int], host: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """The bitmask of n sampling rows on the device (None when no row is constrained):
        `host` copied in one piece without a sync; in a step with free rows a per-row word (0
        constrained, -1 free) is OR-ed in, so free rows allow every token, ids past the
        tokenizer's included. Constrained rows never allow those ids."""
        if not rows:
            return None
        words, grammar_words = bitmask_words(vocab), host.shape[1]
        mask = torch.empty((n, words), dtype=torch.int32, device=self.device)
        mask[:, :grammar_words].copy_(host[:n], non_blocking=True)
        if len(rows) == n:
            mask[:, grammar_words:] = 0
            return mask
        key = (n, tuple(rows))
        if self._free_rows[0] != key:  # most steps constrain the same rows as the last one
            values = torch.full((n,), -1, dtype=torch.int32)
            values[rows] = 0
            self._free_rows = (key, values.to(self.device, non_blocking=self.device.type == "cuda")[:, None])
        per_row = self._free_rows[1]
        mask[:, :grammar_words] |= per_row
        mask[:, grammar_words:] = per_row
        return mask
