"""What a gateway in front of several replicas reads from each one: /server_info, /model_info
and /v1/loads.

smg (the gateway `nanoserve serve --dp` starts, and `nanoserve router` wraps) asks every worker
for its server and model info when it registers it, and polls its load for the least_load and
power_of_two policies and its overload protection. SGLang serves the same routes; the fields
carry SGLang's names so that smg reads them as it reads SGLang's (smg ignores fields it does not
know, and the /get_* spellings are served too for older gateways).

Invariants:
- The routes need no API key, like /health: they say nothing about requests' contents, and a
  gateway probes them before it has any key of a worker.
- /v1/loads is answered from fresh engine stats (asked between two engine steps; the last known
  stats if the engine is slow to answer), so a poll never waits on a long step.
- `token_usage` counts the KV pages requests hold; pages held only by the prefix cache are free
  to reuse and do not count, as in /metrics' kv_cache_usage.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

from fastapi import FastAPI

from nanoserve import __version__


class _ThroughputMeter:
    """Generated tokens per second between two load polls (smg's `gen_throughput`)."""

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None  # (monotonic time, tokens generated so far)
        self.rate = 0.0

    def update(self, generated_tokens: float) -> float:
        now = time.monotonic()
        if self._last is not None and now > self._last[0]:
            self.rate = max(0.0, generated_tokens - self._last[1]) / (now - self._last[0])
        self._last = (now, generated_tokens)
        return self.rate


def load_snapshot(stats: dict, generated_tokens_per_s: float = 0.0) -> dict:
    """One engine's load in the fields of smg's SchedulerLoadSnapshot (and SGLang's /v1/loads)."""
    page_size = int(stats.get("page_size", 0))
    total_pages = int(stats.get("kv_pages_total", 0))
    held_pages = max(total_pages - int(stats.get("kv_pages_free", 0)) - int(stats.get("kv_pages_cached", 0)), 0)
    running = int(stats.get("requests_running", 0))
    waiting = int(stats.get("requests_waiting", 0))
    slots = int(stats.get("request_slots_total", 0))
    return {
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_total_reqs": running + waiting,
        "num_used_tokens": held_pages * page_size,
        "max_total_num_tokens": total_pages * page_size,
        "token_usage": round(held_pages / total_pages, 4) if total_pages else 0.0,
        "gen_throughput": round(generated_tokens_per_s, 2),
        "cache_hit_rate": round(float(stats.get("prefix_cache_hit_rate", 0.0)), 4),
        "utilization": round(running / slots, 4) if slots else 0.0,
        "max_running_requests": slots,
    }


def add_gateway_routes(app: FastAPI, state) -> None:
    """Mount /server_info, /model_info and /v1/loads (and their /get_* aliases) on `app`;
    `state` is the server's ServerState."""
    meter = _ThroughputMeter()

    def server_info() -> dict:
        return {
            "model_path": state.served_name,
            **state.launch,
            "served_model_name": state.served_name,
            "context_length": state.max_model_len,
            "is_embedding": state.task == "embed",
            "version": __version__,
            "dp_size": 1,  # one engine behind this server; replicas are separate servers
        }

    def model_info() -> dict:
        model_path = state.launch.get("model_path", state.served_name)
        return {
            "model_path": model_path,
            "tokenizer_path": state.launch.get("tokenizer_path", model_path),
            "is_generation": state.task == "generate",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": state.launch.get("model_type"),
        }

    async def loads() -> dict:
        stats = await state.client.fetch_stats()
        rate = meter.update(state.metrics.generated_tokens)
        return {
            "timestamp": datetime.now(timezone.utc).isoformat(),
            "version": __version__,
            "dp_rank_count": 1,
            "loads": [load_snapshot(stats, rate)],
        }

    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, server_info, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, model_info, methods=["GET"])
    app.add_api_route("/v1/loads", loads, methods=["GET"])
