"""Soak: start a server, run a changing mix of requests for a while, and check that it held up.

The load repeats one cycle (`--cycle` seconds) until `--duration` is up:

    steady (Poisson at --rate) | a burst of --burst requests at once, above capacity |
    steady again | an idle gap (no requests)

Each request draws one kind: completions and chat, streamed and not, a JSON-schema response,
a forced tool call, n = 2, a stream the client abandons after two chunks, and bad input (unknown
model, negative max_tokens, a prompt longer than the context, a broken schema, a body that is not
JSON). The client is httpx's pool (the openai SDK's), so idle gaps expire pooled connections.

Checked, and printed as one line each (exit code 1 if any fails):
- every request ended as its kind expects: 200 with a complete answer (a stream ends with
  [DONE]; a schema's answer parses as JSON; a forced tool call has JSON arguments; n = 2 gives two
  choices), or the expected 4xx for bad input, or 503 with Retry-After (queue full or queue
  timeout); nothing else (no connection error, no 500, no timeout);
- nothing leaked once the load stops: the engine's own counters read through /metrics show no
  KV page held by a request, every request slot free, nothing running, waiting or tracked;
- the server's and engine's resident memory (and GPU memory, from nvidia-smi, on a GPU) grew
  by at most `--max-growth` from the first cycle after warm-up to the last;
- the p99 inter-token latency of the last cycle is within `--latency-tolerance` of the first
  cycle after warm-up (the first cycle is the warm-up; every cycle replays the same schedule,
  the same requests at the same offsets), over the requests sent in the steady phase before the
  burst (`--latency-phase cycle`: the whole cycle; each cycle's row has both, and the client's
  own event-loop lag, which bounds what its latencies can say about the server);
- the server's log holds no traceback and no ERROR line.

    python benchmarks/soak.py --duration 1800 --output-json soak.json --output-png soak.png
    python benchmarks/soak.py --model qwen3-0.6b --load-format dummy --duration 540 --rate 40 \\
        --burst 600 --max-num-seqs 256 --max-queued-requests 256 --max-tokens 128

A 45-second CPU version runs in CI (tests/test_soak.py). A 30-minute CPU run with
smollm2-135m: benchmarks/results/2026-11-28.md.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "population": {"type": "integer"},
        "coastal": {"type": "boolean"},
    },
    "required": ["city", "population", "coastal"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
QUESTIONS = [
    "What is the capital of France?",
    "Name three rivers in Europe.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Describe Paris in one sentence.",
]
PROMPTS = ["The capital of France is", "Once upon a time", "The three primary colors are", "def fibonacci(n):"]

# Kinds and their weights in the mix.
KINDS = {
    "completion": 3,
    "completion_stream": 3,
    "chat": 2,
    "chat_stream": 3,
    "structured": 2,
    "tools": 1,
    "n2": 1,
    "abort": 1,
    "bad": 1,
}


@dataclass
class Outcome:
    kind: str
    t: float  # seconds since the load began, when the request was sent
    status: int = 0  # HTTP status, 0 if none came
    ok: bool = False  # ended as its kind expects (a 503 with Retry-After included)
    refused: bool = False  # a 503: queue full or queue timeout
    detail: str = ""  # why it is not ok, or the bad input it was
    e2e: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)


# ------------------------------------------------------------------------------------------ server


class Server:
    """`nanoserve serve` in a subprocess; its log gives the URL and the engine's pid. It runs
    in a session of its own (`stop` can kill the whole group), so no signal to the soak reaches
    it: it is stopped at exit whatever ends the soak, a SIGTERM as `timeout` sends too
    (`stop_servers_on_term`); an orphaned server kept a GPU's memory (2026-12-02)."""

    def __init__(self, args: list[str], log_path: str | None, cmd: list[str] | None = None):
        cmd = cmd or [sys.executable, "-m", "nanoserve", "serve", *args, "--port", "0"]
        self.lines: list[str] = []
        self.log_path = log_path
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        atexit.register(self.stop)
        threading.Thread(target=self._read, daemon=True).start()
        self.url: str | None = None
        self.engine_pid: int | None = None

    def _read(self) -> None:
        with open(self.log_path or os.devnull, "w") as log:
            for line in self.proc.stdout:
                self.lines.append(line)
                log.write(line)
                log.flush()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if m := re.search(r"engine process started \(pid (\d+)\)", self.log):
                self.engine_pid = int(m.group(1))
            if m := re.search(r"nanoserve is ready: .* at (http://\S+) ", self.log):
                self.url = m.group(1)
                return
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with {self.proc.returncode}:\n{self.log[-4000:]}")
            time.sleep(0.2)
        self.stop()
        raise SystemExit(f"the server was not ready after {timeout_s:g} s:\n{self.log[-4000:]}")

    def pids(self) -> dict[str, int]:
        return {"server": self.proc.pid, **({"engine": self.engine_pid} if self.engine_pid else {})}

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


def stop_servers_on_term() -> None:
    """A SIGTERM ends the soak as an exception would, so its servers stop at exit."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def gpu_mb(pids: set[int]) -> float | None:
    """GPU memory the given processes hold (nvidia-smi), None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    used = [
        float(m) for p, m in (line.split(",") for line in out.strip().splitlines() if "," in line) if int(p) in pids
    ]
    return sum(used) if used else None


# ------------------------------------------------------------------------------------------ requests


class Client:
    def __init__(self, http: httpx.AsyncClient, model: str, max_tokens: int, max_model_len: int):
        self.http = http
        self.model = model
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len

    async def run(self, kind: str, t: float, rng: random.Random) -> Outcome:
        out = Outcome(kind, t)
        start = time.perf_counter()
        try:
            await getattr(self, kind)(out, rng)
        except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
            out.ok = False
            out.detail = f"{type(exc).__name__}: {exc}"[:300]
        out.e2e = time.perf_counter() - start
        return out

    def _chat_body(self, rng: random.Random, **extra) -> dict:
        messages = [{"role": "user", "content": rng.choice(QUESTIONS)}]
        return {"model": self.model, "messages": messages, "max_tokens": self.max_tokens, **extra}

    def _completion_body(self, rng: random.Random, **extra) -> dict:
        return {"model": self.model, "prompt": rng.choice(PROMPTS), "max_tokens": self.max_tokens, **extra}

    @staticmethod
    def _refused(out: Outcome, resp: httpx.Response, body: str) -> bool:
        """A 503 with Retry-After is an expected answer under overload."""
        if resp.status_code != 503:
            return False
        out.refused = True
        out.ok = "retry-after" in resp.headers
        out.detail = "" if out.ok else f"503 without Retry-After: {body[:200]}"
        return True

    async def _plain(self, out: Outcome, path: str, body: dict) -> dict | None:
        resp = await self.http.post(path, json=body)
        out.status = resp.status_code
        if self._refused(out, resp, resp.text):
            return None
        if resp.status_code != 200:
            out.detail = f"HTTP {resp.status_code}: {resp.text[:200]}"
            return None
        return resp.json()

    async def _stream(self, out: Outcome, path: str, body: dict, stop_after: int | None = None) -> list[dict]:
        """The stream's chunks; `stop_after` chunks: the client walks away (an abort)."""
        chunks: list[dict] = []
        start = time.perf_counter()
        last = None
        async with self.http.stream("POST", path, json={**body, "stream": True}) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                if not self._refused(out, resp, text):
                    out.detail = f"HTTP {resp.status_code}: {text[:200]}"
                return []
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.detail = f"error event: {chunk['error']}"[:300]
                    return chunks
                now = time.perf_counter()
                if chunk.get("choices"):
                    if last is None:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                chunks.append(chunk)
                if stop_after is not None and len(chunks) >= stop_after:
                    out.ok = True  # leaving the block closes the connection mid-stream
                    return chunks
        if stop_after is not None:
            out.ok = True  # the answer was shorter than the abort point
        elif not done:
            out.detail = "the stream ended without [DONE]"
        else:
            out.ok = True
        return chunks

    async def completion(self, out: Outcome, rng: random.Random) -> None:
        data = await self._plain(out, "/v1/completions", self._completion_body(rng))
        if data is not None:
            out.ok = bool(data["choices"]) and data["usage"]["completion_tokens"] > 0
            out.detail = "" if out.ok else "no tokens"

    async def completion_stream(self, out: Outcome, rng: random.Random) -> None:
        await self._stream(out, "/v1/completions", self._completion_body(rng))

    async def chat(self, out: Outcome, rng: random.Random) -> None:
        data = await self._plain(out, "/v1/chat/completions", self._chat_body(rng))
        if data is not None:
            out.ok = data["choices"][0]["message"]["role"] == "assistant"

    async def chat_stream(self, out: Outcome, rng: random.Random) -> None:
        await self._stream(out, "/v1/chat/completions", self._chat_body(rng))

    async def structured(self, out: Outcome, rng: random.Random) -> None:
        fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
        body = self._chat_body(rng, response_format=fmt, max_tokens=max(self.max_tokens, 64))
        data = await self._plain(out, "/v1/chat/completions", body)
        if data is not None:
            choice = data["choices"][0]
            if choice["finish_reason"] == "stop":
                json.loads(choice["message"]["content"])  # raises if the constraint failed
            out.ok = True

    async def tools(self, out: Outcome, rng: random.Random) -> None:
        body = self._chat_body(
            rng,
            tools=[TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=max(self.max_tokens, 64),
        )
        data = await self._plain(out, "/v1/chat/completions", body)
        if data is not None:
            choice = data["choices"][0]
            if choice["finish_reason"] != "length":
                for call in choice["message"]["tool_calls"]:
                    json.loads(call["function"]["arguments"])
            out.ok = True

    async def n2(self, out: Outcome, rng: random.Random) -> None:
        data = await self._plain(out, "/v1/completions", self._completion_body(rng, n=2, temperature=0.8))
        if data is not None:
            out.ok = sorted(c["index"] for c in data["choices"]) == [0, 1]
            out.detail = "" if out.ok else f"choices {[c['index'] for c in data['choices']]}"

    async def abort(self, out: Outcome, rng: random.Random) -> None:
        body = self._completion_body(rng, max_tokens=max(self.max_tokens, 32), ignore_eos=True)
        await self._stream(out, "/v1/completions", body, stop_after=2)

    async def bad(self, out: Outcome, rng: random.Random) -> None:
        cases = [
            ("unknown model", {**self._completion_body(rng), "model": "no-such-model"}, 404),
            ("negative max_tokens", self._completion_body(rng, max_tokens=-1), 400),
            ("prompt longer than the context", self._completion_body(rng) | {"prompt": [5] * self.max_model_len}, 400),
            (
                "broken schema",
                self._chat_body(
                    rng, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}
                ),
                400,
            ),
            ("not JSON", None, 400),
        ]
        name, body, want = rng.choice(cases)
        out.detail = name
        if body is None:
            resp = await self.http.post(
                "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}
            )
        else:
            resp = await self.http.post("/v1/completions" if "prompt" in body else "/v1/chat/completions", json=body)
        out.status = resp.status_code
        if self._refused(out, resp, resp.text):
            return
        has_error_body = "error" in resp.json()
        out.ok = resp.status_code == want and has_error_body
        if not out.ok:
            out.detail = f"{name}: HTTP {resp.status_code} (expected {want}): {resp.text[:200]}"


# ------------------------------------------------------------------------------------------ load


def phase_at(t_in_cycle: float, cycle: float) -> str:
    """Where in the cycle: steady (0-50%), steady after the burst (50-75%), idle (75-100%)."""
    x = t_in_cycle / cycle
    return "steady" if x < 0.5 else ("after burst" if x < 0.75 else "idle")


async def drive(
    client: Client, args, samples: list[dict], lags: list[tuple[float, float]], server: Server | None
) -> list[Outcome]:
    """The load; every cycle replays the same schedule (kinds, bodies, arrival gaps: the random
    draws restart from --seed), so that cycles differ only by what the server does. Also
    samples the client's own event-loop lag (`lags`: (t, ms late) of a 10 ms sleep), which
    bounds what the client's latencies can tell about the server."""
    rng = random.Random(args.seed)
    deck: list[str] = []
    cycle_seeded = -1

    def next_kind() -> str:
        """Kinds dealt from a shuffled deck of KINDS' weights: every kind within each len(deck) requests."""
        if not deck:
            deck.extend(k for k, w in KINDS.items() for _ in range(w))
            rng.shuffle(deck)
        return deck.pop()

    tasks: list[asyncio.Task] = []
    t0 = time.perf_counter()
    pids = set(server.pids().values()) if server else set()

    async def sample_memory() -> None:
        last_gpu = 0.0
        while True:
            t = time.perf_counter() - t0
            row = {"t": round(t, 2)}
            if server:
                for name, pid in server.pids().items():
                    row[f"rss_mb_{name}"] = rss_mb(pid)
                if t - last_gpu >= 5:
                    last_gpu = t
                    row["gpu_mb"] = await asyncio.to_thread(gpu_mb, pids)
            samples.append(row)
            await asyncio.sleep(args.sample_every)

    async def sample_lag() -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append((round(before - t0, 3), (time.perf_counter() - before - 0.01) * 1e3))

    sampler = asyncio.create_task(sample_memory())
    lag_sampler = asyncio.create_task(sample_lag())
    burst_done: set[int] = set()
    try:
        while (now := time.perf_counter() - t0) < args.duration:
            c = int(now // args.cycle)
            in_cycle = now - c * args.cycle
            if c != cycle_seeded:
                cycle_seeded = c
                rng.seed(args.seed)
                deck.clear()
            if in_cycle >= args.cycle / 2 and c not in burst_done:
                burst_done.add(c)
                for _ in range(args.burst):
                    kind = next_kind()
                    tasks.append(asyncio.create_task(client.run(kind, now, random.Random(rng.random()))))
            if phase_at(in_cycle, args.cycle) == "idle":
                await asyncio.sleep(min(args.cycle - in_cycle, args.duration - now) + 1e-3)
                continue
            kind = next_kind()
            tasks.append(asyncio.create_task(client.run(kind, now, random.Random(rng.random()))))
            await asyncio.sleep(rng.expovariate(args.rate))
        return list(await asyncio.gather(*tasks))
    finally:
        sampler.cancel()
        lag_sampler.cancel()


# /metrics gauges that are zero once the server has nothing to do
BUSY = (
    "nanoserve_num_requests_running",
    "nanoserve_num_requests_waiting",
    "nanoserve_server_requests_in_flight",
    "nanoserve_server_requests_queued",
)


async def engine_counters(http: httpx.AsyncClient) -> dict[str, float]:
    text = (await http.get("/metrics")).text
    values = {}
    for line in text.splitlines():
        if line.startswith("nanoserve_") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values


async def wait_idle(http: httpx.AsyncClient, timeout_s: float) -> dict[str, float]:
    """The engine's counters once nothing runs, waits or is tracked (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = await engine_counters(http)
        if not any(m.get(k, 0) for k in BUSY) or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.5)


# ------------------------------------------------------------------------------------------ report


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def windows(
    outcomes: list[Outcome],
    samples: list[dict],
    cycle: float,
    duration: float,
    lags: Sequence[tuple[float, float]] = (),
) -> list[dict]:
    """Per cycle: requests by outcome, latency percentiles (ms; `itl_p99_steady_ms` over the
    requests sent in the steady phase before the burst), the client's loop lag, memory (median MB)."""
    rows = []
    for c in range(max(1, round(duration / cycle))):
        lo, hi = c * cycle, (c + 1) * cycle
        mine = [o for o in outcomes if lo <= o.t < hi]
        ok = [o for o in mine if o.ok and not o.refused]
        itl = [x * 1e3 for o in ok for x in o.itl]
        steady = [x * 1e3 for o in ok if phase_at(o.t - lo, cycle) == "steady" for x in o.itl]
        lag = [ms for t, ms in lags if lo <= t < hi]
        ttft = [o.ttft * 1e3 for o in ok if o.ttft is not None]
        e2e = [o.e2e * 1e3 for o in ok]
        row = {
            "window": c,
            "start_s": lo,
            "requests": len(mine),
            "ok": len(ok),
            "refused_503": sum(o.refused for o in mine),
            "failed": sum(not o.ok for o in mine),
            "itl_p50_ms": pct(itl, 0.5),
            "itl_p99_ms": pct(itl, 0.99),
            "itl_p99_steady_ms": pct(steady, 0.99),
            "client_lag_p99_ms": pct(lag, 0.99),
            "client_lag_max_ms": max(lag, default=None),
            "ttft_p99_ms": pct(ttft, 0.99),
            "e2e_p99_ms": pct(e2e, 0.99),
        }
        mem = [s for s in samples if lo <= s["t"] < hi]
        for key in ("rss_mb_server", "rss_mb_engine", "gpu_mb"):
            vals = [s[key] for s in mem if s.get(key) is not None]
            row[key] = statistics.median(vals) if vals else None
        rows.append(row)
    return rows


def growth_check(rows: list[dict], key: str, limit: float) -> tuple[bool, str] | None:
    first, last = rows[1].get(key), rows[-1].get(key)  # rows[0] is the warm-up
    if first is None or last is None:
        return None
    growth = last / first - 1
    return growth <= limit, f"{key}: {first:.0f} -> {last:.0f} MB ({growth:+.1%}, limit {limit:+.0%})"


# The latency check's figure per --latency-phase: "steady" (the default) leaves out the burst,
# whose requests queue above capacity by design and whose ITL moved 18-60 ms from cycle to cycle
# in the 9-minute GPU soak of 2026-12-02 (p50 0.7-0.9 ms), so that it compares the server's
# decode latency and not where a burst's stalls fall against the 99th percentile.
LATENCY_KEYS = {"steady": "itl_p99_steady_ms", "cycle": "itl_p99_ms"}


def checks(outcomes, rows, counters, server_log: str, args) -> dict[str, tuple[bool, str]]:
    out: dict[str, tuple[bool, str]] = {}
    failed = [o for o in outcomes if not o.ok]
    kinds = sorted({o.kind for o in outcomes})
    out["every request ended as expected"] = (
        bool(outcomes) and not failed,
        f"{len(outcomes)} requests ({', '.join(f'{k} {sum(o.kind == k for o in outcomes)}' for k in kinds)}); "
        f"{sum(o.refused for o in outcomes)} refused with 503 + Retry-After; {len(failed)} unexpected"
        + (f", first: {failed[0].kind} at {failed[0].t:.1f} s: {failed[0].detail}" if failed else ""),
    )
    # A counter the server does not export reads -1 and fails the check.
    total, free = counters.get("nanoserve_kv_cache_pages_total", -1), counters.get("nanoserve_kv_cache_pages_free", -1)
    cached = counters.get("nanoserve_kv_cache_pages_cached", -1)
    in_use = counters.get("nanoserve_kv_cache_pages_in_use", -1)
    slots, slots_free = (
        counters.get("nanoserve_request_slots_total", -1),
        counters.get("nanoserve_request_slots_free", -1),
    )
    busy = {k: counters.get(k, -1) for k in BUSY}
    leak_ok = total > 0 and free + cached == total and in_use == 0 and slots > 0 and slots_free == slots
    leak_ok = leak_ok and not any(busy.values())
    out["no KV page or request slot leaked"] = (
        leak_ok,
        f"KV pages {total:.0f}: {free:.0f} free + {cached:.0f} cached, {in_use:.0f} held; "
        f"request slots {slots_free:.0f} of {slots:.0f} free; "
        + ", ".join(f"{k.removeprefix('nanoserve_')} {v:.0f}" for k, v in busy.items()),
    )
    for key in ("rss_mb_server", "rss_mb_engine", "gpu_mb"):
        if (res := growth_check(rows, key, args.max_growth)) is not None:
            out[f"{key} flat"] = res
    key = LATENCY_KEYS[args.latency_phase]
    name = f"ITL p99 ({args.latency_phase}) of the last cycle near the first"
    first, last = rows[1][key], rows[-1][key]
    if first and last:
        change = last / first - 1
        out[name] = (
            abs(change) <= args.latency_tolerance,
            f"{first:.1f} -> {last:.1f} ms ({change:+.1%}, tolerance {args.latency_tolerance:.0%})",
        )
    else:
        out[name] = (False, f"no streamed tokens to compare ({first}, {last})")
    bad_lines = [line for line in server_log.splitlines() if "Traceback" in line or " ERROR " in line]
    out["no error in the server log"] = (not bad_lines, bad_lines[0][:200] if bad_lines else "none")
    return out


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, samples = report["windows"], report["memory_samples"]
    mid = [r["start_s"] / 60 + report["config"]["cycle"] / 120 for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    ax = axes[0]
    series = (
        ("itl_p50_ms", "o-"),
        ("itl_p99_ms", "^-"),
        ("itl_p99_steady_ms", "v-"),
        ("client_lag_max_ms", "x:"),
        ("ttft_p99_ms", "s--"),
        ("e2e_p99_ms", "d:"),
    )
    for key, style in series:
        ax.plot(mid, [r.get(key) for r in rows], style, label=key.replace("_ms", ""))
    ax.set_yscale("log")
    ax.set_ylabel("ms (per cycle)")
    ax.legend()
    ax.grid(True, alpha=0.3)
    ax = axes[1]
    for key in ("rss_mb_server", "rss_mb_engine", "gpu_mb"):
        pts = [(s["t"] / 60, s[key]) for s in samples if s.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), label=key)
    ax.set_yscale("log")  # GPU memory is a hundred times the processes' RSS
    ax.set_ylabel("MB")
    ax.legend()
    ax.grid(True, alpha=0.3)
    ax = axes[2]
    ax.plot(mid, [r["ok"] for r in rows], "o-", label="ok")
    ax.plot(mid, [r["refused_503"] for r in rows], "s-", label="503 + Retry-After")
    ax.plot(mid, [r["failed"] for r in rows], "x-", label="unexpected")
    ax.set_ylabel("requests per cycle")
    ax.set_xlabel("minutes")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.suptitle(
        f"soak: {report['config']['model']}, {report['config']['duration'] / 60:.1f} min, {report['date']} UTC"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------------------ main


async def amain(args) -> dict:
    server = None
    if args.base_url is None:
        server_args = [
            args.model,
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--max-queued-requests",
            str(args.max_queued_requests),
            "--queue-timeout",
            str(args.queue_timeout),
            *args.server_arg,
        ]
        server = Server(server_args, args.server_log)
        server.wait_ready(args.ready_timeout)
    base = args.base_url or server.url
    try:
        # httpx's pool as the openai SDK sets it up (keep-alive connections, 5 s idle expiry).
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        async with httpx.AsyncClient(base_url=base, timeout=args.request_timeout, limits=limits) as http:
            card = (await http.get("/v1/models")).json()["data"][0]
            client = Client(http, card["id"], args.max_tokens, card.get("max_model_len") or 2048)
            samples: list[dict] = []
            lags: list[tuple[float, float]] = []
            print(f"soak: {card['id']} at {base}, {args.duration:g} s in cycles of {args.cycle:g} s", flush=True)
            outcomes = await drive(client, args, samples, lags, server)
            counters = await wait_idle(http, 60)
            healthy = (await http.get("/health")).status_code == 200
    finally:
        log = server.log if server else ""
        code = server.stop() if server else None
    rows = windows(outcomes, samples, args.cycle, args.duration, lags)
    result = checks(outcomes, rows, counters, log, args)
    result["healthy at the end, clean exit"] = (
        healthy and code in (None, 0),
        f"/health ok {healthy}, exit code {code}",
    )
    for r in rows:
        print(
            f"cycle {r['window']:3d} at {r['start_s']:6.0f} s: {r['requests']:4d} requests, {r['refused_503']:3d} 503, "
            f"{r['failed']} failed; ITL p50/p99 {r['itl_p50_ms'] or 0:7.1f} / {r['itl_p99_ms'] or 0:7.1f} ms "
            f"(steady p99 {r['itl_p99_steady_ms'] or 0:.1f}; client lag max {r['client_lag_max_ms'] or 0:.0f}), "
            f"TTFT p99 {r['ttft_p99_ms'] or 0:7.0f} ms; RSS server {r['rss_mb_server'] or 0:.0f} MB, "
            f"engine {r['rss_mb_engine'] or 0:.0f} MB" + (f", GPU {r['gpu_mb']:.0f} MB" if r["gpu_mb"] else "")
        )
    for name, (ok, detail) in result.items():
        print(f"[{'ok' if ok else 'FAIL'}] {name}: {detail}")
    passed = all(ok for ok, _ in result.values())
    report = {
        "config": {k: v for k, v in vars(args).items()} | {"model": client.model},
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "command": " ".join(sys.argv),
        "passed": passed,
        "checks": {k: {"ok": ok, "detail": d} for k, (ok, d) in result.items()},
        "counters_after": counters,
        "windows": rows,
        "failures": [asdict(o) | {"itl": None} for o in outcomes if not o.ok][:100],
        "memory_samples": samples,
    }
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="the model to serve (default smollm2-135m)")
    ap.add_argument("--base-url", default=None, help="soak a running server instead (no memory or log checks)")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    ap.add_argument("--cycle", type=float, default=60.0, help="seconds of one load cycle (default 60)")
    ap.add_argument("--rate", type=float, default=2.0, help="req/s while steady (default 2)")
    ap.add_argument("--burst", type=int, default=24, help="requests sent at once mid-cycle (default 24)")
    ap.add_argument("--max-tokens", type=int, default=16, help="max_tokens of most requests (default 16)")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="the server's --max-num-seqs (default 8)")
    ap.add_argument("--max-queued-requests", type=int, default=8, help="the server's flag (default 8)")
    ap.add_argument("--queue-timeout", type=float, default=20.0, help="the server's flag, seconds (default 20)")
    ap.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="one more argument for `nanoserve serve` (repeat; e.g. --server-arg=--device --server-arg=cpu)",
    )
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--sample-every", type=float, default=1.0, help="seconds between memory samples")
    ap.add_argument("--max-growth", type=float, default=0.05, help="allowed memory growth after warm-up (0.05)")
    ap.add_argument("--latency-tolerance", type=float, default=0.2, help="allowed ITL p99 change, last vs first")
    ap.add_argument(
        "--latency-phase",
        choices=sorted(LATENCY_KEYS),
        default="steady",
        help="the ITL p99 that check compares: of the steady phase before the burst (default), or the whole cycle",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-log", default=None, help="also write the server's log to this file")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--output-png", default=None)
    args = ap.parse_args(argv)
    if args.duration < 3 * args.cycle:
        raise SystemExit("--duration must hold at least three cycles (a warm-up, a first and a last)")
    stop_servers_on_term()
    report = asyncio.run(amain(args))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.output_json}")
    if args.output_png:
        plot(report, args.output_png)
        print(f"wrote {args.output_png}")
    print("soak passed" if report["passed"] else "soak FAILED")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
