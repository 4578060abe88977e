"""Server process lifecycle with a fake engine (fast to start): engine death and load failure.

The engine process imports the fake from this module (the spawned child finds it through
PYTHONPATH), so these tests exercise the real ZMQ link, the real API server and the real exit
paths without loading a model.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("zmq")

from nanoserve.outputs import StepUpdate

TESTS = str(Path(__file__).resolve().parent)


class FakeEngine:
    """LLMEngine's interface without a model: every sample emits token 7 every 20 ms."""

    def __init__(self, config):
        self.tokenizer = None
        self.max_model_len = 256
        self.model_config = SimpleNamespace(max_model_len=256, vocab_size=1000, eos_token_ids=[0], name="fake")
        self._reqs: dict[tuple[str, int], list] = {}  # (id, index) -> [params, prompt_len, n_out, reason]
        self._done: list[StepUpdate] = []

    def add_request(self, request_id, prompt_token_ids, params):
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens, but max_model_len is 256")
        for i in range(params.n):
            self._reqs[(request_id, i)] = [params, len(prompt_token_ids), 0]

    def abort_request(self, request_id, index=None):
        for key in [k for k in self._reqs if k[0] == request_id and index in (None, k[1])]:
            _, plen, _ = self._reqs.pop(key)
            self._done.append(StepUpdate(key[0], key[1], [], None, "abort", plen))

    def has_unfinished_requests(self):
        return bool(self._reqs or self._done)

    def step(self):
        time.sleep(0.02)
        out, self._done = self._done, []
        for key, state in list(self._reqs.items()):
            params, plen, n_out = state
            state[2] = n_out + 1
            reason = "length" if params.max_tokens is not None and state[2] >= params.max_tokens else None
            if reason:
                del self._reqs[key]
            out.append(StepUpdate(key[0], key[1], [7], None, reason, plen))
        return out

    def stats(self):
        return {"kv_pages_total": 10, "kv_pages_free": 10 - len(self._reqs), "requests_running": len(self._reqs)}


def failing_engine(config):
    raise RuntimeError("this engine cannot load: weights are missing (fake)")


def _server(factory: str):
    from test_server_e2e import ServerProcess  # the same launcher as the end-to-end tests

    code = (
        "import sys; from nanoserve.config import EngineConfig; from nanoserve.server.launch import run_server; "
        f"sys.exit(run_server(EngineConfig.create('fake'), 'fake', port=0, engine_factory={factory!r}))"
    )
    env = {"PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])}
    return ServerProcess([sys.executable, "-c", code], env)


@pytest.fixture(scope="module")
def fake_server():
    srv = _server("test_server_lifecycle:FakeEngine")
    try:
        srv.wait_ready(60)
        yield srv
    finally:
        srv.kill()


def sse_events(resp) -> list:
    events = [line[len("data: ") :] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_multi_prompt_n_stream_and_tokenizerless_model(fake_server):
    with httpx.Client(base_url=fake_server.url, timeout=30) as http:
        body = {"prompt": [[1, 2], [3, 4, 5]], "n": 2, "max_tokens": 3, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as resp:
            chunks = sse_events(resp)
        finals = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks if c["choices"]}
        assert finals == {0: "length", 1: "length", 2: "length", 3: "length"}  # prompt i, sample j -> i * n + j
        assert "usage" in chunks[-1] and chunks[-1]["usage"]["prompt_tokens"] == 5
        assert chunks[-1]["usage"]["completion_tokens"] == 12
        assert all("usage" not in c for c in chunks[:-1])
        # A model without tokenizer takes token ids only, and says so for text.
        resp = http.post("/v1/completions", json={"prompt": "text"})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "no_tokenizer"
        out = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "echo": True}).json()
        assert out["usage"] == {
            "prompt_tokens": 2,
            "completion_tokens": 2,
            "total_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 256


def test_both_processes_freeze_their_startup_heap(fake_server):
    """Full collections in the API server stall every stream at once (nanoserve/heap.py)."""
    log = fake_server.log
    assert re.search(r"API server: \d+ startup objects moved out", log), log
    assert re.search(r"engine process: \d+ startup objects moved out", log), log
    assert "deferred full collections failed" not in log, log


def test_accepted_connections_send_without_nagle():
    """The listening socket has TCP_NODELAY, so every accepted connection inherits it: with
    Nagle's algorithm a response's body waited for the client's delayed ACK of its head, 40 ms
    per request on a kept-alive connection (44 ms for /health, 2026-11-28)."""
    import socket

    from nanoserve.server.launch import bind_socket

    listener = bind_socket("127.0.0.1", 0)
    try:
        listener.listen(1)
        client = socket.create_connection(listener.getsockname()[:2])
        accepted, _ = listener.accept()
        with client, accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        listener.close()


def test_idle_connection_outlives_client_pools(fake_server):
    """A keep-alive connection idle past uvicorn's default 5 s still serves. At 5 s a pooled
    client (httpx's pool expires idle connections after 5 s, aiohttp's after 15 s) could send a
    request as the server closed the connection: the request failed on the client
    (ServerDisconnectedError) and the server logged nothing."""
    from urllib.parse import urlsplit

    import aiohttp

    from nanoserve.server.launch import KEEP_ALIVE_S

    async def aiohttp_default_s() -> float:
        async with aiohttp.TCPConnector() as conn:
            return conn._keepalive_timeout

    assert KEEP_ALIVE_S > max(httpx.Limits().keepalive_expiry, asyncio.run(aiohttp_default_s()))
    url = urlsplit(fake_server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        conn.request("GET", "/v1/models")
        assert conn.getresponse().read() and conn.sock is not None
        sock = conn.sock
        time.sleep(6.0)
        conn.request("GET", "/v1/models")  # on the same connection: a closed one raises here or below
        resp = conn.getresponse()
        assert resp.status == 200 and conn.sock is sock
        assert json.loads(resp.read())["data"][0]["id"] == "fake"
    finally:
        conn.close()


def test_engine_death_answers_503_and_exits(fake_server):
    """Runs last in this module: it kills the fake server's engine."""
    from test_server_e2e import _proc_state, descendants

    srv = fake_server
    procs = descendants(srv.proc.pid) | {srv.proc.pid}
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        ok = http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3}}).json()
        assert ok["token_ids"] == [7, 7, 7] and ok["usage"]["completion_tokens"] == 3

        result = {}

        def long_request():
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_tokens": 200, "ignore_eos": True}}
            result["resp"] = http.post("/generate", json=body)

        body = {"input_ids": [1, 2], "stream": True, "sampling_params": {"max_tokens": 200}}
        with http.stream("POST", "/generate", json=body) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: {")
            waiter = threading.Thread(target=long_request)
            waiter.start()
            time.sleep(0.3)
            os.kill(srv.engine_pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        waiter.join(10)
        # The open stream is told why and ends without [DONE] (it is not complete); the waiting request gets 503.
        assert "data: [DONE]" not in rest
        assert json.loads(rest[-1][len("data: ") :])["error"]["code"] == "engine_dead"
        assert result["resp"].status_code == 503
        assert result["resp"].json()["error"]["type"] == "service_unavailable_error"
    assert srv.wait_exit(10) == 1
    assert "engine process exited unexpectedly" in srv.log
    deadline = time.monotonic() + 10
    while any(_proc_state(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in procs if _proc_state(p)]


def test_engine_load_failure_exits_with_the_reason():
    srv = _server("test_server_lifecycle:failing_engine")
    try:
        assert srv.wait_exit(60) == 1
        assert "weights are missing (fake)" in srv.log
        assert "nanoserve is ready" not in srv.log
    finally:
        srv.kill()
