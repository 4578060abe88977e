"""Admission control, the hung-engine watchdog, vLLM-named metrics and engine death, on CPU with
the embedded SmolLM2-135M behind a real `python -m nanoserve serve` (API server + engine process).

One server with a single sequence slot is shared by the module: a long request holds the slot,
so what waits in the queue (and for how long) is under the test's control. The last test kills
the engine. The in-process tests at the bottom check /health and CORS without a model.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("zmq")
parser = pytest.importorskip("prometheus_client.parser")

from tests.test_server_e2e import MODEL, ServerProcess, _proc_state, descendants

QUEUE_LIMIT = 2
QUEUE_TIMEOUT_S = 2.0
WATCHDOG_S = 1.5
ORIGIN = "http://example.test"
VLLM_NAMES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
)


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(
        [
            sys.executable,
            "-m",
            "nanoserve",  # the package's __main__, same command line as `nanoserve`
            "serve",
            MODEL,
            "--port",
            "0",
            "--max-model-len",
            "512",
            "--kv-cache-tokens",
            "4096",
            "--max-num-seqs",
            "1",
            "--max-queued-requests",
            str(QUEUE_LIMIT),
            "--queue-timeout",
            str(QUEUE_TIMEOUT_S),
            "--watchdog-timeout",
            str(WATCHDOG_S),
            "--allowed-origins",
            ORIGIN,
        ]
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


class SlotHolder:
    """A long streaming /generate request that holds the server's only sequence slot until closed."""

    def __init__(self, http):
        body = {"text": "Once upon a time", "stream": True, "sampling_params": {"max_tokens": 480, "ignore_eos": True}}
        self._cm = http.stream("POST", "/generate", json=body)
        resp = self._cm.__enter__()
        assert resp.status_code == 200
        self.lines = resp.iter_lines()
        first = next(line for line in self.lines if line.startswith("data: "))
        assert json.loads(first[len("data: ") :])["token_ids"]  # it runs: the slot is taken

    def close(self):
        if self._cm is not None:
            self._cm, cm = None, self._cm
            cm.__exit__(None, None, None)


def families(http) -> dict:
    return {f.name: f for f in parser.text_string_to_metric_families(http.get("/metrics").text)}


def sample(fams: dict, family: str, name: str, **labels) -> float:
    for s in fams[family].samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((family, name, labels))


def wait_idle(http, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        fams = families(http)
        busy = sum(
            sample(fams, name, name)
            for name in (
                "nanoserve_kv_cache_pages_in_use",
                "nanoserve_num_requests_running",
                "nanoserve_num_requests_waiting",
                "nanoserve_server_requests_in_flight",
                "nanoserve_server_requests_queued",
            )
        )
        if busy == 0:
            return fams
        assert time.monotonic() < deadline, "the server did not go idle (a leaked page, slot or request)"
        time.sleep(0.1)


def assert_503(resp, code: str) -> None:
    assert resp.status_code == 503, resp.text
    assert resp.headers["retry-after"] == "1"
    err = resp.json()["error"]
    assert err["code"] == code and err["type"] == "service_unavailable_error" and err["message"]


def complete(http, max_tokens: int = 3):
    return http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": max_tokens})


def test_queue_timeout_answers_503_and_frees_the_request(http):
    holder = SlotHolder(http)
    try:
        t0 = time.monotonic()
        resp = complete(http)
        waited = time.monotonic() - t0
    finally:
        holder.close()
    assert_503(resp, "queue_timeout")
    assert QUEUE_TIMEOUT_S <= waited < QUEUE_TIMEOUT_S + 5
    fams = wait_idle(http)
    assert sample(fams, "nanoserve_requests_rejected", "nanoserve_requests_rejected_total", reason="queue_timeout") == 1
    assert complete(http).status_code == 200  # and the server keeps serving


def test_burst_beyond_the_queue_limit_gets_503_with_retry_after(http):
    burst = 5
    holder = SlotHolder(http)
    try:
        with ThreadPoolExecutor(burst) as pool:
            futures = [pool.submit(complete, http) for _ in range(burst)]
            # The refusals come at once, while the slot is still held (nothing is scheduled).
            deadline = time.monotonic() + 10
            while sum(f.done() for f in futures) < burst - QUEUE_LIMIT and time.monotonic() < deadline:
                time.sleep(0.05)
            refused = [f.result() for f in futures if f.done()]
            holder.close()  # the queued requests now run, one at a time
            answers = [f.result() for f in futures]
    finally:
        holder.close()
    assert len(refused) == burst - QUEUE_LIMIT
    for resp in refused:
        assert_503(resp, "queue_full")
    ok = [r for r in answers if r.status_code == 200]
    assert len(ok) == QUEUE_LIMIT
    for resp in ok:
        assert resp.json()["usage"]["completion_tokens"] == 3
    fams = wait_idle(http)
    assert (
        sample(fams, "nanoserve_requests_rejected", "nanoserve_requests_rejected_total", reason="queue_full")
        == burst - QUEUE_LIMIT
    )


def test_vllm_metric_names_parse_with_model_name(http):
    assert complete(http).status_code == 200
    fams = wait_idle(http)
    for name in VLLM_NAMES:
        family = name.removesuffix("_total")
        assert family in fams, name
        assert all(s.labels.get("model_name") == MODEL for s in fams[family].samples), name
    # The two names of one quantity agree.
    for ours, theirs in (
        ("nanoserve_prompt_tokens", "vllm:prompt_tokens"),
        ("nanoserve_generation_tokens", "vllm:generation_tokens"),
    ):
        assert sample(fams, ours, ours + "_total") == sample(fams, theirs, theirs + "_total") > 0
    for reason in ("stop", "length", "abort"):
        ours = sample(fams, "nanoserve_request_finished", "nanoserve_request_finished_total", finish_reason=reason)
        theirs = sample(fams, "vllm:request_success", "vllm:request_success_total", finished_reason=reason)
        assert ours == theirs
    ttft = "vllm:time_to_first_token_seconds"
    assert sample(fams, ttft, ttft + "_count") == sample(
        fams, "nanoserve_time_to_first_token_seconds", "nanoserve_time_to_first_token_seconds_count"
    )
    assert sample(fams, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") == 0


def test_cors_preflight(http):
    headers = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    resp = http.options("/v1/completions", headers=headers)
    assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == ORIGIN
    resp = http.options("/v1/completions", headers={**headers, "Origin": "http://elsewhere.test"})
    assert "access-control-allow-origin" not in resp.headers


def test_frozen_engine_turns_health_503_and_back(server, http):
    assert http.get("/health").status_code == 200
    holder = SlotHolder(http)
    try:
        os.kill(server.engine_pid, signal.SIGSTOP)
        try:
            time.sleep(WATCHDOG_S / 2)
            assert http.get("/health").status_code == 200  # not yet past the timeout
            deadline = time.monotonic() + WATCHDOG_S + 10
            while (resp := http.get("/health")).status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_stalled"
        finally:
            os.kill(server.engine_pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while (resp := http.get("/health")).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert resp.status_code == 200
        assert next(line for line in holder.lines if line.startswith("data: "))  # it decodes again
    finally:
        holder.close()
    wait_idle(http)


def test_killed_engine_ends_streams_with_an_error_and_the_server_exits(server, http):
    """Runs last: it kills the engine."""
    procs = descendants(server.proc.pid) | {server.proc.pid}
    holder = SlotHolder(http)
    result = {}

    def queued_request():
        result["resp"] = complete(http)

    waiter = threading.Thread(target=queued_request)
    waiter.start()
    time.sleep(0.3)
    os.kill(server.engine_pid, signal.SIGKILL)
    rest = [line for line in holder.lines if line.startswith("data: ")]
    holder.close()
    waiter.join(20)
    assert "data: [DONE]" not in rest  # a cut-off stream does not end like a complete one
    assert json.loads(rest[-1][len("data: ") :])["error"]["code"] == "engine_dead"
    assert result["resp"].status_code == 503
    assert server.wait_exit(20) == 1
    deadline = time.monotonic() + 10
    while any(_proc_state(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in procs if _proc_state(p)]


# ------------------------------------------------------------------------------------------ in-process


def _app(stalled_s: float, allowed_origins=None):
    from nanoserve.server.app import ServerState, build_app
    from nanoserve.server.metrics import ServerMetrics

    client = SimpleNamespace(dead=None, stalled_s=lambda: stalled_s)
    state = ServerState(
        client=client,
        served_name="m",
        max_model_len=16,
        vocab_size=10,
        tokenizer=None,
        metrics=ServerMetrics("m"),
        watchdog_timeout_s=5.0,
        allowed_origins=allowed_origins,
    )
    return build_app(state)


def test_health_watchdog_threshold_and_cors_off_by_default():
    from fastapi.testclient import TestClient

    assert TestClient(_app(4.9)).get("/health").status_code == 200
    resp = TestClient(_app(5.1)).get("/health")
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_stalled"
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    assert "access-control-allow-origin" not in TestClient(_app(0)).options("/health", headers=preflight).headers
    on = TestClient(_app(0, ["*"])).options("/health", headers=preflight)
    assert on.headers["access-control-allow-origin"] == "*"


def test_engine_process_reports_each_request_scheduled_once():
    from nanoserve.server.engine_process import _newly_scheduled

    waiting = [SimpleNamespace(request_id="a", slot=None), SimpleNamespace(request_id="b", slot=3)]
    engine = SimpleNamespace(scheduler=SimpleNamespace(waiting=waiting))
    queued = {"a", "b", "c"}  # b: admitted, prompt still chunking; c: admitted and running
    assert sorted(_newly_scheduled(engine, queued)) == ["b", "c"] and queued == {"a"}
    waiting.clear()
    assert _newly_scheduled(engine, queued) == ["a"] and not queued
    assert _newly_scheduled(SimpleNamespace(), {"x"}) == ["x"]  # no scheduler: admitted by the first step
