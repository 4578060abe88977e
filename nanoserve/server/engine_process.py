"""The engine process: owns one LLMEngine and drives its step loop for the API server.

Layout: the API server spawns this process (multiprocessing, spawn context) and talks to it over
two ZMQ PUSH/PULL sockets (requests in, outputs out; see `messages.py`).

Invariants:
- The loop never dies because of one request: `add_request` errors become `RequestRejected`.
  An exception from `step()` is an engine bug: it is reported as `EngineFailed` and the process
  exits non-zero, so the server can answer 503 and exit instead of hanging.
- The process never outlives the server: the kernel sends it SIGKILL when its parent dies
  (PR_SET_PDEATHSIG on Linux) and the loop also checks the parent pid while idle.
- Every accepted request is reported once as `scheduled` (in `StepOutputs`) when the scheduler
  first admits it, so the API server knows which requests still wait in the queue.
- It runs in its own process group, so a terminal Ctrl+C reaches only the server, which then
  shuts the engine down in order (and kills the whole group if that takes too long).
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import signal
import sys
import traceback

from nanoserve.heap import GcPauseWatch, freeze_startup_heap
from nanoserve.server import messages as m

logger = logging.getLogger("nanoserve.engine_process")

IDLE_POLL_MS = 200  # how long an idle engine waits for a message before re-checking its parent


def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL us when the parent exits; no-op where unsupported."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
    # The parent may already have died between fork and prctl.
    if os.getppid() != parent_pid:
        os._exit(1)


def _build_engine(config, engine_factory: str | None):
    if engine_factory is None:
        from nanoserve.engine.llm_engine import LLMEngine

        return LLMEngine(config)
    module_name, _, attr = engine_factory.partition(":")
    return getattr(importlib.import_module(module_name), attr)(config)


def _model_info(engine, served_name: str) -> m.ModelInfo:
    mc = engine.model_config
    # The engine's limit (the model's context, capped by the KV cache) wins over the config's.
    max_model_len = getattr(engine, "max_model_len", None) or mc.max_model_len
    return m.ModelInfo(
        name=served_name,
        max_model_len=int(max_model_len),
        vocab_size=int(mc.vocab_size),
        eos_token_ids=list(getattr(mc, "eos_token_ids", None) or []),
        tokenizer=getattr(engine, "tokenizer", None),
        hidden_size=int(getattr(mc, "hidden_size", 0) or 0),
        task=getattr(getattr(engine, "config", None), "task", "generate"),
        model_type=getattr(mc, "model_type", None),
    )


def engine_main(
    config, served_name: str, in_addr: str, out_addr: str, parent_pid: int, engine_factory: str | None = None
) -> None:
    """Entry point of the engine process (must be importable for the spawn start method)."""
    import zmq

    os.setpgrp()  # own process group: terminal signals go to the server only
    _die_with_parent(parent_pid)
    # The server decides when we stop; ignore the terminal's SIGINT if it still reaches us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(in_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(out_addr)

    try:
        engine = _build_engine(config, engine_factory)
        ready = m.EngineReady(info=_model_info(engine, served_name), stats=dict(engine.stats()))
        payload = m.dumps(ready)
    except BaseException:  # noqa: BLE001 - report any load failure to the operator, then exit
        push.send(m.dumps(m.EngineFailed(error=traceback.format_exc())))
        push.close()
        ctx.term()
        sys.exit(1)
    push.send(payload)
    # The startup heap (torch, transformers, the engine's own long-lived objects: ~200k) would
    # otherwise be scanned by every full collection, a pause in the step loop (a process
    # holding LLM() on CPU: 126 ms, 0.01 ms once frozen; benchmarks/results/2026-11-21.md).
    freeze_startup_heap(logger, "engine process")
    GcPauseWatch(logger).install()

    code = 0
    try:
        _loop(engine, pull, push, parent_pid)
    except BaseException:  # noqa: BLE001
        push.send(m.dumps(m.EngineFailed(error=traceback.format_exc())))
        code = 1
    finally:
        shutdown = getattr(engine, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception:
                logger.exception("engine shutdown failed")
        pull.close(linger=0)
        push.close()
        ctx.term()
    sys.exit(code)


def _loop(engine, pull, push, parent_pid: int) -> None:
    import zmq

    queued: set[str] = set()  # accepted, not yet admitted by the scheduler
    while True:
        busy = engine.has_unfinished_requests()
        # Block while idle (a short poll so a dead parent is noticed), never while requests run.
        if pull.poll(0 if busy else IDLE_POLL_MS):
            while True:
                try:
                    msg = m.loads(pull.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(msg, m.Shutdown):
                    return
                reply = _handle(engine, msg, queued)
                if reply is not None:
                    push.send(m.dumps(reply))
            # Aborts free pages now; tell the server so /metrics shows it even if we go idle.
            if not engine.has_unfinished_requests():
                push.send(m.dumps(m.StepOutputs(updates=[], stats=dict(engine.stats()))))
        elif not busy and os.getppid() != parent_pid:
            return
        if engine.has_unfinished_requests():
            updates = engine.step()
            scheduled = _newly_scheduled(engine, queued) if queued else []
            push.send(m.dumps(m.StepOutputs(updates=updates, stats=dict(engine.stats()), scheduled=scheduled)))


def _newly_scheduled(engine, queued: set[str]) -> list[str]:
    """Take out of `queued` the requests the scheduler has admitted (given a slot) by now.

    Only runs while something is queued and costs one pass over the scheduler's waiting
    queue. An engine without a scheduler (a test double) counts every request as admitted
    by the first step after it arrived."""
    waiting = getattr(getattr(engine, "scheduler", None), "waiting", None)
    still = set() if waiting is None else {r.request_id for r in waiting if getattr(r, "slot", None) is None}
    done = [rid for rid in queued if rid not in still]
    queued.difference_update(done)
    return done


def _handle(engine, msg, queued: set[str]):
    if isinstance(msg, m.AddRequest):
        try:
            engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params)
        except ValueError as exc:
            return m.RequestRejected(request_id=msg.request_id, message=str(exc))
        queued.add(msg.request_id)
        return m.RequestAccepted(request_id=msg.request_id)
    if isinstance(msg, m.AbortRequest):
        if msg.index is None:
            queued.discard(msg.request_id)
            engine.abort_request(msg.request_id)
        else:
            engine.abort_request(msg.request_id, msg.index)
        return None
    if isinstance(msg, m.StatsRequest):
        return m.StatsReply(nonce=msg.nonce, stats=dict(engine.stats()))
    raise TypeError(f"engine process got an unknown message {type(msg).__name__}")
