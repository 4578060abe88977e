"""Throughput of structured outputs: what the grammar mask costs a batch.

Workload: --num-seqs concurrent requests (default 64) of 128 random prompt token ids, up to
--max-tokens output tokens each (default 256), temperature 1, dummy weights (default
qwen3-0.6b, with SmolLM2's tokenizer since the dummy model has none). Kinds, each warmed up
once, then timed in --repeat rounds of every kind back to back:
  free:  no constraint (ignore_eos: every request generates --max-tokens tokens);
  all:   every request under a ~10-field JSON schema (enums, a nested object, an array,
         numeric ranges, a pattern, a free string so that random weights keep writing);
  half:  every other request constrained, the rest free.
`all` and `half` run twice: with the schema as above, and with `maxLength` on its two short
strings, the case where xgrammar's mask fill is slowest (bounded repetition: 67 µs per fill
on average against 8 µs without, single fills up to ~5 ms; benchmarks/results/2026-11-25.md).
`--passes N` makes each timed run N generate calls back to back (a longer run, less noise).
Reported: output tokens actually generated per second (a constrained request may end
early, once its JSON is complete), min / median / max over rounds of the rate and of the ratio
to the same round's free run (each round's ratio listed too), the ratio to a free twin run
right after each constrained run with the same output length per request (so the batch's
uneven ending, which varies from round to round, is in both sides), host time filling masks
per masked step, and grammar compile time for the schema, cold (a fresh compiler service, its
tokenizer tables built first and timed apart) and cached. `--profile-rounds` prints each
round's steps: the median step, the excess of long ones over twice it, the host's wait on the
device and the share of the round the calling thread was on a core (which cause moves a round).
The grammar sees only the tokenizer's 49,152 ids; the model's other rows are masked off by
the engine (before 2026-11-26 xgrammar paid for each of them: all ran at 33-37% of free).
Targets (H200, qwen3-0.6b, 64 x 256): all >= 90% of free, half >= 95% of free. On an H200 at
7d32b4e (benchmarks/results/2026-11-26.md, --repeat 30 --no-max-length, two runs): free ~30.5k
tok/s, all 94.9% / 93.3%, half 96.1% / 96.1%; the rounds themselves spread from 53% to 149%,
so quote medians of many rounds (with the maxLength strings, 7 rounds: 54-59% / 61-65%).
Most of that spread was the detokenizer (the time outside the engine's steps, 189-333 ms of a
~0.7 s round by the tokens drawn; Rust since ecf41e7): free now varies by +-4% (results/2026-12-02.md).

    python benchmarks/structured.py                      # H200
    python benchmarks/structured.py --model smollm2-135m --load-format auto --device cpu \
        --num-seqs 4 --max-tokens 16                    # CPU smoke check
"""

from __future__ import annotations

import argparse
import copy
import logging
import random
import statistics
import time
from dataclasses import dataclass

import torch

from nanoserve import LLM, SamplingParams, StructuredOutputs
from nanoserve.heap import GcPauseWatch, freeze_startup_heap
from nanoserve.structured import GrammarService

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "name": {"type": "string"},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer", "guest"]},
        "active": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "level": {"type": "string", "enum": ["low", "mid", "high"]},
        "email": {"type": ["string", "null"]},
        "notes": {"type": "string"},
    },
    "required": ["id", "name", "role", "active", "score", "tags", "address", "level", "email", "notes"],
    "additionalProperties": False,
}
SCHEMA_MAX_LENGTH = copy.deepcopy(SCHEMA)
SCHEMA_MAX_LENGTH["properties"]["name"]["maxLength"] = 24
SCHEMA_MAX_LENGTH["properties"]["address"]["properties"]["city"]["maxLength"] = 20
SCHEMAS = {"": SCHEMA, " maxLength": SCHEMA_MAX_LENGTH}
TARGETS = {"all": 0.90, "half": 0.95}


def params_for(kind: str, n: int, max_tokens: int, schema: dict = SCHEMA) -> list[SamplingParams]:
    spec = StructuredOutputs(json=schema)
    out = []
    for i in range(n):
        constrained = kind == "all" or (kind == "half" and i % 2 == 0)
        out.append(
            SamplingParams(
                temperature=1.0,
                max_tokens=max_tokens,
                ignore_eos=not constrained,
                structured_outputs=spec if constrained else None,
            )
        )
    return out


@dataclass
class Run:
    tokens: int  # output tokens generated
    elapsed: float  # seconds
    mask_fill_s: float  # host time filling grammar masks
    masked_steps: int
    lengths: list[list[int]]  # per pass, output tokens of each request in prompt order
    steps: list[float]  # wall seconds of each engine step, in order
    gpu_wait_s: float  # host time blocked on the device's sampled tokens
    thread_s: float  # CPU time of the calling thread (its wait on the device spins, so counts): below elapsed, it was off its core
    started: float  # time.time() at the start (to line up with a GPU clock log)

    @property
    def rate(self) -> float:
        return self.tokens / self.elapsed

    def profile(self) -> str:
        """Where the round's time went: a uniformly slower step (the host or the device ran
        slower) moves the median step; a stall moves only the excess over twice the median."""
        mid = statistics.median(self.steps)
        stall = sum(max(0.0, s - 2 * mid) for s in self.steps)
        host = self.elapsed - self.gpu_wait_s
        return (
            f"{self.rate:7.0f} tok/s {self.elapsed * 1e3:6.0f} ms: {len(self.steps)} steps, median "
            f"{mid * 1e3:.3f} max {max(self.steps) * 1e3:5.1f} ms, excess over 2x median {stall * 1e3:5.1f} ms, "
            f"outside steps {(self.elapsed - sum(self.steps)) * 1e3:4.1f} ms, waiting on the device "
            f"{self.gpu_wait_s * 1e3:5.1f} ms, host {host * 1e3:5.0f} ms, the thread on its core {self.thread_s / self.elapsed:.0%}"
        )


def same_lengths(run: Run) -> list[list[SamplingParams]]:
    """Unconstrained requests that generate exactly `run`'s output lengths, pass by pass: the
    free twin of a constrained round, so that the ratio to it holds the grammar's cost and not
    the round's lengths (a constrained batch ends unevenly, and its last steps run few rows)."""
    return [[SamplingParams(temperature=1.0, max_tokens=max(1, n), ignore_eos=True) for n in p] for p in run.lengths]


def spread(values: list[float], scale: float = 1.0, fmt: str = ".1f") -> str:
    """min / median / max of the rounds."""
    lo, mid, hi = min(values) * scale, statistics.median(values) * scale, max(values) * scale
    return f"{lo:{fmt}} / {mid:{fmt}} / {hi:{fmt}}"


def trace_steps(engine) -> list[float]:
    """Note the wall time of every engine step from now on, in the list returned."""
    steps: list[float] = []
    step = engine.step

    def traced():
        t = time.perf_counter()
        try:
            return step()
        finally:
            steps.append(time.perf_counter() - t)

    engine.step = traced
    return steps


# The engine-thread phases of a step that --profile-phases times (inclusive: `_process` holds
# the grammars' advance and, in a constrained overlap step, the next step's sampling).
PHASES = {
    "schedule": ("scheduler", "schedule"),
    "prepare": ("", "_prepare"),
    "forward launch": ("runner", "execute"),
    "process": ("", "_process"),
    "advance": ("step_masks", "advance"),
    "sample": ("", "_sample"),
    "fill": ("step_masks", "fill"),
    "sampling launch": ("", "_queue_sampling"),
}


def trace_phases(engine) -> dict[str, float]:
    """Add the seconds spent in each of PHASES to the mapping returned (reset it per run)."""
    spent = dict.fromkeys(PHASES, 0.0)
    for phase, (owner, name) in PHASES.items():
        obj = getattr(engine, owner) if owner else engine
        inner = getattr(obj, name)

        def timed_call(*a, _inner=inner, _phase=phase, **kw):
            t = time.perf_counter()
            try:
                return _inner(*a, **kw)
            finally:
                spent[_phase] += time.perf_counter() - t

        setattr(obj, name, timed_call)
    return spent


def timed(llm: LLM, prompts, passes: list[list[SamplingParams]], steps: list[float]) -> Run:
    """One timed run: the batch generated once per pass, back to back (more passes, a longer
    run: a round of 64 x 256 lasts ~0.5 s on an H200, where any hiccup moves its rate).
    `steps` is trace_steps' list, emptied here."""
    engine = llm.engine
    engine.step_masks.fill_s, engine.step_masks.num_filled = 0.0, 0
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    steps.clear()
    waited, wall, cpu = engine.gpu_wait_s, time.time(), time.thread_time()
    start = time.perf_counter()
    outs = [llm.generate(prompts, params, use_tqdm=False) for params in passes]
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    lengths = [[len(c.token_ids) for o in out for c in o.outputs] for out in outs]
    return Run(
        sum(map(sum, lengths)), elapsed, engine.step_masks.fill_s, engine.step_masks.num_filled, lengths,
        list(steps), engine.gpu_wait_s - waited, time.thread_time() - cpu, wall,
    )  # fmt: skip


def compile_times(llm: LLM) -> tuple[float, float, float]:
    """(tokenizer tables s, cold compile s, cached compile s) on a fresh service."""
    engine = llm.engine
    start = time.perf_counter()
    service = GrammarService(engine.tokenizer, engine.model_config.vocab_size, list(engine.model_config.eos_token_ids))
    service.compile(StructuredOutputs(regex="a"))  # builds the tokenizer tables
    tables = time.perf_counter() - start
    spec = StructuredOutputs(json=SCHEMA)
    start = time.perf_counter()
    service.compile(spec)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(10):
        service.compile(spec)
    cached = (time.perf_counter() - start) / 10
    service.shutdown()
    return tables, cold, cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--tokenizer", default="smollm2-135m", help="the dummy model has none; 'none': the model's own")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5, help="rounds of every kind (medians are reported)")
    ap.add_argument("--passes", type=int, default=1, help="generate calls per timed run, back to back")
    ap.add_argument("--no-max-length", action="store_true", help="skip the maxLength schema's runs (faster)")
    ap.add_argument("--profile-rounds", action="store_true", help="print where each round's time went")
    ap.add_argument("--profile-phases", action="store_true", help="print the engine thread's time per step by phase")
    args = ap.parse_args()

    llm = LLM(
        args.model,
        load_format=args.load_format,
        tokenizer=None if args.tokenizer == "none" else args.tokenizer,
        device=args.device,
        max_model_len=args.prompt_len + args.max_tokens + 16,
    )
    rng = random.Random(0)
    vocab = min(llm.engine.model_config.vocab_size, len(llm.tokenizer))
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.num_seqs)]
    tables, cold, cached = compile_times(llm)
    print(f"model {args.model} ({args.load_format}) on {llm.engine.device}, {args.num_seqs} x {args.max_tokens}")
    print(
        f"grammar compile (10-field schema): tokenizer tables {tables * 1e3:.0f} ms once, "
        f"cold {cold * 1e3:.1f} ms, cached {cached * 1e6:.1f} us"
    )
    schemas = {"": SCHEMA} if args.no_max_length else SCHEMAS
    runs = [("free", SCHEMA)] + [
        (kind + suffix, schema) for suffix, schema in schemas.items() for kind in ("all", "half")
    ]
    params = {kind: params_for(kind.split()[0], args.num_seqs, args.max_tokens, schema) for kind, schema in runs}
    for kind, _ in runs:
        llm.generate(prompts[: min(8, args.num_seqs)], params[kind][:8], use_tqdm=False)  # warm-up of this kind
    # A full collection scans torch's, transformers' and xgrammar's objects (~100 ms on a CPU) and
    # lands in some rounds of ~0.5 s only: freeze them (nanoserve/heap.py), count what remains.
    freeze_startup_heap(logging.getLogger("structured"), "benchmark")
    gc_watch = GcPauseWatch(logging.getLogger("structured")).install()
    # Rounds of every kind back to back: each ratio to free compares runs minutes apart at
    # most, so the machine's drift (the free run alone varies by 15% between calls) cancels.
    # Each constrained run is followed by its free twin of the same output lengths.
    results: dict[str, list[Run]] = {kind: [] for kind, _ in runs}
    twins: dict[str, list[Run]] = {kind: [] for kind, _ in runs if kind != "free"}
    steps = trace_steps(llm.engine)
    phases = trace_phases(llm.engine) if args.profile_phases else None
    per_phase: dict[str, list[dict[str, float]]] = {kind: [] for kind, _ in runs}  # per round, ms a step
    for _ in range(args.repeat):
        for kind, _ in runs:
            if phases is not None:
                phases.update(dict.fromkeys(phases, 0.0))
            run = timed(llm, prompts, [params[kind]] * args.passes, steps)
            if phases is not None:
                per_phase[kind].append({p: v * 1e3 / len(run.steps) for p, v in phases.items()})
                per_phase[kind][-1]["token wait"] = run.gpu_wait_s * 1e3 / len(run.steps)
                per_phase[kind][-1]["step"] = statistics.median(run.steps) * 1e3
            results[kind].append(run)
            if kind != "free":
                twins[kind].append(timed(llm, prompts, same_lengths(run), steps))
    free_rates = [r.rate for r in results["free"]]
    print(f"{args.repeat} rounds of {args.passes} pass(es); spreads are min / median / max over the rounds")
    for kind, _ in runs:
        rates = [r.rate for r in results[kind]]
        tokens = statistics.median(r.tokens for r in results[kind])
        line = f"{kind:15s}: {tokens:6.0f} output tokens, {spread(rates)} tok/s"
        if kind != "free":
            ratios = [r / f for r, f in zip(rates, free_rates)]
            ratio = statistics.median(ratios)
            target = TARGETS[kind.split()[0]]
            ok = "met" if ratio >= target else "MISSED"
            line += f" | of free {spread(ratios, 100)}% (target {target * 100:.0f}% on the median: {ok})"
            twin = [r.rate / t.rate for r, t in zip(results[kind], twins[kind])]
            line += f" | of free with the same lengths {spread(twin, 100)}%"
            fill_ms = statistics.median(r.mask_fill_s * 1e3 / max(r.masked_steps, 1) for r in results[kind])
            line += f" | mask fill {fill_ms:.3f} ms per masked step"
        print(line, flush=True)
        if kind != "free":
            print(f"{'':17s}rounds, % of free: " + " ".join(f"{r / f * 100:.1f}" for r, f in zip(rates, free_rates)))
    if args.profile_rounds:
        print("each round's time (the spread's cause: a slower median step, or stalls):")
        for kind, _ in runs:
            for i, run in enumerate(results[kind]):
                at = time.strftime("%H:%M:%S", time.gmtime(run.started)) + f"{run.started % 1:.2f}"[1:]
                print(f"  {kind:13s} {i:2d} at {at} UTC: {run.profile()}")
    if phases is not None:
        print("the engine thread's time per step by phase, median over the rounds, ms (inclusive):")
        columns = ["step", "token wait", *PHASES]  # the median step; the wait for sampled tokens (in process)
        print(f"  {'':13s} " + " | ".join(columns))
        for kind, _ in runs:
            row = [statistics.median(r[p] for r in per_phase[kind]) for p in columns]
            print(f"  {kind:13s} " + " | ".join(f"{v:.3f}" for v in row))
    young, middle, full = gc_watch.counts
    print(
        f"garbage collections in the timed rounds: {young} / {middle} / {full} of generations 0 / 1 / 2, "
        f"longest {gc_watch.longest_s * 1e3:.1f} ms"
    )
    gc_watch.remove()
    llm.engine.check_invariants()


if __name__ == "__main__":
    main()
