"""Streams write what is already there in one piece: `coalesced` joins a stream's SSE chunks while
its `Generation` already holds the next engine update, and sends each chunk as made otherwise."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")

from nanoserve.outputs import StepUpdate
from nanoserve.sampling_params import SamplingParams
from nanoserve.server.engine_client import Accepted, EngineDead, Scheduled
from nanoserve.server.generation import Generation, coalesced
from nanoserve.server.protocol import RequestError


class Backlog:
    """A stand-in for a Generation: `update_ready()` answers from a script, one answer per chunk."""

    def __init__(self, ready: list[bool]):
        self.ready = list(ready)

    def update_ready(self) -> bool:
        return self.ready.pop(0)


async def chunks(items, error: Exception | None = None):
    for item in items:
        yield item
    if error is not None:
        raise error


def run(agen) -> list[str]:
    async def drain():
        return [x async for x in agen]

    return asyncio.run(drain())


def test_chunks_behind_the_engine_go_out_together():
    out = run(coalesced(chunks(["a", "b", "c", "d", "e"]), Backlog([True, True, False, False, True])))
    assert out == ["abc", "d", "e"]  # the last one goes out when the stream ends


def test_a_stream_that_keeps_up_is_written_chunk_by_chunk():
    assert run(coalesced(chunks(["a", "b", "c"]), Backlog([False] * 3))) == ["a", "b", "c"]


def test_an_error_mid_stream_still_sends_what_came_before():
    got = []

    async def drain():
        async for x in coalesced(
            chunks(["a", "b"], RequestError(503, "gone", None, "engine_dead")), Backlog([True] * 2)
        ):
            got.append(x)

    with pytest.raises(RequestError):
        asyncio.run(drain())
    assert got == ["ab"]


def test_update_ready_counts_engine_updates_not_admission_events():
    async def check():
        gen = Generation(None, None, None, [], SamplingParams())
        assert not gen.update_ready()
        gen._queue.put_nowait(Accepted("r"))
        gen._queue.put_nowait(Scheduled("r"))
        assert not gen.update_ready()  # admission events alone: the next delta still waits
        gen._queue.put_nowait(StepUpdate("r", 0, [5], None, None, 3))
        assert gen.update_ready()
        other = Generation(None, None, None, [], SamplingParams())
        other._queue.put_nowait(EngineDead("stopped"))
        assert other.update_ready()  # the stream ends at once: nothing to wait for

    asyncio.run(check())
