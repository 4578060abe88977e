"""A pooled connection reused at the server's keep-alive edge (CPU; any running server).

Each trial opens its own aiohttp pool (one connection, aiohttp's default idle expiry of 15 s),
sends a one-token completion, leaves the connection idle for `--idle` seconds plus an offset
drawn from +-`--spread-ms`, then sends a second completion on the same pool. A server whose
keep-alive timeout is about `--idle` closes some of those connections just as the second
request goes out: aiohttp reports ServerDisconnectedError, and the server logs nothing. Trials
run `--parallel` at a time. Printed: outcomes by kind, whether the second request reused the
connection, and the failures by offset.

    nanoserve serve smollm2-135m --device cpu --port 8321 --timeout-keep-alive 5 &
    python benchmarks/probes/keepalive_race.py --base-url http://127.0.0.1:8321 --idle 5

Finding (CPU, 2026-11-28, benchmarks/results/2026-11-28.md): at uvicorn's default of 5 s, the
second requests failed with ServerDisconnectedError in a window of about a millisecond after
the server's timeout; idle longer than that, aiohttp saw the close first and opened a new
connection. With the server's keep-alive above the pool's expiry, none failed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import time

import aiohttp


async def completion(session: aiohttp.ClientSession, base: str, ctx: dict) -> None:
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 1, "temperature": 0.0}
    async with session.post(f"{base}/v1/completions", json=body, trace_request_ctx=ctx) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}")


def tracer() -> aiohttp.TraceConfig:
    """Marks each request's context with whether it went out on a pooled or a new connection."""
    trace = aiohttp.TraceConfig()

    async def reused(session, tctx, params):
        tctx.trace_request_ctx["reused"] = True

    async def created(session, tctx, params):
        tctx.trace_request_ctx["reused"] = False

    trace.on_connection_reuseconn.append(reused)
    trace.on_connection_create_end.append(created)
    return trace


async def trial(base: str, idle_s: float, offset_s: float) -> dict:
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector, trace_configs=[tracer()]) as session:
        await completion(session, base, {})
        await asyncio.sleep(idle_s + offset_s)
        ctx: dict = {}
        try:
            await completion(session, base, ctx)
            outcome = "ok"
        except (aiohttp.ClientError, RuntimeError) as exc:
            outcome = type(exc).__name__
    return {"offset_ms": offset_s * 1e3, "outcome": outcome, "reused": ctx.get("reused")}


async def amain(args) -> None:
    rng = random.Random(args.seed)
    results = []
    t0 = time.perf_counter()
    for start in range(0, args.trials, args.parallel):
        n = min(args.parallel, args.trials - start)
        offsets = [rng.uniform(-args.spread_ms, args.spread_ms) / 1e3 for _ in range(n)]
        results += await asyncio.gather(*(trial(args.base_url, args.idle, off) for off in offsets))
    print(f"{len(results)} trials, idle {args.idle:g} s +- {args.spread_ms:g} ms, {time.perf_counter() - t0:.0f} s")
    counts = collections.Counter((r["outcome"], r["reused"]) for r in results)
    for (outcome, reused), k in sorted(counts.items(), key=lambda kv: -kv[1]):
        how = {True: "pooled connection", False: "new connection", None: "connection unknown"}[reused]
        print(f"  {outcome:28s} {how:20s} {k}")
    failed = sorted(r["offset_ms"] for r in results if r["outcome"] != "ok")
    if failed:
        print(
            f"failures at offsets (ms) {failed[0]:+.2f} .. {failed[-1]:+.2f}: " + " ".join(f"{x:+.2f}" for x in failed)
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--idle", type=float, default=5.0, help="seconds between the two requests (about the keep-alive)")
    ap.add_argument("--spread-ms", type=float, default=5.0, help="offsets drawn uniformly from +-this")
    ap.add_argument("--trials", type=int, default=400)
    ap.add_argument("--parallel", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    asyncio.run(amain(ap.parse_args()))


if __name__ == "__main__":
    main()
