"""Tool-call parsers: a model's tool-call text turned into OpenAI `tool_calls`, streaming.

Owns `ToolFormat` (how one model family writes calls, picked with --tool-call-parser),
`ToolCall`, and `ToolCallStream` (one per choice: text in, content and whole calls out).

Formats:
- `hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number, with text around them;
- `llama3_json` (Llama 3.1/3.2 JSON calls): the whole reply is `{"name": ..., "parameters":
  {...}}` (a leading `<|python_tag|>` is a special token, gone from the text), several
  separated by `;`;
- `mistral` (Mistral, Mixtral, Ministral): `[TOOL_CALLS]` and then, to the end of the reply, a
  JSON list `[{"name": ..., "arguments": {...}}, ...]`; text may come before the marker.
  `[TOOL_CALLS]` is a special token in Mistral's tokenizers, gone from the text, so a reply
  that starts with `[` is read as the list too;
- `pythonic` (Llama 3.2 and Llama 4 pythonic calls): the whole reply is a Python list of
  calls with literal keyword arguments, `[get_weather(city="Paris"), get_time()]`;
- `qwen3_xml` (Qwen3.5, Qwen3-Coder): `<tool_call>` around `<function=NAME>`, then one
  `<parameter=KEY>VALUE</parameter>` per argument, then `</function>`. Values are text: a
  parameter the tool's schema types as a string stays one, any other is read as JSON when it
  parses (numbers, booleans, objects), else kept as text.

`detect_format` picks one from a chat template (--tool-call-parser auto, the default).

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

import ast
import json
import re
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
    end: str  # closes one call ("" with a begin: the calls run to the end of the reply)
    args_key: str  # the key of the arguments object in the model's JSON
    separator: str = ""  # between calls, besides whitespace
    opener: str = "{"  # a reply that starts with this (after whitespace) is calls, where begin is not needed
    syntax: str = "json"  # "json" or "pythonic" (Python calls with literal keyword arguments)
    # Whether `constraint` can force calls in this format; tool_choice "required" or a named
    # function falls back to hermes for the others (their reply is then parsed as hermes).
    has_grammar: bool = True

    @property
    def whole_reply(self) -> bool:
        """The calls are the rest of the reply (parsed when it ends), not closed one by one."""
        return self.end == ""

    def parse_call(self, body: str, param_types: dict[str, dict[str, str]] | None = None) -> ToolCall | None:
        """One call's text -> ToolCall, or None when it is not a well-formed call.
        `param_types`: function -> parameter -> JSON Schema type (the XML syntax's values)."""
        if self.syntax == "xml":
            return _parse_xml_call(body, param_types or {})
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
        """A whole reply of calls only (llama3_json, mistral, pythonic), or None if it is
        anything else. JSON: objects (split by the separator) or lists of them."""
        if self.syntax == "pythonic":
            return _parse_pythonic(text)
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
            for item in obj if isinstance(obj, list) else [obj]:
                call = self._call_of(item)
                if call is None:
                    return None
                calls.append(call)

    def constraint(self, functions: list[dict], *, at_least_one: bool, allow_many: bool) -> StructuredOutputs:
        from nanoserve.structured.tool_calls import tool_call_constraint

        if not self.has_grammar:
            raise ValueError(f"the {self.name} tool-call format has no grammar to force calls with")
        if self.whole_reply and self.begin:  # mistral: the list form, without the special-token marker
            return tool_call_constraint(
                "",
                "",
                functions,
                at_least_one=at_least_one,
                allow_many=allow_many,
                args_key=self.args_key,
                separator=",",
                prefix=self.opener,
                suffix="]",
            )
        return tool_call_constraint(
            self.begin,
            self.end,
            functions,
            at_least_one=at_least_one,
            allow_many=allow_many,
            args_key=self.args_key,
            separator=self.separator,
        )

    def stream(self, param_types: dict[str, dict[str, str]] | None = None) -> ToolCallStream:
        return ToolCallStream(self, param_types)


_XML_CALL = re.compile(r"\s*<function=([^>\s]+)>(.*?)</function>\s*", re.DOTALL)
_XML_PARAM = re.compile(r"\s*<parameter=([^>\s]+)>(.*?)</parameter>\s*", re.DOTALL)


def _parse_xml_call(body: str, param_types: dict[str, dict[str, str]]) -> ToolCall | None:
    """`<function=f><parameter=a>1</parameter></function>` -> ToolCall, or None unless the
    body is exactly one function of parameters. A value loses one newline at each end (the
    format puts the value on lines of its own)."""
    call = _XML_CALL.fullmatch(body)
    if call is None:
        return None
    name, inner = call.groups()
    types = param_types.get(name, {})
    args, at = {}, 0
    while at < len(inner):
        param = _XML_PARAM.match(inner, at)
        if param is None:
            return None if inner[at:].strip() else ToolCall(name, json.dumps(args, ensure_ascii=False))
        key, value = param.groups()
        value = value.removeprefix("\n").removesuffix("\n")
        args[key] = value if types.get(key) == "string" else _json_or_text(value)
        at = param.end()
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _json_or_text(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return value


def _parse_pythonic(text: str) -> list[ToolCall] | None:
    """`[f(a=1, b="x"), g()]` -> calls; None unless it is exactly a list of calls of plain
    names with literal keyword arguments (never evaluated: read with ast)."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    if isinstance(tree, ast.Call):
        tree = ast.List([tree])
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        args = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None
            try:
                args[kw.arg] = ast.literal_eval(kw.value)
            except ValueError:
                return None
        try:
            calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
        except TypeError:  # a literal JSON cannot hold (a set, bytes, a complex number)
            return None
    return calls


FORMATS = {
    "hermes": ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments"),
    "llama3_json": ToolFormat("llama3_json", "", "", "parameters", separator=";"),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", "", "arguments", opener="["),
    "pythonic": ToolFormat("pythonic", "", "", "arguments", opener="[", syntax="pythonic", has_grammar=False),
    "qwen3_xml": ToolFormat("qwen3_xml", "<tool_call>", "</tool_call>", "", syntax="xml", has_grammar=False),
}
AUTO = "auto"  # --tool-call-parser auto: detect_format picks one from the chat template
NONE = "none"  # --tool-call-parser none: tool calls are not parsed (tool_choice "auto" is refused)

# (a snippet of the chat template, the format): the first whose snippet the template holds wins.
_TEMPLATE_MARKERS = (
    ("<function=", "qwen3_xml"),  # Qwen3.5 and Qwen3-Coder show the XML call syntax
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("func_name1(", "pythonic"),  # Llama 3.2's pythonic template shows the call syntax
    ("<|python_start|>", "pythonic"),  # Llama 4
    ("<|python_tag|>", "llama3_json"),
    ('"parameters": ', "llama3_json"),
)
# The template's family, when it names no call syntax of its own.
_FAMILY_MARKERS = (
    ("<|im_start|>", "hermes"),  # ChatML: Qwen, Hermes, SmolLM
    ("<|start_header_id|>", "llama3_json"),
    ("[INST]", "mistral"),
)


def detect_format(template: str | None) -> tuple[str | None, str]:
    """The tool-call format a chat template's model writes, and why: a call syntax the
    template shows, else its family's ("harmony" for gpt-oss's channels, which
    nanoserve.server.harmony reads). None when the template says neither."""
    if not template:
        return None, "the model has no chat template"
    if "<|channel|>" in template:
        return "harmony", "the template uses gpt-oss's harmony format"
    for snippet, name in _TEMPLATE_MARKERS:
        if snippet in template:
            return name, f"the chat template holds {snippet!r}"
    for snippet, name in _FAMILY_MARKERS:
        if snippet in template:
            return name, f"the chat template's family ({snippet!r})"
    return None, "the chat template names no known tool-call format"


@dataclass
class ToolDelta:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallStream:
    """Feeds of one choice's answer text; each returns the new content and completed calls."""

    def __init__(self, fmt: ToolFormat, param_types: dict[str, dict[str, str]] | None = None):
        self.fmt = fmt
        self.param_types = param_types
        self.num_calls = 0
        self._buf = ""
        self._in_call = False
        self._space = ""  # whitespace held back: dropped if a call follows, else emitted
        self._after_call = False
        # Whole-reply formats: the reply is calls (it starts with the opener, or mistral's
        # marker) or text (where mistral's marker may still open calls), known once its first
        # non-space characters arrive; "undecided" until then.
        self._whole_reply: str | None = "undecided" if fmt.whole_reply else None
        self._marker_seen = False  # mistral: the calls followed its marker (restored if they do not parse)

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
                call = self.fmt.parse_call(body, self.param_types)
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
        marker = self.fmt.begin
        if self._whole_reply == "undecided":
            head = self._buf.lstrip()
            if not head or (marker and marker.startswith(head)):
                return out
            if marker and head.startswith(marker):
                self._whole_reply, self._marker_seen = "calls", True
                self._buf = head.removeprefix(marker)
            elif head.startswith(self.fmt.opener):
                self._whole_reply = "calls"
            else:
                self._whole_reply = "text"
        if self._whole_reply == "text":
            if not marker:
                self._content(out, self._buf)
                self._buf = ""
                return out
            at = self._buf.find(marker)
            if at < 0:
                keep = held_suffix(self._buf, marker)
                self._content(out, self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                return out
            self._content(out, self._buf[:at])
            self._buf = self._buf[at + len(marker) :]
            self._whole_reply, self._marker_seen = "calls", True
        return out  # calls: wait for the end of the reply

    def finish(self) -> ToolDelta:
        """Whatever is held back, once the output has ended."""
        out = ToolDelta()
        rest, self._buf = self._buf, ""
        if self._whole_reply == "calls":
            calls = self.fmt.parse_all(rest)
            if calls is None:
                self._content(out, self.fmt.begin + rest if self._marker_seen else rest)
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
