"""OpenAI's Responses API: POST /v1/responses and GET /v1/responses/{id}.

Owns the Responses request model, the translation of its input items into a chat
conversation, the response object and its stream of events, and `ResponseStore`, the bounded
in-memory store behind `previous_response_id` and GET.

A request becomes a `ChatCompletionRequest` (instructions as the system message, input items
as messages, function tools, tool_choice, text.format as response_format) and runs on the
chat path: the same template, tool-call and reasoning parsers, grammar and engine requests.
Its reply becomes output items: a `reasoning` item (the reasoning parser's thinking), a
`message` with one `output_text`, and one `function_call` per tool call.

Invariants:
- Every request field is honoured or refused with a 400 naming it (as in protocol.py).
- `function_call_output` items answer a `function_call` of the same conversation (this
  input or the stored responses before it): an unknown `call_id` is a 400.
- The store keeps at most `max_entries` responses (the oldest go first); a response with
  `store: false` is never kept; an id that is not kept is a 404, for GET and for
  `previous_response_id` alike. What is stored is the conversation (without instructions,
  which OpenAI does not carry over) and the response object.
- A stream is: response.created, response.in_progress, then per output item
  output_item.added, its content events (content_part.added, *.delta, *.done,
  content_part.done), output_item.done, and last response.completed (response.incomplete
  when max_output_tokens cut it, response.failed when the engine aborted it);
  `sequence_number` counts from 0. The engine request is
  aborted when the client goes away (Generation.close in `finally`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, ValidationError, field_validator

from nanoserve.server import protocol as p
from nanoserve.server.chat_features import ChoiceDelta
from nanoserve.server.generation import coalesced, collect

DEFAULT_STORE_ENTRIES = 1024  # responses kept for previous_response_id and GET


class ResponseStore:
    """Stored responses by id, oldest evicted first (an LRU: a read refreshes an entry)."""

    def __init__(self, max_entries: int = DEFAULT_STORE_ENTRIES):
        self.max_entries = max_entries
        self._items: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        self._items[response["id"]] = (response, conversation)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> tuple[dict, list[dict]]:
        entry = self._items.get(response_id)
        if entry is None:
            raise p.RequestError(404, f"Response with id '{response_id}' not found.", param, "not_found")
        self._items.move_to_end(response_id)
        return entry

    def __len__(self) -> int:
        return len(self._items)


# ------------------------------------------------------------------------------------------ request


class FunctionTool(p._Strict):
    """A Responses function tool (flat, unlike chat's {"type", "function": {...}})."""

    type: str
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("type")
    @classmethod
    def _function_only(cls, value):
        if value != "function":
            raise ValueError(f"only function tools are supported, not {value!r}")
        return value


class NamedFunctionChoice(p._Strict):
    type: Literal["function"]
    name: str


class TextFormat(p._Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(p._Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only one a local model has


class ReasoningConfig(p._Strict):
    # Effort and summaries are not controllable here: accepted only when unset.
    effort: Any = None
    summary: Any = None

    @field_validator("effort", "summary")
    @classmethod
    def _unset(cls, value):
        if value is not None:
            raise ValueError(
                "is not supported by nanoserve (thinking is the chat template's: switch it with chat_template_kwargs)"
            )
        return value


class ResponsesRequest(p._Strict):
    model: str | None = None
    input: Any  # a string, or a list of items (objects)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None  # an end-user id for the operator's logs; no effect on output
    truncation: Literal["disabled"] | None = None  # "auto" (dropping old turns) is not done
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension, as in chat
    # Chat's sampling extensions (vLLM's names), validated there; None: chat's default.
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    min_tokens: int | None = None
    stop: Any = None
    ignore_eos: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None

    @field_validator("input")
    @classmethod
    def _input(cls, value):
        if isinstance(value, str) and value:
            return value
        if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
            return value
        raise ValueError("must be a non-empty string or a non-empty list of input items (objects)")


def _text_of(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """A message's content (a string or text parts of `kinds`) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise p.bad_request("content must be a string or a list of text parts", f"{where}.content")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise p.bad_request(
                f"content part of type {kind!r} is not supported here (only {', '.join(kinds)} with text)",
                f"{where}.content[{j}]",
            )
        out.append(part["text"])
    return "".join(out)


def _need(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise p.bad_request(f"Missing required field '{where}.{key}' (a string)", f"{where}.{key}", "missing_field")
    return value


_MESSAGE_KEYS = {"type", "role", "content", "id", "status"}
_ITEM_KEYS = {
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
    "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"},
}


def input_messages(items: list[dict], known_calls: set[str]) -> list[dict]:
    """Input items -> chat messages (OpenAI chat format). `known_calls` holds the call ids of
    the conversation so far and gains this input's."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        allowed = _MESSAGE_KEYS if kind == "message" else _ITEM_KEYS.get(kind)
        if allowed is None:
            raise p.bad_request(
                f"input item of type {kind!r} is not supported (message, function_call, function_call_output, "
                "reasoning)",
                f"{where}.type",
            )
        extra = sorted(set(item) - allowed)
        if extra:
            raise p.bad_request(
                f"Unknown field '{where}.{extra[0]}': nanoserve does not support it",
                f"{where}.{extra[0]}",
                "unknown_field",
            )
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise p.bad_request(f"role must be user, system, developer or assistant, not {role!r}", f"{where}.role")
            kinds = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            messages.append({"role": role, "content": _text_of(item.get("content"), where, kinds)})
        elif kind == "function_call":
            call_id, name = _need(item, "call_id", where), _need(item, "name", where)
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": _need(item, "arguments", where)},
            }
            known_calls.add(call_id)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _need(item, "call_id", where)
            if call_id not in known_calls:
                raise p.bad_request(
                    f"no function_call with call_id {call_id!r} in this conversation",
                    f"{where}.call_id",
                    "unknown_call_id",
                )
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, where, ("input_text",))
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        # reasoning items: an earlier reply's thinking, accepted and not shown to the model (as
        # chat's reasoning_content)
    return messages


# Fields that mean the same in a chat request (validated there: a bad value is a 400 naming it).
_PASSED_ON = ("temperature", "top_p", "chat_template_kwargs", "top_k", "min_p", "seed", "min_tokens", "stop")
_PASSED_ON += ("ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty")


def chat_request(req: ResponsesRequest, conversation: list[dict]) -> p.ChatCompletionRequest:
    """The chat request that runs a Responses request whose whole conversation is given."""
    messages = (
        [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    ) + conversation
    if not messages:
        raise p.bad_request("input must hold at least one message", "input")
    body: dict[str, Any] = {"messages": messages, "parallel_tool_calls": req.parallel_tool_calls}
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in req.tools
        ]
    if isinstance(req.tool_choice, NamedFunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.name is None:
            raise p.bad_request("text.format of type json_schema needs a name", "text.format.name")
        schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {k: v for k, v in schema.items() if v is not None},
        }
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    for key in _PASSED_ON:
        if getattr(req, key) is not None:
            body[key] = getattr(req, key)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    try:
        return p.ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        err = p.validation_error_to_request_error(exc)
        param = err.param if (err.param or "").split(".")[0] in _PASSED_ON else "input"
        raise p.bad_request(err.message, param, err.code) from None
    except p.RequestError as exc:
        raise p.bad_request(
            exc.message, "input" if (exc.param or "").startswith("messages") else exc.param, exc.code
        ) from None


# ------------------------------------------------------------------------------------------ response


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Output:
    """The output items of one response as its reply streams in, and the events that say so."""

    def __init__(self, tokenizer):
        self.items: list[dict] = []
        self._open: dict | None = None  # the reasoning or message item still growing
        self._tokenizer = tokenizer
        self.reasoning_text = ""

    def add(self, piece: ChoiceDelta) -> list[dict]:
        events: list[dict] = []
        if piece.reasoning:
            events += self._grow("reasoning", piece.reasoning)
        if piece.content:
            events += self._grow("message", piece.content)
        for call in piece.calls:
            events += self._close()
            item = {
                "type": "function_call",
                "id": _item_id("fc"),
                "call_id": call.id,
                "name": call.name,
                "arguments": "",
                "status": "in_progress",
            }
            index = len(self.items)
            self.items.append(item)
            ref = {"item_id": item["id"], "output_index": index}
            events.append({"type": "response.output_item.added", "output_index": index, "item": dict(item)})
            events.append({"type": "response.function_call_arguments.delta", **ref, "delta": call.arguments})
            item.update(arguments=call.arguments, status="completed")
            events.append(
                {"type": "response.function_call_arguments.done", **ref, "name": call.name, "arguments": call.arguments}
            )
            events.append({"type": "response.output_item.done", "output_index": index, "item": dict(item)})
        return events

    def _grow(self, kind: str, text: str) -> list[dict]:
        events: list[dict] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            if kind == "reasoning":
                item = {
                    "type": "reasoning",
                    "id": _item_id("rs"),
                    "summary": [],
                    "content": [],
                    "status": "in_progress",
                }
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {
                    "type": "message",
                    "id": _item_id("msg"),
                    "role": "assistant",
                    "status": "in_progress",
                    "content": [],
                }
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.items.append(item)
            self._open = item
            ref = {"item_id": item["id"], "output_index": len(self.items) - 1}
            events.append(
                {
                    "type": "response.output_item.added",
                    "output_index": ref["output_index"],
                    "item": dict(item, content=[]),
                }
            )
            events.append({"type": "response.content_part.added", **ref, "content_index": 0, "part": dict(part)})
            item["content"].append(part)
        item = self._open
        item["content"][0]["text"] += text
        ref = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        if kind == "reasoning":
            self.reasoning_text += text
            events.append({"type": "response.reasoning_text.delta", **ref, "delta": text})
        else:
            events.append({"type": "response.output_text.delta", **ref, "delta": text, "logprobs": []})
        return events

    def _close(self) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed"
        part = item["content"][0]
        ref = {"item_id": item["id"], "output_index": self.items.index(item), "content_index": 0}
        if item["type"] == "reasoning":
            done = {"type": "response.reasoning_text.done", **ref, "text": part["text"]}
        else:
            done = {"type": "response.output_text.done", **ref, "text": part["text"], "logprobs": []}
        return [
            done,
            {"type": "response.content_part.done", **ref, "part": dict(part)},
            {
                "type": "response.output_item.done",
                "output_index": ref["output_index"],
                "item": json.loads(json.dumps(item)),
            },
        ]

    def finish(self) -> list[dict]:
        events = self._close()
        if not self.items:  # an empty reply is still one (empty) message
            events += self._grow("message", "")[:2] + self._close()
        return events

    def reasoning_tokens(self, output_tokens: int) -> int:
        """The thinking's tokens, counted again from its text (the reasoning parser splits
        text, not tokens; a re-encoding may differ by a token from what was generated, and
        never counts more than the output)."""
        if not self.reasoning_text or self._tokenizer is None:
            return 0
        return min(output_tokens, len(self._tokenizer.encode(self.reasoning_text, add_special_tokens=False)))

    def as_message(self) -> dict:
        """The reply as one chat assistant message (stored for previous_response_id)."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [
            {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
            for i in self.items
            if i["type"] == "function_call"
        ]
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            message["tool_calls"] = calls
        return message


# ------------------------------------------------------------------------------------------ routes


def add_responses_routes(router: APIRouter, edge, store: ResponseStore | None = None) -> ResponseStore:
    """Add the Responses routes to `router` (build_app's /v1 router); returns their store."""
    state = edge.state
    store = store if store is not None else ResponseStore()

    def response_object(
        rid: str,
        created: float,
        req: ResponsesRequest,
        status: str,
        output: list[dict],
        usage: dict | None,
        reason: str | None,
    ) -> dict:
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        tool_choice = req.tool_choice
        if isinstance(tool_choice, NamedFunctionChoice):
            tool_choice = tool_choice.model_dump()
        return {
            "id": rid,
            "object": "response",
            "created_at": created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": reason} if reason else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": state.served_name,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "metadata": req.metadata or {},
            "user": req.user,
        }

    def usage_of(gen, output: _Output) -> dict:
        u = gen.usage
        return {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": output.reasoning_tokens(u["completion_tokens"])},
            "total_tokens": u["total_tokens"],
        }

    @router.post("/v1/responses")
    async def create_response(request: Request):
        req = p.parse(ResponsesRequest, await request.body())
        edge.check_model(req.model)
        edge.check_task("generate", "input")
        history: list[dict] = []
        if req.previous_response_id is not None:
            _, history = store.get(req.previous_response_id, "previous_response_id")
        known_calls = {c["id"] for m in history for c in m.get("tool_calls") or ()}
        items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
        conversation = history + input_messages(items, known_calls)
        chat = chat_request(req, conversation)
        prompt_text, ids = edge.chat_prompt(chat)
        try:
            max_tokens = edge.resolve_max_tokens(
                [ids], req.max_output_tokens, req.max_output_tokens is not None, "input"
            )
        except p.RequestError as exc:  # it names chat's field
            exc.param = "max_output_tokens" if exc.param == "max_tokens" else exc.param
            raise
        params = edge.sampling_params(chat, max_tokens)
        params = dataclasses.replace(params, structured_outputs=state.chat.constraint(chat, prompt_text))
        await edge.check_grammar(params, "text.format" if chat.response_format is not None else chat.constraint_field)
        reply = state.chat.output(chat, prompt_text)
        gen = await edge.start([ids], params, "input")
        rid, created = _item_id("resp"), time.time()
        output = _Output(state.tokenizer)

        def final(finish_reason: str | None) -> dict:
            reason = "max_output_tokens" if finish_reason == "length" else None
            status = "failed" if finish_reason == "abort" else "incomplete" if reason else "completed"
            body = response_object(rid, created, req, status, output.items, usage_of(gen, output), reason)
            if finish_reason == "abort":  # the engine ended it (a grammar that failed to compile, a shutdown)
                body["error"] = {"code": "server_error", "message": "the request was aborted in the engine"}
            if req.store:
                store.put(body, conversation + [output.as_message()])
            return body

        if not req.stream:
            deltas = await collect(gen, request)
            text = "".join(d.text for d in deltas)
            finish = next((d.finish_reason for d in deltas if d.finish_reason is not None), None)
            piece = reply.feed(text)
            piece += reply.finish()
            output.add(piece)
            output.finish()
            return final(finish)

        async def events() -> AsyncIterator[dict]:
            start = response_object(rid, created, req, "in_progress", [], None, None)
            yield {"type": "response.created", "response": start}
            yield {"type": "response.in_progress", "response": start}
            finish = None
            async for d in gen.deltas():
                piece = reply.feed(d.text) if d.text else ChoiceDelta()
                if d.finish_reason is not None:
                    piece += reply.finish()
                    finish = d.finish_reason
                for event in output.add(piece):
                    yield event
            for event in output.finish():
                yield event
            body = final(finish)
            yield {"type": f"response.{body['status']}", "response": body}

        return StreamingResponse(
            coalesced(_sse(events(), gen), gen), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return store.get(response_id)[0]

    return store


async def _sse(events: AsyncIterator[dict], gen) -> AsyncIterator[str]:
    """Events as `event: TYPE` / `data: JSON` pairs numbered by sequence_number; an engine
    that dies mid-stream ends it with an `error` event."""
    seq = 0
    try:
        async for event in events:
            event["sequence_number"] = seq
            seq += 1
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
    except p.RequestError as exc:
        body = {"type": "error", "sequence_number": seq, **p.error_body(exc)["error"]}
        yield f"event: error\ndata: {json.dumps(body)}\n\n"
    except asyncio.CancelledError:
        raise
    finally:
        gen.close()
