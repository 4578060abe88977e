"""The harmony format (gpt-oss): a reply's channels turned into thinking, answer and tool calls.

Owns `HarmonyOutput` (one per choice: the reply's text in, as it streams, a `ChoiceDelta` of
thinking, answer and whole tool calls out), picked with `--reasoning-parser harmony` (and
`--tool-call-parser harmony` for tool_choice "auto"). The prompt side is the model's own chat
template (gpt-oss ships one that renders harmony).

A gpt-oss reply is a sequence of messages; the prompt ends with `<|start|>assistant`, so the
reply starts inside the first message's header:
    <|channel|>analysis<|message|>THINKING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>
A header runs up to `<|message|>`: its channel follows `<|channel|>`, its recipient `to=` (in
the role part or after the channel). A body runs up to `<|end|>`, `<|call|>` or `<|return|>`
(the last two stop generation and may be absent from the text), a next `<|start|>`, or the
reply's end.
Routing: `analysis` -> reasoning; `final`, and `commentary` to no one (a preamble shown to the
user) -> content; a message to `functions.NAME` -> a tool call whose arguments are its body.
The markers are special tokens: the server detokenizes harmony replies keeping them
(`keeps_special_tokens`). openai-harmony (PyPI) parses the same format but loads its
vocabulary from the network at run time, which nanoserve never does.

Invariants (as reasoning.py and tool_parsers.py keep them): markers split across chunks are
held back until complete, so any chunking of a reply yields the same pieces; a call is
emitted whole once its message ends and its body is a JSON object (else its body is content,
verbatim); nothing but the markers and headers is dropped.
"""

from __future__ import annotations

import json
import re

from nanoserve.server.choice import ChoiceDelta, ChoiceOutput
from nanoserve.server.reasoning import held_suffix
from nanoserve.server.tool_parsers import ToolCall

NAME = "harmony"
MESSAGE = "<|message|>"
# What ends a body: the three end markers, and a next message's start (a body cannot hold a
# special token, so a model that skips <|end|> still gets its next header read as one).
ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_MARKER = re.compile(r"<\|[a-z_]+\|>")


class HarmonyOutput(ChoiceOutput):
    """One choice's harmony reply in, its thinking, answer and tool calls out."""

    def __init__(self, parse_calls: bool):
        super().__init__(None, None)
        self.parse_calls = parse_calls  # else a message to a function is content, as text
        self._buf = ""
        self._header: str | None = ""  # None: inside a body
        self._route_to = "content"  # the current body's destination: reasoning, content or a call
        self._call_name = ""
        self._call_body = ""

    @property
    def has_reasoning(self) -> bool:
        return True

    def feed(self, text: str) -> ChoiceDelta:
        out = ChoiceDelta()
        self._buf += text
        while self._buf:
            if self._header is not None:
                header = self._header + self._buf
                at = header.find(MESSAGE)
                if at < 0:  # the header is not complete yet
                    self._header, self._buf = header, ""
                    break
                self._open(header[:at])
                self._buf = header[at + len(MESSAGE) :]
                continue
            hits = [(self._buf.find(m), m) for m in ENDS if m in self._buf]
            if not hits:
                keep = max(held_suffix(self._buf, m) for m in ENDS)
                self._body(out, self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            at, marker = min(hits)
            self._body(out, self._buf[:at])
            self._buf = self._buf[at + len(marker) :]
            self._close(out)
        self.num_calls += len(out.calls)
        return out

    def finish(self) -> ChoiceDelta:
        out = ChoiceDelta()
        if self._header is not None:
            # A reply that never reached a body: plain text (a model not speaking harmony).
            out.content += _MARKER.sub("", self._header + self._buf)
        else:
            self._body(out, self._buf)
            self._close(out)  # the stop token (<|call|>, <|return|>) is not part of the text
        self._buf, self._header = "", ""
        self.num_calls += len(out.calls)
        return out

    def _open(self, header: str) -> None:
        """A message's header is complete: where its body goes."""
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self._header = None
        self._call_body = ""
        if recipient and recipient.group(1).startswith("functions.") and self.parse_calls:
            self._route_to, self._call_name = "call", recipient.group(1).removeprefix("functions.")
        elif channel and channel.group(1) == "analysis":
            self._route_to = "reasoning"
        else:
            self._route_to = "content"

    def _body(self, out: ChoiceDelta, text: str) -> None:
        if self._route_to == "call":
            self._call_body += text
        elif self._route_to == "reasoning":
            out.reasoning += text
        else:
            out.content += text

    def _close(self, out: ChoiceDelta) -> None:
        """The current message has ended; the next text is a header (after `<|start|>`)."""
        if self._route_to == "call":
            call = _call(self._call_name, self._call_body)
            if call is None:
                out.content += self._call_body
            else:
                out.calls.append(call)
        self._header, self._route_to, self._call_body = "", "content", ""


def _call(name: str, body: str) -> ToolCall | None:
    try:
        args = json.loads(body)
    except ValueError:
        return None
    if not name or not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))
