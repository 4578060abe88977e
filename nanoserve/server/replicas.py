"""`nanoserve serve MODEL --dp N`: N replicas of the server behind the smg gateway, supervised.

Process layout:

    supervisor (this process) ──> smg gateway on --host:--port (nanoserve.server.gateway)
                              ──> replica 0: `nanoserve serve ... --host 127.0.0.1 --port P0`
                              ...           (each an API server + its engine, own GPU group)
                              ──> replica N-1

Invariants:
- Each replica is a full nanoserve server with the flags `serve` got, minus the supervisor's
  own (--dp, --router-policy, --host, --port, --api-key, --show-examples). Replicas listen on
  127.0.0.1 only; clients reach them through the gateway, which holds the API key.
- GPU groups are disjoint: replica i gets devices [i*T, (i+1)*T) of CUDA_VISIBLE_DEVICES (or of
  all GPUs) as its CUDA_VISIBLE_DEVICES, T = --tp. On CPU the replicas share the cores, each with
  OMP_NUM_THREADS = cores / N unless the caller set it.
- The gateway starts once every replica answers /health; the URL is announced once the gateway
  lists every replica healthy.
- A replica that exits after it was ready is restarted after a back-off (RestartPolicy) while the
  others keep serving; smg's health checks take it out of rotation meanwhile and bring it back.
  A replica that fails before it was ever ready is a configuration error: everything stops,
  exit code 1. More than max_restarts within window_s and the replica stays down (logged);
  when every replica is down, the supervisor exits 1. The gateway is restarted the same way.
- SIGTERM/SIGINT: stop the gateway (no new requests), then SIGTERM every replica (each stops
  its engine), SIGKILL whatever is left in their sessions after the grace period; exit 0, no
  process left. A replica that died is cleared the same way before its restart.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from nanoserve.server.gateway import free_port, smg_command

logger = logging.getLogger("nanoserve.replicas")

POLL_S = 0.2
STOP_GRACE_S = 10.0  # a replica's server gets this long after SIGTERM (it gives its engine a few seconds)
# Flags of `serve` that belong to the supervisor, with whether each takes a value.
SUPERVISOR_FLAGS = {
    "--dp": True,
    "--router-policy": True,
    "--host": True,
    "--port": True,
    "--api-key": True,
    "--show-examples": False,
}


@dataclass(frozen=True)
class RestartPolicy:
    """Restarts of a process that exited: back-off first_delay_s, doubling up to max_delay_s;
    at most max_restarts within window_s."""

    max_restarts: int = 5
    window_s: float = 600.0
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0

    def delay(self, recent_restarts: int) -> float:
        return min(self.max_delay_s, self.first_delay_s * 2**recent_restarts)


def replica_argv(serve_argv: list[str], port: int) -> list[str]:
    """The `serve` arguments of one replica: the user's, without the supervisor's flags, on
    127.0.0.1:port."""
    out: list[str] = []
    i = 0
    while i < len(serve_argv):
        arg = serve_argv[i]
        name, has_value_inline = arg.split("=", 1)[0], "=" in arg
        if name in SUPERVISOR_FLAGS:
            i += 1 if has_value_inline or not SUPERVISOR_FLAGS[name] else 2
            continue
        out.append(arg)
        i += 1
    return [*out, "--host", "127.0.0.1", "--port", str(port)]


def gpu_groups(dp: int, tp: int, device: str, visible: str | None, count: Callable[[], int]) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each replica (None: CPU). `visible` is the caller's
    CUDA_VISIBLE_DEVICES, `count` the number of GPUs when it is unset."""
    if device == "cpu":
        return [None] * dp
    if device not in ("auto", "cuda"):
        raise ValueError(
            f"--dp assigns GPUs to replicas itself: use --device cuda (got {device!r}) and choose the "
            "GPUs with CUDA_VISIBLE_DEVICES"
        )
    ids = (
        [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else list(map(str, range(count())))
    )
    if not ids:
        if device == "cuda":
            raise ValueError("--device cuda: no GPU is visible")
        return [None] * dp  # a machine without GPUs: replicas on the CPU
    if len(ids) < dp * tp:
        raise ValueError(f"--dp {dp} x --tp {tp} needs {dp * tp} GPUs, {len(ids)} visible ({','.join(ids)})")
    return [",".join(ids[i * tp : (i + 1) * tp]) for i in range(dp)]


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def http_get_json(url: str, timeout_s: float = 1.0, api_key: str | None = None):
    """The JSON body of a 200 answer, None for anything else (refused, error status, timeout)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as resp:
            return json.loads(resp.read() or b"null") if resp.status == 200 else None
    except (OSError, ValueError):  # URLError is an OSError
        return None


def session_members(sid: int) -> list[int]:
    """Live processes of session `sid` (Linux /proc; empty elsewhere). A child started in its
    own session keeps every process it forks there, even one that made its own process group
    (a replica's engine) or lost its parent."""
    members = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    state, _ppid, _pgrp, session = f.read().rsplit(")", 1)[1].split()[:4]
            except (OSError, ValueError):
                continue
            if int(session) == sid and state not in ("Z", "X"):
                members.append(int(entry))
    return members


def kill_session(sid: int) -> None:
    for pid in session_members(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class Supervised:
    """One child the supervisor keeps running: its command, its process and its restarts."""

    name: str
    cmd: list[str]
    env: dict[str, str] | None
    policy: RestartPolicy
    ready_url: str  # GET answers 200 once the child serves
    proc: subprocess.Popen | None = None
    ever_ready: bool = False
    restarts: collections.deque = field(default_factory=collections.deque)  # monotonic times
    restart_at: float | None = None  # when a restart is due
    given_up: bool = False
    terminated: bool = False

    def start(self) -> None:
        # Own session: a terminal's Ctrl-C reaches the supervisor only, which stops children in
        # order, and everything the child forks stays findable (session_members).
        self.proc = subprocess.Popen(self.cmd, env=self.env, start_new_session=True, stdin=subprocess.DEVNULL)
        self.restart_at = None
        logger.info("%s started (pid %d)", self.name, self.proc.pid)

    def exited(self) -> int | None:
        return None if self.proc is None or self.restart_at is not None else self.proc.poll()

    def schedule_restart(self, now: float, code: int) -> None:
        """After an exit: a restart after the back-off, or none once the budget is spent."""
        kill_session(self.proc.pid)  # what it left behind (an engine whose server was killed)
        while self.restarts and now - self.restarts[0] > self.policy.window_s:
            self.restarts.popleft()
        if len(self.restarts) >= self.policy.max_restarts:
            self.given_up = True
            self.proc = None
            logger.error(
                "%s exited (code %s) after %d restarts within %.0f s; it stays down",
                self.name,
                code,
                len(self.restarts),
                self.policy.window_s,
            )
            return
        delay = self.policy.delay(len(self.restarts))
        self.restarts.append(now + delay)
        self.restart_at = now + delay
        logger.warning("%s exited (code %s); restarting in %.1f s", self.name, code, delay)

    def terminate(self) -> None:
        """SIGTERM, once (a second one would force the server's exit)."""
        if self.proc is not None and self.proc.poll() is None and not self.terminated:
            self.proc.send_signal(signal.SIGTERM)
            self.terminated = True

    def stop(self, grace_s: float) -> None:
        """terminate(), wait up to grace_s, then SIGKILL whatever is left in its session."""
        if self.proc is None:
            return
        self.terminate()
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within %.0f s; killing it", self.name, grace_s)
        kill_session(self.proc.pid)
        self.proc.wait()


class DataParallelServer:
    """The supervisor of `serve --dp N`: replicas, the gateway, restarts and shutdown."""

    def __init__(
        self,
        *,
        serve_argv: list[str],
        dp: int,
        tp: int,
        device: str,
        host: str,
        port: int,
        policy: str,
        api_key: str | None,
        served_name: str,
        restart: RestartPolicy | None = None,
    ):
        self.restart = restart or RestartPolicy()
        groups = gpu_groups(dp, tp, device, os.environ.get("CUDA_VISIBLE_DEVICES"), _cuda_device_count)
        self.replicas: list[Supervised] = []
        for i, group in enumerate(groups):
            replica_port = free_port()
            env = dict(os.environ)
            if group is not None:
                env["CUDA_VISIBLE_DEVICES"] = group
            elif "OMP_NUM_THREADS" not in os.environ:
                env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // dp))
            cmd = [sys.executable, "-m", "nanoserve.server", "serve", *replica_argv(serve_argv, replica_port)]
            where = f"GPUs {group}" if group is not None else "CPU"
            self.replicas.append(
                Supervised(
                    f"replica {i} ({where}, http://127.0.0.1:{replica_port})",
                    cmd,
                    env,
                    self.restart,
                    f"http://127.0.0.1:{replica_port}/health",
                )
            )
        self.worker_urls = [r.ready_url.removesuffix("/health") for r in self.replicas]
        self.port = port or free_port(host)
        local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self.url = f"http://{local}:{self.port}"
        cmd = smg_command(host=host, port=self.port, policy=policy, worker_urls=self.worker_urls, api_key=api_key)
        self.gateway = Supervised(
            f"smg gateway ({policy})",
            cmd,
            None,
            self.restart,
            f"{self.url}/workers",
        )
        self.policy = policy
        self.api_key = api_key  # the gateway's: its /workers listing needs it too
        self.served_name = served_name
        self._stopping = False

    # ------------------------------------------------------------------------------ lifecycle

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            return self._run()
        finally:
            self.shutdown()

    def _on_signal(self, signum, _frame) -> None:
        if not self._stopping:
            logger.info("got %s; stopping the gateway and %d replicas", signal.Signals(signum).name, len(self.replicas))
        self._stopping = True

    def _run(self) -> int:
        for r in self.replicas:
            r.start()
        if not self._wait(self._replicas_ready):
            return 0 if self._stopping else 1
        self.gateway.start()
        if not self._wait(self._gateway_ready):
            return 0 if self._stopping else 1
        self.gateway.ever_ready = True
        logger.info(
            "nanoserve is ready: serving '%s' at %s (OpenAI API: %s/v1) through smg, policy %s, %d replicas",
            self.served_name,
            self.url,
            self.url,
            self.policy,
            len(self.replicas),
        )
        while not self._stopping:
            self._supervise(time.monotonic())
            if all(r.given_up for r in self.replicas):
                logger.error("every replica is down; stopping")
                return 1
            if self.gateway.given_up:
                logger.error("the gateway keeps exiting; stopping")
                return 1
            time.sleep(POLL_S)
        return 0

    def _wait(self, ready: Callable[[], bool]) -> bool:
        """Until ready() (True), a signal or a child's failure before it was ever ready (False)."""
        while not self._stopping:
            for child in [*self.replicas, self.gateway]:
                code = child.exited()
                if code is not None and not child.ever_ready:
                    logger.error("%s exited with code %s before it was ready; stopping", child.name, code)
                    return False
            if ready():
                return True
            time.sleep(POLL_S)
        return False

    def _replicas_ready(self) -> bool:
        for r in self.replicas:
            if not r.ever_ready and http_get_json(r.ready_url) is not None:
                r.ever_ready = True
                logger.info("%s is ready", r.name)
        return all(r.ever_ready for r in self.replicas)

    def _gateway_ready(self) -> bool:
        """smg lists every replica as a healthy worker."""
        listing = http_get_json(self.gateway.ready_url, api_key=self.api_key)
        if not isinstance(listing, dict):
            return False
        healthy = {w.get("url") for w in listing.get("workers", []) if w.get("is_healthy")}
        return set(self.worker_urls) <= healthy

    def _supervise(self, now: float) -> None:
        for child in [*self.replicas, self.gateway]:
            if child.given_up:
                continue
            code = child.exited()
            if code is not None:
                child.schedule_restart(now, code)
            elif child.restart_at is not None and now >= child.restart_at:
                child.start()

    def shutdown(self) -> None:
        self._stopping = True
        self.gateway.stop(STOP_GRACE_S)
        for r in self.replicas:  # SIGTERM to all first: they stop in parallel
            r.terminate()
        for r in self.replicas:
            r.stop(STOP_GRACE_S)
        logger.info("stopped")
