"""Structured outputs through a real `nanoserve serve` (API process + engine process) on CPU
with SmolLM2-135M, driven by the openai SDK: `chat.completions.parse` with a pydantic model,
response_format json_schema (sampled, several seeds, checked with jsonschema) and json_object,
vLLM's structured_outputs (regex, choice, grammar) on both /v1 endpoints and /generate,
streaming, constrained and free requests at once, max_tokens cut ("length"), and bad
constraints answered with a 400 while the server keeps serving and leaks nothing."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import pytest

from tests.test_server_e2e import KEY, MODEL, serving, wait_idle

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "population": {"type": "integer", "minimum": 0, "maximum": 50000000},
        "size": {"type": "string", "enum": ["small", "medium", "large"]},
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
        "districts": {
            "type": "array",
            "items": {"type": "string", "maxLength": 10},
            "minItems": 1,
            "maxItems": 3,
        },
        "location": {
            "type": "object",
            "properties": {"country": {"type": "string", "maxLength": 16}, "coastal": {"type": "boolean"}},
            "required": ["country", "coastal"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "population", "size", "rating", "districts", "location"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe Paris as JSON."}]


class City(pydantic.BaseModel):
    name: str
    country: str
    size: Literal["small", "medium", "large"]


@pytest.fixture(scope="module")
def server():
    with serving("--max-model-len", "512", "--kv-cache-tokens", "8192", "--max-num-seqs", "16") as srv:
        yield srv


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}


def test_parse_with_a_pydantic_model(client):
    done = client.chat.completions.parse(
        model=MODEL, messages=ASK, response_format=City, max_tokens=80, temperature=0.7, seed=1
    )
    msg = done.choices[0].message
    assert done.choices[0].finish_reason == "stop", msg.content
    assert isinstance(msg.parsed, City), msg.content


def test_sampled_json_schema_outputs_validate(client):
    for seed in range(3):
        done = client.chat.completions.create(
            model=MODEL, messages=ASK, response_format=schema_format(SCHEMA), max_tokens=150, temperature=1.0, seed=seed
        )
        assert done.choices[0].finish_reason == "stop", done.choices[0].message.content
        jsonschema.validate(json.loads(done.choices[0].message.content), SCHEMA)


def test_json_object_and_streaming(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        response_format={"type": "json_object"},
        max_tokens=80,
        temperature=1.0,
        seed=3,
        stream=True,
    )
    text, reasons = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert reasons[-1] == "stop", text
    assert isinstance(json.loads(text), dict)


def test_structured_outputs_regex_choice_grammar(client, http):
    done = client.completions.create(
        model=MODEL,
        prompt="My phone number is",
        max_tokens=20,
        temperature=1.0,
        extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}},
    )
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", done.choices[0].text)
    done = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=5,
        temperature=1.0,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    )
    assert done.choices[0].message.content in ("yes", "no", "maybe")
    body = {
        "text": "Sum:",
        "sampling_params": {
            "max_tokens": 20,
            "temperature": 1.0,
            "structured_outputs": {"grammar": 'root ::= [1-9] [0-9]? ("+" [1-9] [0-9]?)*'},
        },
    }
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    text = out["text"] if "text" in out else out["choices"][0]["text"]
    assert re.fullmatch(r"[1-9][0-9]?(\+[1-9][0-9]?)*", text), text


def test_max_tokens_cut_is_length(client):
    done = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=schema_format(SCHEMA), max_tokens=4, temperature=1.0
    )
    assert done.choices[0].finish_reason == "length"


def test_constrained_and_free_requests_at_once(server):
    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        jobs = []
        for i in range(6):
            if i % 2:
                jobs.append(aclient.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0))
            else:
                jobs.append(
                    aclient.chat.completions.create(
                        model=MODEL,
                        messages=ASK,
                        response_format=schema_format(SCHEMA),
                        max_tokens=150,
                        temperature=1.0,
                        seed=i,
                    )
                )
        return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    free = [r.choices[0].message.content for i, r in enumerate(results) if i % 2]
    assert len(set(free)) == 1, "greedy free requests differ beside constrained ones"
    for i, r in enumerate(results):
        if i % 2 == 0:
            jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": schema_format({"type": "nosuchtype"})}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"structured_outputs": {"regex": "([a-"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_bad_constraints_are_400_and_the_server_keeps_serving(http, client, body, param):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    done = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, temperature=0)
    assert done.choices[0].finish_reason == "length"


def test_no_leaks_after_everything(http):
    m = wait_idle(http)
    assert m["nanoserve_kv_cache_pages_in_use"] == 0 and m["nanoserve_num_requests_running"] == 0, m
