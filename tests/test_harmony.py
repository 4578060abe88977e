"""The harmony format (gpt-oss) behind the chat parsers: a reply's analysis channel comes back
as reasoning_content, its final channel as content, messages to functions as tool_calls, in
every chunking (token by token as the server detokenizes it, keeping special tokens). The
tokenizer is SmolLM2's with harmony's markers as special tokens and a gpt-oss-style template
(tests/chat_tokenizers.py)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pydantic")

from nanoserve.server import protocol as p
from nanoserve.server.chat_features import ChatFeatures, ChatOptions
from tests.chat_tokenizers import load_tokenizer_dir, make_tokenizer_dir
from tests.test_chat_parsers import TIME, WEATHER, check_every_chunking, request


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer_dir(make_tokenizer_dir(tmp_path_factory.mktemp("tok"), "harmony"))


def harmony(tokenizer, tools: bool = True, **body):
    options = ChatOptions(reasoning_parser="harmony", tool_call_parser="harmony" if tools else None)
    features = ChatFeatures(tokenizer, options)
    if tools:
        body.setdefault("tools", [WEATHER, TIME])
    req = request(**body)
    prompt = features.prompt(req)
    assert prompt.endswith("<|start|>assistant") and features.keeps_special_tokens
    return lambda: features.output(req, prompt)


def test_analysis_is_reasoning_final_is_content(tok):
    text = "<|channel|>analysis<|message|>User asks; think <b>.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"
    got = check_every_chunking(harmony(tok, tools=False), tok, text, skip_special_tokens=False)
    assert (got.reasoning, got.content, got.calls) == ("User asks; think <b>.", "It is sunny.", [])


def test_calls_after_thinking_and_a_preamble(tok):
    text = (
        "<|channel|>analysis<|message|>Need weather.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}"
    )  # the last call ends with the reply (its <|call|> stopped generation and is not in the text)
    make = harmony(tok)
    got = check_every_chunking(make, tok, text, skip_special_tokens=False)
    assert got.reasoning == "Need weather." and got.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    out = make()
    out.feed(text)
    out.finish()
    assert out.finish_reason("stop") == "tool_calls"


def test_broken_call_is_content_and_calls_off_without_the_tool_parser(tok):
    broken = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Par<|call|>'
    got = check_every_chunking(harmony(tok), tok, broken, skip_special_tokens=False)
    assert got.calls == [] and got.content == '{"city": "Par'
    call = "<|channel|>commentary to=functions.get_time<|message|>{}<|call|>"
    got = check_every_chunking(harmony(tok, tools=False), tok, call, skip_special_tokens=False)
    assert got.calls == [] and got.content == "{}"


def test_message_without_its_end_marker(tok):
    text = "<|channel|>analysis<|message|>hmm<|start|>assistant<|channel|>final<|message|>ok"
    got = check_every_chunking(harmony(tok, tools=False), tok, text, skip_special_tokens=False)
    assert (got.reasoning, got.content) == ("hmm", "ok")


def test_reply_without_harmony_markers_is_content(tok):
    got = check_every_chunking(harmony(tok), tok, "just text, no channel", skip_special_tokens=False)
    assert (got.reasoning, got.content, got.calls) == ("", "just text, no channel", [])


def test_refusals(tok):
    features = ChatFeatures(tok, ChatOptions(reasoning_parser="harmony", tool_call_parser="harmony"))
    forced = request(tools=[WEATHER], tool_choice="required")
    with pytest.raises(p.RequestError, match="harmony"):
        features.constraint(forced, features.prompt(forced))
    schema = request(response_format={"type": "json_object"})
    with pytest.raises(p.RequestError, match="harmony"):
        features.constraint(schema, features.prompt(schema))
    auto = request(tools=[TIME])
    assert ChatFeatures(tok, ChatOptions(reasoning_parser="harmony")).harmony_calls  # auto: the template's harmony
    no_tools = ChatFeatures(tok, ChatOptions(reasoning_parser="harmony", tool_call_parser="none"))
    with pytest.raises(p.RequestError, match="--tool-call-parser harmony"):
        no_tools.output(auto, no_tools.prompt(auto))
    with pytest.raises(ValueError, match="harmony"):
        ChatOptions(reasoning_parser="qwen3", tool_call_parser="harmony")
