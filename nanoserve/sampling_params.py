"""Per-request sampling and stopping parameters, validated at construction.

Every field is checked in `__post_init__`; a bad value raises ValueError naming the field,
so nothing invalid ever reaches the engine loop. `StructuredOutputs` (the grammar a request's
output must follow) is checked for its shape here; whether its schema, regex or grammar
compiles is nanoserve.structured's job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class ReasoningGate:
    """Where a reasoning model's thinking lies in its output, so that a constraint applies to
    the answer only: the thinking runs from `start_token` (or from the first output token when
    `starts_open`, as when the chat template already opened it) up to and including
    `end_token`. Without `starts_open` the output may begin with `start_token` or go straight
    to the answer. Single token ids: the markers must be single tokens of the vocabulary."""

    start_token: int
    end_token: int
    starts_open: bool = False

    def __post_init__(self) -> None:
        for name in ("start_token", "end_token"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ReasoningGate.{name} must be a token id >= 0, got {value!r}")


@dataclass(frozen=True)
class StructuredOutputs:
    """Constrain the output: exactly one of
    json: a JSON Schema (dict or its JSON text) the output must be an instance of;
    regex: a regular expression the whole output must match;
    choice: the output is exactly one of these strings;
    grammar: an EBNF grammar (xgrammar's GBNF dialect, start rule `root`);
    json_object: True for any JSON object.
    `after_reasoning` (optional) leaves a reasoning model's thinking unconstrained: the
    constraint starts after it (it is not part of the constraint's identity, `key()`)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    after_reasoning: ReasoningGate | None = None

    def __post_init__(self) -> None:
        set_kinds = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                f"StructuredOutputs needs exactly one of {', '.join(STRUCTURED_KINDS)}, got {set_kinds or 'none'}"
            )
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise ValueError(f"StructuredOutputs.json is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"StructuredOutputs.json must be a JSON Schema object, got {type(schema).__name__}")
        if self.regex is not None and not (isinstance(self.regex, str) and self.regex):
            raise ValueError("StructuredOutputs.regex must be a non-empty string")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar.strip()):
            raise ValueError("StructuredOutputs.grammar must be a non-empty EBNF string")
        if self.choice is not None:
            ok = isinstance(self.choice, (list, tuple)) and self.choice and all(isinstance(c, str) for c in self.choice)
            if not ok:
                raise ValueError("StructuredOutputs.choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.json_object, bool):
            raise ValueError("StructuredOutputs.json_object must be a bool")  # noqa: TRY004 - ValueError names the field everywhere
        if self.after_reasoning is not None and not isinstance(self.after_reasoning, ReasoningGate):
            raise ValueError("StructuredOutputs.after_reasoning must be a ReasoningGate or None")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical spec text): equal constraints get equal keys (the compile cache's)."""
        kind = self.kind
        if kind == "json":
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return kind, json.dumps(schema, sort_keys=True, separators=(",", ":"))
        if kind == "choice":
            return kind, json.dumps(list(self.choice))
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top log-probabilities per output position
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")

        def is_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def is_num(value) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        need(is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1")
        need(is_num(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0")
        need(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k", "must be -1 (off) or >= 1")
        need(is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        need(self.seed is None or is_int(self.seed), "seed", "must be an integer or None")
        need(
            is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"
        )
        need(
            is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            "must be in [-2, 2]",
        )
        need(
            is_num(self.repetition_penalty) and 0 < self.repetition_penalty <= 2,
            "repetition_penalty",
            "must be in (0, 2]",
        )
        need(
            self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens", "must be >= 1"
        )
        need(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None:
            need(self.min_tokens <= self.max_tokens, "min_tokens", "must be <= max_tokens")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        need(
            stops is None or (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)),
            "stop",
            "must be a non-empty string or a list of them",
        )
        self.stop_strings = list(stops or [])
        need(
            self.stop_token_ids is None
            or (isinstance(self.stop_token_ids, list) and all(is_int(t) and t >= 0 for t in self.stop_token_ids)),
            "stop_token_ids",
            "must be a list of non-negative integers",
        )
        need(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a bool")
        need(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputs),
            "structured_outputs",
            "must be a StructuredOutputs or None",
        )
        need(
            self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= 20),
            "logprobs",
            "must be in [0, 20]",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
