"""The startup heap of long-lived processes, kept out of the garbage collector's full collections.

A full (generation 2) collection scans every tracked object. After start-up a server process
holds ~60k (the API server's FastAPI, pydantic and tokenizer objects) to ~220k (the engine
process's torch and transformers) of them that live as long as the process, and each full
collection then stops the process for tens of milliseconds (on the 2-core dev machine: 41 ms
for the API server's imports alone, 190-265 ms with a tokenizer and torch loaded). In the API
server that pause holds every stream's next chunk at once. `freeze_startup_heap` moves the
start-up objects to the permanent generation (`gc.freeze`), so full collections scan only what
requests created.

Invariant: called once per process, after its long-lived objects exist and before it serves;
nothing frozen needs collecting later, because the process ends with them.

Freezing is not enough in the API server: at 32 req/s on an H200 (dummy llama-3.1-8b, 1024-token
prompts) its full collections still took 22-38 ms every 4-5 s with nothing collected (hundreds
of live streams, their coroutines and their prompts' token lists; benchmarks/results/2026-12-02.md),
and each one again held every stream. `DeferredFullCollections` takes full
collections away from the allocation counter: the server runs one when it has no request in
flight (at most every `IDLE_AFTER_S`), or every `AT_LEAST_EVERY_S` under load that never
pauses, one stall every few minutes instead of every few seconds. Young collections (the
generations where short-lived cycles die) run as before.

`GcPauseWatch` times every collection (`gc.callbacks`) and logs a warning for one longer than
its threshold, so a latency tail caused by the collector shows in the log.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

DEFAULT_WARN_S = 0.02  # a collection this long shows in an inter-token p99
IDLE_AFTER_S = 10.0  # an idle server's full collection, at most this often
AT_LEAST_EVERY_S = 300.0  # a full collection at least this often, idle or not
NEVER = 2**30  # a generation-2 threshold the allocation counter never reaches


def freeze_startup_heap(logger: logging.Logger, process: str) -> int:
    """Collect once, then freeze what survives; returns the number of frozen objects."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: %d startup objects moved out of the garbage collector's scans", process, frozen)
    return frozen


class GcPauseWatch:
    """Times collections; counts them per generation and warns about long ones."""

    def __init__(self, logger: logging.Logger, warn_s: float = DEFAULT_WARN_S, clock=time.perf_counter):
        self.logger = logger
        self.warn_s = warn_s
        self.clock = clock
        self.counts = [0, 0, 0]
        self.longest_s = 0.0
        self._start: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = self.clock()
            return
        if self._start is None:  # installed mid-collection
            return
        took = self.clock() - self._start
        self._start = None
        generation = info.get("generation", 2)
        self.counts[generation] += 1
        self.longest_s = max(self.longest_s, took)
        if took > self.warn_s:
            self.logger.warning(
                "garbage collection of generation %d took %.1f ms (%d objects collected)",
                generation,
                took * 1e3,
                info.get("collected", 0),
            )

    def install(self) -> GcPauseWatch:
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


class DeferredFullCollections:
    """Full (generation 2) collections when the process is idle, or every `at_least_every_s`;
    never from the allocation counter. `tick()` is called periodically (every second)."""

    def __init__(
        self,
        is_idle: Callable[[], bool],
        idle_after_s: float = IDLE_AFTER_S,
        at_least_every_s: float = AT_LEAST_EVERY_S,
        clock=time.monotonic,
        collect=gc.collect,
    ):
        self.is_idle = is_idle
        self.idle_after_s = idle_after_s
        self.at_least_every_s = at_least_every_s
        self.clock = clock
        self.collect = collect
        self.last_full = clock()
        self.num_full = 0
        self._saved: tuple[int, int, int] | None = None

    def start(self) -> DeferredFullCollections:
        if self._saved is None:
            self._saved = gc.get_threshold()
            gc.set_threshold(self._saved[0], self._saved[1], NEVER)
        return self

    def stop(self) -> None:
        if self._saved is not None:
            gc.set_threshold(*self._saved)
            self._saved = None

    def tick(self) -> bool:
        """Run a full collection if one is due; returns whether it ran."""
        now = self.clock()
        since = now - self.last_full
        promoted = gc.get_count()[2] > 0  # young collections since the last full one moved objects up
        due = since >= self.at_least_every_s or (since >= self.idle_after_s and promoted and self.is_idle())
        if due:
            self.collect(2)
            self.last_full = self.clock()
            self.num_full += 1
        return due
