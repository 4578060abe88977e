"""Compiling StructuredOutputs into xgrammar grammars, off the engine's step loop.

Owns `GrammarService`: a small pool of worker threads in the process that creates it (the
API process validates a request's constraint before admitting it; the engine process
compiles the same spec again for its own matchers), a cache of compiled grammars keyed by
`StructuredOutputs.key()` (kind, canonical spec), and a time limit per request.

Invariants:
- nothing here runs on the caller's thread but dictionary look-ups: compiles run on the
  pool, and `compile` / `PendingGrammar.poll` only wait on (or look at) a future;
- one compile per key at a time: requests with the same spec share one future, so a
  thousand requests with one schema compile it once;
- a compile that fails is not cached (a later request tries again and gets the same clear
  error); one that exceeds the time limit fails the requests that waited for it with a
  GrammarError naming the limit, and keeps running on its worker (threads cannot be
  killed): if it finishes later, its result is cached. Several workers, so one slow schema
  never holds up the compiles of others (xgrammar releases the GIL while it compiles).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import xgrammar as xgr

from nanoserve.sampling_params import StructuredOutputs

DEFAULT_TIMEOUT_S = 10.0
CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)


_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


class GrammarError(ValueError):
    """A constraint that cannot be used: it does not compile, is unsupported, or took longer
    to compile than the time limit. The message names the problem (the server returns it
    in a 400)."""


def _compile(compiler: xgr.GrammarCompiler, spec: StructuredOutputs) -> xgr.CompiledGrammar:
    kind = spec.kind
    try:
        if kind == "json":
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            # Fixed separators (", " and ": "): a model cannot wander off into whitespace.
            return compiler.compile_json_schema(schema, any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if kind == "regex":
            return compiler.compile_regex(spec.regex)
        if kind == "choice":
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
        return compiler.compile_grammar(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar: RuntimeError with the parser's message
        what = {"json": "JSON schema", "json_object": "JSON object grammar", "grammar": "EBNF grammar"}.get(kind, kind)
        # xgrammar prefixes its messages with a time and a C++ source location: drop them.
        message = _LOCATION.sub("", str(exc).strip()) or type(exc).__name__
        raise GrammarError(f"invalid {what}: {message}") from None


def _vocab_end(tokenizer) -> int:
    """One past the largest token id of the tokenizer (added tokens included)."""
    return max(tokenizer.get_vocab().values()) + 1


@dataclass
class PendingGrammar:
    """A compile a request waits for, with the request's own deadline."""

    future: Future
    deadline: float
    timeout_s: float

    def poll(self) -> xgr.CompiledGrammar | None:
        """The compiled grammar once ready, None while compiling; raises GrammarError if the
        compile failed or the deadline passed."""
        if self.future.done():
            return self.future.result()  # raises the GrammarError of a failed compile
        if time.monotonic() > self.deadline:
            raise GrammarError(f"compiling the grammar took longer than the time limit ({self.timeout_s:g} s)")
        return None

    def wait(self) -> xgr.CompiledGrammar:
        try:
            return self.future.result(timeout=max(0.0, self.deadline - time.monotonic()))
        except futures.TimeoutError:  # the builtin TimeoutError from Python 3.11
            raise GrammarError(
                f"compiling the grammar took longer than the time limit ({self.timeout_s:g} s)"
            ) from None


class GrammarService:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        timeout_s: float = DEFAULT_TIMEOUT_S,
        workers: int = 4,
    ):
        """`tokenizer`: a Hugging Face tokenizer; `vocab_size`: the model's logits width (ids
        past the tokenizer's vocabulary are never allowed); `stop_token_ids`: what ends a
        request (allowed only where the grammar can end)."""
        self.vocab_size = vocab_size
        # Grammars know only the tokenizer's ids: xgrammar treats every id past them (a model's
        # padding rows) as a special token and pays for each one in every mask fill and token
        # accept (5x and 8x slower with SmolLM2's 49,152 tokens in a 151,936-row model). The
        # engine leaves those ids out of a constrained row's mask itself. A stop id past them
        # (a model config's end-of-sequence id that this tokenizer lacks: another model's
        # tokenizer, as dummy-weight benchmarks use) is never allowed under a grammar.
        self.grammar_vocab_size = min(vocab_size, _vocab_end(tokenizer))
        stop_token_ids = [t for t in stop_token_ids if t < self.grammar_vocab_size] or None
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="nanoserve-grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0  # compiles started (cache misses)
        # The tokenizer's tables take a second or so for a large vocabulary: built on the pool.
        self._compiler: Future = self._pool.submit(
            lambda: xgr.GrammarCompiler(
                xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.grammar_vocab_size, stop_token_ids=stop_token_ids
                ),
                max_threads=1,
                cache_enabled=False,  # this service's cache is the one
            )
        )

    def submit(self, spec: StructuredOutputs, timeout_s: float | None = None) -> PendingGrammar:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        key = spec.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None and future.done() and (future.cancelled() or future.exception() is not None):
                future = None  # failed compiles are not cached
            if future is None:
                future = self._pool.submit(self._run, spec)
                self._cache[key] = future
                self.num_compiles += 1
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        return PendingGrammar(future, time.monotonic() + timeout, timeout)

    def compile(self, spec: StructuredOutputs, timeout_s: float | None = None) -> xgr.CompiledGrammar:
        """Compile (or fetch from the cache) in the pool and wait, at most the time limit."""
        return self.submit(spec, timeout_s).wait()

    def _run(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        return _compile(self._compiler.result(), spec)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
