"""What /v1/chat/completions adds to plain generation: the chat template, tools and reasoning.

Owns `ChatFeatures`: the server's --chat-template, --tool-call-parser and --reasoning-parser
bound to its tokenizer. For one request it gives the prompt (messages, tools and
`chat_template_kwargs` through the template), the constraint its `tool_choice` or
`response_format` asks for, and one `ChoiceOutput` per choice (nanoserve/server/choice.py),
which turns the choice's text into thinking, answer and tool calls.

Invariants:
- tool_choice "required" or a named function is enforced by a grammar in the format that
  parses the reply (the parser's, else hermes: without a parser, or for pythonic, which has
  no grammar), so such replies always parse
  into calls whose arguments follow the function's parameters schema;
- with a reasoning parser, a constraint starts after the thinking (`ReasoningGate`), and
  the parser splits the thinking off before the tool parser sees the answer;
- a `ChoiceOutput` fed a reply in any chunking yields, concatenated, what it yields for the
  whole reply at once (the streamed and non-streamed responses agree);
- the harmony format (gpt-oss, `harmony` for either parser; nanoserve/server/harmony.py)
  parses thinking and calls together from the reply's special tokens, which its requests
  then keep in their text (`keeps_special_tokens`); constraints are refused there (they
  would have to start inside the final channel).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from jinja2 import TemplateError

from nanoserve.sampling_params import StructuredOutputs
from nanoserve.server import protocol as p
from nanoserve.server.choice import ChoiceDelta, ChoiceOutput
from nanoserve.server.harmony import NAME as HARMONY
from nanoserve.server.harmony import HarmonyOutput
from nanoserve.server.reasoning import FORMATS as REASONING_FORMATS
from nanoserve.server.reasoning import ReasoningParser
from nanoserve.server.tool_parsers import AUTO, NONE, ToolFormat, detect_format
from nanoserve.server.tool_parsers import FORMATS as TOOL_FORMATS

__all__ = ["ChatFeatures", "ChatOptions", "ChoiceDelta", "ChoiceOutput"]

logger = logging.getLogger("nanoserve.server")

# apply_chat_template's own arguments: chat_template_kwargs may not set them.
_TEMPLATE_ARGUMENTS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "tokenize"}
    | {"continue_final_message", "return_dict", "return_tensors", "padding", "truncation", "max_length"}
)


@dataclass(frozen=True)
class ChatOptions:
    """The chat flags of `nanoserve serve`."""

    chat_template: str | None = None  # a Jinja template's text, instead of the tokenizer's
    # a key of tool_parsers.FORMATS, "auto" (picked from the chat template) or "none" (None: "none")
    tool_call_parser: str | None = AUTO
    reasoning_parser: str | None = None  # a key of reasoning.FORMATS

    def __post_init__(self):
        if self.tool_call_parser not in (None, AUTO, NONE, HARMONY, *TOOL_FORMATS):
            known = ", ".join((AUTO, NONE, *TOOL_FORMATS, HARMONY))
            raise ValueError(f"unknown tool call parser {self.tool_call_parser!r} (known: {known})")
        if self.reasoning_parser not in (None, HARMONY, *REASONING_FORMATS):
            known = ", ".join([*REASONING_FORMATS, HARMONY])
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r} (known: {known})")
        if HARMONY in (self.tool_call_parser, self.reasoning_parser) and not (
            self.reasoning_parser in (None, HARMONY) and self.tool_call_parser in (None, AUTO, NONE, HARMONY)
        ):
            raise ValueError("the harmony format cannot be combined with another tool call or reasoning parser")


class ChatFeatures:
    def __init__(self, tokenizer, options: ChatOptions | None = None):
        options = options or ChatOptions()
        if options.reasoning_parser is not None and tokenizer is None:
            raise ValueError("--reasoning-parser needs a model with a tokenizer")
        self.tokenizer = tokenizer
        self.chat_template = options.chat_template
        tool_parser = self._tool_parser(options.tool_call_parser)
        # harmony: the reply's channels give thinking and calls (HarmonyOutput), not these parsers
        self.harmony = HARMONY in (options.reasoning_parser, tool_parser)
        self.harmony_calls = tool_parser == HARMONY
        self.tool_format = TOOL_FORMATS.get(tool_parser)
        self.reasoning = (
            ReasoningParser(REASONING_FORMATS[options.reasoning_parser], tokenizer)
            if options.reasoning_parser in REASONING_FORMATS
            else None
        )

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether chat replies must be detokenized with their special tokens (harmony's markers)."""
        return self.harmony

    def _tool_parser(self, parser: str | None) -> str | None:
        """The tool-call format in force: `auto` picks it from the chat template (and logs it)."""
        if parser in (None, NONE):
            return None
        if parser != AUTO:
            return parser
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        name, why = detect_format(template if isinstance(template, str) else None)
        if name is None:
            logger.info("tool calls: no parser (%s); tool_choice 'auto' needs --tool-call-parser", why)
            return None
        logger.info("tool calls: parsed as %s (%s; --tool-call-parser picks another)", name, why)
        return name

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
        if self.harmony:
            if req.forced_functions() is not None:
                raise p.bad_request(
                    "tool_choice 'required' or a named function is not supported with the harmony format; "
                    "send tool_choice 'auto' or 'none'",
                    "tool_choice",
                )
            if not self.harmony_calls:
                raise p.bad_request(
                    "tool_choice 'auto' needs the server started with --tool-call-parser harmony", "tool_choice"
                )
            return None
        if req.forced_functions() is not None:
            fmt = self.tool_format
            return fmt if fmt is not None and fmt.has_grammar else TOOL_FORMATS["hermes"]
        if self.tool_format is None:
            raise p.bad_request(
                "tool_choice 'auto' needs a tool-call parser: this server runs without one (--tool-call-parser "
                f"none, or 'auto' found no format in the chat template; pick one of {', '.join(TOOL_FORMATS)}); "
                "send tool_choice 'required', a named function or 'none'",
                "tool_choice",
            )
        return self.tool_format

    def constraint(self, req: p.ChatCompletionRequest, prompt_text: str) -> StructuredOutputs | None:
        """What the reply must follow: the forced tool calls, or response_format /
        structured_outputs; with a reasoning parser, only after the thinking."""
        spec = req.structured_spec()
        self._call_format(req)  # refuses what this server cannot parse
        if self.harmony and spec is not None:
            raise p.bad_request(
                "response_format and structured_outputs are not supported with the harmony format",
                req.constraint_field,
            )
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
        if self.harmony:
            return HarmonyOutput(parse_calls=req.calls_tools and self.harmony_calls)
        splitter = self.reasoning.splitter(prompt_text) if self.reasoning is not None else None
        return ChoiceOutput(splitter, fmt.stream(_param_types(req.tools)) if fmt is not None else None)


def _param_types(tools: list[p.ToolDefinition] | None) -> dict[str, dict[str, str]]:
    """function -> parameter -> its JSON Schema type (where the schema names one)."""
    out: dict[str, dict[str, str]] = {}
    for tool in tools or ():
        props = (tool.function.parameters or {}).get("properties") or {}
        out[tool.function.name] = {
            k: v["type"] for k, v in props.items() if isinstance(v, dict) and isinstance(v.get("type"), str)
        }
    return out
