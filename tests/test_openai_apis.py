"""The APIs agents and apps call, through real `nanoserve serve` processes on CPU, driven by the
openai SDK: tools with the default --tool-call-parser (auto), the Responses API, embeddings,
/detokenize, /version and max_model_len in /v1/models; bad input is a 4xx with OpenAI's error
body while the servers keep serving; a concurrent mix of chat, responses and embeddings
requests leaks no page, slot or request.

Two servers for the module on one tiny random Llama with SmolLM2's vocabulary and the
Qwen-style tokenizer of tests/chat_tokenizers.py: `server` generates (no chat flags but
--reasoning-parser), `embed_server` embeds (--task embed), its vectors checked against
transformers' AutoModel. Also the offline `LLM(task="embed").embed()` against
transformers on a tiny random Qwen3 (chunked prefill included).
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Literal

import pytest

from tests.chat_tokenizers import make_tokenizer_dir
from tests.test_server_e2e import KEY, MODEL, http_client, sdk_client, serving, wait_idle

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
torch = pytest.importorskip("torch")

ASK = "What is the weather in Paris?"
# The random model may open a thinking it never closes, and a grammar starts after the thinking
# (--reasoning-parser): forced calls switch the thinking off in the template.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CHAT_WEATHER = {"type": "function", "function": WEATHER}
RESP_WEATHER = {"type": "function", **WEATHER}
EMBED_LEN = 64  # the embed server's max_model_len
EMBED_MODEL = "tiny-embed"  # its served name


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama with SmolLM2's vocabulary and the Qwen-style tokenizer (chat template
    with tools and thinking) of tests/chat_tokenizers.py: both servers run it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.tiny import tiny_config

    out = make_tokenizer_dir(tmp_path_factory.mktemp("model"), "qwen")
    spec = {**tiny_config("llama"), "vocab_size": 49152}
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(out))  # its config.json
    return out


@pytest.fixture(scope="module")
def server(model_dir):
    with serving(
        *["--served-model-name", MODEL, "--reasoning-parser", "qwen3"],
        *["--max-model-len", "1024", "--kv-cache-tokens", "8192", "--max-num-seqs", "16"],
        model=str(model_dir),
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def embed_server(model_dir):
    with serving(
        *["--task", "embed", "--max-model-len", str(EMBED_LEN), "--kv-cache-tokens", "1024"],
        *["--chunked-prefill-size", "32", "--max-num-seqs", "8", "--served-model-name", EMBED_MODEL],
        model=str(model_dir),
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def eclient(embed_server):
    return sdk_client(embed_server.url)


@pytest.fixture(scope="module")
def ehttp(embed_server):
    with http_client(embed_server.url) as c:
        yield c


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


# ------------------------------------------------------------------------------------------ tools, small routes


def test_tools_round_trip_with_a_default_server(server, client, http):
    assert "tool calls: parsed as hermes" in server.log  # --tool-call-parser auto, logged
    ask = [{"role": "user", "content": ASK}]
    auto = client.chat.completions.create(model=MODEL, messages=ask, tools=[CHAT_WEATHER], max_tokens=8, temperature=0)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")  # no 400 without a flag
    forced = client.chat.completions.create(
        model=MODEL,
        messages=ask,
        tools=[CHAT_WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
        extra_body=NO_THINKING,
    )
    (call,) = forced.choices[0].message.tool_calls
    assert forced.choices[0].finish_reason == "tool_calls" and json.loads(call.function.arguments)["city"]
    back = ask + [forced.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "21 C, sunny"}]
    answer = client.chat.completions.create(model=MODEL, messages=back, tools=[CHAT_WEATHER], max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert wait_idle(http)["nanoserve_kv_cache_pages_in_use"] == 0


def test_detokenize_version_and_models(client, http):
    ids = http.post("/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "Hello there"}
    assert error_of(http.post("/detokenize", json={"tokens": [10**9]}), 400)["param"] == "tokens"
    assert error_of(http.post("/detokenize", json={"tokens": "abc"}), 400)["param"] == "tokens"
    from nanoserve import __version__

    assert http.get("/version").json() == {"version": __version__}
    (model,) = client.models.list().data
    assert model.max_model_len == 1024


def test_bench_serve(server, http, tmp_path):
    """`nanoserve bench serve` (vLLM's flag names) against the server: a few requests, a saved result."""
    import subprocess
    import sys

    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    cmd = [sys.executable, "-m", "nanoserve", "bench", "serve", "--host", host, "--port", port, "--api-key", KEY]
    cmd += ["--dataset-name", "random", "--num-prompts", "3", "--random-input-len", "12", "--random-output-len", "4"]
    cmd += ["--request-rate", "inf", "--max-concurrency", "2", "--seed", "1", "--warmup", "0"]
    cmd += ["--save-result", "--result-dir", str(tmp_path), "--result-filename", "serve.json"]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "request throughput" in done.stdout
    report = json.loads((tmp_path / "serve.json").read_text())
    (rate,) = report["results"]
    assert rate["completed"] == 3 and rate["failed"] == 0 and rate["total_output_tokens"] == 12
    assert rate["max_concurrency"] == 2 and report["model"] == MODEL
    assert wait_idle(http)["nanoserve_kv_cache_pages_in_use"] == 0


# ------------------------------------------------------------------------------------------ responses


def test_responses_text_stream_and_store(client, http):
    kw = {"model": MODEL, "input": "What is the capital of France?", "max_output_tokens": 6, "temperature": 0}
    whole = client.responses.create(**kw, instructions="Answer briefly.")
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.output_text
    assert whole.status in ("completed", "incomplete") and whole.instructions == "Answer briefly."
    if whole.status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens" and whole.usage.output_tokens == 6
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    assert client.responses.retrieve(whole.id).output_text == whole.output_text

    events = list(client.responses.create(**kw, instructions="Answer briefly.", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    end = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-4:-1] == end and kinds[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text  # greedy: the same answer

    gone = client.responses.create(**kw, store=False)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(gone.id)
    assert info.value.body["code"] == "not_found" and gone.id in info.value.body["message"]
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(**kw, previous_response_id="resp_nope")
    assert info.value.body["param"] == "previous_response_id"
    # A conversation goes on from a stored response: its prompt holds the earlier turn.
    more = client.responses.create(**kw | {"input": "And of Italy?"}, previous_response_id=whole.id)
    assert more.previous_response_id == whole.id
    assert more.usage.input_tokens > whole.usage.input_tokens + 4
    assert wait_idle(http)["nanoserve_kv_cache_pages_in_use"] == 0


def test_responses_function_call_round_trip(client, http):
    first = client.responses.create(
        model=MODEL,
        input=ASK,
        tools=[RESP_WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
        extra_body=NO_THINKING,
    )
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] and call.call_id.startswith("call_")
    assert first.status == "completed"
    # The tool's result goes back as a function_call_output item, after the stored response.
    answer = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"}],
        tools=[RESP_WEATHER],
        tool_choice="none",
        max_output_tokens=6,
        temperature=0,
    )
    assert answer.output[-1].type == "message"
    # The same conversation sent whole, as items (the call, then its output), gives the same answer.
    whole = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": ASK},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"},
        ],
        tools=[RESP_WEATHER],
        tool_choice="none",
        max_output_tokens=6,
        temperature=0,
    )
    assert whole.output_text == answer.output_text and whole.usage.input_tokens == answer.usage.input_tokens
    # Streamed: the call arrives as one function_call item with its arguments.
    events = list(
        client.responses.create(
            model=MODEL,
            input=ASK,
            tools=[RESP_WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=60,
            temperature=0,
            stream=True,
            extra_body=NO_THINKING,
        )
    )
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == json.loads(call.arguments)
    assert events[-1].type == "response.completed"
    assert wait_idle(http)["nanoserve_kv_cache_pages_in_use"] == 0


def test_responses_parse_and_reasoning(client, http):
    from pydantic import BaseModel

    class City(BaseModel):
        name: Literal["Paris", "Rome", "Oslo"]
        capital: bool

    parsed = client.responses.parse(
        model=MODEL, input="Name a city as JSON.", text_format=City, max_output_tokens=40, temperature=0
    )
    assert isinstance(parsed.output_parsed, City) and parsed.status == "completed"
    with client.responses.stream(
        model=MODEL, input="Name a city as JSON.", text_format=City, max_output_tokens=40, temperature=0
    ) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed
    # Thinking opened by the template is a reasoning item before the message.
    thinking = client.responses.create(
        model=MODEL,
        input="Why is the sky blue? Think step by step.",
        max_output_tokens=12,
        temperature=0,
        extra_body={"chat_template_kwargs": {"open_thinking": True}, "min_tokens": 12},
    )
    reasoning = [o for o in thinking.output if o.type == "reasoning"]
    assert reasoning and reasoning[0].content[0].text and thinking.output[0].type == "reasoning"
    assert 0 < thinking.usage.output_tokens_details.reasoning_tokens <= thinking.usage.output_tokens
    assert wait_idle(http)["nanoserve_kv_cache_pages_in_use"] == 0


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"input": [{"type": "web_search_call", "id": "x"}]}, 400, "input[0].type"),
        ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "1"}]}, 400, "input[0].call_id"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            400,
            "input[0].content[0]",
        ),
        ({"input": 5}, 400, "input"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"input": "hi", "reasoning": {"effort": "high"}}, 400, "reasoning.effort"),
        ({"input": "hi", "max_output_tokens": 5000}, 400, "max_output_tokens"),
        ({"input": "hi", "truncation": "auto"}, 400, "truncation"),
        ({"input": "hi", "top_k": -5}, 400, "top_k"),
        ({"input": "hi", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
    ],
)
def test_bad_responses_requests(client, http, body, status, param):
    error = error_of(http.post("/v1/responses", json={"model": MODEL, **body}), status)
    assert error["param"] == param, error
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).usage.output_tokens >= 1


# ------------------------------------------------------------------------------------------ embeddings


def hf_vectors(model_dir, prompts: list[list[int]]) -> torch.Tensor:
    """transformers' last hidden state (final norm applied) of each prompt's last token, L2-normalized."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        rows = [model(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts]
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1)


def test_offline_embed_equals_transformers(tmp_path):
    from nanoserve import LLM
    from tests.tiny import make_tiny_model, random_prompts

    model_dir = make_tiny_model(tmp_path, "qwen3")
    prompts = random_prompts(5, max_len=90) + random_prompts(1, seed=1, min_len=96, max_len=96)  # chunked; the context
    llm = LLM(
        str(model_dir), device="cpu", task="embed", max_model_len=96, kv_cache_tokens=512, chunked_prefill_size=32
    )
    got = torch.tensor([o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)])
    torch.testing.assert_close(got, hf_vectors(model_dir, prompts), atol=2e-5, rtol=0)
    llm.engine.check_invariants()
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"] and stats["requests_running"] == 0
    with pytest.raises(ValueError, match="embedding model"):
        LLM(str(model_dir), device="cpu", max_model_len=96, kv_cache_tokens=512).embed([[1, 2]])


def test_embeddings_equal_transformers(eclient, ehttp, model_dir):
    texts = ["The capital of France is Paris.", "Embeddings", "A longer sentence about the sea and the sky, " * 5]
    ids = [ehttp.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
    assert len(ids[2]) > 32  # a chunked prefill
    want = hf_vectors(model_dir, ids)
    out = eclient.embeddings.create(model=EMBED_MODEL, input=texts, encoding_format="float")
    got = torch.tensor([d.embedding for d in out.data])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    assert [d.index for d in out.data] == [0, 1, 2]
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    # The SDK's default (base64, decoded by the SDK), token ids as input, one at a time: the same.
    for i, prompt in enumerate(ids):
        one = eclient.embeddings.create(model=EMBED_MODEL, input=prompt)
        torch.testing.assert_close(torch.tensor(one.data[0].embedding), want[i], atol=2e-5, rtol=0)
    raw = ehttp.post("/v1/embeddings", json={"input": texts[1], "encoding_format": "base64"}).json()
    decoded = torch.frombuffer(bytearray(base64.b64decode(raw["data"][0]["embedding"])), dtype=torch.float32)
    torch.testing.assert_close(decoded, want[1], atol=2e-5, rtol=0)
    # dimensions: the first N components, normalized again.
    short = eclient.embeddings.create(model=EMBED_MODEL, input=texts[0], dimensions=16, encoding_format="float")
    torch.testing.assert_close(
        torch.tensor(short.data[0].embedding), torch.nn.functional.normalize(want[0, :16], dim=0), atol=2e-5, rtol=0
    )
    assert wait_idle(ehttp)["nanoserve_kv_cache_pages_in_use"] == 0


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": 5}, "input"),
        ({"input": [["a"]]}, "input"),
        ({"input": ""}, "input"),
        ({"input": [1, -2]}, "input"),
        ({"input": [10**6]}, "input"),
        ({"input": "word " * (EMBED_LEN + 10)}, "input"),
        ({"input": ["ok", "word " * (EMBED_LEN + 10)]}, "input[1]"),
        ({"input": "hi", "dimensions": 65}, "dimensions"),
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_bad_embeddings_requests(eclient, ehttp, body, param):
    error = error_of(ehttp.post("/v1/embeddings", json={"model": EMBED_MODEL, **body}), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert len(eclient.embeddings.create(model=EMBED_MODEL, input="still serving").data[0].embedding) == 64


def test_wrong_task_is_400(http, ehttp):
    chat = {"model": EMBED_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert error_of(ehttp.post("/v1/chat/completions", json=chat), 400)["code"] == "wrong_task"
    assert error_of(ehttp.post("/v1/responses", json={"input": "hi"}), 400)["code"] == "wrong_task"
    assert error_of(ehttp.post("/v1/completions", json={"prompt": "hi"}), 400)["code"] == "wrong_task"
    assert error_of(http.post("/v1/embeddings", json={"input": "hi"}), 400)["code"] == "wrong_task"


def test_a_concurrent_mix_leaks_nothing(server, embed_server, http, ehttp):
    async def run():
        gen = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        emb = openai.AsyncOpenAI(base_url=embed_server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        jobs = []
        for i in range(4):
            jobs.append(
                gen.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"Count to {i}"}], max_tokens=6
                )
            )
            jobs.append(gen.responses.create(model=MODEL, input=f"Say {i}", max_output_tokens=6, stream=i % 2 == 1))
            jobs.append(emb.embeddings.create(model=EMBED_MODEL, input=[f"text {i}"] * (i + 1)))
        jobs.append(gen.responses.create(model=MODEL, input=[{"type": "bogus"}]))  # a 400 among them
        results = await asyncio.gather(*jobs, return_exceptions=True)
        for r in results:  # drain the streams
            if isinstance(r, openai.AsyncStream):
                async for _ in r:
                    pass
        return results

    results = asyncio.run(run())
    assert isinstance(results[-1], openai.BadRequestError)
    assert not [r for r in results[:-1] if isinstance(r, BaseException)]
    for h in (http, ehttp):
        m = wait_idle(h)
        assert m["nanoserve_kv_cache_pages_in_use"] == 0 and m["nanoserve_num_requests_running"] == 0, m
        assert m["nanoserve_server_requests_in_flight"] == 0, m
