"""`nanoserve bench serve`: load a running OpenAI-compatible server and measure latency and throughput.

Sends streaming /v1/completions requests at a Poisson request rate (or all at once, `inf`),
optionally capped at a fixed concurrency, from a random dataset (token-id prompts of a given
input length, `ignore_eos` outputs of a given length) or a ShareGPT-format JSON file. Per
request it records time to first token (TTFT), inter-token latencies (ITL, between streamed
chunks), time per output token (TPOT, (e2e - TTFT) / (output tokens - 1)) and end-to-end
latency; it reports mean/p50/p90/p99 of each plus request and token throughput. Several rates
(`--request-rate 4,8,16,32,inf`) make a sweep; `--output-png` then draws the latency curves
(or later, without a server: `--plot-from RESULT.json --output-png PLOT.png`).

`--dataset-name multiturn` runs conversations instead: `--num-conversations` of them at once,
each `--turns` turns long, every turn's prompt the conversation so far (a text opening of about
`--random-input-len` words, then each question and the answer the server gave) plus a new
question, sent when the previous answer has arrived. It reports the prefix-cache hit rate
(cached prompt tokens from `usage`, over all prompt tokens) beside TTFT: the workload that
tells cache-aware routing across replicas from round robin.

`--goodput TTFT_MS,TPOT_MS` adds each rate's SLO attainment (the share of requests, failed ones
included, with TTFT and TPOT both within the bounds) and the goodput rate: the highest request
rate up to which at least 90% of requests attain both. It is found by a sweep: the listed rates
first, then `--goodput-steps` bisections between the highest passing and the lowest failing
finite rate (assuming attainment falls as the rate grows).

Flags follow `vllm bench serve` where it has one (--base-url or --host/--port, --model,
--dataset-name, --num-prompts, --request-rate, --max-concurrency, --random-input-len,
--random-output-len, --random-range-ratio, --seed, --save-result with --result-dir and
--result-filename); --output-json and --dataset are the older names of the same things.
`benchmarks/serving.py` runs this module too.

Needs only aiohttp (and matplotlib for the PNG): `pip install nanoserve[bench]`. Output token
counts come from the server's `usage` (stream_options.include_usage); ShareGPT lengths are
measured with the server's /tokenize endpoint, so no tokenizer is needed here.

    nanoserve bench serve --base-url http://127.0.0.1:8000 --dataset-name random \
        --random-input-len 1024 --random-output-len 256 --num-prompts 200 \
        --request-rate 4,8,16,32,inf --output-json serving.json --output-png serving.png \
        --goodput 500,25

On one H200 (benchmarks/results/2026-11-26.md, 957c4b6): dummy llama-3.1-8b, 1024 in / 256 out, 200
prompts: at 16 req/s ITL p99 63.7 ms and TTFT p99 1,209 ms; all at once 6,007 output tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

try:
    import aiohttp
except ImportError:  # the bench extra; `nanoserve bench serve` says so when it runs
    aiohttp = None

from nanoserve.heap import GcPauseWatch, freeze_startup_heap

logger = logging.getLogger("nanoserve.bench")


@dataclass
class RequestSpec:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    chunks: int = 0  # streamed chunks received before the end (or the failure)
    connection: str = ""  # "pooled" or "new": how the request went out (aiohttp's trace)
    cached_tokens: int = 0  # prompt tokens the server found in its prefix cache (usage)
    text: str = ""  # the streamed answer (a multi-turn conversation sends it back as history)


# ------------------------------------------------------------------------------------------ datasets


_WORDS = [
    "river", "stone", "garden", "market", "winter", "harbour", "lantern", "orchard", "bridge", "meadow",
    "copper", "signal", "valley", "forest", "engine", "window", "letter", "silver", "thunder", "island",
    "castle", "pepper", "candle", "mirror", "shadow", "ladder", "basket", "feather", "planet", "rocket",
    "violin", "pocket", "marble", "cotton", "ticket", "dragon", "falcon", "tunnel", "canyon", "saddle",
    "anchor", "needle"
]  # fmt: skip


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def random_dataset(
    n: int, input_len: int, output_len: int, range_ratio: float, vocab: int, seed: int, text: bool = False
):
    """Token-id prompts of about input_len tokens, or with `text` prompts of input_len random
    words (for gateways that take only text prompts, as smg does)."""
    rng = random.Random(seed)

    def length(mean: int) -> int:
        lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
        return rng.randint(lo, hi)

    specs = []
    for _ in range(n):
        ilen, olen = length(input_len), length(output_len)
        if text:
            specs.append(RequestSpec(_words(rng, ilen), ilen, olen))
            continue
        # Skip the lowest ids: they are often special tokens (BOS/EOS/pad) in real vocabularies.
        ids = [rng.randrange(min(1000, vocab // 2), vocab) for _ in range(ilen)]
        specs.append(RequestSpec(ids, ilen, olen))
    return specs


def _read_json(path: str):
    with open(path) as f:
        return json.load(f)


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


async def sharegpt_dataset(session, base: str, path: str, n: int, max_len: int, seed: int, fixed_output: int | None):
    data = _read_json(path)
    pairs = []
    for item in data:
        conv = item.get("conversations") or item.get("conversation") or []
        if len(conv) >= 2 and conv[0].get("value") and conv[1].get("value"):
            pairs.append((conv[0]["value"], conv[1]["value"]))
    random.Random(seed).shuffle(pairs)
    specs = []
    for prompt, answer in pairs:
        if len(specs) >= n:
            break
        plen = await _count_tokens(session, base, prompt)
        olen = fixed_output or await _count_tokens(session, base, answer)
        if plen < 4 or olen < 4 or plen + olen > max_len:
            continue  # too short to measure, or does not fit the context
        specs.append(RequestSpec(prompt, plen, olen))
    if len(specs) < n:
        print(f"warning: only {len(specs)} usable conversations in {path}", file=sys.stderr)
    return specs


async def _count_tokens(session, base: str, text: str) -> int:
    async with session.post(f"{base}/tokenize", json={"prompt": text}) as resp:
        if resp.status != 200:
            raise SystemExit(f"/tokenize failed ({resp.status}): {await resp.text()}")
        return (await resp.json())["count"]


# ------------------------------------------------------------------------------------------ requests


def connection_tracer() -> aiohttp.TraceConfig:
    """Marks each request's trace context with whether it went out on a pooled or a new connection."""
    trace = aiohttp.TraceConfig()

    async def pooled(session, ctx, params):
        if ctx.trace_request_ctx is not None:
            ctx.trace_request_ctx["connection"] = "pooled"

    async def new(session, ctx, params):
        if ctx.trace_request_ctx is not None:
            ctx.trace_request_ctx["connection"] = "new"

    trace.on_connection_reuseconn.append(pooled)
    trace.on_connection_create_end.append(new)
    return trace


def failure_cause(res: RequestResult) -> str:
    """Why a request failed, as far as the client can tell (printed beside each failure)."""
    where = f"after {res.chunks} streamed chunks" if res.chunks else "before any response byte"
    if res.error.startswith(("ServerDisconnectedError", "ClientOSError")) and not res.chunks:
        if res.connection == "pooled":
            return f"{where}, on a pooled connection: the server closed it idle as the request went out (keep-alive)"
        return f"{where}, on a {res.connection or 'new'} connection: the server or the network closed it"
    return where


async def send(session, base: str, model: str, spec: RequestSpec, temperature: float) -> RequestResult:
    body = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.output_len,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = RequestResult(prompt_len=spec.prompt_len)
    res.start = start = time.perf_counter()
    last = None
    ctx: dict = {}
    try:
        async with session.post(f"{base}/v1/completions", json=body, trace_request_ctx=ctx) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                now = time.perf_counter()
                res.chunks += 1
                if chunk.get("choices"):
                    res.text += chunk["choices"][0].get("text") or ""
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.prompt_len = chunk["usage"]["prompt_tokens"]
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens") or 0
        res.e2e = time.perf_counter() - start
        res.ok = last is not None
        if not res.ok:
            res.error = "no tokens received"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        res.connection = ctx.get("connection", "")
    return res


async def run_rate(session, base, model, specs, rate: float, max_concurrency: int | None, temperature, seed):
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(spec):
        if sem is None:
            return await send(session, base, model, spec, temperature)
        async with sem:
            return await send(session, base, model, spec, temperature)

    tasks = []
    t0 = time.perf_counter()
    for spec in specs:
        tasks.append(asyncio.create_task(one(spec)))
        if math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0, t0


async def run_conversations(session, base, model, args, temperature, seed: int):
    """`--num-conversations` conversations at once, each `--turns` turns: every prompt is the
    conversation so far plus a new question, sent when the previous answer has arrived."""
    rng = random.Random(seed)
    openings = [
        f"Conversation {c}. Notes: {_words(rng, args.random_input_len)}." for c in range(args.num_conversations)
    ]

    async def conversation(history: str, crng: random.Random) -> list[RequestResult]:
        out = []
        for _turn in range(args.turns):
            history += f"\nUser: tell me about the {_words(crng, 6)}.\nAssistant:"
            res = await send(session, base, model, RequestSpec(history, 0, args.random_output_len), temperature)
            out.append(res)
            if not res.ok:
                break  # the rest of this conversation has no history to build on
            history += res.text
        return out

    t0 = time.perf_counter()
    runs = await asyncio.gather(*(conversation(o, random.Random(seed * 1000 + i)) for i, o in enumerate(openings)))
    return [r for run in runs for r in run], time.perf_counter() - t0, t0


# ------------------------------------------------------------------------------------------ stats


def _pcts(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    xs = sorted(v * scale for v in values)

    def pct(q):
        k = (len(xs) - 1) * q
        lo, hi = math.floor(k), math.ceil(k)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return {"mean": statistics.fmean(xs), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


def summarize(rate: float, results: list[RequestResult], duration: float, max_concurrency, t0: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "request_rate": "inf" if math.isinf(rate) else rate,
        "max_concurrency": max_concurrency,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors[:5],
        # every failed request: when it was sent, what the client saw, and where it broke
        "failures": [
            {"sent_s": round(r.start - t0, 4), "error": r.error, "cause": failure_cause(r)} for r in results if not r.ok
        ],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "prefix_hit_rate": sum(r.cached_tokens for r in ok) / in_tokens if in_tokens else 0.0,
        "ttft_ms": _pcts([r.ttft for r in ok]),
        "tpot_ms": _pcts(tpot),
        "itl_ms": _pcts([x for r in ok for x in r.itl]),
        "e2e_ms": _pcts([r.e2e for r in ok]),
        # per request (seconds from the run's start, ms): where in the run a latency tail sits
        "requests": [
            {
                "sent_s": round(r.start - t0, 4),
                "ttft_ms": round(r.ttft * 1e3, 2),
                "e2e_ms": round(r.e2e * 1e3, 2),
                "max_itl_ms": round(max(r.itl, default=0.0) * 1e3, 2),
            }
            for r in ok
        ],
    }


GOODPUT_SHARE = 0.9  # the share of requests that must attain the SLO for a rate to count


def tpot_s(r: RequestResult) -> float | None:
    return (r.e2e - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def slo_attainment(results: list[RequestResult], ttft_ms: float, tpot_ms: float) -> float:
    """The share of all requests (failed ones count as missing) within both bounds; a
    one-token answer has no TPOT and is judged by its TTFT alone."""

    def good(r: RequestResult) -> bool:
        tpot = tpot_s(r)
        return r.ok and r.ttft * 1000 <= ttft_ms and (tpot is None or tpot * 1000 <= tpot_ms)

    return sum(map(good, results)) / len(results) if results else 0.0


def goodput_bounds(summaries: list[dict]) -> tuple[float, float | None]:
    """(highest rate such that it and every lower rate measured passed, 0.0 if none;
    lowest failing rate or None). Rates are numbers, math.inf for 'all at once'."""
    passed, failed = 0.0, None
    for s in sorted(summaries, key=_rate):
        if s["slo_attainment"] >= GOODPUT_SHARE and failed is None:
            passed = _rate(s)
        elif s["slo_attainment"] < GOODPUT_SHARE and failed is None:
            failed = _rate(s)
    return passed, failed


def _rate(s: dict) -> float:
    return math.inf if s["request_rate"] == "inf" else float(s["request_rate"])


def goodput_line(g: dict) -> str:
    slo = f"TTFT <= {g['ttft_ms']:g} ms and TPOT <= {g['tpot_ms']:g} ms"
    share = f"{GOODPUT_SHARE:.0%} of requests"
    if g["rate"] == 0:
        return f"goodput: fewer than {share} meet {slo} even at {g['first_failing_rate']} req/s"
    if g["first_failing_rate"] is None:
        return f"goodput: {share} meet {slo} at every rate measured, up to {g['rate']} req/s"
    return f"goodput: {share} meet {slo} up to {g['rate']:.2f} req/s (fewer at {g['first_failing_rate']} req/s)"


def print_summary(s: dict) -> None:
    print(f"---- request rate {s['request_rate']} (max concurrency {s['max_concurrency']}) ----")
    print(f"completed {s['completed']}  failed {s['failed']}  duration {s['duration_s']:.2f} s")
    for f in s.get("failures", []):
        print(f"  failed (sent at {f['sent_s']:.2f} s): {f['error']} -- {f['cause']}")
    print(
        f"request throughput {s['request_throughput']:.2f} req/s, output {s['output_throughput']:.1f} tok/s, "
        f"total {s['total_token_throughput']:.1f} tok/s, prefix-cache hits {s.get('prefix_hit_rate', 0.0):.1%}"
    )
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        v = s[key]
        if v["mean"] is None:
            continue
        print(f"{key:8s} mean {v['mean']:9.2f}  p50 {v['p50']:9.2f}  p90 {v['p90']:9.2f}  p99 {v['p99']:9.2f}")
    if "slo_attainment" in s:
        print(f"SLO attainment {s['slo_attainment']:.1%}")
    slowest = sorted(s["requests"], key=lambda r: -r["ttft_ms"])[:5]
    if slowest:
        print("slowest TTFT: " + ", ".join(f"{r['ttft_ms']:.0f} ms (sent at {r['sent_s']:.2f} s)" for r in slowest))


def plot(summaries: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = sorted(summaries, key=_rate)  # goodput bisection runs come after the listed rates
    labels = [str(s["request_rate"]) for s in summaries]
    xs = list(range(len(summaries)))
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [
        ("ttft_ms", "time to first token (ms)"),
        ("itl_ms", "inter-token latency (ms)"),
        ("e2e_ms", "end-to-end latency (ms)"),
    ]
    for ax, (key, name) in zip(axes.flat, panels):
        for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(xs, [s[key][q] for s in summaries], style, label=q)
        ax.set_title(name)
        ax.set_xticks(xs, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax = axes.flat[3]
    ax.plot(xs, [s["output_throughput"] for s in summaries], "o-")
    ax.set_title("output throughput (tok/s)")
    ax.set_xticks(xs, labels)
    ax.set_xlabel("request rate (req/s)")
    ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ------------------------------------------------------------------------------------------ main


def _title(report: dict) -> str:
    if report["dataset"] == "random":
        return f"{report['model']}: random, input {report['random_input_len']} / output {report['random_output_len']}"
    return f"{report['model']}: {report['dataset']}"


def parse_goodput(text: str) -> tuple[float, float]:
    try:
        ttft_ms, tpot_ms = (float(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"--goodput takes TTFT_MS,TPOT_MS (e.g. 500,25), got {text!r}") from None
    if ttft_ms <= 0 or tpot_ms <= 0:
        raise SystemExit(f"--goodput bounds must be positive, got {text!r}")
    return ttft_ms, tpot_ms


def parse_rates(text: str) -> list[float]:
    return [math.inf if r.strip() in ("inf", "infinite") else float(r) for r in text.split(",")]


async def amain(args) -> int:
    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    # No client-side cap: the benchmark sets the load. By default a new connection per request,
    # so that no server's keep-alive timeout can close one as a request goes out on it (at
    # uvicorn's default of 5 s that failed 1 and 3 of 200 requests in two sweeps, 2026-11-26,
    # ServerDisconnectedError; benchmarks/results/2026-11-28.md). --pooled-connections
    # keeps them as clients do, each idle at most --pool-idle seconds.
    if args.pooled_connections:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=args.pool_idle)
    else:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(
        headers=headers, timeout=timeout, connector=connector, trace_configs=[connection_tracer()]
    ) as session:
        async with session.get(f"{base}/v1/models") as resp:
            if resp.status != 200:
                raise SystemExit(f"GET /v1/models failed ({resp.status}): {await resp.text()}")
            card = (await resp.json())["data"][0]
        model = args.model or card["id"]
        vocab = args.vocab_size or card.get("vocab_size") or 32000
        max_len = card.get("max_model_len") or 10**9

        def random_specs(seed: int) -> list[RequestSpec]:
            return random_dataset(
                args.num_prompts,
                args.random_input_len,
                args.random_output_len,
                args.random_range_ratio,
                vocab,
                seed,
                args.random_text,
            )

        if args.dataset == "random":
            specs = random_specs(args.seed)
        elif args.dataset == "multiturn":
            specs = [RequestSpec("Hello, a warm-up.", 0, args.random_output_len)]
        else:
            if not args.dataset_path:
                raise SystemExit("--dataset sharegpt needs --dataset-path FILE.json")
            specs = await sharegpt_dataset(
                session, base, args.dataset_path, args.num_prompts, max_len, args.seed, args.sharegpt_output_len
            )

        # Warm up (first requests pay one-time costs: allocation, compilation, graph capture).
        warm = RequestSpec(specs[0].prompt, specs[0].prompt_len, min(16, specs[0].output_len))
        for _ in range(args.warmup):
            r = await send(session, base, model, warm, args.temperature)
            if not r.ok:
                raise SystemExit(f"warm-up request failed: {r.error}")

        # The client's own full collections would show as inter-token gaps: keep its startup
        # heap out of them (nanoserve/heap.py), and report any long one.
        freeze_startup_heap(logger, "benchmark client")
        gc_watch = GcPauseWatch(logger).install()
        report = {
            "base_url": base,
            "model": model,
            "dataset": args.dataset,
            "dataset_path": args.dataset_path,
            "num_prompts": len(specs) if args.dataset != "multiturn" else args.num_conversations * args.turns,
            "num_conversations": args.num_conversations if args.dataset == "multiturn" else None,
            "turns": args.turns if args.dataset == "multiturn" else None,
            "random_input_len": args.random_input_len if args.dataset == "random" else None,
            "random_output_len": args.random_output_len if args.dataset == "random" else None,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv),
            "results": [],
        }
        summaries = report["results"]
        slo = parse_goodput(args.goodput) if args.goodput else None

        async def measure(i: int, rate: float) -> None:
            nonlocal specs
            if args.dataset == "random":
                # Fresh prompts per rate: reusing them would turn later rates into prefix-cache hits.
                specs = random_specs(args.seed + 1 + i)
            if args.dataset == "multiturn":
                # Fresh conversations per rate, for the same reason.
                results, duration, t0 = await run_conversations(
                    session, base, model, args, args.temperature, args.seed + i
                )
            else:
                results, duration, t0 = await run_rate(
                    session, base, model, specs, rate, args.max_concurrency, args.temperature, args.seed
                )
            summary = summarize(rate, results, duration, args.max_concurrency, t0)
            if slo is not None:
                summary["slo_attainment"] = slo_attainment(results, *slo)
            print_summary(summary)
            summaries.append(summary)
            if args.output_json:  # after every rate, so a sweep cut short keeps what it measured
                _write_json(args.output_json, report)

        rates = parse_rates(args.request_rate)
        for i, rate in enumerate(rates):
            await measure(i, rate)
        if slo is not None:
            for step in range(args.goodput_steps):
                lo, hi = goodput_bounds(summaries)
                if hi is None or math.isinf(hi):
                    break  # nothing failed, or only 'all at once': no finite bracket to narrow
                await measure(len(rates) + step, round((lo + hi) / 2, 3))
            lo, hi = goodput_bounds(summaries)
            report["goodput"] = {
                "ttft_ms": slo[0],
                "tpot_ms": slo[1],
                "share": GOODPUT_SHARE,
                "rate": "inf" if math.isinf(lo) else lo,
                "first_failing_rate": None if hi is None else ("inf" if math.isinf(hi) else hi),
            }
            print(goodput_line(report["goodput"]))
            if args.output_json:
                _write_json(args.output_json, report)

        gc_watch.remove()
        young, middle, full = gc_watch.counts
        print(
            f"client garbage collections: {young} / {middle} / {full} of generations 0 / 1 / 2, "
            f"longest {gc_watch.longest_s * 1e3:.1f} ms"
        )
    if args.output_json:
        print(f"wrote {args.output_json}")
    if args.output_png:
        plot(summaries, args.output_png, _title(report))
        print(f"wrote {args.output_png}")
    return 0 if all(s["failed"] == 0 for s in summaries) else 1


def add_serve_args(ap: argparse.ArgumentParser) -> None:
    """The flags of `nanoserve bench serve` (and of benchmarks/serving.py)."""
    ap.add_argument("--base-url", default=None, help="the server (default: http://HOST:PORT)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument(
        "--dataset-name", "--dataset", dest="dataset", choices=["random", "sharegpt", "multiturn"], default="random"
    )
    ap.add_argument("--num-conversations", type=int, default=32, help="multiturn: conversations at once")
    ap.add_argument("--turns", type=int, default=8, help="multiturn: turns per conversation")
    ap.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file")
    ap.add_argument("--sharegpt-output-len", type=int, default=None, help="override the reference answer lengths")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--random-input-len", type=int, default=1024)
    ap.add_argument("--random-output-len", type=int, default=256)
    ap.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in mean*(1±ratio)")
    ap.add_argument("--vocab-size", type=int, default=None, help="token id range for random prompts")
    ap.add_argument(
        "--random-text",
        action="store_true",
        help="random: prompts of random words instead of token ids (smg accepts only text prompts)",
    )
    ap.add_argument("--request-rate", default="inf", help="req/s, comma-separated for a sweep; inf = all at once")
    ap.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    ap.add_argument(
        "--pooled-connections",
        action="store_true",
        help="reuse keep-alive connections as clients do (default: a new connection per request)",
    )
    ap.add_argument(
        "--pool-idle",
        type=float,
        default=15.0,
        help="with --pooled-connections: seconds a pooled connection may idle (aiohttp's default 15); keep it "
        "below the server's keep-alive timeout",
    )
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--warmup", type=int, default=1, help="warm-up requests before measuring")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None, help="write the report here (after every rate)")
    ap.add_argument("--save-result", action="store_true", help="write the report to --result-dir/--result-filename")
    ap.add_argument("--result-dir", default=".", help="where --save-result writes (default: here)")
    ap.add_argument(
        "--result-filename", default=None, help="--save-result's file name (default: serve-MODEL-DATE.json)"
    )
    ap.add_argument("--output-png", default=None)
    ap.add_argument(
        "--goodput",
        default=None,
        metavar="TTFT_MS,TPOT_MS",
        help=f"SLO bounds: report each rate's attainment and the rate up to which {GOODPUT_SHARE:.0%} attain both",
    )
    ap.add_argument("--goodput-steps", type=int, default=3, help="bisection runs that narrow the goodput rate")
    ap.add_argument(
        "--plot-from",
        default=None,
        metavar="JSON",
        help="only draw --output-png from a JSON this command wrote (no server needed)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark for parsed `add_serve_args` flags."""
    if args.plot_from:
        with open(args.plot_from) as f:
            report = json.load(f)
        plot(report["results"], args.output_png or args.plot_from.removesuffix(".json") + ".png", _title(report))
        return 0
    if aiohttp is None:
        raise SystemExit("nanoserve bench serve needs aiohttp: pip install 'nanoserve[bench]'")
    if args.base_url is None:
        host = f"[{args.host}]" if ":" in args.host else args.host
        args.base_url = f"http://{host}:{args.port}"
    if args.save_result and args.output_json is None:
        name = (
            args.result_filename
            or f"serve-{(args.model or 'model').replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        )
        args.output_json = str(Path(args.result_dir) / name)
    return asyncio.run(amain(args))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_args(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
