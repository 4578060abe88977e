"""The API server's handle on the engine process: spawn, readiness, routing, liveness, shutdown.

Layout: the server binds two ZMQ PUSH/PULL sockets on ipc:// paths in a private temp directory;
the engine process (see `engine_process.py`) connects to both. One reader task routes every
engine message to the asyncio.Queue registered for its request id; one monitor task watches the
process.

Invariants:
- A request id is registered (has a sink) from `submit` until `release`; updates for ids without
  a sink (aborted or released requests) are dropped, so finished requests leave no state here.
- If the engine process dies or reports a fatal error, every registered sink receives
  `EngineDead`, `dead` holds the reason, and `on_death` runs once (the server then exits).
- `kill()` is synchronous and idempotent, safe from atexit and `finally` blocks.
- Queue: a request is *queued* from `submit` until the engine reports that its scheduler admitted
  it (`Scheduled` goes into its sink), or until it is aborted, released or rejected. `admits(k)`
  says whether k more fit under `max_queued_requests`; a request queued longer than
  `queue_timeout_s` is aborted in the engine and gets `QueueTimeout` instead.
- Heartbeat: every engine step sends one `StepOutputs`; `stalled_s()` is how long the engine has
  had work (tracked requests) without finishing a step, the watchdog's measure.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from nanoserve.sampling_params import SamplingParams
from nanoserve.server import messages as m
from nanoserve.server.engine_process import engine_main

logger = logging.getLogger("nanoserve.server")


@dataclass
class EngineDead:
    """Put into a request's sink when the engine process is gone."""

    reason: str


@dataclass
class Accepted:
    """Put into a request's sink when the engine took the request (before any of its updates)."""

    request_id: str


@dataclass
class Rejected:
    """Put into a request's sink when the engine refused the request (bad size, ...)."""

    message: str


@dataclass
class Scheduled:
    """Put into a request's sink when the engine's scheduler first admitted it (it left the queue)."""

    request_id: str


@dataclass
class QueueTimeout:
    """Put into a request's sink when it waited in the queue longer than the queue timeout (it is
    aborted in the engine)."""

    waited_s: float


class EngineStartError(RuntimeError):
    pass


class EngineClient:
    def __init__(
        self,
        config,
        served_name: str,
        engine_factory: str | None = None,
        max_queued_requests: int | None = None,
        queue_timeout_s: float | None = None,
    ):
        self._config = config
        self.max_queued_requests = max_queued_requests
        self.queue_timeout_s = queue_timeout_s
        self._queued: dict[str, float] = {}  # request id -> submit time, while queued (insertion order)
        self._last_step = time.monotonic()  # the last StepOutputs, or the moment work appeared
        self._served_name = served_name
        self._engine_factory = engine_factory
        self._sinks: dict[str, asyncio.Queue] = {}
        self._stats_waiters: dict[int, asyncio.Future] = {}
        self._nonce = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._ipc_dir: str | None = None
        self._stopping = False
        self.info: m.ModelInfo | None = None
        self.stats: dict = {}
        self.dead: str | None = None
        self.on_death: Callable[[str], None] | None = None

    # ----------------------------------------------------------------------------- lifecycle

    async def start(self) -> m.ModelInfo:
        """Spawn the engine process and wait until its model is loaded (or it failed)."""
        self._ipc_dir = tempfile.mkdtemp(prefix="nanoserve-")
        os.chmod(self._ipc_dir, 0o700)  # only this user may connect to the pickle sockets
        to_engine = f"ipc://{self._ipc_dir}/in"
        from_engine = f"ipc://{self._ipc_dir}/out"
        # Sends are synchronous (a plain socket, no high-water mark: they only queue), so that
        # aborts can be sent from `finally` blocks of cancelled tasks, where awaiting is not possible.
        self._sync_ctx = zmq.Context()
        self._push = self._sync_ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.bind(to_engine)
        self._ctx = zmq.asyncio.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(from_engine)

        spawn = multiprocessing.get_context("spawn")
        # Not a daemon: the engine may start tensor-parallel workers of its own, which daemonic
        # processes may not. Lifetime is tied to ours by PDEATHSIG, atexit and `kill()` instead.
        self._proc = spawn.Process(
            target=engine_main,
            args=(self._config, self._served_name, to_engine, from_engine, os.getpid(), self._engine_factory),
            name="nanoserve-engine",
        )
        self._proc.start()
        atexit.register(self.kill)
        logger.info("engine process started (pid %d)", self._proc.pid)

        while True:
            if await self._pull.poll(200):
                msg = m.loads(await self._pull.recv())
                if isinstance(msg, m.EngineReady):
                    self.info, self.stats = msg.info, msg.stats
                    break
                if isinstance(msg, m.EngineFailed):
                    self.kill()
                    raise EngineStartError(f"the engine failed to start:\n{msg.error}")
            elif not self._proc.is_alive():
                code = self._proc.exitcode
                self.kill()
                raise EngineStartError(f"the engine process exited with code {code} while loading the model")

        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read_loop()), loop.create_task(self._monitor_loop())]
        if self.queue_timeout_s is not None:
            self._tasks.append(loop.create_task(self._queue_timeout_loop()))
        return self.info

    async def shutdown(self, grace_s: float = 3.0) -> None:
        """Ask the engine to stop, then kill its process group if it is not gone within grace_s."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        if self._proc is not None and self._proc.is_alive() and self.info is not None:
            # (An engine still loading reads no messages: it is killed at once below.)
            try:
                self._push.send(m.dumps(m.Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            deadline = time.monotonic() + grace_s
            while self._proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        self.kill()

    def kill(self) -> None:
        self._stopping = True
        proc = self._proc
        if proc is not None and proc.pid is not None:
            if proc.is_alive():
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the engine and any workers it started
                except (ProcessLookupError, PermissionError):
                    proc.kill()
            proc.join(timeout=5)
        for sock in (getattr(self, "_push", None), getattr(self, "_pull", None)):
            if sock is not None and not sock.closed:
                sock.close(linger=0)
        for ctx in (self._ctx, getattr(self, "_sync_ctx", None)):
            if ctx is not None and not ctx.closed:
                ctx.term()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # ----------------------------------------------------------------------------- requests

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, sink: asyncio.Queue):
        if self.dead is not None:
            sink.put_nowait(EngineDead(self.dead))
            return
        if not self._sinks:
            self._last_step = time.monotonic()  # the watchdog measures from when work appeared
        self._sinks[request_id] = sink
        self._queued[request_id] = time.monotonic()
        self._push.send(m.dumps(m.AddRequest(request_id, prompt_token_ids, params)))

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Stop a request (or one sample of it) in the engine; its pages are freed at once.
        Aborting the whole request also forgets its sink."""
        if index is None:
            self._sinks.pop(request_id, None)
            self._queued.pop(request_id, None)
        if self.dead is None and not self._stopping:
            self._push.send(m.dumps(m.AbortRequest(request_id, index)))

    def release(self, request_id: str) -> None:
        """Forget a request that finished normally."""
        self._sinks.pop(request_id, None)
        self._queued.pop(request_id, None)

    @property
    def num_tracked_requests(self) -> int:
        return len(self._sinks)

    @property
    def num_queued_requests(self) -> int:
        return len(self._queued)

    def admits(self, count: int) -> bool:
        """Whether `count` more requests fit in the queue (always, without a limit)."""
        return self.max_queued_requests is None or len(self._queued) + count <= self.max_queued_requests

    def stalled_s(self) -> float:
        """Seconds the engine has had work without finishing a step (0 while it has none)."""
        if not self._sinks or self.dead is not None:
            return 0.0
        return time.monotonic() - self._last_step

    async def fetch_stats(self, timeout_s: float = 2.0) -> dict:
        """Fresh engine stats (answered between two engine steps); the last known on timeout."""
        if self.dead is not None or self._stopping:
            return self.stats
        nonce = next(self._nonce)
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters[nonce] = fut
        try:
            self._push.send(m.dumps(m.StatsRequest(nonce)))
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            return self.stats
        finally:
            self._stats_waiters.pop(nonce, None)

    # ----------------------------------------------------------------------------- background

    async def _read_loop(self) -> None:
        while True:
            msg = m.loads(await self._pull.recv())
            if isinstance(msg, m.StepOutputs):
                self.stats = msg.stats
                self._last_step = time.monotonic()
                for request_id in msg.scheduled:
                    self._queued.pop(request_id, None)
                    sink = self._sinks.get(request_id)
                    if sink is not None:
                        sink.put_nowait(Scheduled(request_id))
                for update in msg.updates:
                    sink = self._sinks.get(update.request_id)
                    if sink is not None:
                        sink.put_nowait(update)
            elif isinstance(msg, m.RequestAccepted):
                sink = self._sinks.get(msg.request_id)
                if sink is not None:
                    sink.put_nowait(Accepted(msg.request_id))
            elif isinstance(msg, m.RequestRejected):
                sink = self._sinks.pop(msg.request_id, None)
                self._queued.pop(msg.request_id, None)
                if sink is not None:
                    sink.put_nowait(Rejected(msg.message))
            elif isinstance(msg, m.StatsReply):
                self.stats = msg.stats
                fut = self._stats_waiters.get(msg.nonce)
                if fut is not None and not fut.done():
                    fut.set_result(msg.stats)
            elif isinstance(msg, m.EngineFailed):
                self._declare_dead(f"the engine loop failed:\n{msg.error}")

    async def _monitor_loop(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            if not self._stopping and self._proc is not None and not self._proc.is_alive():
                self._declare_dead(f"the engine process exited unexpectedly (exit code {self._proc.exitcode})")
                return

    async def _queue_timeout_loop(self) -> None:
        limit = self.queue_timeout_s
        while True:
            await asyncio.sleep(min(0.1, limit / 4))
            now = time.monotonic()
            expired = []
            for request_id, since in self._queued.items():  # oldest first
                if now - since < limit:
                    break
                expired.append((request_id, now - since))
            for request_id, waited in expired:
                sink = self._sinks.get(request_id)
                self.abort(request_id)  # forgets its sink and queue entry; frees it in the engine
                if sink is not None:
                    sink.put_nowait(QueueTimeout(waited))

    def _declare_dead(self, reason: str) -> None:
        if self.dead is not None or self._stopping:
            return
        self.dead = reason
        logger.error("%s", reason)
        sinks, self._sinks = self._sinks, {}
        self._queued.clear()
        for sink in sinks.values():
            sink.put_nowait(EngineDead(reason))
        if self.on_death is not None:
            self.on_death(reason)
