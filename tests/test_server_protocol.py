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


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name"),
        (
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
            "response_format.type",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": 4}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_chat_rejects(body, param):
    assert error_of(p.ChatCompletionRequest, body).param == param


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
