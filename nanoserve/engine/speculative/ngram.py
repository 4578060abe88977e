"""n-gram drafting: what followed the same tokens before is proposed to follow them again.

Owns: `NgramIndex` (one request's tokens, indexed by their n-grams as they grow) and
`SuffixStore` (a bounded store of finished requests' tokens, shared by all requests), and
`NgramProposer`, the drafter that asks the request's own index first and the store second.

A look-up takes the request's last L tokens for L from `max_match` down to `min_match` and
finds where they occurred before; the tokens that followed that occurrence (up to k) are the
draft. The longest match wins; among equal lengths, the most recent occurrence (text being
edited or copied is usually copied from close by). The store does the same over other
requests' tokens (prompt and output), as SuffixDecoding does for agent loops whose calls
repeat each other's outputs.

Host cost: the index grows by the new tokens only (a dict insert per new token and match
length), and a look-up is `max_match - min_match + 1` dict probes: independent of the
context's length. Invariants: an index covers exactly `tokens[:num_indexed]`, and maps each
n-gram to the end of its latest occurrence strictly before the current suffix's own.
"""

from __future__ import annotations

from collections import OrderedDict

from nanoserve.engine.speculative.proposer import Draft


class NgramIndex:
    """One request's n-grams -> the position just after their latest occurrence."""

    def __init__(self, min_match: int, max_match: int):
        self.lengths = range(max_match, min_match - 1, -1)  # longest first
        self.last_end: dict[tuple[int, ...], int] = {}  # keys of every length share one dict
        self.num_indexed = 0  # tokens[:num_indexed] are indexed, except the n-grams ending at it

    def update(self, tokens: list[int]) -> None:
        """Index the n-grams that end before the last token: each n-gram ending at position e
        (exclusive) is recorded once e < len(tokens), i.e. once a token follows it."""
        end = len(tokens) - 1
        lengths = self.lengths
        last_end = self.last_end
        for e in range(max(self.num_indexed, 1), end + 1):
            for n in lengths:
                if n <= e:
                    last_end[tuple(tokens[e - n : e])] = e
        self.num_indexed = max(self.num_indexed, end + 1)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        self.update(tokens)
        size = len(tokens)
        for n in self.lengths:
            if n >= size:
                continue
            e = self.last_end.get(tuple(tokens[size - n :]))
            if e is not None:
                return tokens[e : e + k]
        return []


class SuffixStore:
    """Finished requests' tokens, indexed like `NgramIndex`, within `max_tokens` tokens: the
    oldest sequences go first. Each n-gram points at its latest stored occurrence."""

    def __init__(self, min_match: int, max_match: int, max_tokens: int):
        self.lengths = range(max_match, min_match - 1, -1)
        self.max_tokens = max_tokens
        self.sequences: OrderedDict[int, list[int]] = OrderedDict()
        self.num_tokens = 0
        self.index: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (sequence id, end)
        self._next_id = 0

    def add(self, tokens: list[int]) -> None:
        if self.max_tokens == 0 or len(tokens) < 2:
            return
        tokens = tokens[-self.max_tokens :]
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self.sequences[seq_id] = tokens
        self.num_tokens += len(tokens)
        for e in range(1, len(tokens)):
            for n in self.lengths:
                if n <= e:
                    self.index[tuple(tokens[e - n : e])] = (seq_id, e)
        while self.num_tokens > self.max_tokens:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        seq_id, tokens = self.sequences.popitem(last=False)
        self.num_tokens -= len(tokens)
        for e in range(1, len(tokens)):
            for n in self.lengths:
                key = tuple(tokens[e - n : e]) if n <= e else None
                if key is not None and self.index.get(key, (None,))[0] == seq_id:
                    del self.index[key]

    def propose(self, tokens: list[int], k: int) -> list[int]:
        size = len(tokens)
        for n in self.lengths:
            if n > size:
                continue
            hit = self.index.get(tuple(tokens[size - n :]))
            if hit is not None:
                seq_id, e = hit
                return self.sequences[seq_id][e : e + k]
        return []


class NgramProposer:
    """Drafts from each request's own tokens (prompt and output), else from the store of
    finished requests' tokens (nanoserve.engine.speculative.ngram)."""

    needs_pages = False
    kv_bytes_per_token = 0

    def __init__(self, min_match: int, max_match: int, store_tokens: int):
        self.min_match, self.max_match = min_match, max_match
        self.store = SuffixStore(min_match, max_match, store_tokens)
        self.indexes: dict[object, NgramIndex] = {}  # per request

    def propose(self, reqs: list, budgets: list[int]) -> list[Draft]:
        drafts = []
        for req, k in zip(reqs, budgets):
            index = self.indexes.get(req)
            if index is None:
                index = self.indexes[req] = NgramIndex(self.min_match, self.max_match)
            tokens = index.propose(req.token_ids, k) if k > 0 else []
            if not tokens and k > 0 and self.store.max_tokens:
                tokens = self.store.propose(req.token_ids, k)
            drafts.append(Draft(tokens))
        return drafts

    def attach(self, engine, plan) -> None:
        pass

    def verified(self, reqs: list) -> None:
        pass

    def finished(self, req) -> None:
        self.indexes.pop(req, None)
        if req.finish_reason != "abort":
            self.store.add(req.token_ids)
