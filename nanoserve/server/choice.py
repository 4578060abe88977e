"""One chat choice's reply text turned into thinking, answer and tool calls, as it streams.

Owns `ChoiceDelta` (what one feed yields) and `ChoiceOutput` (a reasoning splitter, then a
tool-call stream over the answer; nanoserve/server/harmony.py's `HarmonyOutput` does both at
once for gpt-oss). nanoserve/server/chat_features.py picks one per choice.

Invariant: fed a reply in any chunking, a choice output yields, concatenated, what it yields
for the whole reply at once (the streamed and non-streamed responses agree).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Self

from nanoserve.server.reasoning import ReasoningSplitter
from nanoserve.server.tool_parsers import ToolCall, ToolCallStream


@dataclass
class ChoiceDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: ChoiceDelta) -> Self:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        return self


class ChoiceOutput:
    """One choice's text in (as it streams), its thinking, answer and tool calls out."""

    def __init__(self, splitter: ReasoningSplitter | None, tools: ToolCallStream | None):
        self._splitter = splitter
        self._tools = tools
        self.num_calls = 0

    @property
    def has_reasoning(self) -> bool:
        return self._splitter is not None

    def feed(self, text: str) -> ChoiceDelta:
        return self._route(self._splitter.feed(text) if self._splitter else None, text, final=False)

    def finish(self) -> ChoiceDelta:
        return self._route(self._splitter.finish() if self._splitter else None, "", final=True)

    def _route(self, split, text: str, final: bool) -> ChoiceDelta:
        out = ChoiceDelta()
        answer = text
        if split is not None:
            out.reasoning, answer = split.reasoning, split.content
        if self._tools is None:
            out.content = answer
            return out
        parsed = self._tools.feed(answer) if answer else None
        if parsed is not None:
            out.content, out.calls = parsed.content, parsed.calls
        if final:
            rest = self._tools.finish()
            out.content += rest.content
            out.calls += rest.calls
        self.num_calls += len(out.calls)
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.num_calls else reason

    def message(self, whole: ChoiceDelta) -> dict:
        """The non-streaming `message` of this choice, from everything it yielded."""
        has_other = bool(whole.calls) or (self.has_reasoning and whole.reasoning)
        message = {"role": "assistant", "content": whole.content or (None if has_other else whole.content)}
        if self.has_reasoning:
            message["reasoning_content"] = whole.reasoning or None
        if whole.calls:
            message["tool_calls"] = [c.to_openai() for c in whole.calls]
        return message
