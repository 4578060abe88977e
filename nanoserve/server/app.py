"""The FastAPI application of the API server process: routes, auth, tokenization, response shapes.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, POST /generate
(native), POST /tokenize, POST /detokenize, GET /version, GET /health, GET /metrics; what a
gateway reads (/server_info, /model_info, /v1/loads) from gateway_info.py; the Responses API (responses.py) and /v1/embeddings (embeddings.py) are added from their own
modules through `Edge`, the checks and steps every route shares. Every generating route
builds a `Generation` (see generation.py) and renders its deltas either as one JSON body or
as server-sent events in OpenAI's chunk format, ending with `data: [DONE]`.

Invariants:
- Every error is answered with OpenAI's error body (`protocol.error_body`), including 404/405
  from routing and 500 from bugs; the server keeps serving after any of them.
- With an API key, every /v1 route (and /generate, /tokenize) needs `Authorization: Bearer KEY`.
- A client that goes away aborts its engine requests at once: streaming responses are
  cancelled by Starlette on disconnect, non-streaming ones race a disconnect watcher; both end
  in `Generation.close()`.
- Admission: a request that would overflow the engine client's queue, or waits in it past the
  queue timeout, is answered 503 with `Retry-After` (and counted in /metrics).
- /health is 503 when the engine is dead, or has had work but finished no step for
  `watchdog_timeout_s`; a stream cut by the engine's death ends with an error event, no [DONE].
- Every response carries `usage`: non-streaming bodies always; streams in a final usage chunk
  (OpenAI's `stream_options.include_usage`) or, when that is off, on the request's last chunk.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanoserve import __version__
from nanoserve.outputs import TokenLogprobs
from nanoserve.server import protocol as p
from nanoserve.server.chat_features import ChatFeatures, ChoiceDelta
from nanoserve.server.embeddings import add_embedding_routes
from nanoserve.server.gateway_info import add_gateway_routes
from nanoserve.server.generation import Generation, SampleDelta, coalesced, collect
from nanoserve.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from nanoserve.server.responses import add_responses_routes

logger = logging.getLogger("nanoserve.server")


@dataclass
class ServerState:
    client: object  # EngineClient (or a test double with the same methods)
    served_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: object | None
    metrics: ServerMetrics
    api_key: str | None = None
    grammars: object | None = None  # nanoserve.structured.GrammarService, made on first use
    watchdog_timeout_s: float = 60.0  # /health is 503 while the engine has work but no step for this long
    allowed_origins: list[str] | None = None  # CORS origins ("*" for any); None: no CORS headers
    chat: ChatFeatures | None = None  # template, tool and reasoning parsers; default: the tokenizer's template only
    task: str = "generate"  # "generate" or "embed" (`nanoserve serve --task`): which routes serve
    hidden_size: int = 0  # an embedding model's vector length (the most `dimensions` may ask)
    # Launch settings /server_info reports (model_path, tp_size, max_running_requests, ...).
    launch: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.chat is None:
            self.chat = ChatFeatures(self.tokenizer)


# ------------------------------------------------------------------------------------------ helpers


class _TokenText:
    """Token id -> its text, cached (logprob entries name tokens by their decoded text)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            if self._tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


_SSE_DONE = "data: [DONE]\n\n"
_RETRY_AFTER_S = "1"  # what a 503 for a full queue or a queue timeout tells clients to wait
_QUEUE_ERRORS = ("queue_full", "queue_timeout")


class _Choice:
    """Accumulates one choice of a non-streaming response."""

    def __init__(self):
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.finish_reason: str | None = None

    def add(self, delta: SampleDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs:
            self.logprobs += delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason


def _choices(deltas: list[SampleDelta], n: int, num_prompts: int) -> list[_Choice]:
    choices = [_Choice() for _ in range(n * num_prompts)]
    for delta in deltas:
        choices[delta.prompt_index * n + delta.index].add(delta)
    return choices


@dataclass(frozen=True)
class Edge:
    """The checks and steps of build_app's routes, for the routes defined in other modules."""

    state: ServerState
    check_model: Callable[[str | None], None]
    check_task: Callable[[str, str | None], None]  # (the task a route needs, the param to blame)
    need_tokenizer: Callable[[str], object]
    check_token_ids: Callable[[list[int], str], None]
    chat_prompt: Callable[[p.ChatCompletionRequest], tuple[str, list[int]]]
    resolve_max_tokens: Callable[[list[list[int]], int | None, bool, str], int]
    sampling_params: Callable[[object, int], object]
    check_grammar: Callable[[object, str], Awaitable[None]]
    start: Callable[[list[list[int]], object, str], Awaitable[Generation]]


# ------------------------------------------------------------------------------------------ app


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="nanoserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.nanoserve = state
    token_text = _TokenText(state.tokenizer)
    if state.allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=state.allowed_origins, allow_methods=["*"], allow_headers=["*"]
        )

    @app.exception_handler(p.RequestError)
    async def _request_error(_request: Request, exc: p.RequestError):
        headers = None
        if exc.code in _QUEUE_ERRORS:
            state.metrics.rejected(exc.code)
            headers = {"Retry-After": _RETRY_AFTER_S}
        return JSONResponse(p.error_body(exc), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else None
        err = p.RequestError(exc.status_code, str(exc.detail), None, code)
        return JSONResponse(p.error_body(err), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception):
        logger.exception("internal error while serving a request")
        err = p.RequestError(500, f"internal server error: {type(exc).__name__}: {exc}", None, "internal_error")
        return JSONResponse(p.error_body(err), status_code=500)

    def check_api_key(request: Request) -> None:
        if state.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise p.RequestError(
                401, "Invalid or missing API key (send Authorization: Bearer KEY)", None, "invalid_api_key"
            )

    def check_alive() -> None:
        if state.client.dead is not None:
            raise p.RequestError(503, f"The engine is not available: {state.client.dead}", None, "engine_dead")

    def check_model(name: str | None) -> None:
        if name is not None and name != state.served_name:
            raise p.RequestError(
                404,
                f"The model '{name}' does not exist; this server serves '{state.served_name}'",
                "model",
                "model_not_found",
            )

    def check_task(task: str, param: str | None) -> None:
        if state.task != task:
            what = (
                "an embedding model (--task embed): use /v1/embeddings"
                if state.task == "embed"
                else ("a generative model: start one with --task embed for /v1/embeddings")
            )
            raise p.bad_request(f"This server serves {what}", param, "wrong_task")

    def need_tokenizer(param: str):
        if state.tokenizer is None:
            raise p.bad_request("this model has no tokenizer: send token ids instead of text", param, "no_tokenizer")
        return state.tokenizer

    def check_token_ids(ids: list[int], param: str) -> None:
        for t in ids:
            if t >= state.vocab_size:
                raise p.bad_request(f"token id {t} is out of range (vocab size {state.vocab_size})", param)

    def resolve_max_tokens(prompts: list[list[int]], requested: int | None, was_sent: bool, param: str) -> int:
        """The per-request max_tokens; refuses prompts that leave no room in the context."""
        longest = max(len(ids) for ids in prompts)
        room = state.max_model_len - longest
        if room < 1:
            raise p.bad_request(
                f"This model's maximum context length is {state.max_model_len} tokens, but the prompt has {longest} "
                "tokens (at least one token must be generated)",
                param,
                "context_length_exceeded",
            )
        if requested is None:
            return room
        if requested > room:
            if not was_sent:
                return room  # a default (not the client's choice) just shrinks to fit
            raise p.bad_request(
                f"This model's maximum context length is {state.max_model_len} tokens; the prompt has {longest} "
                f"tokens and max_tokens is {requested} ({longest + requested} in all)",
                "max_tokens",
                "context_length_exceeded",
            )
        return requested

    def sampling_params(req, max_tokens: int):
        try:
            return req.to_sampling_params(max_tokens)
        except ValueError as exc:
            raise p.sampling_error_to_request_error(exc) from None

    async def check_grammar(params, param: str) -> None:
        """Compile a request's constraint here (worker threads of this process, cached), so a
        bad schema, regex or grammar, or one over the time limit, is a 400 naming it before
        the engine sees the request; the engine process compiles it again off its step loop."""
        spec = params.structured_outputs
        if spec is None:
            return
        from nanoserve.structured import GrammarError, GrammarService

        tokenizer = need_tokenizer(param)
        if state.grammars is None:
            state.grammars = GrammarService(tokenizer, state.vocab_size, [tokenizer.eos_token_id or 0])
        pending = state.grammars.submit(spec)
        try:
            # shield: a time-out here must not cancel the shared, cached compile
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(pending.future)), timeout=pending.timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            raise p.bad_request(
                f"compiling the {spec.kind} constraint took longer than the time limit ({pending.timeout_s:g} s)",
                param,
                "grammar_timeout",
            ) from None
        except GrammarError as exc:
            raise p.bad_request(str(exc), param, "invalid_grammar") from None

    async def start(prompts: list[list[int]], params, prompt_param: str) -> Generation:
        check_alive()
        if not state.client.admits(len(prompts)):
            raise p.RequestError(
                503,
                f"The server's queue is full ({state.client.max_queued_requests} requests); retry later",
                None,
                "queue_full",
            )
        gen = Generation(state.client, state.metrics, state.tokenizer, prompts, params)
        await gen.start(prompt_param)
        return gen

    def stream(gen: Generation, events: AsyncIterator[str]) -> StreamingResponse:
        async def body():
            try:
                async for chunk in coalesced(events, gen):
                    yield chunk
            except p.RequestError as exc:
                # The engine died mid-stream: say so and end without [DONE], so no client takes
                # the cut-off answer for a complete one.
                yield _sse(p.error_body(exc))
                return
            finally:
                gen.close()
            yield _SSE_DONE

        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    v1 = APIRouter(dependencies=[Depends(check_api_key)])

    # -------------------------------------------------------------------------- /v1/models

    @v1.get("/v1/models")
    async def list_models():
        return {
            "object": "list",
            "data": [
                {
                    "id": state.served_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "nanoserve",
                    "max_model_len": state.max_model_len,
                    "vocab_size": state.vocab_size,
                }
            ],
        }

    # -------------------------------------------------------------------------- /v1/completions

    def completion_logprobs(lps: list[TokenLogprobs], offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            text = token_text(lp.token_id)
            tokens.append(text)
            token_lps.append(lp.logprob)
            tops.append({token_text(t): v for t, v in lp.top.items()})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    @v1.post("/v1/completions")
    async def completions(request: Request):
        req = p.parse(p.CompletionRequest, await request.body())
        check_model(req.model)
        check_task("generate", "prompt")
        prompts, texts = [], []
        for item in req.prompt:
            if isinstance(item, str):
                ids = need_tokenizer("prompt").encode(item)
                if not ids:
                    raise p.bad_request("prompt must not be empty (it has no tokens)", "prompt")
                texts.append(item)
            else:
                check_token_ids(item, "prompt")
                ids = list(item)
                texts.append(None)
            prompts.append(ids)
        max_tokens = resolve_max_tokens(prompts, req.max_tokens, "max_tokens" in req.model_fields_set, "prompt")
        params = sampling_params(req, max_tokens)
        await check_grammar(params, "structured_outputs")
        gen = await start(prompts, params, "prompt")
        rid, created, n = f"cmpl-{uuid.uuid4().hex}", int(time.time()), req.n

        def echo_text(prompt_index: int) -> str:
            text = texts[prompt_index]
            if text is None:
                text = state.tokenizer.decode(prompts[prompt_index]) if state.tokenizer is not None else ""
            return text

        if not req.stream:
            choices = _choices(await collect(gen, request), n, len(prompts))
            out = []
            for i, ch in enumerate(choices):
                prefix = echo_text(i // n) if req.echo else ""
                lps = completion_logprobs(ch.logprobs, len(prefix)) if req.logprobs is not None else None
                out.append({"index": i, "text": prefix + ch.text, "logprobs": lps, "finish_reason": ch.finish_reason})
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": state.served_name,
                "choices": out,
                "usage": gen.usage,
            }

        async def events():
            offsets = [0] * (n * len(prompts))
            extra = {"usage": None} if req.include_usage else {}
            if req.echo:
                for i in range(n * len(prompts)):
                    text = echo_text(i // n)
                    offsets[i] = len(text)
                    choice = {"index": i, "text": text, "logprobs": None, "finish_reason": None}
                    yield _sse(
                        {
                            "id": rid,
                            "object": "text_completion",
                            "created": created,
                            "model": state.served_name,
                            "choices": [choice],
                            **extra,
                        }
                    )
            async for d in gen.deltas():
                i = d.prompt_index * n + d.index
                if not (d.text or d.finish_reason or d.logprobs or state.tokenizer is None):
                    continue  # text held back (partial character or possible stop string)
                lps = None
                if req.logprobs is not None and d.logprobs:
                    lps = completion_logprobs(d.logprobs, offsets[i])
                offsets[i] += len(d.text)
                chunk = {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": state.served_name,
                    "choices": [{"index": i, "text": d.text, "logprobs": lps, "finish_reason": d.finish_reason}],
                    **extra,
                }
                if gen.finished and not req.include_usage:  # the request's last chunk carries its usage
                    chunk["usage"] = gen.usage
                yield _sse(chunk)
            if req.include_usage:
                yield _sse(
                    {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": state.served_name,
                        "choices": [],
                        "usage": gen.usage,
                    }
                )

        return stream(gen, events())

    # -------------------------------------------------------------------------- /v1/chat/completions

    def chat_logprobs(lps: list[TokenLogprobs]) -> dict:
        content = []
        for lp in lps:
            text = token_text(lp.token_id)
            top = [
                {"token": token_text(t), "logprob": v, "bytes": list(token_text(t).encode("utf-8"))}
                for t, v in sorted(lp.top.items(), key=lambda kv: -kv[1])
            ]
            content.append(
                {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8")), "top_logprobs": top}
            )
        return {"content": content}

    def chat_prompt(req: p.ChatCompletionRequest) -> tuple[str, list[int]]:
        text = state.chat.prompt(req)
        return text, state.tokenizer.encode(text, add_special_tokens=False)

    @v1.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = p.parse(p.ChatCompletionRequest, await request.body())
        check_model(req.model)
        check_task("generate", "messages")
        prompt_text, ids = chat_prompt(req)
        was_sent = bool({"max_tokens", "max_completion_tokens"} & req.model_fields_set)
        max_tokens = resolve_max_tokens([ids], req.requested_max_tokens, was_sent, "messages")
        params = sampling_params(req, max_tokens)
        params = dataclasses.replace(params, structured_outputs=state.chat.constraint(req, prompt_text))
        if state.chat.keeps_special_tokens:  # harmony's channel markers are special tokens
            params = dataclasses.replace(params, skip_special_tokens=False)
        await check_grammar(params, req.constraint_field)
        outputs = [state.chat.output(req, prompt_text) for _ in range(req.n)]
        gen = await start([ids], params, "messages")
        rid, created, n = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), req.n

        if not req.stream:
            choices = _choices(await collect(gen, request), n, 1)
            out = []
            for i, ch in enumerate(choices):
                whole = outputs[i].feed(ch.text)
                whole += outputs[i].finish()
                out.append(
                    {
                        "index": i,
                        "message": outputs[i].message(whole),
                        "logprobs": chat_logprobs(ch.logprobs) if req.logprobs else None,
                        "finish_reason": outputs[i].finish_reason(ch.finish_reason),
                    }
                )
            return {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": state.served_name,
                "choices": out,
                "usage": gen.usage,
            }

        def chunk(choices: list[dict], **extra) -> str:
            return _sse(
                {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": state.served_name,
                    "choices": choices,
                    **extra,
                }
            )

        async def events():
            extra = {"usage": None} if req.include_usage else {}
            for i in range(n):  # OpenAI opens each choice with the role
                yield chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    **extra,
                )
            async for d in gen.deltas():
                output = outputs[d.index]
                piece = output.feed(d.text) if d.text else ChoiceDelta()
                if d.finish_reason is not None:
                    piece += output.finish()
                delta = {}
                if piece.reasoning:
                    delta["reasoning_content"] = piece.reasoning
                if piece.content:
                    delta["content"] = piece.content
                if piece.calls:
                    first = output.num_calls - len(piece.calls)
                    delta["tool_calls"] = [{"index": first + k, **c.to_openai()} for k, c in enumerate(piece.calls)]
                if not (delta or d.finish_reason or d.logprobs):
                    continue  # text held back (partial character, stop string, marker or tool call)
                lps = chat_logprobs(d.logprobs) if req.logprobs and d.logprobs else None
                last = {"usage": gen.usage} if gen.finished and not req.include_usage else extra
                reason = output.finish_reason(d.finish_reason)
                yield chunk([{"index": d.index, "delta": delta, "logprobs": lps, "finish_reason": reason}], **last)
            if req.include_usage:
                yield chunk([], usage=gen.usage)

        return stream(gen, events())

    # -------------------------------------------------------------------------- native /generate

    def native_logprobs(lps: list[TokenLogprobs] | None):
        if lps is None:
            return None
        return [
            {"token_id": lp.token_id, "logprob": lp.logprob, "top": {str(t): v for t, v in lp.top.items()}}
            for lp in lps
        ]

    @v1.post("/generate")
    async def generate(request: Request):
        req = p.parse(p.GenerateRequest, await request.body())
        check_task("generate", None)
        if req.text is not None:
            ids, param = need_tokenizer("text").encode(req.text), "text"
            if not ids:
                raise p.bad_request("prompt must not be empty (it has no tokens)", "text")
        else:
            ids, param = list(req.input_ids), "input_ids"
            check_token_ids(ids, param)
        sent = "max_tokens" in req.sampling_params.model_fields_set
        max_tokens = resolve_max_tokens([ids], req.sampling_params.max_tokens, sent, param)
        params = sampling_params(req, max_tokens)
        await check_grammar(params, "structured_outputs")
        gen = await start([ids], params, param)
        rid = f"gen-{uuid.uuid4().hex}"

        if not req.stream:
            choices = _choices(await collect(gen, request), params.n, 1)
            out = [
                {
                    "index": i,
                    "text": ch.text,
                    "token_ids": ch.token_ids,
                    "finish_reason": ch.finish_reason,
                    "logprobs": native_logprobs(ch.logprobs) if params.logprobs is not None else None,
                }
                for i, ch in enumerate(choices)
            ]
            return {
                "id": rid,
                "text": out[0]["text"],
                "token_ids": out[0]["token_ids"],
                "choices": out,
                "prompt_token_ids": ids,
                "usage": gen.usage,
            }

        async def events():
            async for d in gen.deltas():
                yield _sse(
                    {
                        "id": rid,
                        "index": d.index,
                        "text": d.text,
                        "token_ids": d.token_ids,
                        "logprobs": native_logprobs(d.logprobs),
                        "finish_reason": d.finish_reason,
                    }
                )
            yield _sse({"id": rid, "usage": gen.usage, "prompt_token_ids": ids})

        return stream(gen, events())

    @v1.post("/tokenize")
    async def tokenize(request: Request):
        req = p.parse(p.TokenizeRequest, await request.body())
        check_model(req.model)
        if req.prompt is not None:
            ids = need_tokenizer("prompt").encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            _, ids = chat_prompt(req.chat_request())
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @v1.post("/detokenize")
    async def detokenize(request: Request):
        req = p.parse(p.DetokenizeRequest, await request.body())
        check_model(req.model)
        check_token_ids(req.tokens, "tokens")
        return {"prompt": need_tokenizer("tokens").decode(req.tokens)}

    edge = Edge(
        state=state,
        check_model=check_model,
        check_task=check_task,
        need_tokenizer=need_tokenizer,
        check_token_ids=check_token_ids,
        chat_prompt=chat_prompt,
        resolve_max_tokens=resolve_max_tokens,
        sampling_params=sampling_params,
        check_grammar=check_grammar,
        start=start,
    )
    add_responses_routes(v1, edge)
    add_embedding_routes(v1, edge)
    app.include_router(v1)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    add_gateway_routes(app, state)

    # -------------------------------------------------------------------------- health, metrics

    @app.get("/health")
    async def health():
        if state.client.dead is not None:
            raise p.RequestError(503, f"The engine is not available: {state.client.dead}", None, "engine_dead")
        stalled = state.client.stalled_s()
        if stalled > state.watchdog_timeout_s:
            raise p.RequestError(
                503, f"The engine has had work but finished no step for {stalled:.1f} s", None, "engine_stalled"
            )
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        stats = await state.client.fetch_stats()
        state.metrics.update_engine(stats, state.client.num_tracked_requests, state.client.num_queued_requests)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
