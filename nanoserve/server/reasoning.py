"""Reasoning parsers: a reasoning model's output split into its thinking and its answer.

Owns `ReasoningFormat` (the markers of one model family, picked with --reasoning-parser),
`ReasoningParser` (a format bound to the served tokenizer) and `ReasoningSplitter` (one per
choice: text in, thinking and answer out, streaming).

Formats: `qwen3` (Qwen3, QwQ): the thinking is `<think> ... </think>` at the start of the
output, or absent (thinking disabled, or a model that skips it); `deepseek_r1`: the output
starts inside the thinking, with or without an opening `<think>`, up to `</think>`. For
both, a chat template that opened the thinking in the prompt (ends with `<think>`) makes the
output start inside it, and one that closed it (`<think>\n\n</think>` at the end, as Qwen3's
template does for `enable_thinking: false`) makes the whole output the answer.

Invariants:
- Splitting is by text: markers split across stream chunks are held back until they can be
  told apart from ordinary text, so the concatenated pieces of a stream equal the split of
  the whole text, whatever the chunking (tests split at every position).
- Nothing is dropped but the markers themselves and the whitespace between `</think>` and
  the answer: a reply that never ends its thinking is all thinking; one that never starts
  it (qwen3) is all answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.sampling_params import ReasoningGate

UNDECIDED, THINKING, ANSWER = "undecided", "thinking", "answer"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    always_thinks: bool = False  # the output starts inside the thinking unless the prompt closed it


FORMATS = {
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek_r1": ReasoningFormat("deepseek_r1", always_thinks=True),
}


def _single_token(tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def held_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """Feeds of one choice's text; each returns the new thinking and answer text."""

    def __init__(self, fmt: ReasoningFormat, phase: str):
        self.fmt = fmt
        self.phase = phase
        self.thought = phase == THINKING  # the reply has (had) a thinking part
        self._buf = ""
        self._skip_space = False  # drop the whitespace between </think> and the answer
        # An output that starts inside the thinking may still open it itself (DeepSeek-R1's
        # older templates leave `<think>` to the model): that marker is dropped too.
        self._may_open = phase == THINKING

    def feed(self, text: str) -> Split:
        out = Split()
        self._buf += text
        while self._buf:
            if self.phase == UNDECIDED:
                head = self._buf.lstrip()
                if head.startswith(self.fmt.start):
                    self._buf = head[len(self.fmt.start) :]
                    self.phase, self.thought = THINKING, True
                elif not head or self.fmt.start.startswith(head):
                    break  # whitespace, or a marker not yet complete
                else:
                    self.phase = ANSWER
            elif self.phase == THINKING:
                if self._may_open:
                    head = self._buf.lstrip()
                    if head.startswith(self.fmt.start):
                        self._buf = head[len(self.fmt.start) :]
                    elif not head or self.fmt.start.startswith(head):
                        break
                    self._may_open = False
                    continue
                at = self._buf.find(self.fmt.end)
                if at < 0:
                    keep = held_suffix(self._buf, self.fmt.end)
                    out.reasoning += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                out.reasoning += self._buf[:at]
                self._buf = self._buf[at + len(self.fmt.end) :]
                self.phase, self._skip_space = ANSWER, True
            else:
                if self._skip_space:
                    self._buf = self._buf.lstrip()
                    if not self._buf:
                        break
                    self._skip_space = False
                out.content += self._buf
                self._buf = ""
        return out

    def finish(self) -> Split:
        """The text still held back, once the output has ended."""
        rest, self._buf = self._buf, ""
        if self.phase == THINKING:
            return Split(reasoning=rest)
        return Split(content=rest.lstrip() if self._skip_space else rest)


class ReasoningParser:
    """A reasoning format bound to the served tokenizer."""

    def __init__(self, fmt: ReasoningFormat, tokenizer):
        self.fmt = fmt
        self.start_token = _single_token(tokenizer, fmt.start)
        self.end_token = _single_token(tokenizer, fmt.end)

    def initial_phase(self, prompt_text: str) -> str:
        """Where the output starts, from how the chat template ended the prompt."""
        opened, closed = prompt_text.rfind(self.fmt.start), prompt_text.rfind(self.fmt.end)
        if opened > closed:
            return THINKING
        if closed >= 0 and not prompt_text[closed + len(self.fmt.end) :].strip():
            return ANSWER  # the template closed an empty thinking: thinking is off
        return THINKING if self.fmt.always_thinks else UNDECIDED

    def splitter(self, prompt_text: str) -> ReasoningSplitter:
        return ReasoningSplitter(self.fmt, self.initial_phase(prompt_text))

    def gate(self, prompt_text: str) -> ReasoningGate | None:
        """What a constraint needs to start after the thinking (None: there is none)."""
        phase = self.initial_phase(prompt_text)
        if phase == ANSWER:
            return None
        if self.start_token is None or self.end_token is None:
            raise ValueError(
                f"--reasoning-parser {self.fmt.name}: {self.fmt.start!r} and {self.fmt.end!r} are not single tokens "
                "of this model's tokenizer, so a constraint cannot start after the thinking"
            )
        return ReasoningGate(self.start_token, self.end_token, starts_open=phase == THINKING)
