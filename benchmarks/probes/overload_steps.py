"""Serving above capacity without HTTP: Poisson arrivals into the engine's step loop, every step
traced, to find which steps make the inter-token latency tail.

Builds `LLMEngine` as the server does (its config, so the mixed policy's serving budget) and
runs the loop of the server's engine process: requests are added when their arrival time has
come, and the engine steps while it has work. A token counts as delivered when the step that
returned it ends. Recorded per step: its wall time, decode rows, prompt tokens, queue and
running lengths, and whether the scheduler was in a burst or had grown the step. Printed: ITL
and TTFT percentiles (as a streaming client would see them, less HTTP), the number of steps over
`--itl-bound`, and the queue's length over time. `--burst-start`,
`--burst-end`, `--growth` and `--drain-steps` override the scheduler's constants, and
`--burst-max-running` tries a rule (no burst step while more than N requests decode);
`--max-queued` refuses arrivals while that many wait, as the server's --max-queued-requests
does. `--variants` runs several such settings (and `--num-prompts` several lengths) on one
engine, one after the other: the same arrivals for each, other prompts (no prefix-cache hits).

    python benchmarks/probes/overload_steps.py --model llama-3.1-8b --rate 32 --num-prompts 300
    python benchmarks/probes/overload_steps.py --num-prompts 300 600 --variants "default|--burst-start 2|--growth 1.5"
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, run from anywhere

from nanoserve import SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.scheduler import scheduler as sched_mod


@dataclass
class StepTrace:
    t: float  # seconds since the first arrival, at the step's end
    ms: float  # the step call's wall time
    decodes: int  # decode rows
    prompt_tokens: int  # prompt tokens computed
    waiting: int  # before the step
    running: int
    bursting: bool  # the scheduler's burst rule gave this step the prefill budget
    grown: bool  # a mixed step allowed more than the mixed budget because prompts queue


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else float("nan")


def traced(engine: LLMEngine, steps: list[StepTrace]):
    """Wrap the scheduler's schedule() (and the mixed step's size) to note each batch's make-up;
    the step's end fills in t and ms."""
    sched = engine.scheduler
    plain, sized = sched.schedule, sched.mixed_step_tokens
    last: dict[str, int] = {}

    def mixed_step_tokens() -> int:
        last["tokens"] = sized()
        return last["tokens"]

    def schedule():
        waiting, running = len(sched.waiting), len(sched.running)
        last.clear()
        batch = plain()
        if batch is not None:
            tokens = last.get("tokens", 0)  # 0: not a mixed step
            bursting = tokens >= sched.chunk_budget > (sched.mixed_budget or 0)
            grown = not bursting and tokens > (sched.mixed_budget or 0)
            decodes = batch.num_decodes if not batch.is_decode else len(batch.requests)
            steps.append(StepTrace(0.0, 0.0, decodes, batch.num_tokens - decodes, waiting, running, bursting, grown))
        return batch

    sched.mixed_step_tokens = mixed_step_tokens
    sched.schedule = schedule


def limit_bursts(engine: LLMEngine, max_running: int) -> None:
    """A candidate rule, tried without changing the scheduler: a burst step (the prefill budget)
    only while at most `max_running` requests decode; above, the step is sized as if no burst."""
    sched = engine.scheduler
    plain = sched.mixed_step_tokens

    def mixed_step_tokens() -> int:
        if sched.bursting and len(sched.running) > max_running:
            sched.bursting = False
            try:
                return plain()
            finally:
                sched.bursting = True
        return plain()

    sched.mixed_step_tokens = mixed_step_tokens


def run(engine: LLMEngine, args, v: argparse.Namespace, num_prompts: int, vocab: int, prompt_seed: int) -> dict:
    rng = random.Random(args.seed)
    arrivals, t = [], 0.0
    for i in range(num_prompts):
        arrivals.append(t)
        t += rng.expovariate(args.rate)
    rng = random.Random(args.seed + prompt_seed)
    prompts = [[rng.randrange(vocab // 4, vocab) for _ in range(args.input_len)] for _ in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    steps: list[StepTrace] = []
    traced(engine, steps)
    arrived: dict[str, float] = {}
    token_times: dict[str, list[float]] = {}
    refused = 0
    nxt = 0
    start = time.perf_counter()
    while nxt < len(arrivals) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while nxt < len(arrivals) and arrivals[nxt] <= now:
            if v.max_queued is not None and len(engine.scheduler.waiting) >= v.max_queued:
                refused += 1
            else:
                rid = f"r{prompt_seed}-{nxt}"
                engine.add_request(rid, prompts[nxt], params)
                arrived[rid] = arrivals[nxt]
                token_times[rid] = []
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[nxt] - (time.perf_counter() - start)))
            continue
        before = len(steps)
        t0 = time.perf_counter()
        updates = engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        end = time.perf_counter()
        if len(steps) > before:
            steps[-1].t, steps[-1].ms = end - start, (end - t0) * 1e3
        for u in updates:
            if u.new_token_ids:
                token_times[u.request_id].extend([end - start] * len(u.new_token_ids))
    engine.check_invariants()
    itl = [b - a for ts in token_times.values() for a, b in itertools.pairwise(ts)]
    ttft = [ts[0] - arrived[rid] for rid, ts in token_times.items() if ts]
    return {"steps": steps, "itl": itl, "ttft": ttft, "refused": refused, "duration": time.perf_counter() - start}


def report(res: dict, bound_ms: float) -> None:
    itl_ms = [x * 1e3 for x in res["itl"]]
    ttft_ms = [x * 1e3 for x in res["ttft"]]
    steps: list[StepTrace] = res["steps"]
    print(f"{len(res['ttft'])} requests served, {res['refused']} refused, {res['duration']:.1f} s, {len(steps)} steps")
    print(
        f"ITL  p50 {pct(itl_ms, 0.5):7.1f}  p90 {pct(itl_ms, 0.9):7.1f}  p99 {pct(itl_ms, 0.99):7.1f} ms"
        f"   ({sum(x > bound_ms for x in itl_ms)} of {len(itl_ms)} gaps over {bound_ms:g} ms)"
    )
    print(f"TTFT p50 {pct(ttft_ms, 0.5):7.0f}  p90 {pct(ttft_ms, 0.9):7.0f}  p99 {pct(ttft_ms, 0.99):7.0f} ms")
    slow = [s for s in steps if s.ms > bound_ms and s.decodes]
    kinds: dict[str, list[StepTrace]] = {}
    for s in slow:
        kind = "burst" if s.bursting else ("grown" if s.grown else "plain")
        kinds.setdefault(kind, []).append(s)
    print(f"steps with decode rows over {bound_ms:g} ms: {len(slow)} of {sum(1 for s in steps if s.decodes)}")
    for kind, ss in sorted(kinds.items()):
        print(
            f"  {kind:6s} {len(ss):5d}: ms median {statistics.median(s.ms for s in ss):6.1f} max "
            f"{max(s.ms for s in ss):6.1f}; decode rows median {statistics.median(s.decodes for s in ss):5.0f}; "
            f"prompt tokens median {statistics.median(s.prompt_tokens for s in ss):6.0f}; "
            f"queue median {statistics.median(s.waiting for s in ss):5.0f}"
        )
    every = max(1, len(steps) // 12)
    print(
        "queue over time (s: waiting / running): "
        + ", ".join(f"{s.t:.1f}: {s.waiting}/{s.running}" for s in steps[::every])
    )


def variant_parser() -> argparse.ArgumentParser:
    """The scheduler settings one run tries (each `--variants` entry is parsed by it)."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--burst-start", type=float, default=None, help="override BURST_START_SHARE (>1: no bursts)")
    ap.add_argument("--burst-end", type=float, default=None, help="override BURST_END_SHARE")
    ap.add_argument(
        "--burst-max-running", type=int, default=None, help="a candidate rule: no burst step while more decode"
    )
    ap.add_argument("--growth", type=float, default=None, help="override MIXED_GROWTH (1: steps never grow)")
    ap.add_argument("--drain-steps", type=int, default=None, help="override QUEUE_DRAIN_STEPS")
    ap.add_argument("--max-queued", type=int, default=None, help="refuse arrivals while this many wait")
    return ap


CONSTANTS = (
    ("burst_start", "BURST_START_SHARE"),
    ("burst_end", "BURST_END_SHARE"),
    ("growth", "MIXED_GROWTH"),
    ("drain_steps", "QUEUE_DRAIN_STEPS"),
)


def apply_variant(engine: LLMEngine, v: argparse.Namespace) -> dict:
    """Set the scheduler's constants (and the candidate rule) for one run; returns what to restore."""
    saved = {name: getattr(sched_mod, name) for _, name in CONSTANTS}
    for flag, name in CONSTANTS:
        if getattr(v, flag) is not None:
            setattr(sched_mod, name, getattr(v, flag))  # read at each schedule() call
    if v.burst_max_running is not None:
        limit_bursts(engine, v.burst_max_running)
    return saved


def restore(engine: LLMEngine, saved: dict) -> None:
    for name, value in saved.items():
        setattr(sched_mod, name, value)
    sched = engine.scheduler
    for attr in ("schedule", "mixed_step_tokens"):  # the instance wrappers of traced / limit_bursts
        sched.__dict__.pop(attr, None)
    sched.bursting = False


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, parents=[variant_parser()]
    )
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--rate", type=float, default=32.0)
    ap.add_argument("--num-prompts", type=int, nargs="+", default=[300])
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--itl-bound", type=float, default=40.0, help="ms; steps and gaps above it are counted")
    ap.add_argument(
        "--variants",
        default=None,
        help='runs of one engine, "|"-separated, each a set of the settings above ("default": none), e.g. '
        '"default|--burst-start 2|--growth 1.5"; without it one run of the flags given',
    )
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--kv-cache-tokens", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None, help="write every step's trace here")
    args = ap.parse_args()
    if args.variants is None:
        variants = [("flags", args)]
    else:
        vp = variant_parser()
        variants = [
            (v.strip(), vp.parse_args([] if v.strip() == "default" else v.split())) for v in args.variants.split("|")
        ]
    extra = {k: v for k, v in (("max_model_len", args.max_model_len), ("kv_cache_tokens", args.kv_cache_tokens)) if v}
    config = EngineConfig.create(args.model, load_format=args.load_format, device=args.device, **extra)
    engine = LLMEngine(config)
    print(
        f"{args.model} on {engine.device}, mixed budget {engine.scheduler.mixed_budget}, {args.rate:g} req/s, "
        f"{args.input_len} in / {args.output_len} out"
    )
    # Warm-up: one short request of each shape, not traced.
    engine.add_request("warm", [5] * args.input_len, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    traces = []
    for i, n in enumerate(args.num_prompts):
        for j, (name, v) in enumerate(variants):
            saved = apply_variant(engine, v)
            print(
                f"\n=== {n} prompts, {name}: burst {sched_mod.BURST_START_SHARE} -> {sched_mod.BURST_END_SHARE}, "
                f"growth {sched_mod.MIXED_GROWTH}, drain {sched_mod.QUEUE_DRAIN_STEPS} steps"
                + (f", bursts only while <= {v.burst_max_running} decode" if v.burst_max_running is not None else "")
            )
            # Same arrivals for every variant; other prompts each run (no prefix-cache hits between runs).
            res = run(
                engine, args, v, n, engine.model_config.vocab_size, prompt_seed=1000 * (i * len(variants) + j + 1)
            )
            restore(engine, saved)
            report(res, args.itl_bound)
            traces.append({"num_prompts": n, "variant": name, "steps": [asdict(s) for s in res["steps"]]})
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "runs": traces}, f)


if __name__ == "__main__":
    main()
