"""The startup heap of long-lived processes, kept out of the garbage collector's full collections.

A full (generation 2) collection scans every tracked object. After start-up a server process
holds ~60k (the API server's FastAPI, pydantic and tokenizer objects) to ~220k (the engine
process's torch and transformers) of them that live as long as the process, and each full
collection then stops the process for tens of milliseconds (on the 2-core dev machine: 41 ms
for the API server's imports alone, 190-265 ms with a tokenizer and torch loaded). In the API
server that pause holds every stream's next chunk at once: at 32 req/s on an H200 (dummy
llama-3.1-8b) the engine's steps kept the inter-token p99 at 37 ms while the clients saw
65 ms (benchmarks/results/2026-12-02.md). `freeze_startup_heap` moves the start-up objects to
the permanent generation (`gc.freeze`), so full collections scan only what requests created.

Invariant: called once per process, after its long-lived objects exist and before it serves;
nothing frozen needs collecting later, because the process ends with them.

`GcPauseWatch` times every collection (`gc.callbacks`) and logs a warning for one longer than
its threshold, so a latency tail caused by the collector shows in the log.
"""

from __future__ import annotations

import gc
import logging
import time

DEFAULT_WARN_S = 0.02  # a collection this long shows in an inter-token p99


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
