"""Tool calling and reasoning content through a real `nanoserve serve` on CPU: SmolLM2-135M's
weights with a Qwen-style tokenizer (tests/chat_tokenizers.py: `<think>`, `<tool_call>` as
single tokens, a template that renders tools, tool calls and tool results), started with
`--tool-call-parser hermes --reasoning-parser qwen3`, driven by the openai SDK.

Checked: a named function and tool_choice "required" give calls whose arguments parse and
follow the function's schema (jsonschema), streamed and not, with finish_reason "tool_calls"
and the streamed deltas adding up to the non-streamed message; a conversation carrying tool
calls and tool results goes through the template; bad tool requests get a 400 naming the
field while the server keeps serving; thinking opened by the template (chat_template_kwargs)
lands in reasoning_content, a closed one leaves the answer in content, and JSON asked for by
response_format lands in content; nothing leaks."""

from __future__ import annotations

import json

import pytest

from tests.chat_tokenizers import load_tokenizer_dir, make_tokenizer_dir
from tests.test_server_e2e import MODEL, serving, wait_idle

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"), "qwen")


@pytest.fixture(scope="module")
def server(tokenizer_dir):
    with serving(
        *["--tokenizer", str(tokenizer_dir), "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"],
        *["--max-model-len", "1024", "--kv-cache-tokens", "8192", "--max-num-seqs", "16"],
    ) as srv:
        yield srv


def assert_calls_follow_schemas(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


def streamed(client, **kw) -> tuple[dict, str]:
    """A streamed chat reply put back together: (message fields, finish_reason)."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for part in delta.tool_calls or ():
            call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = part.id or call["id"]
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
        finish = choice.finish_reason or finish
    assert sorted(calls) == list(range(len(calls))), "tool call indices must count from 0"
    return {"content": content, "reasoning": reasoning, "calls": [calls[i] for i in sorted(calls)]}, finish


@pytest.mark.parametrize("seed", [0, 1])
def test_named_function_streamed_and_not(client, http, seed):
    kw = {
        "model": MODEL,
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "temperature": 1.0,
        "seed": seed,
        "max_tokens": 120,
    }
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert_calls_follow_schemas(choice.message.tool_calls, {"get_weather"})
    assert len(choice.message.tool_calls) == 1 and choice.message.content is None

    parts, finish = streamed(client, **kw)
    assert finish == "tool_calls" and parts["content"] == ""
    want = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert [(c["name"], json.loads(c["arguments"])) for c in parts["calls"]] == want  # same seed, same calls
    assert wait_idle(http)["nanoserve_kv_cache_pages_in_use"] == 0


def test_required_may_call_several_functions(client, http):
    for seed in range(3):
        out = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        assert out.choices[0].finish_reason == "tool_calls"
        assert_calls_follow_schemas(out.choices[0].message.tool_calls, {"get_weather", "get_time"})
    one = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=200,
    )
    assert len(one.choices[0].message.tool_calls) == 1
    assert wait_idle(http)["nanoserve_kv_cache_pages_in_use"] == 0


def test_conversation_with_tool_results(client, http, tokenizer_dir):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    tok = http.post("/tokenize", json={"model": MODEL, "messages": messages, "tools": [WEATHER]}).json()
    text = load_tokenizer_dir(tokenizer_dir).decode(tok["tokens"])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temperature": 21' in text and '"name": "get_weather"' in text.split("<tools>")[-1]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=24
    )
    message = out.choices[0].message
    assert message.content or message.tool_calls  # auto: the model's choice, parsed either way
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The SDK's own round trip (README): the reply's message object goes back as it came.
    forced = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=120
    )
    message = forced.choices[0].message
    back = ASK + [message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "21 C"}]
    again = client.chat.completions.create(model=MODEL, messages=back, tools=[WEATHER], max_tokens=8)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert wait_idle(http)["nanoserve_kv_cache_pages_in_use"] == 0


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"messages": [{"role": "tool", "content": "21"}]}, "messages[0].tool_call_id"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"tools": [WEATHER], "tool_choice": "required", "max_tokens": 5000}, "max_tokens"),
    ],
)
def test_bad_tool_requests_are_400_and_the_server_keeps_serving(client, http, body, param):
    body = {"model": MODEL, "messages": ASK, **body}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason == "length"
    assert wait_idle(http)["nanoserve_server_requests_in_flight"] == 0


def test_reasoning_content(client, http):
    base = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 16}
    # The template opens the thinking (`<think>\n` ends the prompt); the model never closes it
    # (SmolLM2 may end its reply at once after these prompts: min_tokens keeps it going).
    thinking = {"chat_template_kwargs": {"open_thinking": True}, "min_tokens": 16}
    opened = client.chat.completions.create(**base, extra_body=thinking)
    message = opened.choices[0].message
    assert message.content is None and message.reasoning_content
    parts, finish = streamed(client, **base, extra_body=thinking)
    assert parts["reasoning"] == message.reasoning_content and parts["content"] == "" and finish == "length"
    # Thinking switched off: the template closes an empty thinking, all is answer.
    off = {"chat_template_kwargs": {"enable_thinking": False}, "min_tokens": 8}
    closed = client.chat.completions.create(**base, extra_body=off)
    assert closed.choices[0].message.content and closed.choices[0].message.reasoning_content is None
    # JSON asked for lands in content, whether the thinking is off or left to the model.
    for kwargs in ({"enable_thinking": False}, {}):
        out = client.chat.completions.create(
            **{**base, "max_tokens": 120},
            response_format={"type": "json_object"},
            extra_body={"chat_template_kwargs": kwargs},
        )
        assert out.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(out.choices[0].message.content), dict)
        assert out.choices[0].message.reasoning_content is None
    assert wait_idle(http)["nanoserve_kv_cache_pages_in_use"] == 0
