"""The startup-heap freeze and the collection timer (nanoserve/heap.py)."""

from __future__ import annotations

import gc
import logging

from nanoserve.heap import GcPauseWatch, freeze_startup_heap


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_freeze_moves_the_heap_out_of_full_collections(caplog):
    before = gc.get_freeze_count()
    keep = [[i] for i in range(5000)]  # tracked objects that survive the collection
    try:
        with caplog.at_level(logging.INFO):
            frozen = freeze_startup_heap(logging.getLogger("test"), "test process")
        assert frozen >= before + len(keep)
        assert f"test process: {frozen} startup objects" in caplog.text
        assert not any(obj is keep for obj in gc.get_objects(2))  # a full collection no longer scans them
    finally:
        gc.unfreeze()


def test_pause_watch_counts_generations_and_warns_on_long_ones(caplog):
    clock = FakeClock()
    watch = GcPauseWatch(logging.getLogger("test"), warn_s=0.02, clock=clock)
    with caplog.at_level(logging.WARNING):
        for generation, took in ((0, 0.001), (2, 0.05), (1, 0.019)):
            watch("start", {"generation": generation})
            clock.t += took
            watch("stop", {"generation": generation, "collected": 3})
        watch("stop", {"generation": 0})  # a stop without its start (installed mid-collection): ignored
    assert watch.counts == [1, 1, 1]
    assert abs(watch.longest_s - 0.05) < 1e-12
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["garbage collection of generation 2 took 50.0 ms (3 objects collected)"]


def test_pause_watch_installs_once_and_sees_real_collections():
    watch = GcPauseWatch(logging.getLogger("test")).install()
    try:
        watch.install()
        assert gc.callbacks.count(watch) == 1
        gc.collect()
        assert watch.counts[2] >= 1
    finally:
        watch.remove()
    assert watch not in gc.callbacks
