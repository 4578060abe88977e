"""One HTTP request's generation: its engine requests, detokenization, stop strings and metrics.

An HTTP request may carry several prompts (completions with a list prompt), each sent to the
engine as one request with `n` samples. `Generation` submits them, waits until the engine has
accepted all (so a rejection becomes a 400 before any byte is streamed), then yields one
`SampleDelta` per engine update of each sample: the newly visible text (incrementally
detokenized, stop strings cut), the new token ids and log-probabilities, and the finish reason.

Invariants:
- Token ids, logprobs and usage counts stop at the token that completed a stop string; the text
  stops before the stop string.
- A sample ended by a stop string is aborted in the engine at once (its pages are freed); when
  every sample of an engine request has finished, the request is released here.
- `close()` is synchronous and idempotent: it aborts whatever is unfinished (client gone,
  error), so it is safe in `finally` blocks of cancelled tasks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from nanoserve.outputs import StepUpdate, TokenLogprobs
from nanoserve.sampling_params import SamplingParams
from nanoserve.server.engine_client import Accepted, EngineDead, QueueTimeout, Rejected, Scheduled
from nanoserve.server.protocol import RequestError, bad_request


def _queue_timeout(event: QueueTimeout) -> RequestError:
    return RequestError(
        503, f"The request waited {event.waited_s:.1f} s in the queue without being scheduled", None, "queue_timeout"
    )


class _TextlessDetokenizer:
    """Stands in for SampleDetokenizer when the model has no tokenizer: tokens, no text."""

    stopped = False
    stop_reason = None
    text = ""

    def append(self, token_ids: list[int]) -> str:
        return ""

    def feed(self, token_ids: list[int]) -> tuple[str, int]:
        return "", len(token_ids)  # no text, so no stop string can cut the tokens

    def flush(self) -> str:
        return ""


def make_detokenizer(tokenizer, prompt_token_ids: list[int], params: SamplingParams):
    if tokenizer is None:
        return _TextlessDetokenizer()
    from nanoserve.detokenizer import SampleDetokenizer

    return SampleDetokenizer(tokenizer, prompt_token_ids, params)


@dataclass
class SampleDelta:
    prompt_index: int  # which prompt of the HTTP request
    index: int  # sample index among that prompt's n samples
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    embedding: list[float] | None = None  # an embedding model's vector (on the request's one delta)


@dataclass
class _Sample:
    detok: object
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    last_token_time: float | None = None


@dataclass
class _Job:
    prompt_index: int
    request_id: str
    prompt_token_ids: list[int]
    samples: list[_Sample]
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    closed: bool = False  # released or aborted in the engine

    @property
    def done(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class Generation:
    def __init__(self, client, metrics, tokenizer, prompts: list[list[int]], params: SamplingParams):
        self._client = client
        self._metrics = metrics
        self._params = params
        self._arrival = time.monotonic()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pending: deque = deque()
        base = uuid.uuid4().hex
        self._jobs = [
            _Job(
                prompt_index=i,
                request_id=f"{base}-{i}",
                prompt_token_ids=ids,
                samples=[_Sample(make_detokenizer(tokenizer, ids, params)) for _ in range(params.n)],
            )
            for i, ids in enumerate(prompts)
        ]
        self._by_id = {job.request_id: job for job in self._jobs}

    # ------------------------------------------------------------------------------- start/stop

    async def start(self, prompt_param: str) -> None:
        """Submit every prompt and wait until the engine accepted all of them and its scheduler
        admitted them (so a queue timeout is still an HTTP 503, before any byte is streamed)."""
        for job in self._jobs:
            self._client.submit(job.request_id, job.prompt_token_ids, self._params, self._queue)
        waiting = set(self._by_id)
        queued = set(self._by_id)
        try:
            while waiting or queued:
                event = await self._queue.get()
                if isinstance(event, Accepted):
                    waiting.discard(event.request_id)
                    continue
                if isinstance(event, Scheduled):
                    queued.discard(event.request_id)
                    continue
                if isinstance(event, EngineDead):
                    raise RequestError(503, f"The engine is not available: {event.reason}", None, "engine_dead")
                if isinstance(event, Rejected):
                    raise bad_request(event.message, prompt_param, "prompt_rejected")
                if isinstance(event, QueueTimeout):
                    raise _queue_timeout(event)
                self._pending.append(event)  # an update of an accepted prompt: replay it later
            for job in self._jobs:
                self._metrics.prompt_tokens.inc(len(job.prompt_token_ids))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Abort every engine request not finished yet; count its unfinished samples as aborted."""
        for job in self._jobs:
            if job.closed:
                continue
            job.closed = True
            self._client.abort(job.request_id)
            for sample in job.samples:
                if sample.finish_reason is None:
                    sample.finish_reason = "abort"
                    self._metrics.finished("abort")

    # ------------------------------------------------------------------------------- results

    @property
    def finished(self) -> bool:
        """Every sample of every prompt has ended (the last delta has been yielded)."""
        return all(job.done for job in self._jobs)

    @property
    def usage(self) -> dict:
        prompt = sum(len(job.prompt_token_ids) for job in self._jobs)
        completion = sum(len(s.token_ids) for job in self._jobs for s in job.samples)
        cached = sum(job.num_cached_tokens for job in self._jobs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def update_ready(self) -> bool:
        """Whether an engine update (or the engine's death) is already here, so that the next
        step of `deltas()` will not wait for the engine (moves what has arrived to `_pending`)."""
        while not self._queue.empty():
            self._pending.append(self._queue.get_nowait())
        return any(not isinstance(event, (Accepted, Scheduled)) for event in self._pending)

    async def deltas(self) -> AsyncIterator[SampleDelta]:
        while not self.finished:
            event = self._pending.popleft() if self._pending else await self._queue.get()
            if isinstance(event, (Accepted, Scheduled)):
                continue
            if isinstance(event, QueueTimeout):  # cannot happen after start(); be explicit anyway
                raise _queue_timeout(event)
            if isinstance(event, EngineDead):
                raise RequestError(503, f"The engine is not available: {event.reason}", None, "engine_dead")
            if isinstance(event, Rejected):  # cannot happen after start(); be explicit anyway
                raise bad_request(event.message, None, "prompt_rejected")
            delta = self._apply(event)
            if delta is not None:
                yield delta

    def _apply(self, update: StepUpdate) -> SampleDelta | None:
        job = self._by_id.get(update.request_id)
        if job is None or update.index >= len(job.samples):
            return None
        sample = job.samples[update.index]
        if sample.finish_reason is not None:
            return None  # this sample already ended here (a stop string); the engine ran on
        now = time.monotonic()
        job.num_cached_tokens = max(job.num_cached_tokens, update.num_cached_tokens)
        if update.new_token_ids and job.first_token_time is None:
            job.first_token_time = now
            self._metrics.ttft.observe(now - self._arrival)
        if update.new_token_ids and sample.last_token_time is not None:
            gap = (now - sample.last_token_time) / len(update.new_token_ids)
            for _ in update.new_token_ids:
                self._metrics.itl.observe(gap)
        if update.new_token_ids:
            sample.last_token_time = now

        text, num_kept = sample.detok.feed(update.new_token_ids)  # cut at the token completing a stop string
        text_parts: list[str] = [text]
        kept = update.new_token_ids[:num_kept]
        sample.token_ids.extend(kept)
        self._metrics.generation_tokens.inc(len(kept))
        logprobs = update.new_logprobs[: len(kept)] if update.new_logprobs is not None else None

        finish = None
        if sample.detok.stopped:
            finish = "stop"
        elif update.finish_reason is not None:
            finish = update.finish_reason
            text_parts.append(sample.detok.flush())
        if finish is not None:
            sample.finish_reason = finish
            self._metrics.finished(finish)
            if update.finish_reason is None:
                # A stop string ended this sample while the engine was still generating it.
                self._client.abort(job.request_id, update.index)
            if job.done and not job.closed:
                job.closed = True
                self._metrics.e2e.observe(now - self._arrival)
                self._client.release(job.request_id)
        return SampleDelta(
            job.prompt_index, update.index, "".join(text_parts), kept, logprobs, finish, update.embedding
        )


async def coalesced(chunks: AsyncIterator[str], gen: Generation) -> AsyncIterator[str]:
    """A stream's SSE `chunks` joined while `gen` already holds its next engine update, so that a
    stream behind the engine (a busy API server, a burst) is written once per catch-up rather
    than once per engine step: fewer writes, and once a client has gone, one write before the
    server sees the connection lost (asyncio warns from the fifth; thousands of warnings per
    9-minute GPU soak before). A stream that keeps up is written once per step, as before."""
    batch: list[str] = []
    try:
        async for chunk in chunks:
            batch.append(chunk)
            if not gen.update_ready():
                yield "".join(batch)
                batch.clear()
    except Exception:
        if batch:  # what came before an error mid-stream is still sent
            yield "".join(batch)
        raise
    if batch:
        yield "".join(batch)


async def _wait_disconnect(request) -> None:
    """Returns when the client has gone away (the body must already have been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(gen: Generation, request) -> list[SampleDelta]:
    """All deltas of a non-streaming request; aborts it if the client disconnects first
    (`request`: the Starlette request, whose body has been read)."""

    async def consume():
        return [delta async for delta in gen.deltas()]

    work = asyncio.ensure_future(consume())
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            raise RequestError(499, "client disconnected", None, "client_disconnected")
        return work.result()
    finally:
        watch.cancel()
        gen.close()
