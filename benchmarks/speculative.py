"""Speculative decoding: what it gains on real text, what a verify step costs, and what it
costs a throughput run.

Sections (each on by its flag; all by default):
- --real: the embedded SmolLM2-135M-Instruct (real weights), batch 1, greedy, 128 new tokens,
  on two workloads of 32 chat prompts each: copy-heavy (edit or rewrite a given code or text
  passage: the answer copies most of the prompt) and free writing. TPOT with speculation off
  and with n-gram drafts, the mean acceptance length (tokens per verify step), and how many
  outputs equal the speculation-off output token for token.
  Targets (issue 46): n-gram TPOT >= 2.0x faster on copy-heavy, <= 3% slower on free writing.
- --verify-cost: llama-3.1-8b (dummy weights; --verify-model, --verify-k, --verify-batches): the forward of a plain decode step against a
  verify step of K = 4 drafts (5 positions per request, the decode graph of 5x the rows, whose
  attention reads a request's K/V once for its 5 rows, as runs; also timed with the
  rows attended one by one, as before it) at batch 1 and 32, context 512, and
  the speedup that follows at acceptance lengths 2, 3 and 4 (acceptance length x decode step /
  verify step; n-gram drafts cost no forward). Targets: verify <= 1.10x decode at batch 1,
  <= 1.3x at batch 32. --verify-profile: also each kernel's device time in both steps
  (torch.profiler over 20 of each), the kernels whose time grew most first; run it with
  NANOSERVE_PDL=0, since under PDL a kernel's duration includes its wait for the one before.
- --throughput: the offline workload (benchmarks/offline_throughput.py, 256 sequences) with
  speculation on against off (qwen3-0.6b by default). Target: on >= 0.97x off.

    python benchmarks/speculative.py [--real] [--verify-cost] [--throughput] [--model-throughput M]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent / "probes"))  # profile_decode's helpers, for --verify-profile
from offline_throughput import timed_run, warm_up, workload

from nanoserve import LLM, SamplingParams
from nanoserve.engine.speculative.positions import position_batch

NEW_TOKENS = 128

_CODE = [
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n",
    (
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
        "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n"
    ),
    (
        "def fizzbuzz(n):\n    for i in range(1, n + 1):\n        if i % 15 == 0:\n            print('FizzBuzz')\n"
        "        elif i % 3 == 0:\n            print('Fizz')\n        elif i % 5 == 0:\n            print('Buzz')\n"
        "        else:\n            print(i)\n"
    ),
    (
        "def read_lines(path):\n    with open(path) as f:\n        lines = f.readlines()\n"
        "    return [line.strip() for line in lines if line.strip()]\n"
    ),
]
_TEXT = [
    (
        "The city council met on Tuesday to discuss the new budget. Members agreed to increase funding for "
        "public parks and libraries, while reducing spending on road repairs. The mayor said the changes "
        "reflect what residents asked for during the spring survey."
    ),
    (
        "Our store will be closed on Monday for the holiday. Regular hours resume on Tuesday at nine in the "
        "morning. Online orders placed over the weekend will ship on Tuesday afternoon."
    ),
    (
        "Photosynthesis is the process by which plants use sunlight, water and carbon dioxide to make glucose "
        "and oxygen. It takes place mainly in the leaves, inside small structures called chloroplasts."
    ),
    (
        "Dear team, thank you for your hard work this quarter. Sales grew by ten percent and customer "
        "complaints fell by a third. Please join us on Friday for a small celebration in the main hall."
    ),
]
_CODE_TASKS = [
    "Rename every variable to a longer, clearer name and return the whole code.",
    "Add type hints to this code and return the whole code.",
    "Add a docstring to each function and return the whole code.",
    "Repeat this code exactly, then explain it in one sentence.",
]
_TEXT_TASKS = [
    "Fix any spelling mistakes and return the full text.",
    "Rewrite this text in the past tense, keeping everything else the same.",
    "Repeat the text exactly, replacing every 'the' with 'THE'.",
    "Copy this text, then add one sentence at the end.",
]
_TOPICS = [
    "a lighthouse keeper", "a robot learning to paint", "the first day of school", "a dragon who is afraid of fire",
    "a trip to the mountains", "a lost cat finding its way home", "an old tree in a city park", "a chef's best dish",
]  # fmt: skip
_FORMS = ["Write a short story about", "Write a poem about", "Describe", "Write a diary entry about"]


def copy_heavy_prompts() -> list[list[dict]]:
    """32 chat prompts whose answers copy most of a given passage (16 code, 16 text)."""
    out = []
    for passages, tasks in ((_CODE, _CODE_TASKS), (_TEXT, _TEXT_TASKS)):
        for p in passages:
            for t in tasks:
                out.append([{"role": "user", "content": f"{t}\n\n{p}"}])
    return out


def free_writing_prompts() -> list[list[dict]]:
    """32 chat prompts with nothing to copy."""
    return [[{"role": "user", "content": f"{form} {topic}."}] for form in _FORMS for topic in _TOPICS]


def _release() -> None:
    """Give a deleted engine's GPU memory back before the next one is built (each takes most of it)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def tpot_run(llm: LLM, conversations, params) -> tuple[float, list[list[int]]]:
    """Mean TPOT (ms) over the conversations, each run alone (batch 1), and their tokens."""
    engine = llm.engine
    tok = llm.tokenizer
    tpots, outputs = [], []
    for i, conv in enumerate(conversations):
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        engine.add_request(f"r{i}", ids, params)
        first = last = None
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for up in engine.step():
                if up.new_token_ids:
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    tokens += up.new_token_ids
        if len(tokens) > 1:
            tpots.append((last - first) * 1e3 / (len(tokens) - 1))
        outputs.append(tokens)
    return statistics.mean(tpots), outputs


class PhaseTimes:
    """--phases: where a verify step's wall time goes. Wraps the speculator's and runner's
    calls with host timers (perf_counter, no synchronisation added: the forward's launch is
    timed apart from the wait for its tokens, `tolist`), and a CUDA event pair around each
    verify forward for its device time; plain steps are timed whole (engine.step)."""

    def __init__(self, llm: LLM):
        import nanoserve.engine.speculative.step as step_mod

        self.totals: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._events: list[tuple] = []  # (start, end) CUDA events of each verify forward
        self._pending_end = None  # the end event of the verify forward in flight
        self._in_verify = False
        self._patched: list[tuple[object, str]] = []
        cuda = llm.engine.device.type == "cuda"
        engine, spec, runner = llm.engine, llm.engine.speculator, llm.engine.runner
        self._wrap(spec, "step", "verify step (all)")
        self._wrap(spec.proposer, "propose", "  drafting")
        self._wrap(engine.scheduler, "schedule", "  schedule")
        self._wrap(spec, "_drafts", "  reserve pages, clip")
        self._wrap(runner, "prepare", "  prepare inputs")
        self._wrap(spec, "_sample_rows", "  sample rows")
        self._wrap(spec, "_apply", "  apply tokens")
        self._wrap(spec.proposer, "verified", "  drafter bookkeeping")
        self._wrap(engine, "_process", "drain / process a plain step")
        real_execute, real_dist = runner.execute, step_mod.target_distributions

        def execute(inputs, _real=real_execute):
            if not self._in_verify or not cuda:
                return _real(inputs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t = time.perf_counter()
            out = _real(inputs)
            self._add("  launch forward", time.perf_counter() - t)
            self._events.append((start, end))
            self._pending_end = end
            return out

        def distributions(*a, _real=real_dist, **kw):
            t = time.perf_counter()
            greedy, probs = _real(*a, **kw)
            if cuda:
                self._pending_end.record()
            self._add("  launch argmax", time.perf_counter() - t)
            real_tolist = greedy.tolist

            class Waited:  # times the wait for the tokens (the device's remaining work)
                def __getattr__(_, name):
                    return getattr(greedy, name)

                def tolist(_):
                    t0 = time.perf_counter()
                    out = real_tolist()
                    self._add("  wait for tokens (tolist)", time.perf_counter() - t0)
                    return out

            return Waited(), probs

        real_step = spec.step

        def spec_step(_real=real_step):
            self._in_verify = True
            try:
                return _real()
            finally:
                self._in_verify = False

        runner.execute = execute
        spec.step = spec_step
        self._patched += [(runner, "execute"), (spec, "step"), (engine, "step")]
        self._restore_distributions = lambda: setattr(step_mod, "target_distributions", real_dist)
        step_mod.target_distributions = distributions
        real_engine_step = engine.step

        def engine_step(_real=real_engine_step):
            t = time.perf_counter()
            before = spec.counters.num_verify_steps
            out = _real()
            kind = "plain step (engine.step)" if spec.counters.num_verify_steps == before else "verify (engine.step)"
            self._add(kind, time.perf_counter() - t)
            return out

        engine.step = engine_step

    def _wrap(self, obj, name: str, label: str) -> None:
        real = getattr(obj, name)

        def timed(*a, _real=real, **kw):
            t = time.perf_counter()
            try:
                return _real(*a, **kw)
            finally:
                self._add(label, time.perf_counter() - t)

        setattr(obj, name, timed)
        self._patched.append((obj, name))

    def restore(self) -> None:
        """Unwrap everything (the instances' own attributes go, their classes' methods show again)."""
        for obj, name in reversed(self._patched):
            if name in vars(obj):
                delattr(obj, name)
        self._restore_distributions()

    def _add(self, label: str, seconds: float) -> None:
        self.totals[label] = self.totals.get(label, 0.0) + seconds
        self.counts[label] = self.counts.get(label, 0) + 1

    def report(self, title: str) -> None:
        if self._events:
            torch.cuda.synchronize()
        device = [a.elapsed_time(b) for a, b in self._events]
        print(f"phases, {title}: (label: calls, mean ms per call)")
        for label, total in self.totals.items():
            print(f"  {label:32s} {self.counts[label]:6d}  {total / self.counts[label] * 1e3:8.3f}")
        if device:
            print(f"  {'  verify forward on the device':32s} {len(device):6d}  {statistics.mean(device):8.3f}")


def section_real(args) -> None:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    workloads = {"copy-heavy": copy_heavy_prompts(), "free-writing": free_writing_prompts()}
    results = {}
    configs = {None: {}, "ngram": {"speculative_algorithm": "ngram"}}
    if args.gate:
        configs["ngram, cost gate"] = {"speculative_algorithm": "ngram", "speculative_cost_gate": True}
    if args.prompts:
        workloads = {name: convs[: args.prompts] for name, convs in workloads.items()}
    for algo, extra in configs.items():
        llm = LLM("smollm2-135m", kv_cache_gib=4, **extra)
        warm = workloads["copy-heavy"][:2] + workloads["free-writing"][:2]
        tpot_run(llm, warm, params)  # compile and capture before timing
        if args.profile and algo == "ngram":
            import cProfile
            import pstats

            with cProfile.Profile() as prof:
                tpot_run(llm, workloads["copy-heavy"][:8], params)
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        if args.phases and algo == "ngram":
            phases = PhaseTimes(llm)
            tpot_run(llm, workloads["copy-heavy"][:8], params)
            phases.report("copy-heavy, 8 prompts")
            phases.restore()
        for name, convs in workloads.items():
            before = dict(llm.stats())
            tpot, outs = tpot_run(llm, convs, params)
            after = llm.stats()
            steps = after.get("vllm:spec_decode_num_drafts", 0) - before.get("vllm:spec_decode_num_drafts", 0)
            accepted = after.get("vllm:spec_decode_num_accepted_tokens", 0) - before.get(
                "vllm:spec_decode_num_accepted_tokens", 0
            )
            drafted = after.get("vllm:spec_decode_num_draft_tokens", 0) - before.get(
                "vllm:spec_decode_num_draft_tokens", 0
            )
            results[(algo, name)] = (tpot, outs, steps, accepted, drafted)
            spec = llm.engine.speculator
            if spec is not None:
                ms = [None if v is None else round(v * 1e3, 3) for v in (spec.plain_step_s, spec.verify_step_s)]
                print(f"{algo} {name}: plain step {ms[0]} ms, verify step {ms[1]} ms, tokens {spec.tokens_per_verify}")
        llm.engine.check_invariants()
        del llm
        _release()
    for (algo, name), (tpot, outs, steps, accepted, drafted) in results.items():
        if algo is None:
            continue
        base = results[(None, name)][0]
        same = sum(a == b for a, b in zip(outs, results[(None, name)][1]))
        acc_len = 1 + accepted / steps if steps else 1.0
        print(
            f"real smollm2-135m {name:13s}: TPOT off {base:.3f} ms, {algo} {tpot:.3f} ms -> {base / tpot:.2f}x; "
            f"acceptance length {acc_len:.2f} over {steps} drafting steps ({accepted}/{drafted} drafts accepted); "
            f"identical outputs {same}/{len(outs)}"
        )


def _time(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _kernel_profile(fn, reps: int = 20) -> dict[str, tuple[float, float]]:
    """Per kernel name: launches and device µs per call of fn (CUPTI sees inside graph replays)."""
    from profile_decode import device_us

    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return {e.key: (e.count / reps, device_us(e) / reps) for e in prof.key_averages() if device_us(e) > 0}


def _print_profiles(decode: dict, verify: dict, rows: int = 16) -> None:
    """Both steps' kernels side by side, most grown first, then totals by kind."""
    from profile_decode import kernel_kind

    def grown(name: str) -> float:
        return verify.get(name, (0, 0.0))[1] - decode.get(name, (0, 0.0))[1]

    names = sorted(set(decode) | set(verify), key=lambda n: -grown(n))
    print(f"  {'kernel':<64} {'decode n':>8} {'us':>8} {'verify n':>8} {'us':>8} {'grown':>8}")
    for name in names[:rows]:
        (dn, dus), (vn, vus) = decode.get(name, (0, 0.0)), verify.get(name, (0, 0.0))
        print(f"  {name[:64]:<64} {dn:8.1f} {dus:8.1f} {vn:8.1f} {vus:8.1f} {vus - dus:+8.1f}")
    for kind in sorted({kernel_kind(n) for n in names}):
        d = sum(us for n, (_, us) in decode.items() if kernel_kind(n) == kind)
        v = sum(us for n, (_, us) in verify.items() if kernel_kind(n) == kind)
        print(f"  {'kind: ' + kind:<64} {'':8} {d:8.1f} {'':8} {v:8.1f} {v - d:+8.1f}")
    d, v = sum(us for _, us in decode.values()), sum(us for _, us in verify.values())
    print(f"  {'kernel time per step':<64} {'':8} {d:8.1f} {'':8} {v:8.1f} {v - d:+8.1f}")


def _step(runner, sched, reqs, drafts: list[list[int]] | None) -> None:
    """One forward as the engine runs it: a decode step (drafts None) or a verify step (each
    request's last token and its drafts, a row per position: nanoserve.engine.speculative.positions)."""
    drafts = drafts or [[] for _ in reqs]
    tokens = [[r.token_ids[-1], *d] for r, d in zip(reqs, drafts)]
    batch = position_batch(reqs, tokens, [r.num_computed for r in reqs], sched.page_table)
    runner.execute(runner.prepare(batch, list(range(len(batch.requests)))))


@torch.inference_mode()
def section_verify_cost(args) -> None:
    k, context = args.verify_k, 512
    # Speculation configured (never stepped here: the loop below builds the steps) so that
    # the runner reads a verify step's positions of a request in one program (its runs).
    spec = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": k}
    llm = LLM(args.verify_model, load_format="dummy", max_model_len=4096, overlap_schedule=False, **spec)
    engine = llm.engine
    runner, sched = engine.runner, engine.scheduler
    run_rows = runner.max_run_rows
    for bs in args.verify_batches:
        for i in range(bs):
            prompt = [(i * 131 + 7 * j) % 30000 for j in range(context)]
            engine.add_request(f"v{bs}-{i}", prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        while sched.waiting:  # the simple loop: nothing stays in flight
            engine.step()
        reqs = sorted(sched.running, key=lambda r: -r.num_computed)
        for r in reqs:
            assert sched.reserve_lookahead(r, k) == k
        drafts = [[(r.token_ids[-1] + j + 1) % 30000 for j in range(k)] for r in reqs]
        t_dec = _time(lambda reqs=reqs, run=runner, s=sched: _step(run, s, reqs, None), 50)
        t_ver = _time(lambda reqs=reqs, d=drafts, run=runner, s=sched: _step(run, s, reqs, d), 50)
        runner.max_run_rows = 0  # the rows of a verify step attended one by one, as before runs
        t_rows = _time(lambda reqs=reqs, d=drafts, run=runner, s=sched: _step(run, s, reqs, d), 50)
        runner.max_run_rows = run_rows
        gains = ", ".join(f"{a}: {a * t_dec / t_ver:.2f}x" for a in (2, 3, 4))
        print(
            f"verify cost {args.verify_model} batch {bs:2d}: decode step {t_dec:.3f} ms, K={k} verify step {t_ver:.3f} ms "
            f"= {t_ver / t_dec:.3f}x (rows one by one: {t_rows:.3f} ms = {t_rows / t_dec:.3f}x; runs of {run_rows}); "
            f"speedup at acceptance length {gains}"
        )
        if args.verify_profile:
            decode = _kernel_profile(lambda reqs=reqs, run=runner, s=sched: _step(run, s, reqs, None))
            verify = _kernel_profile(lambda reqs=reqs, d=drafts, run=runner, s=sched: _step(run, s, reqs, d))
            _print_profiles(decode, verify)
        for r in list(sched.running):
            engine.abort_request(r.request_id)
        while engine.has_unfinished_requests():
            engine.step()
    engine.check_invariants()
    del llm, engine, runner, sched
    _release()


def section_throughput(args) -> None:
    prompts, max_tokens = workload()
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    rates = {}
    for algo in (None, "ngram"):
        extra = {"speculative_algorithm": algo} if algo else {}
        llm = LLM(args.model_throughput, load_format="dummy", max_model_len=4096, **extra)
        warm_up(llm, prompts)
        _, elapsed = timed_run(llm, prompts, params)
        rates[algo] = sum(max_tokens) / elapsed
        spec = {k: v for k, v in llm.stats().items() if k.startswith("vllm:spec")}
        print(f"throughput {args.model_throughput} speculation {algo or 'off'}: {rates[algo]:,.0f} output tok/s {spec}")
        del llm
        _release()
    print(f"throughput ratio on/off: {rates['ngram'] / rates[None]:.3f} (target >= 0.97)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real", action="store_true")
    ap.add_argument("--verify-cost", action="store_true")
    ap.add_argument("--verify-model", default="llama-3.1-8b", help="--verify-cost: the model (dummy weights)")
    ap.add_argument("--verify-k", type=int, default=4, help="--verify-cost: drafts per request")
    ap.add_argument("--verify-batches", type=int, nargs="+", default=[1, 32], help="--verify-cost: batch sizes")
    ap.add_argument("--verify-profile", action="store_true", help="--verify-cost: each kernel's time in both steps")
    ap.add_argument("--throughput", action="store_true")
    ap.add_argument("--model-throughput", default="qwen3-0.6b")
    ap.add_argument("--gate", action="store_true", help="--real: also time n-gram drafts with the cost gate on")
    ap.add_argument("--profile", action="store_true", help="--real: cProfile the host side of 8 prompts")
    ap.add_argument("--prompts", type=int, default=0, help="--real: only the first N prompts of each workload")
    ap.add_argument("--phases", action="store_true", help="--real: a verify step's wall time by phase (8 prompts)")
    args = ap.parse_args()
    every = not (args.real or args.verify_cost or args.throughput)
    if args.real or every:
        section_real(args)
    if args.verify_cost or every:
        section_verify_cost(args)
    if args.throughput or every:
        section_throughput(args)


if __name__ == "__main__":
    main()
