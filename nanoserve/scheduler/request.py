"""The state of one sequence being generated.

Owns: `Request`. One `Request` is one sample: a prompt asked with `n` > 1 becomes one
request that is forked into `n` once its prompt has been computed.

Invariants:
- `token_ids` = prompt followed by the generated tokens; `num_computed` tokens of it have
  their K/V in the cache, in `pages` (page j holds positions j*P .. j*P+P-1);
- every step computes tokens [num_computed, len(token_ids)) and, if that reaches the end,
  samples one more; a decode step is the case len(token_ids) - num_computed == 1;
- len(pages) * P >= num_computed while the request holds pages; a request that is
  waiting from scratch holds no pages and no slot.
- with a prefix cache, `pages` may start with cached pages the request retained at
  admission; it then holds one lock on `prefix_node`, the node those pages end at.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from nanoserve.outputs import TokenLogprobs
from nanoserve.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    params: SamplingParams
    prompt_len: int
    token_ids: list[int]
    arrival: int  # admission order; preemption picks the largest
    index: int = 0  # sample index among the request's n
    status: Status = Status.WAITING
    num_computed: int = 0
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache at first admission
    admitted: bool = False  # given a slot once (a preempted request keeps its first count)
    pages: list[int] = field(default_factory=list)
    slot: int | None = None  # row of the request in per-slot device tables
    generator: torch.Generator | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    num_reported: int = 0  # output tokens already handed to the caller
    forked: bool = False  # n > 1 samples created (only meaningful for index 0)
    reserved_slots: list[int] = field(default_factory=list)  # slots held for the n-1 forks
    prefix_node: object | None = None  # locked radix-cache node, if any
    stream: bool = True  # report every step's tokens; False: report once, when finished
    # Stopping rules set by the engine at admission: the request stops when its length
    # reaches stop_len (max_tokens or max_model_len), or at a token in stop_ids (EOS unless
    # ignored, stop_token_ids) once min_tokens are out.
    stop_len: int = 2**62
    stop_ids: frozenset[int] | None = None
    sample_row: object | None = None  # the sampler's row, cached when it never changes (no penalties)
    # Grammar state of a constrained request (nanoserve.structured.GrammarMatcher): it has
    # accepted every output token already processed; dropped when the request finishes.
    matcher: object | None = None
    num_preemptions: int = 0  # times its KV was given back (a drafter's KV of it is then stale too)
    # With window groups (nanoserve.kvcache.window): per position page, the pages of the
    # windowed layers (None once given back: entries before window_start).
    window_pages: list[tuple[int, ...] | None] = field(default_factory=list)
    window_start: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
