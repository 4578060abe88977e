"""Typed messages that cross the ZMQ boundary between the API server and the engine process.

Every message is a plain dataclass sent with pickle over a pair of PUSH/PULL sockets on
private ipc:// paths (only the two processes of one server can reach them, so pickle is safe).

Invariants:
- server -> engine: `AddRequest`, `AbortRequest`, `StatsRequest`, `Shutdown`.
- engine -> server: `EngineReady` exactly once before anything else (or `EngineFailed` instead),
  then any mix of `StepOutputs`, `RequestAccepted`/`RequestRejected` (one per AddRequest, before
  any of its updates), `StatsReply`, and `EngineFailed` if the
  engine loop itself breaks (after which the engine process exits).
- A request id that was rejected never produces a `StepUpdate`.
- Every accepted request id appears once in some `StepOutputs.scheduled` (the step that
  admitted it), in or before the message that carries its first update, unless it was aborted
  while still queued. `StepOutputs` are sent once per engine step: they are the heartbeat.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from nanoserve.outputs import StepUpdate
from nanoserve.sampling_params import SamplingParams


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class AbortRequest:
    request_id: str
    index: int | None = None  # one sample of the request; None: all of them


@dataclass
class StatsRequest:
    nonce: int


@dataclass
class Shutdown:
    pass


@dataclass
class ModelInfo:
    """What the API server needs to know about the loaded model (sent once, at ready)."""

    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    tokenizer: Any = None  # a transformers tokenizer (picklable) or None for tokenizer-less models
    hidden_size: int = 0  # the length of an embedding model's vectors
    task: str = "generate"  # EngineConfig.task: "generate" or "embed"
    model_type: str | None = None  # the model's config.json model_type (reported in /model_info)


@dataclass
class EngineReady:
    info: ModelInfo
    stats: dict = field(default_factory=dict)


@dataclass
class EngineFailed:
    error: str  # a formatted traceback or message, shown to the operator


@dataclass
class StepOutputs:
    updates: list[StepUpdate]
    stats: dict
    # Requests the scheduler admitted for the first time in this step (they left the queue).
    scheduled: list[str] = field(default_factory=list)


@dataclass
class RequestAccepted:
    request_id: str


@dataclass
class RequestRejected:
    request_id: str
    message: str


@dataclass
class StatsReply:
    nonce: int
    stats: dict


def dumps(msg: object) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> object:
    return pickle.loads(data)
