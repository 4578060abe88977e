"""Tensor parallelism on CPU (gloo): TP=2 against TP=1 on tiny models of every
architecture, chunked prefill and the prefix cache on; a dead or hung worker rank makes
rank 0 fail with a clear error within the collective timeout; the server with --tp 2.

Spawned ranks re-import torch, so each architecture starts one TP=2 LLM for the module.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tiny import TINY_CONFIGS, make_tiny_model, random_prompts

from nanoserve.distributed.tp_runner import TensorParallelError
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parent.parent
ENGINE = {
    "device": "cpu",
    "dtype": "float32",
    "chunked_prefill_size": 16,
    "kv_cache_tokens": 4096,
    "enable_prefix_caching": True,
}
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
TIMEOUT_S = 8.0


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_tp")
    return {arch: make_tiny_model(root / arch, arch) for arch in TINY_CONFIGS}


def _tokens(outputs):
    return [[s.token_ids for s in o.outputs] for o in outputs]


def _assert_idle_and_no_leak(llm):
    stats = llm.engine.stats()
    assert stats["requests_running"] == 0 and stats["requests_waiting"] == 0
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    llm.engine.check_invariants()


@pytest.mark.parametrize("arch", list(TINY_CONFIGS))
def test_tp2_greedy_matches_tp1(model_dirs, arch):
    # Prompts longer than a 16-token chunk, some sharing a prefix (prefix-cache hits on
    # the second round), and an n=2 request (its fork copies a KV page on every rank).
    prompts = random_prompts(6, seed=3, min_len=5, max_len=60)
    prompts += [prompts[0][:40] + [1, 2, 3], prompts[1] + [7]]
    params = [GREEDY] * len(prompts)
    params[-1] = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2)
    tp1 = LLM(str(model_dirs[arch]), **ENGINE)
    want = [_tokens(tp1.generate(prompts, params, use_tqdm=False)) for _ in range(2)]
    del tp1
    tp2 = LLM(str(model_dirs[arch]), tensor_parallel_size=2, dist_timeout_s=60, **ENGINE)
    try:
        got = [_tokens(tp2.generate(prompts, params, use_tqdm=False)) for _ in range(2)]
        assert got == want
        assert tp2.engine.stats()["prefix_cache_hit_tokens"] > 0
        _assert_idle_and_no_leak(tp2)
        pids = tp2.engine.runner.worker_pids
    finally:
        tp2.shutdown()
    assert len(pids) == 1
    assert not _alive(pids[0])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return _state(pid) not in ("Z", None)  # a reaped zombie is gone


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return None


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_dead_or_hung_worker_raises_within_timeout(model_dirs, how):
    llm = LLM(str(model_dirs["llama"]), tensor_parallel_size=2, dist_timeout_s=TIMEOUT_S, **ENGINE)
    try:
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
        (pid,) = llm.engine.runner.worker_pids
        os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        time.sleep(0.2)
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match="tensor parallelism failed"):
            llm.generate([[4, 5, 6, 7]], GREEDY, use_tqdm=False)
        assert time.monotonic() - started < TIMEOUT_S + 5
        with pytest.raises(TensorParallelError):  # the group stays failed
            llm.generate([[4, 5, 6, 7]], GREEDY, use_tqdm=False)
        assert not _alive(pid)  # a hung worker is killed by rank 0
    finally:
        llm.shutdown()


# ---- the server with --tp 2 ------------------------------------------------------------------


class _Server:
    def __init__(self, cmd: list[str]):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if m := re.search(pattern, self.log):
                return m
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log}")
            time.sleep(0.1)
        raise TimeoutError(f"{pattern!r} not seen in {timeout_s} s:\n{self.log}")


def test_server_tp2_serves_and_exits_when_a_rank_dies(model_dirs):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("zmq")
    cmd = [sys.executable, "-m", "nanoserve.cli", "serve", str(model_dirs["qwen2"]), "--tp", "2", "--device", "cpu",
           "--port", "0", "--kv-cache-tokens", "4096", "--dist-timeout", str(TIMEOUT_S)]  # fmt: skip
    srv = _Server(cmd)
    try:
        url = srv.wait_for(r"nanoserve is ready: .* at (http://\S+) ", 120).group(1)
        worker = int(srv.wait_for(r"worker pids \[(\d+)\]", 5).group(1))
        body = {
            "model": str(model_dirs["qwen2"]),
            "prompt": [5, 6, 7, 8],
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5

        os.kill(worker, signal.SIGKILL)
        try:
            httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT_S + 20)
        except httpx.HTTPError:
            pass  # the server may go away mid-request
        code = srv.proc.wait(TIMEOUT_S + 30)
        assert code != 0
        assert "tensor parallelism failed" in srv.log
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait(10)


def test_garbage_collected_llm_stops_its_workers(model_dirs):
    import gc

    llm = LLM(str(model_dirs["llama"]), tensor_parallel_size=2, dist_timeout_s=TIMEOUT_S, **ENGINE)
    (pid,) = llm.engine.runner.worker_pids
    del llm
    gc.collect()
    assert not _alive(pid)


def test_two_nodes_on_one_host(model_dirs):
    """--nnodes 2: node 1 runs the same command with --node-rank 1 and hosts rank 1."""
    from nanoserve.distributed.process_group import free_port

    addr = f"127.0.0.1:{free_port()}"
    prompts = random_prompts(3, seed=5, min_len=5, max_len=40)
    want = _tokens(LLM(str(model_dirs["mistral"]), **ENGINE).generate(prompts, GREEDY, use_tqdm=False))
    node1 = subprocess.Popen(
        [sys.executable, "-m", "nanoserve.cli", "generate", "--model", str(model_dirs["mistral"]), "--device", "cpu",
         "--tp", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr, "--kv-cache-tokens", "4096",
         "--chunked-prefill-size", "16", "--dist-timeout", "60"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        llm = LLM(
            str(model_dirs["mistral"]),
            tensor_parallel_size=2,
            nnodes=2,
            node_rank=0,
            dist_init_addr=addr,
            dist_timeout_s=60,
            **ENGINE,
        )
        assert llm.engine.runner.worker_pids == []  # rank 1 is node 1's
        assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
        llm.shutdown()
        assert node1.wait(30) == 0, node1.stdout.read()
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait(10)
