"""Tool-call parsers: a model's tool-call text turned into OpenAI `tool_calls`, streaming.

Owns `ToolFormat` (how one model family writes calls, picked with --tool-call-parser),
`ToolCall`, and `ToolCallStream` (one per choice: text in, content and whole calls out).

Formats:
- `hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number, with text around them;
- `llama3_json` (Llama 3.1/3.2 JSON calls): the whole reply is `{"name": ..., "parameters":
  {...}}` (a leading `<|python_tag|>` is a special token, gone from the text), several
  separated by `;`.

Invariants:
- A call is emitted whole, once its text is complete and its JSON parses into a name and an
  object of arguments: a stream never carries half or corrupted arguments, and the streamed
  calls equal the non-streamed ones for any chunking (tests split at every position).
- Text that looks like a call but does not parse (bad JSON, no name, not closed when the
  output ends) is returned as content, verbatim: nothing is dropped but whitespace next to
  calls.
- `constraint` builds the grammar that makes a reply consist of calls in this format only
  (tool_choice "required" or a named function), so those replies always parse.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from nanoserve.sampling_params import StructuredOutputs
from nanoserve.server.reasoning import held_suffix


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolFormat:
    name: str
    begin: str  # opens one call ("" when the whole reply is calls)
    end: str
    args_key: str  # the key of the arguments object in the model's JSON
    separator: str = ""  # between calls, besides whitespace

    def parse_call(self, body: str) -> ToolCall | None:
        """One call's JSON text -> ToolCall, or None when it is not a well-formed call."""
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        return self._call_of(obj)

    def _call_of(self, obj) -> ToolCall | None:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj.get(self.args_key, obj.get("arguments", obj.get("parameters", {})))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))

    def parse_all(self, text: str) -> list[ToolCall] | None:
        """A whole reply of calls only (llama3_json), or None if it is anything else."""
        decoder, calls, at = json.JSONDecoder(), [], 0
        while True:
            while at < len(text) and (text[at].isspace() or (calls and self.separator and text[at] in self.separator)):
                at += 1
            if at == len(text):
                return calls or None
            try:
                obj, at = decoder.raw_decode(text, at)
            except ValueError:
                return None
            call = self._call_of(obj)
            if call is None:
                return None
            calls.append(call)

    def constraint(self, functions: list[dict], *, at_least_one: bool, allow_many: bool) -> StructuredOutputs:
        from nanoserve.structured.tool_calls import tool_call_constraint

        return tool_call_constraint(
            self.begin,
            self.end,
            functions,
            at_least_one=at_least_one,
            allow_many=allow_many,
            args_key=self.args_key,
            separator=self.separator,
        )

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


FORMATS = {
    "hermes": ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments"),
    "llama3_json": ToolFormat("llama3_json", "", "", "parameters", separator=";"),
}


@dataclass
class ToolDelta:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallStream:
    """Feeds of one choice's answer text; each returns the new content and completed calls."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.num_calls = 0
        self._buf = ""
        self._in_call = False
        self._space = ""  # whitespace held back: dropped if a call follows, else emitted
        self._after_call = False
        # llama3_json: the whole reply is calls (it starts with "{") or plain text, known once
        # its first non-space character arrives; "undecided" until then.
        self._whole_reply: str | None = "undecided" if fmt.begin == "" else None

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        self._buf += text
        if self._whole_reply is not None:
            return self._feed_whole(out)
        while self._buf:
            if self._in_call:
                at = self._buf.find(self.fmt.end)
                if at < 0:
                    break
                body, self._buf = self._buf[:at], self._buf[at + len(self.fmt.end) :]
                self._in_call = False
                call = self.fmt.parse_call(body)
                if call is None:
                    self._content(out, self.fmt.begin + body + self.fmt.end)
                else:
                    self._call(out, call)
                continue
            at = self._buf.find(self.fmt.begin)
            if at < 0:
                keep = held_suffix(self._buf, self.fmt.begin)
                self._content(out, self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            self._content(out, self._buf[:at])
            self._buf = self._buf[at + len(self.fmt.begin) :]
            self._in_call = True
        return out

    def _feed_whole(self, out: ToolDelta) -> ToolDelta:
        if self._whole_reply == "undecided":
            head = self._buf.lstrip()
            if not head:
                return out
            self._whole_reply = "calls" if head.startswith("{") else "text"
        if self._whole_reply == "text":
            self._content(out, self._buf)
            self._buf = ""
        return out  # calls: wait for the end of the reply

    def finish(self) -> ToolDelta:
        """Whatever is held back, once the output has ended."""
        out = ToolDelta()
        rest, self._buf = self._buf, ""
        if self._whole_reply == "calls":
            calls = self.fmt.parse_all(rest)
            if calls is None:
                self._content(out, rest)
            for call in calls or ():
                self._call(out, call)
        elif self._in_call:
            self._content(out, self.fmt.begin + rest)  # never closed: it was not a call
        else:
            self._content(out, rest)
        if self.num_calls == 0:
            out.content += self._space
        self._space = ""
        return out

    def _content(self, out: ToolDelta, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if body:
            out.content += self._space + body
            self._space = ""
        self._space += text[len(body) :]

    def _call(self, out: ToolDelta, call: ToolCall) -> None:
        self._space = ""
        self._after_call = True
        self.num_calls += 1
        out.calls.append(call)
