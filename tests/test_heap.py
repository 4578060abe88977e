"""The startup-heap freeze and the collection timer (nanoserve/heap.py)."""

from __future__ import annotations

import gc
import logging

from nanoserve.heap import DeferredFullCollections, GcPauseWatch, freeze_startup_heap


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


def test_full_collections_wait_for_an_idle_moment():
    clock, calls, idle = FakeClock(), [], [False]
    saved = gc.get_threshold()
    deferred = DeferredFullCollections(
        lambda: idle[0], idle_after_s=10, at_least_every_s=300, clock=clock, collect=calls.append
    ).start()
    try:
        assert gc.get_threshold()[:2] == saved[:2] and gc.get_threshold()[2] >= 2**30  # none from allocations
        gc.collect(1)  # a young collection moves objects into the oldest generation
        clock.t = 50
        assert not deferred.tick() and calls == []  # busy: no full collection
        idle[0] = True
        clock.t = 5  # idle, but the last full collection was 5 s ago
        deferred.last_full = 0
        assert not deferred.tick()
        clock.t = 11
        assert deferred.tick() and calls == [2] and deferred.last_full == 11
        idle[0] = False
        clock.t = 11 + 299
        assert not deferred.tick()
        clock.t = 11 + 300  # under load that never pauses: one every at_least_every_s
        assert deferred.tick() and calls == [2, 2] and deferred.num_full == 2
    finally:
        deferred.stop()
    assert gc.get_threshold() == saved


def test_an_idle_process_with_nothing_new_is_not_collected_again():
    clock, calls = FakeClock(), []
    deferred = DeferredFullCollections(lambda: True, idle_after_s=10, clock=clock, collect=calls.append).start()
    try:
        gc.collect()  # nothing promoted since
        clock.t = 20
        assert not deferred.tick() and calls == []
    finally:
        deferred.stop()
