"""Prometheus metrics of the API server, in a registry of its own (never the global one).

Request-level series (finish reasons, token counts, TTFT, inter-token latency, end-to-end
latency) are recorded by the request handler as tokens arrive; engine-level gauges (running and
waiting requests, KV pages, prefix-cache hit rate) are refreshed from the engine's stats on each
scrape, so /metrics shows freed pages as soon as the engine has freed them.

Every series that vLLM also exports is exported a second time under vLLM's name (`vllm:...`,
same `model_name` label, same meaning), so Grafana dashboards and the Kubernetes Gateway API
inference extension written for vLLM read nanoserve unchanged. The two copies are updated by
the same call and never disagree.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401 - re-exported for the app
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)


class _Both:
    """One update, two series (ours and vLLM's name for the same thing)."""

    def __init__(self, *children):
        self._children = children
        self.total = 0.0  # what inc() added up to (read back by /v1/loads' throughput)

    def inc(self, amount: float = 1) -> None:
        self.total += amount
        for c in self._children:
            c.inc(amount)

    def set(self, value: float) -> None:
        for c in self._children:
            c.set(value)

    def observe(self, value: float) -> None:
        for c in self._children:
            c.observe(value)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        label = {"model_name": model_name}
        r = self.registry

        def counter(name, doc, labels=()):
            return Counter(name, doc, ["model_name", *labels], registry=r)

        def gauge(name, doc):
            return Gauge(name, doc, ["model_name"], registry=r).labels(**label)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=r).labels(**label)

        self._label = label
        self._finished = counter("nanoserve_request_finished", "Finished samples by finish reason", ["finish_reason"])
        self._vllm_success = counter("vllm:request_success", "Finished requests by finish reason", ["finished_reason"])
        self._rejected = counter(
            "nanoserve_requests_rejected", "Requests answered 503 before running, by reason", ["reason"]
        )
        self.prompt_tokens = _Both(
            counter("nanoserve_prompt_tokens", "Prompt tokens processed").labels(**label),
            counter("vllm:prompt_tokens", "Number of prefill tokens processed").labels(**label),
        )
        self.generation_tokens = _Both(
            counter("nanoserve_generation_tokens", "Tokens generated").labels(**label),
            counter("vllm:generation_tokens", "Number of generation tokens processed").labels(**label),
        )
        self.ttft = _Both(
            histogram("nanoserve_time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS),
            histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token", _LATENCY_BUCKETS),
        )
        self.itl = _Both(
            histogram("nanoserve_inter_token_latency_seconds", "Time between two output tokens", _ITL_BUCKETS),
            histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency", _ITL_BUCKETS),
        )
        self.e2e = _Both(
            histogram("nanoserve_e2e_request_latency_seconds", "Request latency, arrival to end", _LATENCY_BUCKETS),
            histogram("vllm:e2e_request_latency_seconds", "Histogram of end-to-end request latency", _LATENCY_BUCKETS),
        )
        self.running = _Both(
            gauge("nanoserve_num_requests_running", "Requests being decoded/prefilled by the engine"),
            gauge("vllm:num_requests_running", "Number of requests in model execution batches"),
        )
        self.waiting = _Both(
            gauge("nanoserve_num_requests_waiting", "Requests queued in the engine"),
            gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed"),
        )
        self.in_flight = gauge("nanoserve_server_requests_in_flight", "Engine requests the API server is tracking")
        self.queued = gauge(
            "nanoserve_server_requests_queued", "Engine requests submitted and not yet admitted by the scheduler"
        )
        self.slots_total = gauge("nanoserve_request_slots_total", "Request slots of the engine (max_num_seqs)")
        self.slots_free = gauge("nanoserve_request_slots_free", "Request slots no request holds")
        self.kv_total = gauge("nanoserve_kv_cache_pages_total", "KV cache pages")
        self.kv_free = gauge("nanoserve_kv_cache_pages_free", "KV cache pages free")
        self.kv_cached = gauge("nanoserve_kv_cache_pages_cached", "KV cache pages held only by the prefix cache")
        self.kv_in_use = gauge("nanoserve_kv_cache_pages_in_use", "KV cache pages held by requests")
        # vLLM's kv_cache_usage_perc is a fraction in [0, 1] despite its name; so is ours.
        self.kv_usage = _Both(
            gauge("nanoserve_kv_cache_usage_ratio", "Fraction of KV cache pages held by requests"),
            gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage"),
        )
        self.prefix_hit_rate = gauge("nanoserve_prefix_cache_hit_rate", "Prefix cache hit tokens / query tokens")
        self.prefix_queries = gauge(
            "nanoserve_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_hits = gauge("nanoserve_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache")
        # Speculative decoding (engine counters under vLLM's names; exported when it is on).
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts").labels(**label)
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens").labels(**label)
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens").labels(
            **label
        )
        self.spec_accepted_per_pos = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position", ["position"]
        )
        self._spec_seen: dict[str, object] = {}  # the engine's last counter values
        for reason in ("stop", "length", "abort"):  # export zeros from the start
            self._finished.labels(finish_reason=reason, **label)
            self._vllm_success.labels(finished_reason=reason, **label)
        for reason in ("queue_full", "queue_timeout"):
            self._rejected.labels(reason=reason, **label)

    @property
    def generated_tokens(self) -> float:
        return self.generation_tokens.total

    def finished(self, reason: str) -> None:
        self._finished.labels(finish_reason=reason, **self._label).inc()
        self._vllm_success.labels(finished_reason=reason, **self._label).inc()

    def rejected(self, reason: str) -> None:
        """A request refused with 503 before it ran: queue_full or queue_timeout."""
        self._rejected.labels(reason=reason, **self._label).inc()

    def update_engine(self, stats: dict, in_flight: int, queued: int = 0) -> None:
        total = int(stats.get("kv_pages_total", 0))
        free = int(stats.get("kv_pages_free", 0))
        cached = int(stats.get("kv_pages_cached", 0))
        # Pages the prefix cache holds can be evicted at any time: they are not "in use".
        in_use = max(total - free - cached, 0)
        self.kv_total.set(total)
        self.kv_free.set(free)
        self.kv_cached.set(cached)
        self.kv_in_use.set(in_use)
        self.kv_usage.set(in_use / total if total else 0.0)
        self.slots_total.set(int(stats.get("request_slots_total", 0)))
        self.slots_free.set(int(stats.get("request_slots_free", 0)))
        self.running.set(int(stats.get("requests_running", 0)))
        self.waiting.set(int(stats.get("requests_waiting", 0)))
        self.in_flight.set(in_flight)
        self.queued.set(queued)
        queries = int(stats.get("prefix_cache_query_tokens", 0))
        hits = int(stats.get("prefix_cache_hit_tokens", 0))
        self.prefix_queries.set(queries)
        self.prefix_hits.set(hits)
        self.prefix_hit_rate.set(hits / queries if queries else 0.0)
        if "vllm:spec_decode_num_drafts" in stats:
            self._update_speculative(stats)

    def _update_speculative(self, stats: dict) -> None:
        """Advance the speculative counters by what the engine's cumulative counts grew."""
        seen = self._spec_seen
        for name, series in (
            ("vllm:spec_decode_num_drafts", self.spec_drafts),
            ("vllm:spec_decode_num_draft_tokens", self.spec_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", self.spec_accepted),
        ):
            value = int(stats[name])
            series.inc(max(0, value - int(seen.get(name, 0))))
            seen[name] = value
        per_pos = list(stats["vllm:spec_decode_num_accepted_tokens_per_pos"])
        before = seen.get("per_pos", [0] * len(per_pos))
        for pos, (now, then) in enumerate(zip(per_pos, before)):
            self.spec_accepted_per_pos.labels(position=str(pos), **self._label).inc(max(0, now - then))
        seen["per_pos"] = per_pos

    def render(self) -> bytes:
        return generate_latest(self.registry)
