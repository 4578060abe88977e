"""End-to-end tests of `nanoserve serve` on CPU with SmolLM2-135M, driven by the openai client.

One real server (API server process + engine process) is started for the whole module, on a
free port, with an API key; the last test shuts it down with SIGTERM and checks that no process
is left. Outputs are kept short (a few tokens) so the module runs in a couple of minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("zmq")

MODEL = "smollm2-135m"
KEY = "test-key"
MAX_MODEL_LEN = 512
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
READY_TIMEOUT_S = 240
REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ processes


def _proc_state(pid: int) -> str | None:
    """The /proc state letter of a live process, or None if it is gone (zombies count as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if state in ("Z", "X") else state


def descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


class ServerProcess:
    """A server command in a subprocess (e.g. `python -m nanoserve.server serve ...`); its log gives the URL."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url: str | None = None
        self.engine_pid: int | None = None

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            log = self.log
            if self.engine_pid is None and (m := re.search(r"engine process started \(pid (\d+)\)", log)):
                self.engine_pid = int(m.group(1))
            if m := re.search(r"nanoserve is ready: .* at (http://\S+) ", log):
                self.url = m.group(1)
                return self.url
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{log}")
            time.sleep(0.1)
        self.kill()
        raise TimeoutError(f"server not ready after {timeout_s} s:\n{self.log}")

    def wait_exit(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        for pid in descendants(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


# ------------------------------------------------------------------------------------------ fixtures


@contextlib.contextmanager
def serving(*args: str, model: str = MODEL):
    """`python -m nanoserve.server serve MODEL` on a free port with KEY and `args`, ready; killed
    on exit."""
    srv = ServerProcess(
        [sys.executable, "-m", "nanoserve.server", "serve", model, "--port", "0", "--api-key", KEY, *args]
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.kill()


def sdk_client(url: str):
    """The openai SDK on a test server (started with --api-key tests.test_server_e2e.KEY)."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def http_client(url: str):
    """httpx on a test server, for raw requests (a context manager)."""
    import httpx

    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


@pytest.fixture(scope="module")
def server():
    with serving(
        "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-tokens", "16384", "--max-num-seqs", "64", "--show-examples"
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def greedy(client):
    """The greedy completion of PROMPT, the reference several tests compare against."""
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)


def metrics(http) -> dict[str, float]:
    out = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[re.sub(r"\{.*\}", "", name) if "finish_reason" not in name else name] = float(value)
    return out


def abort_count(m: dict) -> float:
    return next(v for k, v in m.items() if k.startswith("nanoserve_request_finished_total") and '"abort"' in k)


def wait_idle(http, timeout_s: float = 20) -> dict:
    """Poll /metrics until no request runs and no page is held by a request."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(http)
        idle = (
            m["nanoserve_kv_cache_pages_in_use"] == 0
            and m["nanoserve_num_requests_running"] == 0
            and m["nanoserve_num_requests_waiting"] == 0
            and m["nanoserve_server_requests_in_flight"] == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------ good requests


def test_models_health_and_ready_log(server, client, http):
    assert server.url.startswith("http://127.0.0.1:")
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert http.get("/health").json() == {"status": "ok"}
    assert f"curl {server.url}/v1/chat/completions" in server.log  # --show-examples, as `make run` uses it


def test_completion_usage_and_logprobs(greedy, http):
    choice = greedy.choices[0]
    assert choice.finish_reason in ("length", "stop")
    assert greedy.usage.prompt_tokens == http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert 1 <= greedy.usage.completion_tokens <= 6
    assert greedy.usage.total_tokens == greedy.usage.prompt_tokens + greedy.usage.completion_tokens
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == greedy.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    assert choice.text.strip()


def test_completion_stream_matches_and_has_usage(client, greedy):
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == greedy.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == greedy.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == greedy.choices[0].finish_reason


def test_stop_string(client, greedy, http):
    text = greedy.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"greedy text too short to pick a stop string: {text!r}"
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stop=[stop])
    assert out.choices[0].text == text[: text.find(stop)]
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens <= greedy.usage.completion_tokens
    # With n=2 each sample that meets the stop string is cut and aborted on its own.
    two = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stop=stop, n=2)
    assert [(c.text, c.finish_reason) for c in two.choices] == [(out.choices[0].text, "stop")] * 2
    assert wait_idle(http)["nanoserve_kv_cache_pages_in_use"] == 0


def test_n_and_seed_reproducible(client):
    def run(seed):
        return client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0, n=2, seed=seed, logprobs=0
        )

    a, b = run(1234), run(1234)
    assert len(a.choices) == 2 and [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in a.choices)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens  # the prompt counts once, not n times


def test_chat_and_chat_stream(client, http):
    ref = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    assert ref.choices[0].message.role == "assistant" and ref.choices[0].message.content
    assert 1 <= ref.usage.completion_tokens <= 6
    # The stream as raw SSE: role first, content pieces, usage on the last chunk, then [DONE].
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == ref.choices[0].message.content
    assert chunks[-1]["choices"][0]["finish_reason"] == ref.choices[0].finish_reason
    assert chunks[-1]["usage"]["completion_tokens"] == ref.usage.completion_tokens


def test_chat_logprobs_and_max_completion_tokens(client):
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens <= 3
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_native_generate(http, greedy):
    out = http.post("/generate", json={"text": PROMPT, "sampling_params": {"max_tokens": 6, "temperature": 0}}).json()
    assert out["text"] == greedy.choices[0].text
    assert len(out["token_ids"]) == out["usage"]["completion_tokens"] == greedy.usage.completion_tokens
    again = http.post(
        "/generate", json={"input_ids": out["prompt_token_ids"], "sampling_params": {"max_tokens": 6, "temperature": 0}}
    ).json()
    assert again["token_ids"] == out["token_ids"]


# ------------------------------------------------------------------------------------------ bad requests

_MSG = [{"role": "user", "content": "hi"}]
BAD = [
    # (name, path, body (dict, or raw bytes), headers, status, param)
    ("malformed json", "/v1/completions", b'{"prompt": "hi",', None, 400, None),
    ("body not an object", "/v1/completions", b"[1, 2]", None, 400, None),
    ("missing prompt", "/v1/completions", {"max_tokens": 1}, None, 400, "prompt"),
    ("temperature wrong type", "/v1/completions", {"prompt": "hi", "temperature": "hot"}, None, 400, "temperature"),
    ("temperature out of range", "/v1/completions", {"prompt": "hi", "temperature": 5}, None, 400, "temperature"),
    ("top_p zero", "/v1/completions", {"prompt": "hi", "top_p": 0}, None, 400, "top_p"),
    ("max_tokens zero", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, None, 400, "max_tokens"),
    ("max_tokens as string", "/v1/completions", {"prompt": "hi", "max_tokens": "10"}, None, 400, "max_tokens"),
    ("n zero", "/v1/completions", {"prompt": "hi", "n": 0}, None, 400, "n"),
    ("logprobs too many", "/v1/completions", {"prompt": "hi", "logprobs": 50}, None, 400, "logprobs"),
    ("seed wrong type", "/v1/completions", {"prompt": "hi", "seed": "abc"}, None, 400, "seed"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, None, 400, "prompt"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, None, 400, "prompt"),
    ("empty stop string", "/v1/completions", {"prompt": "hi", "stop": [""]}, None, 400, "stop"),
    ("prompt too long", "/v1/completions", {"prompt": [100] * (MAX_MODEL_LEN + 10)}, None, 400, "prompt"),
    (
        "prompt+max_tokens too long",
        "/v1/completions",
        {"prompt": [100] * 500, "max_tokens": 100},
        None,
        400,
        "max_tokens",
    ),
    ("token id out of vocab", "/v1/completions", {"prompt": [10**9]}, None, 400, "prompt"),
    ("unknown model", "/v1/completions", {"model": "gpt-17", "prompt": "hi"}, None, 404, "model"),
    ("unknown field", "/v1/completions", {"prompt": "hi", "foo": 1}, None, 400, "foo"),
    ("unsupported logit_bias", "/v1/completions", {"prompt": "hi", "logit_bias": {"1": 5}}, None, 400, "logit_bias"),
    (
        "stream_options without stream",
        "/v1/completions",
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        None,
        400,
        "stream_options",
    ),
    ("chat no messages", "/v1/chat/completions", {"messages": []}, None, 400, "messages"),
    (
        "chat bad role",
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        None,
        400,
        "messages[0].role",
    ),
    (
        "chat image part",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        None,
        400,
        "messages[0].content",
    ),
    (
        "chat tool without a function",
        "/v1/chat/completions",
        {"messages": _MSG, "tools": [{"type": "function"}]},
        None,
        400,
        "tools[0].function",
    ),
    (
        "chat top_logprobs without logprobs",
        "/v1/chat/completions",
        {"messages": _MSG, "top_logprobs": 2},
        None,
        400,
        "top_logprobs",
    ),
    ("generate text and ids", "/generate", {"text": "hi", "input_ids": [1]}, None, 400, "text"),
    ("no api key", "/v1/completions", {"prompt": "hi"}, {"Authorization": ""}, 401, None),
    ("wrong api key", "/v1/completions", {"prompt": "hi"}, {"Authorization": "Bearer nope"}, 401, None),
    ("unknown route", "/v1/nothing-here", {"prompt": "hi"}, None, 404, None),
]


@pytest.mark.parametrize("name,path,body,headers,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_then_good_request(http, name, path, body, headers, status, param):
    kwargs = (
        {"content": body, "headers": {"Content-Type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    if headers:
        kwargs["headers"] = {**kwargs.get("headers", {}), **headers}
    resp = http.post(path, **kwargs)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    good = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 1})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 1


# ------------------------------------------------------------------------------------------ load, disconnect


def test_disconnect_mid_stream_aborts_and_frees_pages(http):
    before = metrics(http)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        # Keep the line iterator referenced: dropping it early would already close the connection.
        lines = resp.iter_lines()
        seen = 0
        while seen < 3:
            seen += next(lines).startswith("data: {")
        during = metrics(http)
        assert during["nanoserve_kv_cache_pages_in_use"] > 0
        assert during["nanoserve_num_requests_running"] == 1
    # Leaving the block closes the connection mid-stream.
    after = wait_idle(http)
    assert after["nanoserve_kv_cache_pages_in_use"] == 0
    assert after["nanoserve_num_requests_running"] == 0
    assert after["nanoserve_server_requests_in_flight"] == 0
    assert abort_count(after) == abort_count(before) + 1
    generated = after["nanoserve_generation_tokens_total"] - before["nanoserve_generation_tokens_total"]
    assert generated < 400  # it stopped well before max_tokens


def test_32_concurrent_streaming_clients(client, http):
    prompts = ["The capital of France is", "One, two, three,", "The sky is", "Water boils at"]
    refs = {}
    for p in prompts:
        refs[p] = client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0).choices[0].text
    aclient = openai.AsyncOpenAI(base_url=client.base_url, api_key=KEY, max_retries=0, timeout=300)

    async def one(prompt):
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True}
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usage = chunk.usage
        return prompt, text, usage

    async def all_clients():
        try:
            return await asyncio.gather(*(one(prompts[i % 4]) for i in range(32)))
        finally:
            await aclient.close()

    results = asyncio.run(all_clients())
    assert len(results) == 32
    for prompt, text, usage in results:
        assert text == refs[prompt]
        assert usage is not None and 1 <= usage.completion_tokens <= 4
    after = wait_idle(http)
    assert after["nanoserve_server_requests_in_flight"] == 0
    assert after["nanoserve_kv_cache_pages_in_use"] == 0


def test_chat_cli_against_server(server):
    """`nanoserve chat --url`: streams answers, keeps the conversation, knows /reset and /exit."""
    cmd = [
        sys.executable,
        "-m",
        "nanoserve.server",
        "chat",
        "--url",
        server.url,
        "--api-key",
        KEY,
        "--max-tokens",
        "4",
        "--temperature",
        "0",
    ]
    out = subprocess.run(
        cmd,
        input="Hi there\n/reset\nWhat is 2+2?\n/exit\nnever sent\n",
        text=True,
        capture_output=True,
        check=False,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    assert "(conversation cleared)" in out.stderr
    answers = [line for line in out.stdout.replace("you> ", "").splitlines() if line.strip()]
    assert len(answers) == 2, out.stdout


# ------------------------------------------------------------------------------------------ shutdown (last)


def test_sigterm_shuts_everything_down(server):
    procs = descendants(server.proc.pid) | {server.proc.pid}
    assert server.engine_pid in procs
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code = server.wait_exit(20)
    assert code == 0, server.log
    deadline = time.monotonic() + 10
    while any(_proc_state(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in procs if _proc_state(p)], "processes left behind"
    assert time.monotonic() - started < 15
    assert "server stopped" in server.log
