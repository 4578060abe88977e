"""POST /v1/embeddings: OpenAI's embeddings endpoint, served by `nanoserve serve MODEL --task embed`.

Owns the request model, its validation (input types, lengths against the context, dimensions)
and the response shapes (float lists or base64 of little-endian float32, as the openai SDK
decodes them). The vectors come from the engine (nanoserve.engine.pooling): the last token's
final hidden state, L2-normalized. All inputs of one request go to the engine at once, so its
scheduler runs them as one prefill batch (within its token budget); none keeps KV afterwards.

`dimensions` keeps the first N components and normalizes them again (Matryoshka-style
truncation, as Qwen3-Embedding is trained for); any N from 1 to the hidden size is accepted.
"""

from __future__ import annotations

import base64
import math
import struct
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import Field, field_validator

from nanoserve.sampling_params import SamplingParams
from nanoserve.server import protocol as p
from nanoserve.server.generation import collect

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(p._Strict):
    model: str | None = None
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None  # an end-user id for the operator's logs; no effect on output

    @field_validator("input")
    @classmethod
    def _input(cls, value):
        value = p.prompt_list(value, "input")
        if len(value) > MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} inputs per request")
        return value


def truncate(vector: list[float], dimensions: int | None) -> list[float]:
    """The first `dimensions` components, normalized again (the vector itself without)."""
    if dimensions is None or dimensions == len(vector):
        return vector
    head = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def add_embedding_routes(router: APIRouter, edge) -> None:
    state = edge.state

    @router.post("/v1/embeddings")
    async def embeddings(request: Request):
        req = p.parse(EmbeddingRequest, await request.body())
        edge.check_model(req.model)
        edge.check_task("embed", "input")
        hidden = state.hidden_size
        if req.dimensions is not None and req.dimensions > hidden:
            raise p.bad_request(
                f"dimensions must be at most the model's hidden size ({hidden}), got {req.dimensions}", "dimensions"
            )
        prompts = []
        for i, item in enumerate(req.input):
            param = "input" if len(req.input) == 1 else f"input[{i}]"
            if isinstance(item, str):
                ids = edge.need_tokenizer(param).encode(item)
            else:
                ids = list(item)
                edge.check_token_ids(ids, param)
            if not ids:
                raise p.bad_request("an input must not be empty (it has no tokens)", param)
            if len(ids) > state.max_model_len:
                raise p.bad_request(
                    f"This model's maximum context length is {state.max_model_len} tokens, but the input has "
                    f"{len(ids)} tokens",
                    param,
                    "context_length_exceeded",
                )
            prompts.append(ids)
        gen = await edge.start(prompts, SamplingParams(temperature=0.0, max_tokens=1), "input")
        vectors: list[list[float] | None] = [None] * len(prompts)
        for delta in await collect(gen, request):
            if delta.embedding is not None:
                vectors[delta.prompt_index] = delta.embedding
        missing = [i for i, v in enumerate(vectors) if v is None]
        if missing:  # aborted in the engine (it shut down meanwhile): no vector to give
            raise p.RequestError(503, f"the engine gave no embedding for input {missing[0]}", None, "engine_aborted")
        usage = gen.usage
        return {
            "object": "list",
            "data": [
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": encode(truncate(v, req.dimensions), req.encoding_format),
                }
                for i, v in enumerate(vectors)
            ],
            "model": state.served_name,
            "usage": {"prompt_tokens": usage["prompt_tokens"], "total_tokens": usage["prompt_tokens"]},
        }
