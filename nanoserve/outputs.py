"""What the engine hands back: per-step token updates and the offline API's results."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Log-probability of the chosen token and the top-N alternatives at one position."""

    token_id: int
    logprob: float
    top: dict[int, float]  # token id -> logprob, the N most likely tokens


@dataclass
class StepUpdate:
    """New tokens for one sample of one request after an engine step.

    `index` is the sample's index among the request's `n` samples.
    `finish_reason` is None while running, else "stop", "length" or "abort".
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    # An embedding model's request (`--task embed`): its pooled, L2-normalized vector, on the
    # one update that finishes it (nanoserve.engine.pooling).
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # L2-normalized, of the model's hidden size


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s result for one prompt (vLLM's shape: `.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
