"""What /v1/chat/completions adds to plain generation: the chat template, tools and reasoning.

Owns `ChatFeatures`: the server's --chat-template, --tool-call-parser and --reasoning-parser
bound to its tokenizer. For one request it gives the prompt (messages, tools and
`chat_template_kwargs` through the template), the constraint its `tool_choice` or
`response_format` asks for, and one `ChoiceOutput` per choice, which turns the choice's text
into thinking, answer and tool calls.

Invariants:
- tool_choice "required" or a named function is enforced by a grammar in the format that
  parses the reply (the configured parser's, else hermes), so such replies always parse
  into calls whose arguments follow the function's parameters schema;
- with a reasoning parser, a constraint starts after the thinking (`ReasoningGate`), and
  the parser splits the thinking off before the tool parser sees the answer;
- a `ChoiceOutput` fed a reply in any chunking yields, concatenated, what it yields for the
  whole reply at once (the streamed and non-streamed responses agree).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Self

from jinja2 import TemplateError

from nanoserve.sampling_params import StructuredOutputs
from nanoserve.server import protocol as p
from nanoserve.server.reasoning import FORMATS as REASONING_FORMATS
from nanoserve.server.reasoning import ReasoningParser, ReasoningSplitter
from nanoserve.server.tool_parsers import FORMATS as TOOL_FORMATS
from nanoserve.server.tool_parsers import ToolCall, ToolCallStream, ToolFormat

# apply_chat_template's own arguments: chat_template_kwargs may not set them.
_TEMPLATE_ARGUMENTS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "tokenize"}
    | {"continue_final_message", "return_dict", "return_tensors", "padding", "truncation", "max_length"}
)


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


@dataclass(frozen=True)
class ChatOptions:
    """The chat flags of `nanoserve serve`."""

    chat_template: str | None = None  # a Jinja template's text, instead of the tokenizer's
    tool_call_parser: str | None = None  # a key of tool_parsers.FORMATS
    reasoning_parser: str | None = None  # a key of reasoning.FORMATS

    def __post_init__(self):
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_FORMATS:
            raise ValueError(f"unknown tool call parser {self.tool_call_parser!r} (known: {', '.join(TOOL_FORMATS)})")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_FORMATS:
            known = ", ".join(REASONING_FORMATS)
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r} (known: {known})")


class ChatFeatures:
    def __init__(self, tokenizer, options: ChatOptions | None = None):
        options = options or ChatOptions()
        if options.reasoning_parser is not None and tokenizer is None:
            raise ValueError("--reasoning-parser needs a model with a tokenizer")
        self.tokenizer = tokenizer
        self.chat_template = options.chat_template
        self.tool_format = TOOL_FORMATS[options.tool_call_parser] if options.tool_call_parser else None
        self.reasoning = (
            ReasoningParser(REASONING_FORMATS[options.reasoning_parser], tokenizer)
            if options.reasoning_parser
            else None
        )

    # ---------------------------------------------------------------------------- the prompt

    def prompt(self, req: p.ChatCompletionRequest) -> str:
        """The request's prompt text: messages and tools through the chat template."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise p.bad_request(
                "this model has no tokenizer: send token ids instead of text", "messages", "no_tokenizer"
            )
        template = self.chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise p.bad_request("this model has no chat template: use /v1/completions", "messages", "no_chat_template")
        extra = dict(req.chat_template_kwargs or {})
        clash = sorted(_TEMPLATE_ARGUMENTS & extra.keys())
        if clash:
            raise p.bad_request(
                f"chat_template_kwargs may not set {', '.join(clash)}: they are the request's own fields",
                "chat_template_kwargs",
            )
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.calls_tools else None
        try:
            return tokenizer.apply_chat_template(
                req.template_messages(),
                tools=tools,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=req.add_generation_prompt,
                **extra,
            )
        except (TemplateError, ValueError, TypeError, KeyError) as exc:  # templates raise on what they refuse
            raise p.bad_request(f"the chat template refused these messages: {exc}", "messages") from None

    # ---------------------------------------------------------------------------- the constraint

    def _call_format(self, req: p.ChatCompletionRequest) -> ToolFormat | None:
        """The format the reply's tool calls are parsed in (None: the reply is not parsed)."""
        if not req.calls_tools:
            return None
        if req.forced_functions() is not None:
            return self.tool_format or TOOL_FORMATS["hermes"]
        if self.tool_format is None:
            raise p.bad_request(
                "tool_choice 'auto' needs the server started with --tool-call-parser "
                f"({' or '.join(TOOL_FORMATS)}); send tool_choice 'required', a named function or 'none'",
                "tool_choice",
            )
        return self.tool_format

    def constraint(self, req: p.ChatCompletionRequest, prompt_text: str) -> StructuredOutputs | None:
        """What the reply must follow: the forced tool calls, or response_format /
        structured_outputs; with a reasoning parser, only after the thinking."""
        spec = req.structured_spec()
        forced = req.forced_functions()  # validation made sure they are among the tools sent
        if forced is not None:
            if spec is not None:
                raise p.bad_request(
                    "tool_choice 'required' or a named function cannot be combined with response_format "
                    "or structured_outputs",
                    "tool_choice",
                )
            # A named function is called once (as vLLM does); "required" may call several.
            many = req.parallel_tool_calls and not isinstance(req.tool_choice, p.NamedToolChoice)
            try:
                spec = self._call_format(req).constraint(forced, at_least_one=True, allow_many=many)
            except ValueError as exc:
                raise p.bad_request(str(exc), "tools") from None
        if spec is None or self.reasoning is None:
            return spec
        try:
            return dataclasses.replace(spec, after_reasoning=self.reasoning.gate(prompt_text))
        except ValueError as exc:
            raise p.bad_request(str(exc), req.constraint_field) from None

    # ---------------------------------------------------------------------------- the reply

    def output(self, req: p.ChatCompletionRequest, prompt_text: str) -> ChoiceOutput:
        fmt = self._call_format(req)
        splitter = self.reasoning.splitter(prompt_text) if self.reasoning is not None else None
        return ChoiceOutput(splitter, fmt.stream() if fmt is not None else None)
