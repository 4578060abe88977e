"""Request models of the HTTP API (OpenAI completions/chat and the native /generate) and errors.

Validation happens here, at the edge, and is strict: wrong JSON types are not coerced, values
out of range are refused, and every field is either honoured by the engine or rejected with a
400 that names it. Unknown fields are refused (extra="forbid"); OpenAI fields we know but cannot
honour (logit_bias, suffix, store, ...) are listed explicitly so the message says why.

Invariants:
- A request model that validates converts to a `SamplingParams` (`to_sampling_params`); any
  ValueError left (cross-field rules of SamplingParams) is turned into a 400 by the caller.
- Every error leaves this module as `RequestError(status, message, param, code)`, rendered by
  `error_body` as OpenAI's `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from nanoserve.sampling_params import SamplingParams, StructuredOutputs

MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16

# ------------------------------------------------------------------------------------------ errors

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class RequestError(Exception):
    """An error answered to the client; `param` names the offending field when there is one."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> RequestError:
    return RequestError(400, message, param, code)


def error_body(err: RequestError) -> dict:
    return {
        "error": {
            "message": err.message,
            "type": _ERROR_TYPES.get(err.status, "invalid_request_error"),
            "param": err.param,
            "code": err.code,
        }
    }


def _loc_to_param(loc: tuple) -> str | None:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


def validation_error_to_request_error(exc: ValidationError) -> RequestError:
    err = exc.errors(include_url=False)[0]
    param = _loc_to_param(tuple(err["loc"]))
    kind = err["type"]
    if kind == "json_invalid":
        return bad_request(f"Request body is not valid JSON: {err['msg']}", None, "invalid_json")
    if kind == "extra_forbidden":
        return bad_request(f"Unknown field '{param}': nanoserve does not support it", param, "unknown_field")
    if kind == "missing":
        return bad_request(f"Missing required field '{param}'", param, "missing_field")
    msg = err["msg"]
    if kind == "value_error":  # our own validators: drop pydantic's "Value error, " prefix
        msg = msg.removeprefix("Value error, ")
    where = f"'{param}'" if param else "request body"
    return bad_request(f"Invalid value for {where}: {msg}", param, "invalid_value")


def sampling_error_to_request_error(exc: ValueError) -> RequestError:
    """SamplingParams raises 'SamplingParams.<field> ...'; keep the field as param."""
    text = str(exc)
    param = None
    if text.startswith("SamplingParams."):
        param = text.removeprefix("SamplingParams.").split(" ", 1)[0]
    return bad_request(text, param, "invalid_value")


# ------------------------------------------------------------------------------------------ models


class _Strict(BaseModel):
    # strict: "1" is not an int, 1 is not a bool; forbid: unknown fields are errors, not ignored.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


def _check_stop(value: Any) -> Any:
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("must be a string or a list of strings")
    if not all(stops):
        raise ValueError("stop strings must not be empty")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
    return stops


class StructuredOutputsField(_Strict):
    """vLLM's `structured_outputs` extension: exactly one constraint on the output."""

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def spec(self) -> StructuredOutputs:
        try:
            return StructuredOutputs(
                json=self.json_,
                regex=self.regex,
                choice=self.choice,
                grammar=self.grammar,
                json_object=bool(self.json_object),
            )
        except ValueError as exc:
            raise bad_request(
                str(exc).replace("StructuredOutputs", "structured_outputs"), "structured_outputs"
            ) from None


class _SamplingFields(_Strict):
    """Sampling and stopping fields shared by completions and chat (OpenAI names + vLLM extras)."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)  # -1 or 0: off
    min_p: float = Field(0.0, ge=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Any = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the operator's logs; has no effect on output
    structured_outputs: StructuredOutputsField | None = None
    # Known OpenAI fields that the engine cannot honour: accepted only at their neutral value.
    logit_bias: dict[str, float] | None = None

    _check_stop = field_validator("stop")(classmethod(lambda cls, v: _check_stop(v)))

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value):
        if value is not None and any(t < 0 for t in value):
            raise ValueError("token ids must be >= 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value):
        if value:
            raise ValueError("logit_bias is not supported by nanoserve")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def structured_spec(self) -> StructuredOutputs | None:
        return self.structured_outputs.spec() if self.structured_outputs is not None else None

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return sampling_params_from(self, max_tokens, logprobs)


def prompt_list(value: Any, what: str) -> list[str | list[int]]:
    """str | list[str] | list[int] | list[list[int]], never empty, as a list (completion prompts,
    embedding inputs); a ValueError (a 400 naming the field) for anything else."""

    def is_tok(x):
        return isinstance(x, int) and not isinstance(x, bool)

    if isinstance(value, str) or isinstance(value, list) and value and all(is_tok(t) for t in value):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError("must be a non-empty string, list of strings, list of token ids or list of those")
    for item in value:
        if isinstance(item, str):
            if not item:
                raise ValueError(f"{what} must not be empty")
        elif isinstance(item, list):
            if not item:
                raise ValueError(f"{what} must not be empty")
            if not all(is_tok(t) for t in item):
                raise ValueError(f"token id {what}s must contain only integers")
            if any(t < 0 for t in item):
                raise ValueError("token ids must be >= 0")
        else:
            # pydantic turns only ValueError into a validation error (a 400 naming the field)
            raise ValueError("must be a string, list of strings, list of token ids or list of those")  # noqa: TRY004
    return value


class CompletionRequest(_SamplingFields):
    prompt: Any
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default; null: up to the context length
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        return prompt_list(value, "prompt")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value is not None:
            raise ValueError("suffix (insertion) is not supported by nanoserve")
        return value

    @model_validator(mode="after")
    def _cross_checks(self):
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported (only best_of == n)", "best_of")
        if self.echo and self.logprobs is not None:
            # OpenAI would return prompt log-probabilities here; the engine does not compute them.
            raise bad_request("echo together with logprobs is not supported (no prompt logprobs)", "echo")
        return self

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        return self._params(max_tokens, self.logprobs)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it


class ToolCallMessagePart(_Strict):
    """A tool call of an earlier assistant message, sent back by the client."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only for an assistant message with tool_calls
    name: str | None = None  # a participant's name; templates that know it show it
    tool_calls: list[ToolCallMessagePart] | None = None  # assistant only
    tool_call_id: str | None = None  # tool only: the call this message answers
    reasoning_content: str | None = None  # an earlier reply's thinking: accepted, not shown to the model

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value):
        if isinstance(value, list):
            for i, part in enumerate(value):
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(
                        f"content part {i}: only parts of type 'text' are supported, not {kind!r} (nanoserve serves "
                        "text only: a multimodal checkpoint's vision tower is not loaded)"
                    )
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def check(self, i: int) -> None:
        """The rules pydantic's types cannot say, with the offending field as param."""
        where = f"messages[{i}]"
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise bad_request(f"Missing required field '{where}.content'", f"{where}.content", "missing_field")
        if self.tool_calls is not None and self.role != "assistant":
            raise bad_request("only assistant messages carry tool_calls", f"{where}.tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise bad_request("a tool message needs the tool_call_id it answers", f"{where}.tool_call_id")
        if self.tool_call_id is not None and self.role != "tool":
            raise bad_request("only tool messages carry tool_call_id", f"{where}.tool_call_id")

    def template_message(self) -> dict:
        """This message as chat templates expect it ("developer" is OpenAI's newer name for
        "system"; tool-call arguments as objects, which templates render with tojson)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _args(c)}}
                for c in self.tool_calls
            ]
        return out


def _args(call: ToolCallMessagePart) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments  # not JSON: the template shows the text as sent


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema of the arguments object
    strict: bool | None = None  # arguments always follow `parameters` under tool_choice required/named


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema` (`schema` is the JSON Schema itself)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise bad_request("response_format of type json_schema needs a json_schema", "response_format")
        return self

    def spec(self) -> StructuredOutputs | None:
        if self.type == "json_object":
            return StructuredOutputs(json_object=True)
        if self.type == "json_schema":
            # No schema: any JSON object (OpenAI requires one; be lenient as vLLM is).
            schema = self.json_schema.schema_
            return StructuredOutputs(json=schema) if schema is not None else StructuredOutputs(json_object=True)
        return None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI fields with no effect on the output, accepted at their neutral values.
    metadata: dict[str, str] | None = None
    store: bool = False
    service_tier: str | None = None

    @field_validator("store")
    @classmethod
    def _no_store(cls, value):
        if value:
            raise ValueError("store (keeping completions for later retrieval) is not supported by nanoserve")
        return value

    @field_validator("service_tier")
    @classmethod
    def _one_tier(cls, value):
        if value not in (None, "auto", "default"):
            raise ValueError(f"nanoserve has one service tier: send 'auto' or 'default', not {value!r}")
        return value

    @model_validator(mode="after")
    def _cross_checks(self):
        for i, message in enumerate(self.messages):
            message.check(i)
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or ()]
            if self.tool_choice.function.name not in names:
                raise bad_request(
                    f"tool_choice names the function {self.tool_choice.function.name!r}, which is not in tools "
                    f"({', '.join(names) or 'none sent'})",
                    "tool_choice",
                )
        elif self.tool_choice == "required" and not self.tools:
            raise bad_request("tool_choice 'required' needs tools", "tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise bad_request("max_tokens and max_completion_tokens disagree; send one of them", "max_tokens")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        return self._params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    def structured_spec(self) -> StructuredOutputs | None:
        """response_format or structured_outputs (not both) as the engine's constraint."""
        from_format = self.response_format.spec() if self.response_format is not None else None
        if from_format is not None and self.structured_outputs is not None:
            raise bad_request("send response_format or structured_outputs, not both", "response_format")
        return from_format or _SamplingFields.structured_spec(self)

    def template_messages(self) -> list[dict]:
        return [m.template_message() for m in self.messages]

    @property
    def calls_tools(self) -> bool:
        """Tools are offered to the model (sent, and tool_choice is not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_functions(self) -> list[dict] | None:
        """The functions a reply must call (tool_choice "required" or named), else None."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t.function.model_dump() for t in self.tools if t.function.name == self.tool_choice.function.name]
        if self.tool_choice == "required":
            return [t.function.model_dump() for t in self.tools]
        return None

    @property
    def constraint_field(self) -> str:
        """The field that asked for this request's constraint (the param of its errors)."""
        if self.forced_functions() is not None:
            return "tool_choice"
        return "response_format" if self.response_format is not None else "structured_outputs"


class GenerateSamplingParams(_Strict):
    """The native endpoint's sampling block: SamplingParams' own field names."""

    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    max_tokens: int | None = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)
    stop: Any = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsField | None = None

    def structured_spec(self) -> StructuredOutputs | None:
        return self.structured_outputs.spec() if self.structured_outputs is not None else None

    _check_stop = field_validator("stop")(classmethod(lambda cls, v: _check_stop(v)))


class GenerateRequest(_Strict):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False

    @model_validator(mode="after")
    def _one_prompt(self):
        if (self.text is None) == (self.input_ids is None):
            raise bad_request("send exactly one of 'text' and 'input_ids'", "text")
        if self.text is not None and not self.text:
            raise bad_request("prompt must not be empty", "text")
        if self.input_ids is not None:
            if not self.input_ids:
                raise bad_request("prompt must not be empty", "input_ids")
            if any(t < 0 for t in self.input_ids):
                raise bad_request("token ids must be >= 0", "input_ids")
        return self

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        return sampling_params_from(self.sampling_params, max_tokens, self.sampling_params.logprobs)


class TokenizeRequest(_Strict):
    """POST /tokenize: used by the serving benchmark to measure ShareGPT lengths in tokens."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    # With messages, as in a chat request: what the chat template receives.
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    def chat_request(self) -> ChatCompletionRequest:
        return ChatCompletionRequest(
            messages=self.messages,
            tools=self.tools,
            chat_template_kwargs=self.chat_template_kwargs,
            add_generation_prompt=self.add_generation_prompt,
        )

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("send exactly one of 'prompt' and 'messages'", "prompt")
        return self


class DetokenizeRequest(_Strict):
    """POST /detokenize: token ids back to text (special tokens kept, as vLLM does)."""

    model: str | None = None
    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _ids(cls, value):
        if any(t < 0 for t in value):
            raise ValueError("token ids must be >= 0")
        return value


def parse(model: type[BaseModel], body: bytes) -> Any:
    """Validate a raw JSON body into `model`, raising RequestError on any problem."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error_to_request_error(exc) from None


def sampling_params_from(fields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The engine's SamplingParams from a request model carrying the shared sampling fields
    (the OpenAI bodies and /generate's `sampling_params` name them alike)."""
    return SamplingParams(
        n=fields.n,
        temperature=float(fields.temperature),
        top_p=float(fields.top_p),
        top_k=-1 if fields.top_k in (0, -1) else fields.top_k,
        min_p=float(fields.min_p),
        seed=fields.seed,
        presence_penalty=float(fields.presence_penalty),
        frequency_penalty=float(fields.frequency_penalty),
        repetition_penalty=float(fields.repetition_penalty),
        max_tokens=max_tokens,
        min_tokens=fields.min_tokens,
        stop=list(fields.stop) if fields.stop else None,
        stop_token_ids=list(fields.stop_token_ids) if fields.stop_token_ids else None,
        ignore_eos=fields.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=fields.skip_special_tokens,
        structured_outputs=fields.structured_spec(),
    )
