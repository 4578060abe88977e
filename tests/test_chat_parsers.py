"""Tool-call and reasoning parsers at token level, with real chat templates (a Qwen-style and a
Llama-3.1-style one, tests/data/*.jinja, over SmolLM2's vocabulary with the families' marker
tokens): replies are tokenized, detokenized token by token as the server does, and fed to a
`ChoiceOutput` in every chunking; the streamed pieces must add up to the whole reply's parse.
Also the request side: templates receive tools, tool calls and tool results, and
chat_template_kwargs; tool_choice rules; the constraints that force calls."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pydantic")

from nanoserve.detokenizer import SampleDetokenizer
from nanoserve.sampling_params import SamplingParams
from nanoserve.server import protocol as p
from nanoserve.server.chat_features import ChatFeatures, ChatOptions, ChoiceDelta
from tests.chat_tokenizers import load_tokenizer_dir, make_tokenizer_dir

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return load_tokenizer_dir(make_tokenizer_dir(tmp_path_factory.mktemp("tok"), "qwen"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return load_tokenizer_dir(make_tokenizer_dir(tmp_path_factory.mktemp("tok"), "llama31"))


def request(**body) -> p.ChatCompletionRequest:
    body.setdefault("messages", [{"role": "user", "content": "What is the weather in Paris?"}])
    return p.parse(p.ChatCompletionRequest, json.dumps(body).encode())


def run(output, chunks: list[str]) -> ChoiceDelta:
    whole = ChoiceDelta()
    for chunk in chunks:
        whole += output.feed(chunk)
    whole += output.finish()
    return whole


def token_chunks(tokenizer, text: str, skip_special_tokens: bool = True) -> list[str]:
    """The text pieces the server streams for `text` generated token by token."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = SampleDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip_special_tokens))
    chunks = [detok.append([t]) for t in ids] + [detok.flush()]
    assert "".join(chunks) == text
    return chunks


def check_every_chunking(make_output, tokenizer, text: str, skip_special_tokens: bool = True) -> ChoiceDelta:
    """Parse `text` whole, token by token, and split in two and three at every position:
    all give the same thinking, content and calls."""
    expected = run(make_output(), [text])
    key = (expected.reasoning, expected.content, [(c.name, c.arguments) for c in expected.calls])

    def same(got: ChoiceDelta, how: str) -> None:
        assert (got.reasoning, got.content, [(c.name, c.arguments) for c in got.calls]) == key, how

    same(run(make_output(), token_chunks(tokenizer, text, skip_special_tokens)), "token by token")
    for i in range(len(text) + 1):
        same(run(make_output(), [text[:i], text[i:]]), f"split at {i}")
    step = max(1, len(text) // 12)
    for i in range(0, len(text), step):
        for j in range(i, len(text), step):
            same(run(make_output(), [text[:i], text[i:j], text[j:]]), f"split at {i}, {j}")
    same(run(make_output(), list(text)), "one character at a time")
    return expected


# ------------------------------------------------------------------------------------------ hermes


def outputs(tokenizer, tool_parser=None, reasoning=None, **body):
    """A maker of fresh `ChoiceOutput`s for one request (tools sent when a parser is on)."""
    features = ChatFeatures(tokenizer, ChatOptions(tool_call_parser=tool_parser, reasoning_parser=reasoning))
    if tool_parser is not None:
        body.setdefault("tools", [WEATHER, TIME])
    req = request(**body)
    prompt = features.prompt(req)
    return lambda: features.output(req, prompt)


def hermes(qwen, reasoning=None, **body):
    return outputs(qwen, "hermes", reasoning, **body)


def test_hermes_calls_between_text(qwen):
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nDone <b>.'
    )
    got = check_every_chunking(hermes(qwen), qwen, text)
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("get_time", {}),
    ]
    assert got.content == "Let me check.Done <b>."
    assert len({c.id for c in got.calls}) == 2


def test_hermes_broken_calls_stay_content(qwen):
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>'
    text = f'Hi {broken} <tool_call>{{"arguments": {{}}}}</tool_call> and <tool_call>{{"name": "get_time"'
    got = check_every_chunking(hermes(qwen), qwen, text)
    assert got.calls == []
    assert got.content == text  # no name, bad JSON, never closed: all verbatim


def test_hermes_plain_reply_is_unchanged(qwen):
    text = "  Paris is sunny today; <tool and </tool_call> are just text.\n"
    got = check_every_chunking(hermes(qwen), qwen, text)
    assert got.calls == [] and got.content == text


def test_arguments_as_a_json_string_are_normalised(qwen):
    text = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
    got = check_every_chunking(hermes(qwen), qwen, text)
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [("get_weather", {"city": "Oslo"})]
    assert got.content == ""


# ------------------------------------------------------------------------------------------ llama3_json


def llama_json(llama, **body):
    return outputs(llama, "llama3_json", **body)


def test_llama3_json_several_calls(llama):
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}'
    )
    # <|python_tag|> is a special token: the detokenizer drops it, as the server does.
    ids = llama.encode(text, add_special_tokens=False)
    shown = llama.decode(ids, skip_special_tokens=True)
    got = check_every_chunking(llama_json(llama), llama, shown)
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [
        ("get_weather", {"city": "Rome"}),
        ("get_time", {}),
    ]
    assert got.content == ""


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Rome is fine.",
        '{"city": "Rome"} is what you asked for',
        '{"name": "get_weather", "parameters": {"city": "Rome"}',
        '{"name": "get_weather", "parameters": {"city": "Rome"}}; and more',
    ],
)
def test_llama3_json_other_replies_are_content(llama, text):
    got = check_every_chunking(llama_json(llama), llama, text)
    assert got.calls == [] and got.content == text


# ------------------------------------------------------------------------------------------ mistral, pythonic


@pytest.mark.parametrize("marker", ["[TOOL_CALLS]", ""])  # the marker is a special token, often gone
def test_mistral_calls_with_or_without_the_marker(qwen, marker):
    text = marker + '[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": {}}]'
    got = check_every_chunking(outputs(qwen, "mistral"), qwen, text)
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [
        ("get_weather", {"city": "Rome"}),
        ("get_time", {}),
    ]
    assert got.content == ""


def test_mistral_text_before_the_marker_and_broken_calls(qwen):
    text = 'Let me look. [TOOL_CALLS][{"name": "get_time", "arguments": {}}]'
    got = check_every_chunking(outputs(qwen, "mistral"), qwen, text)
    assert got.content == "Let me look." and [c.name for c in got.calls] == ["get_time"]
    for text in ['[TOOL_CALLS][{"name": "get_time"', "[1, 2] are numbers", "Plain [TOOL answer"]:
        got = check_every_chunking(outputs(qwen, "mistral"), qwen, text)
        assert got.calls == [] and got.content == text


def test_pythonic_calls(qwen):
    text = '[get_weather(city="Rome", unit="c"), get_time()]'
    got = check_every_chunking(outputs(qwen, "pythonic"), qwen, text)
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [
        ("get_weather", {"city": "Rome", "unit": "c"}),
        ("get_time", {}),
    ]
    for text in ["[1, 2]", "[f(x)]", "[os.system('ls')]", "[f(a=g())]", "Rome is fine.", "[f(a=1)"]:
        got = check_every_chunking(outputs(qwen, "pythonic"), qwen, text)
        assert got.calls == [] and got.content == text


def test_qwen3_xml_calls(qwen):
    """Qwen3.5 / Qwen3-Coder calls: parameters typed by the tool's schema (a string parameter
    stays text even when it reads as a number), others read as JSON where they parse."""
    text = (
        "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n1984\n</parameter>\n"
        '<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{"hourly": true}\n</parameter>\n'
        "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
    )
    got = check_every_chunking(outputs(qwen, "qwen3_xml"), qwen, text)
    assert got.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [
        ("get_weather", {"city": "1984", "days": 3, "opts": {"hourly": True}}),
        ("get_time", {}),
    ]
    for text in ["<tool_call>\n<function=get_time>\n</tool_call>", '<tool_call>{"name": "get_time"}</tool_call>']:
        got = check_every_chunking(outputs(qwen, "qwen3_xml"), qwen, text)
        assert got.calls == [] and got.content == text


def test_auto_picks_the_format_from_the_template(qwen, llama):
    from nanoserve.server.tool_parsers import detect_format

    assert ChatFeatures(qwen).tool_format.name == "hermes"  # --tool-call-parser auto is the default
    assert ChatFeatures(llama).tool_format.name == "llama3_json"
    assert ChatFeatures(qwen, ChatOptions(tool_call_parser="none")).tool_format is None
    assert detect_format("{{ '[INST]' }}{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]")[0] == "mistral"
    assert detect_format("[INST] {{ m }} [/INST]")[0] == "mistral"
    assert detect_format("<|header_start|>{{ '<|python_start|>' }}")[0] == "pythonic"
    assert detect_format("[func_name1(params_name1=params_value1)]")[0] == "pythonic"
    assert detect_format("<|im_start|>{{ m }}<|im_end|>")[0] == "hermes"  # ChatML family
    assert detect_format("<tool_call>\n<function=example_function_name>\n<parameter=p>")[0] == "qwen3_xml"
    assert detect_format("<|start|>assistant<|channel|>final")[0] == "harmony"  # gpt-oss: nanoserve.server.harmony
    assert detect_format(None)[0] is None and detect_format("{{ m }}")[0] is None
    with pytest.raises(ValueError, match="unknown tool call parser"):
        ChatOptions(tool_call_parser="nope")


def test_mistral_grammar_and_pythonic_forced_calls_use_hermes(qwen):
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(qwen, vocab_size=len(qwen)))

    def admits(spec, text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiler.compile_grammar(spec.grammar))
        ok = all(matcher.accept_token(t) for t in qwen.encode(text, add_special_tokens=False))
        return ok and matcher.accept_token(qwen.eos_token_id)

    req = request(tools=[WEATHER, TIME], tool_choice="required")
    mistral = ChatFeatures(qwen, ChatOptions(tool_call_parser="mistral"))
    spec = mistral.constraint(req, mistral.prompt(req))
    assert admits(
        spec, '[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": {}}]'
    )
    assert not admits(spec, '{"name": "get_time", "arguments": {}}')
    pythonic = ChatFeatures(qwen, ChatOptions(tool_call_parser="pythonic"))
    spec = pythonic.constraint(req, pythonic.prompt(req))
    assert admits(spec, '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    # Whitespace around a call is bounded, so a model cannot spin in it until max_tokens.
    assert admits(spec, '<tool_call>\n {"name": "get_time", "arguments": {}}\n\n</tool_call>')
    assert not admits(spec, '<tool_call>{"name": "get_time", "arguments": {}}' + " " * 5 + "</tool_call>")
    reply = pythonic.output(req, pythonic.prompt(req))
    got = reply.feed('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    got += reply.finish()
    assert [c.name for c in got.calls] == ["get_time"]


# ------------------------------------------------------------------------------------------ reasoning


def reasoning(tokenizer, name, **body):
    return outputs(tokenizer, reasoning=name, **body)


def test_qwen3_thinking_then_answer(qwen):
    text = "<think>\nThe user asks about </thi Paris.\n</think>\n\nIt is sunny."
    got = check_every_chunking(reasoning(qwen, "qwen3"), qwen, text)
    assert got.reasoning == "\nThe user asks about </thi Paris.\n" and got.content == "It is sunny."


def test_qwen3_without_thinking_is_all_answer(qwen):
    text = "It is sunny. <think>not thinking</think>"
    got = check_every_chunking(reasoning(qwen, "qwen3"), qwen, text)
    assert got.reasoning == "" and got.content == text


def test_thinking_disabled_by_chat_template_kwargs(qwen):
    make = reasoning(qwen, "deepseek_r1", chat_template_kwargs={"enable_thinking": False})
    text = "It is sunny.</think> really"
    got = check_every_chunking(make, qwen, text)
    assert got.reasoning == "" and got.content == text
    assert make().message(got) == {"role": "assistant", "content": text, "reasoning_content": None}


def test_deepseek_r1_starts_thinking_and_may_never_stop(qwen):
    got = check_every_chunking(reasoning(qwen, "deepseek_r1"), qwen, "Hmm, Paris.</think>Sunny.")
    assert (got.reasoning, got.content) == ("Hmm, Paris.", "Sunny.")
    got = check_every_chunking(reasoning(qwen, "deepseek_r1"), qwen, "<think>Still thinking about </th")
    assert (got.reasoning, got.content) == ("Still thinking about </th", "")


def test_reasoning_then_tool_calls(qwen):
    text = (
        "<think>I need the weather tool.</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    make = hermes(qwen, reasoning="qwen3")
    got = check_every_chunking(make, qwen, text)
    assert got.reasoning == "I need the weather tool." and got.content == ""
    output = make()
    whole = run(output, [text])
    message = output.message(whole)
    assert message["content"] is None and message["reasoning_content"] == "I need the weather tool."
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert output.finish_reason("stop") == "tool_calls" and output.finish_reason("length") == "length"


# ------------------------------------------------------------------------------------------ requests


def test_template_receives_tools_calls_results_and_kwargs(qwen):
    features = ChatFeatures(qwen)
    conversation = [
        {"role": "user", "content": "Weather in Paris?", "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
    ]
    req = request(messages=conversation, tools=[WEATHER], chat_template_kwargs={"enable_thinking": False})
    prompt = features.prompt(req)
    assert '"name": "get_weather"' in prompt.split("<|im_start|>user")[0]  # tools in the system part
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert '"get_weather"' not in features.prompt(request(tools=[WEATHER], tool_choice="none"))


def test_request_side_errors(qwen):
    features = ChatFeatures(qwen)
    with pytest.raises(p.RequestError) as info:
        features.prompt(request(chat_template_kwargs={"tools": []}))
    assert info.value.param == "chat_template_kwargs"
    assert features.output(request(tools=[WEATHER]), "") is not None  # auto found hermes in the template
    with pytest.raises(p.RequestError) as info:  # tool_choice auto needs a parser
        ChatFeatures(qwen, ChatOptions(tool_call_parser="none")).output(request(tools=[WEATHER]), "")
    assert info.value.param == "tool_choice"
    forced = request(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(p.RequestError) as info:
        features.constraint(forced, "")
    assert info.value.param == "tool_choice"


def test_forced_calls_grammar_and_gate(qwen):
    import xgrammar as xgr

    features = ChatFeatures(qwen, ChatOptions(reasoning_parser="qwen3"))
    named = request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    prompt = features.prompt(named)
    spec = features.constraint(named, prompt)
    assert spec.grammar is not None
    assert spec.after_reasoning is not None and not spec.after_reasoning.starts_open
    assert spec.after_reasoning.end_token == qwen.encode("</think>", add_special_tokens=False)[0]
    off = request(
        tools=[WEATHER],
        tool_choice="required",
        chat_template_kwargs={"enable_thinking": False},
    )
    assert features.constraint(off, features.prompt(off)).after_reasoning is None  # the template closed it

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(qwen, vocab_size=len(qwen)))

    def admits(spec, text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiler.compile_grammar(spec.grammar))
        ok = all(matcher.accept_token(t) for t in qwen.encode(text, add_special_tokens=False))
        return ok and matcher.accept_token(qwen.eos_token_id)

    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert admits(spec, one)
    assert not admits(spec, one + "\n" + one)  # a named function: one call
    assert not admits(spec, one.replace("get_weather", "get_time"))
    required = features.constraint(request(tools=[WEATHER, TIME], tool_choice="required"), prompt)
    assert admits(
        required,
        one + "\n" + one.replace('"get_weather", "arguments": {"city": "Paris"}', '"get_time", "arguments": {}'),
    )
    assert not admits(required, "")
    no_parallel = request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert not admits(features.constraint(no_parallel, prompt), one + "\n" + one)
    llama_like = ChatFeatures(qwen, ChatOptions(tool_call_parser="llama3_json")).constraint(
        request(tools=[WEATHER, TIME], tool_choice="required"), prompt
    )
    assert admits(
        llama_like, '{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}'
    )


def test_offline_chat_passes_tools_and_template_kwargs(tmp_path):
    from nanoserve import LLM

    llm = LLM("smollm2-135m", device="cpu", tokenizer=str(make_tokenizer_dir(tmp_path, "qwen")), max_model_len=512)
    try:
        (out,) = llm.chat(
            [{"role": "user", "content": "Weather in Paris?"}],
            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
            use_tqdm=False,
            tools=[WEATHER],
            chat_template_kwargs={"enable_thinking": False},
        )
    finally:
        llm.shutdown()
    assert '"name": "get_weather"' in out.prompt
    assert out.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert len(out.outputs[0].token_ids) == 4
