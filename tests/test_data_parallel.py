"""`nanoserve serve --dp 2` on CPU: two replicas of SmolLM2-135M behind the smg gateway.

One supervisor (gateway + 2 replicas) serves the whole module; the tests read the replicas'
own URLs and pids from its log. Order matters at the end: a replica is killed under load and
must come back, then SIGTERM must leave no process behind. The unit tests at the top need no
server (argument splitting, GPU groups, back-off, the load report, the missing-extra error).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from nanoserve.server import gateway
from nanoserve.server.gateway_info import load_snapshot
from nanoserve.server.replicas import RestartPolicy, Supervised, gpu_groups, replica_argv, session_members

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

MODEL = "smollm2-135m"
KEY = "dp-key"
LONG_PREFIX = "The history of the old harbour town goes back many centuries, to fishermen and traders. " * 12


# ------------------------------------------------------------------------------------------ no server


def test_replica_argv_drops_the_supervisors_flags():
    argv = [
        "smollm2-135m",
        "--dp",
        "2",
        "--port=9000",
        "--host",
        "0.0.0.0",
        "--router-policy",
        "round_robin",
        "--api-key",
        "k",
        "--show-examples",
        "--max-model-len",
        "512",
        "--tp",
        "2",
    ]
    assert replica_argv(argv, 4321) == [
        "smollm2-135m",
        "--max-model-len",
        "512",
        "--tp",
        "2",
        "--host",
        "127.0.0.1",
        "--port",
        "4321",
    ]


def test_gpu_groups_are_disjoint_and_checked():
    assert gpu_groups(2, 2, "auto", None, lambda: 4) == ["0,1", "2,3"]
    assert gpu_groups(2, 1, "cuda", "3,5,7", lambda: 0) == ["3", "5"]
    assert gpu_groups(3, 1, "cpu", None, lambda: 8) == [None, None, None]
    assert gpu_groups(2, 1, "auto", None, lambda: 0) == [None, None]  # no GPU: replicas on the CPU
    with pytest.raises(ValueError, match="needs 4 GPUs, 3 visible"):
        gpu_groups(2, 2, "auto", "0,1,2", lambda: 3)
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        gpu_groups(2, 1, "cuda:1", None, lambda: 2)


def test_restarts_back_off_and_stop_after_the_budget():
    policy = RestartPolicy(max_restarts=3, window_s=100.0, first_delay_s=1.0, max_delay_s=3.0)
    child = Supervised("x", ["true"], None, policy, "http://unused")
    child.proc = subprocess.Popen(["true"], start_new_session=True)
    child.proc.wait()
    delays = []
    for now in (0.0, 10.0, 20.0):
        child.schedule_restart(now, 1)
        delays.append(child.restart_at - now)
        child.restart_at = None
    assert delays == [1.0, 2.0, 3.0] and not child.given_up
    child.schedule_restart(30.0, 1)
    assert child.given_up  # 3 restarts within 100 s: it stays down
    child.given_up, child.proc = False, subprocess.Popen(["true"], start_new_session=True)
    child.proc.wait()
    child.schedule_restart(500.0, 1)  # the window moved on: restarts are allowed again
    assert not child.given_up and child.restart_at == 501.0


def test_load_snapshot_counts_pages_requests_hold():
    stats = {
        "page_size": 16,
        "kv_pages_total": 100,
        "kv_pages_free": 60,
        "kv_pages_cached": 15,
        "requests_running": 3,
        "requests_waiting": 2,
        "request_slots_total": 8,
        "prefix_cache_hit_rate": 0.25,
    }
    snap = load_snapshot(stats, 12.345)
    assert snap["num_used_tokens"] == 25 * 16 and snap["max_total_num_tokens"] == 1600
    assert snap["token_usage"] == 0.25 and snap["num_total_reqs"] == 5 and snap["gen_throughput"] == 12.35
    assert snap["utilization"] == 0.375 and snap["max_running_requests"] == 8 and snap["cache_hit_rate"] == 0.25


def test_dp_without_the_router_extra_names_it(monkeypatch):
    real = gateway.importlib.util.find_spec
    monkeypatch.setattr(gateway.importlib.util, "find_spec", lambda name: None if name == "smg" else real(name))
    from nanoserve.cli import main

    with pytest.raises(SystemExit, match=re.escape("pip install 'nanoserve[router]'")):
        main(["serve", MODEL, "--dp", "2"])
    with pytest.raises(SystemExit, match=re.escape("pip install 'nanoserve[router]'")):
        main(["router", "--worker-urls", "http://127.0.0.1:1"])


# ------------------------------------------------------------------------------------------ the gateway

pytest.importorskip("smg")
from tests.test_server_e2e import ServerProcess


class Fleet:
    """The supervisor's process and what its log says about the replicas."""

    def __init__(self, srv: ServerProcess):
        self.srv = srv
        self.url = srv.url

    def replicas(self) -> dict[int, tuple[str, int]]:
        """Replica index -> (URL, pid of its latest start)."""
        out = {}
        for m in re.finditer(r"replica (\d+) \(CPU, (http://[\d.:]+)\) started \(pid (\d+)\)", self.srv.log):
            out[int(m.group(1))] = (m.group(2), int(m.group(3)))
        return out

    def served(self) -> dict[str, float]:
        """Replica URL -> requests it finished (its own /metrics)."""
        out = {}
        for url, _pid in self.replicas().values():
            text = httpx.get(url + "/metrics", timeout=10).text
            out[url] = sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("vllm:request_success_total")
            )
        return out

    def healthy_workers(self) -> set[str]:
        listing = httpx.get(self.url + "/workers", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
        return {w["url"] for w in listing["workers"] if w["is_healthy"]}


@pytest.fixture(scope="module")
def fleet():
    srv = ServerProcess(
        [
            sys.executable,
            "-m",
            "nanoserve.server",
            "serve",
            MODEL,
            "--dp",
            "2",
            "--port",
            "0",
            "--api-key",
            KEY,
            "--max-model-len",
            "512",
            "--kv-cache-tokens",
            "8192",
            "--max-num-seqs",
            "16",
            "--max-queued-requests",
            "6",
        ]
    )
    try:
        # Each replica logs its own "nanoserve is ready" line too: wait for the supervisor's.
        deadline = time.monotonic() + 300
        while not (m := re.search(r"nanoserve is ready: .* at (http://\S+) .* through smg", srv.log)):
            assert srv.proc.poll() is None and time.monotonic() < deadline, srv.log[-5000:]
            time.sleep(0.2)
        srv.url = m.group(1)
        yield Fleet(srv)
    finally:
        srv.kill()


def client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_requests_spread_over_both_replicas(fleet):
    before = fleet.served()
    c = client(fleet.url)
    # Nothing shared: cache_aware balances requests that match no replica's prefixes.
    words = ["Apples", "Rivers", "Zebras", "Copper", "Violins", "Glaciers", "Mangoes", "Tunnels"]
    prompts = [f"{w} are what I think about; tell me {i} facts." for i, w in enumerate(words)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: c.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0), prompts))
    grew = {url: n - before[url] for url, n in fleet.served().items()}
    assert sum(grew.values()) == 8 and all(n > 0 for n in grew.values()), grew


def test_cache_aware_sends_a_shared_prefix_to_the_replica_that_holds_it(fleet):
    c = client(fleet.url)
    for topic in ("bridges", "lighthouses", "markets"):
        prefix = f"{LONG_PREFIX} This chapter is about its {topic}."
        first = c.completions.create(model=MODEL, prompt=prefix + " First,", max_tokens=2, temperature=0)
        again = c.completions.create(model=MODEL, prompt=prefix + " Second,", max_tokens=2, temperature=0)
        assert first.usage.prompt_tokens > 200
        # Random routing would miss the replica with the prefix half the time, three times over.
        assert again.usage.prompt_tokens_details.cached_tokens > 150, (topic, again.usage)


def test_every_replica_serves_what_the_gateway_reads(fleet):
    for url, _pid in fleet.replicas().values():
        info = httpx.get(url + "/server_info", timeout=10).json()
        assert info["served_model_name"] == MODEL and info["context_length"] == 512 and info["tp_size"] == 1
        assert httpx.get(url + "/model_info", timeout=10).json()["is_generation"] is True
        loads = httpx.get(url + "/v1/loads", params={"include": "core"}, timeout=10).json()
        (load,) = loads["loads"]
        assert (
            loads["dp_rank_count"] == 1 and load["max_total_num_tokens"] >= 8192 and load["max_running_requests"] == 16
        )
    assert fleet.healthy_workers() == {url for url, _ in fleet.replicas().values()}
    # smg found every route it asks for (its log warns on a 404 and on a load report it cannot read).
    assert "returned 404" not in fleet.srv.log and "falling back" not in fleet.srv.log


def test_the_api_through_the_gateway(fleet):
    c = client(fleet.url)
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi!"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 5 and "".join(ch.choices[0].delta.content or "" for ch in chunks[:-1])
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    out = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give a number as JSON."}],
        max_tokens=20,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )
    assert isinstance(json.loads(out.choices[0].message.content)["n"], int)
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                "required": ["city"],
            },
        },
    }
    out = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[tool],
        tool_choice="required",
        max_tokens=60,
    )
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    with httpx.Client(base_url=fleet.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as h:
        bad = h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        long = h.post("/v1/completions", json={"model": MODEL, "prompt": "word " * 600, "max_tokens": 4})
        assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
        assert (
            h.post(
                "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers={"Authorization": "Bearer no"}
            ).status_code
            == 401
        )


def test_a_full_queue_answers_503_with_retry_after_and_the_gateway_keeps_serving(fleet):
    """Admission control's 503 is back-pressure, not a broken replica: smg tries the other
    replica, then passes the 503 through with Retry-After, and serves the next request."""

    def one(i: int) -> httpx.Response:
        body = {"model": MODEL, "prompt": f"{i} {i} {i} tell me about number {i}", "max_tokens": 1}
        return httpx.post(
            fleet.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
        )

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(one, range(64)))
    refused = [r for r in answers if r.status_code != 200]
    assert refused and len(refused) < len(answers), [r.status_code for r in answers]
    for r in refused:
        assert r.status_code == 503 and r.headers["retry-after"], (r.status_code, r.text)
        assert r.json()["error"]["code"] == "queue_full", r.text  # nanoserve's own body, passed through
    assert one(100).status_code == 200


@pytest.mark.parametrize("policy", ["round_robin", "power_of_two", "least_load", "prefix_hash"])
def test_each_policy_routes_to_nanoserve(fleet, policy):
    """`nanoserve router --worker-urls` (the several-hosts path) with each policy in front of the replicas."""
    port = gateway.free_port()
    urls = [url for url, _ in fleet.replicas().values()]
    router = ServerProcess(
        [
            sys.executable,
            "-m",
            "nanoserve.cli",
            "router",
            "--worker-urls",
            *urls,
            "--port",
            str(port),
            "--router-policy",
            policy,
        ]
    )
    try:
        url = f"http://127.0.0.1:{port}"
        assert len(_wait_healthy(router, url, 2)) == 2
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        for i in range(3):
            out = c.completions.create(model=MODEL, prompt=f"{policy} {i}: one, two,", max_tokens=3, temperature=0)
            assert out.usage.completion_tokens == 3
        assert "returned 404" not in router.log, router.log
    finally:
        router.proc.send_signal(signal.SIGTERM)
        if router.wait_exit(20) is None:
            router.kill()


def test_bench_serve_through_the_gateway(fleet, tmp_path):
    """The serving benchmark's multi-turn conversations and text prompts through smg (which
    takes no token-id prompts): every turn is served and later turns hit the prefix cache."""
    pytest.importorskip("aiohttp")
    from nanoserve.bench import serving

    def bench(*flags: str) -> dict:
        out = tmp_path / "bench.json"
        common = ["--base-url", fleet.url, "--api-key", KEY, "--model", MODEL, "--output-json", str(out)]
        assert serving.main([*common, *flags]) == 0
        (run,) = json.loads(out.read_text())["results"]
        return run

    run = bench("--dataset-name", "multiturn", "--num-conversations", "4", "--turns", "3", "--random-input-len", "60",
                "--random-output-len", "4")  # fmt: skip
    assert run["completed"] == 12 and run["failed"] == 0
    assert run["prefix_hit_rate"] > 0.4, run["prefix_hit_rate"]  # turns 2 and 3 find their history
    run = bench("--random-text", "--num-prompts", "4", "--random-input-len", "30", "--random-output-len", "3")
    assert run["completed"] == 4 and run["total_output_tokens"] == 12


def test_router_follows_a_discovery_file(fleet, tmp_path):
    """`nanoserve router --discovery-file`: smg registers the replicas a manifest lists, and
    rereads it when it changes."""
    urls = sorted(url for url, _ in fleet.replicas().values())
    manifest = tmp_path / "workers.json"
    manifest.write_text(json.dumps({"version": 1, "workers": [{"url": urls[0]}]}))
    port = gateway.free_port()
    router = ServerProcess(
        [sys.executable, "-m", "nanoserve.cli", "router", "--discovery-file", str(manifest), "--port", str(port)]
    )
    try:
        url = f"http://127.0.0.1:{port}"
        assert _wait_healthy(router, url) == {urls[0]}
        out = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0).completions.create(
            model=MODEL, prompt="Discovered:", max_tokens=2
        )
        assert out.usage.completion_tokens == 2
        manifest.write_text(json.dumps({"version": 1, "workers": [{"url": u} for u in urls]}))
        assert _wait_healthy(router, url, len(urls)) == set(urls)
    finally:
        router.proc.send_signal(signal.SIGTERM)
        if router.wait_exit(20) is None:
            router.kill()


def _wait_healthy(router: ServerProcess, url: str, count: int = 1, timeout_s: float = 60) -> set[str]:
    """The gateway's healthy workers, once there are `count` of them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            healthy = {w["url"] for w in httpx.get(url + "/workers", timeout=5).json()["workers"] if w["is_healthy"]}
            if len(healthy) >= count:
                return healthy
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        assert router.proc.poll() is None, router.log
        time.sleep(0.2)
    raise TimeoutError(router.log)


def test_a_killed_replica_fails_only_its_requests_and_rejoins(fleet):
    replicas = fleet.replicas()
    c = client(fleet.url)
    subjects = ["otters", "volcanoes", "pianos", "deserts", "comets", "bakeries"]

    def ask(i: int):
        try:
            out = c.completions.create(
                model=MODEL,
                prompt=f"Write about {subjects[i]}, please:",
                max_tokens=128,
                temperature=0.8,
                seed=i,
                extra_body={"ignore_eos": True},
            )
            return out.usage.completion_tokens
        except openai.APIError as exc:
            return exc

    def in_flight(url: str) -> int:
        (load,) = httpx.get(url + "/v1/loads", timeout=10).json()["loads"]
        return load["num_running_reqs"] + load["num_waiting_reqs"]

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(ask, i) for i in range(6)]
        deadline = time.monotonic() + 30
        while True:  # until every request has reached a replica
            counts = {i: in_flight(url) for i, (url, _pid) in replicas.items()}
            if sum(counts.values()) == 6 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        # The busier replica dies: what runs there is lost (or retried by smg), nothing else.
        victim = max(counts, key=counts.get)
        victim_url, victim_pid = replicas[victim]
        os.kill(victim_pid, signal.SIGKILL)
        results = [f.result() for f in futures]
    failed = [r for r in results if not isinstance(r, int)]
    assert sum(counts.values()) == 6 and len(failed) <= counts[victim], (counts, results)
    assert all(r == 128 for r in results if isinstance(r, int)), results
    # The supervisor restarts it; smg's health checks bring it back into rotation.
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if fleet.replicas()[victim][1] != victim_pid and victim_url in fleet.healthy_workers():
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"replica {victim} did not rejoin:\n{fleet.srv.log[-3000:]}")
    assert re.search(rf"replica {victim} .* exited \(code -9\); restarting in", fleet.srv.log)
    served = fleet.served()
    # Nothing shared (as in the spread test), so cache_aware balances them over both replicas.
    words = ["Tea", "Rain", "Maps", "Owls", "Jazz", "Salt", "Kites", "Moss"]
    for round_ in range(3):  # it takes requests again (three rounds: routing is smg's choice)
        prompts = [f"{w} after the restart, round {round_}, a note {i}:" for i, w in enumerate(words)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda p: c.completions.create(model=MODEL, prompt=p, max_tokens=2), prompts))
        if fleet.served()[victim_url] > served[victim_url]:
            break
    else:
        pytest.fail(f"replica {victim} took none of 24 requests after it rejoined")


def test_sigterm_leaves_no_process_behind(fleet):
    sessions = [pid for _url, pid in fleet.replicas().values()]
    gateway_pid = int(re.findall(r"smg gateway \(cache_aware\) started \(pid (\d+)\)", fleet.srv.log)[-1])
    assert all(session_members(pid) for pid in sessions)  # each replica: its server and its engine
    fleet.srv.proc.send_signal(signal.SIGTERM)
    assert fleet.srv.wait_exit(60) == 0, fleet.srv.log[-3000:]
    left = [pid for sid in [*sessions, gateway_pid] for pid in session_members(sid)]
    assert left == [], left
