"""Unit tests of the server's request validation (no server, no engine): fast and exhaustive."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pydantic")

from nanoserve.server import protocol as p


def parse(model, body):
    return p.parse(model, json.dumps(body).encode() if not isinstance(body, bytes) else body)


def error_of(model, body) -> p.RequestError:
    with pytest.raises(p.RequestError) as info:
        parse(model, body)
    return info.value


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "temperature": "1"}, "temperature"),  # strict: no string -> number coercion
        ({"prompt": "x", "n": 1.0}, "n"),  # strict: a float is not an int
        ({"prompt": "x", "echo": 1}, "echo"),  # strict: 1 is not a bool
        ({"prompt": "x", "top_k": -2}, "top_k"),
        ({"prompt": "x", "min_p": 1.5}, "min_p"),
        ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [[1], []]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
        ({"prompt": "x", "stop_token_ids": [-3]}, "stop_token_ids"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
        ({"prompt": "x", "stream_options": {"include_usage": True, "other": 1}}, "stream_options.other"),
    ],
)
def test_completion_rejects(body, param):
    err = error_of(p.CompletionRequest, body)
    assert err.status == 400 and err.param == param
    assert p.error_body(err)["error"]["param"] == param


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
FN_CALL = {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def named_choice(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "tool", "content": "22 C"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c1"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "assistant"}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "c", "function": FN_CALL}]}]},
            "messages[0].tool_calls",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
            "response_format.type",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL], "tool_choice": named_choice("other")},
            "tool_choice",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {}}]}, None),
        ({"messages": [{"role": "user", "content": "x"}], "store": True}, "store"),
        ({"messages": [{"role": "user", "content": "x"}], "service_tier": "flex"}, "service_tier"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": 4}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_chat_rejects(body, param):
    err = error_of(p.ChatCompletionRequest, body)
    assert err.status == 400
    if param is not None:
        assert err.param == param


def test_chat_accepts_openai_fields_at_neutral_values():
    req = parse(
        p.ChatCompletionRequest,
        {
            "messages": [
                {"role": "user", "content": "weather?", "name": "bob"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "type": "function", "function": FN_CALL}],
                },
                {"role": "tool", "content": "22 C", "tool_call_id": "c1"},
            ],
            "tools": [TOOL],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "user": "u1",
            "metadata": {"k": "v"},
            "store": False,
            "service_tier": "auto",
        },
    )
    assert req.calls_tools and req.forced_functions() is None
    messages = req.template_messages()
    assert messages[0]["name"] == "bob"
    assert messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert messages[2] == {"role": "tool", "content": "22 C", "tool_call_id": "c1"}
    named = parse(
        p.ChatCompletionRequest, {"messages": messages[:1], "tools": [TOOL], "tool_choice": named_choice("get_weather")}
    )
    assert [f["name"] for f in named.forced_functions()] == ["get_weather"]
    none = parse(p.ChatCompletionRequest, {"messages": messages[:1], "tools": [TOOL], "tool_choice": "none"})
    assert not none.calls_tools


def test_malformed_json_and_error_body_shape():
    err = error_of(p.CompletionRequest, b"{nope")
    body = p.error_body(err)["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["type"] == "invalid_request_error" and body["code"] == "invalid_json" and body["param"] is None


def test_completion_defaults_and_sampling_params():
    req = parse(p.CompletionRequest, {"prompt": "hi", "temperature": 0, "top_k": 0, "stop": "x", "seed": 3})
    assert req.prompt == ["hi"] and req.max_tokens == 16 and "max_tokens" not in req.model_fields_set
    sp = req.to_sampling_params(16)
    assert sp.temperature == 0 and sp.top_k == -1 and sp.stop_strings == ["x"] and sp.seed == 3
    assert parse(p.CompletionRequest, {"prompt": [1, 2]}).prompt == [[1, 2]]
    assert parse(p.CompletionRequest, {"prompt": [[1], [2, 3]]}).prompt == [[1], [2, 3]]


def test_chat_to_sampling_params_and_template_messages():
    req = parse(
        p.ChatCompletionRequest,
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
            "max_completion_tokens": 5,
            "logprobs": True,
            "top_logprobs": 3,
        },
    )
    assert req.requested_max_tokens == 5
    assert req.template_messages() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert req.to_sampling_params(5).logprobs == 3


def test_sampling_params_errors_name_the_field():
    req = parse(p.CompletionRequest, {"prompt": "x", "min_tokens": 50, "max_tokens": 10})
    with pytest.raises(ValueError) as info:
        req.to_sampling_params(10)
    err = p.sampling_error_to_request_error(info.value)
    assert err.status == 400 and err.param == "min_tokens"
