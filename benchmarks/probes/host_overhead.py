"""Host (Python) time per engine step, measured on CPU with the model forward stubbed out.

What it runs: the real `LLM` / `LLMEngine` (scheduler, prefix cache, `ModelRunner.prepare`,
sampler, overlap loop forced on, result processing, `LLM.generate`'s output building) on
the offline benchmark's workload shape (nano-vllm's: 256 sequences, random.seed(0),
prompts of randint(100, 1024) tokens, max_tokens randint(100, 1024), temperature 0.6,
ignore_eos; `--output-scale` scales max_tokens: 1.0, the default, is ~1,040 steps and
takes seconds). The model is a tiny config with dummy weights (token ids folded into its
16-token vocabulary, so the sampler's arithmetic on CPU stays small), and its forward is
replaced by a function that returns a fixed block of logits: what is timed is the host
work around the forward. By default decode goes through `DecodeGraphs.replay` with no-op
graphs, so decode batches are padded and the static buffers filled as on a GPU
(`--no-graphs`: eager decode).

On a GPU the same host work runs while the GPU computes the previous step; the host must
take less than the GPU step time (about 3.5 ms for qwen3-0.6b at batch 256 on an H200) or
the GPU waits. What a GPU adds per torch op (kernel launch, copy call) is not in these
times: `--count-ops` counts the torch ops of a decode step instead.

    python benchmarks/probes/host_overhead.py [--output-scale 1.0] [--profile] [--count-ops] [--no-graphs]

`--model qwen3-0.6b` times the same phases on the real engine instead (dummy weights, the
default device): on a GPU that is the offline benchmark itself, and `gpu wait` (the host
blocked on a step's sampled tokens, inside `process`) gets its own column, so the table
shows how much host work each step kind costs next to the GPU's time.

Phases (mean ms per step, decode and prefill steps apart): schedule (Scheduler.schedule),
prepare (ModelRunner.prepare), execute (the forward call: graph buffer copies + the stub),
sample (Sampler.sample), launch rest (the rest of LLMEngine._prepare, _forward and _sample:
step accounting, forks, token pool), process (LLMEngine._process: tokens to host, stop
checks, updates), step rest (the rest of LLMEngine.step), outputs (LLM.generate's handling
of the step's updates).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the repository, and benchmarks/ for shared helpers

import argparse
import cProfile
import functools
import io
import json
import os
import pstats
import random
import tempfile
import time
from collections import Counter, defaultdict

import torch
from offline_throughput import GCTimer
from torch.utils._python_dispatch import TorchDispatchMode

from nanoserve import LLM, SamplingParams
from nanoserve.engine.cuda_graph import PLAIN, DecodeGraphs

NUM_SEQS = 256
VOCAB = 16  # small: the CPU-side sampling compute must not hide the host overhead
PHASES = ("schedule", "prepare", "execute", "sample", "launch rest", "process", "gpu wait", "step rest", "outputs")


def workload(output_scale: float) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's draws (as benchmarks/offline_throughput.py), token ids folded into the
    tiny vocabulary and max_tokens scaled by `output_scale`."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) % VOCAB for _ in range(random.randint(100, 1024))] for _ in range(NUM_SEQS)]
    max_tokens = [max(1, round(random.randint(100, 1024) * output_scale)) for _ in range(NUM_SEQS)]
    return prompts, max_tokens


def tiny_model_dir(root: Path) -> Path:
    """A config-only Hugging Face directory (load_format='dummy' builds random weights)."""
    cfg = {
        "model_type": "qwen3",
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    path = root / "tiny-qwen3"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    return path


class _NoGraph:
    def replay(self) -> None:
        pass


def stub_forward(llm: LLM, graphs: bool, max_bs: int) -> None:
    """Replace the forward by a fixed logits block; with `graphs`, route decode through
    DecodeGraphs.replay (static-buffer copies, padding) with graphs that do nothing."""
    runner = llm.engine.runner
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16384, VOCAB, generator=gen)

    def forward_logits(inputs):
        rows = inputs.logit_rows.numel() if inputs.logit_rows is not None else inputs.input_ids.numel()
        return logits[:rows]

    runner.forward_logits = forward_logits
    if graphs:
        g = DecodeGraphs(runner, max_bs, llm.engine.max_model_len)  # CPU: torch backend, no cascade twins
        for bs in g.sizes:
            g.graphs[(bs, PLAIN)] = _NoGraph()
            g.outputs[(bs, PLAIN)] = logits[:bs]
        runner.graphs = g


class OpCounter(TorchDispatchMode):
    """Counts the torch (aten) ops run under it: each is at least one dispatch, and on a GPU
    most are a kernel launch or a copy, which cost host time the CPU run does not show."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def count_ops(llm: LLM, prompts, params, min_decode_bs: int) -> None:
    """Torch ops per decode step at batch >= min_decode_bs (LLM.generate included)."""
    engine = llm.engine
    step = engine.step
    per_step: list[Counter] = []

    def counted_step():
        batch_box = []
        schedule = engine.scheduler.schedule

        def spy():
            batch = schedule()
            batch_box.append(batch)
            return batch

        engine.scheduler.schedule = spy
        with OpCounter() as counter:
            out = step()
        engine.scheduler.schedule = schedule
        batch = batch_box[0] if batch_box else None
        if batch is not None and batch.is_decode and len(batch.requests) >= min_decode_bs:
            per_step.append(counter.counts)
        return out

    engine.step = counted_step
    llm.generate(prompts, params, use_tqdm=False)
    engine.step = step
    total = sum(per_step, Counter())
    n = max(len(per_step), 1)
    print(
        f"torch ops per decode step at batch >= {min_decode_bs} ({len(per_step)} steps): {sum(total.values()) / n:.1f}"
    )
    print("  " + ", ".join(f"{name} {c / n:.1f}" for name, c in total.most_common()))


class PhaseTimer:
    """Wraps engine methods to add their wall time to the current step's record."""

    def __init__(self):
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[tuple[str, int, dict[str, float]]] = []  # (kind, batch size, phases)
        self.kind = ("idle", 0)
        self._wrapped: list[tuple[object, str]] = []

    def wrap(self, obj, name: str, phase: str, on_result=None) -> None:
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            self.current[phase] += time.perf_counter() - t
            if on_result is not None:
                on_result(out)
            return out

        setattr(obj, name, timed)
        self._wrapped.append((obj, name))

    def uninstall(self) -> None:
        """Drop the wrappers (instance attributes over the class's methods)."""
        for obj, name in self._wrapped:
            delattr(obj, name)
        self._wrapped = []

    def install(self, llm: LLM) -> None:
        engine = llm.engine

        def batch_kind(batch):
            if batch is not None:
                self.kind = ("decode" if batch.is_decode else "prefill", len(batch.requests))

        self.wrap(engine.scheduler, "schedule", "schedule", batch_kind)
        self.wrap(engine.runner, "prepare", "prepare")
        self.wrap(engine.runner, "execute", "execute")
        self.wrap(engine.sampler, "sample", "sample")
        for name in ("_prepare", "_forward", "_sample"):  # a step's launch, in three parts
            self.wrap(engine, name, "_launch")
        self.wrap(engine, "_process", "process")
        step = engine.step

        def timed_step():
            self.end_step()
            self.kind = ("idle", 0)
            t, waited = time.perf_counter(), engine.gpu_wait_s
            out = step()
            self.current["_step"] = time.perf_counter() - t
            self.current["gpu wait"] = engine.gpu_wait_s - waited  # inside _process, on a GPU
            self._last_step_end = time.perf_counter()
            return out

        engine.step = timed_step
        self._wrapped.append((engine, "step"))
        self._last_step_end = None

    def end_step(self) -> None:
        """Close the previous step: the time since it returned is LLM.generate's output work."""
        if self._last_step_end is None:
            return
        c = self.current
        c["outputs"] = time.perf_counter() - self._last_step_end
        launch_rest = c.pop("_launch", 0.0) - c["prepare"] - c["execute"] - c["sample"]
        step_rest = c.pop("_step") - c["schedule"] - (launch_rest + c["prepare"] + c["execute"] + c["sample"])
        c["process"] -= c["gpu wait"]
        step_rest -= c["process"] + c["gpu wait"]
        c["launch rest"], c["step rest"] = launch_rest, step_rest
        self.steps.append((*self.kind, dict(c)))
        self.current = defaultdict(float)
        self._last_step_end = None


def summarize(timer: PhaseTimer, min_decode_bs: int) -> None:
    groups = {
        "prefill": [s for k, b, s in timer.steps if k == "prefill"],
        "decode": [s for k, b, s in timer.steps if k == "decode"],
        f"decode bs>={min_decode_bs}": [s for k, b, s in timer.steps if k == "decode" and b >= min_decode_bs],
    }
    header = f"{'steps':<18}{'n':>6}" + "".join(f"{p:>12}" for p in PHASES) + f"{'total':>10}"
    print("mean host ms per step")
    print(header)
    for name, steps in groups.items():
        if not steps:
            continue
        means = [1e3 * sum(s[p] for s in steps) / len(steps) for p in PHASES]
        print(f"{name:<18}{len(steps):>6}" + "".join(f"{m:>12.3f}" for m in means) + f"{sum(means):>10.3f}")


def build(args, kv_tokens: int) -> LLM:
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(
            str(tiny_model_dir(Path(tmp))),
            device="cpu",
            load_format="dummy",
            max_model_len=4096,
            kv_cache_tokens=kv_tokens,
            enable_prefix_caching=not args.no_prefix_cache,
        )
    llm.engine.overlap = not args.no_overlap
    stub_forward(llm, not args.no_graphs, llm.engine.config.max_num_seqs)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    return llm


def build_real(model: str, prompts: list[list[int]]) -> LLM:
    """The offline benchmark's engine: a bundled config with dummy weights on the default
    device (CUDA: real forward, decode graphs, Triton kernels), warmed up as that benchmark does."""
    import offline_throughput

    llm = LLM(model, load_format="dummy", max_model_len=4096)
    offline_throughput.warm_up(llm, prompts)
    return llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output-scale", type=float, default=1.0, help="multiply every max_tokens by this")
    ap.add_argument("--no-graphs", action="store_true", help="decode eagerly (no DecodeGraphs.replay)")
    ap.add_argument("--no-overlap", action="store_true", help="simple loop instead of the overlap loop")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also run cProfile and print the top functions")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--count-ops", action="store_true", help="count torch ops in the decode steps at batch >= 200")
    ap.add_argument(
        "--model",
        default=None,
        help="time the real engine instead (a bundled config, dummy weights, the default device: on a GPU the "
        "offline benchmark itself, with its GPU wait in its own column); the tiny-model flags do not apply",
    )
    args = ap.parse_args()

    if args.model:
        import offline_throughput

        prompts, max_tokens = offline_throughput.workload()
        max_tokens = [max(1, round(m * args.output_scale)) for m in max_tokens]
        llm = build_real(args.model, prompts)

        def fresh() -> LLM:  # one engine (GPU memory): the same one, its prefix cache emptied
            if llm.engine.prefix_cache is not None:
                llm.engine.prefix_cache.reset()
            return llm
    else:
        torch.set_num_threads(1)
        prompts, max_tokens = workload(args.output_scale)
        kv_tokens = sum(map(len, prompts)) + sum(max_tokens) + 64 * NUM_SEQS
        llm = build(args, kv_tokens)

        def fresh() -> LLM:  # a fresh prefix cache, no timers
            return build(args, kv_tokens)

    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    engine = llm.engine
    timer = PhaseTimer()
    timer.install(llm)
    gc_timer = GCTimer()  # collections land in whichever phase allocates: shown apart
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    timer.end_step()
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(max_tokens), (produced, sum(max_tokens))
    engine.check_invariants()
    what = (
        f"{args.model} on {engine.device}"
        if args.model
        else f"graphs {'off' if args.no_graphs else 'on (no-op replay)'}, prefix cache "
        f"{'off' if args.no_prefix_cache else 'on'}"
    )
    print(
        f"host_overhead: {NUM_SEQS} seqs, {sum(map(len, prompts))} prompt + {produced} output tokens "
        f"(output scale {args.output_scale}), {what}, overlap {'on' if engine.overlap else 'off'}, "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs"
    )
    print(f"{len(timer.steps)} steps in {elapsed:.2f} s ({1e3 * elapsed / max(len(timer.steps), 1):.3f} ms per step)")
    summarize(timer, min_decode_bs=200)
    print(f"garbage collector during the run (inside the phases above): {gc_timer.read()}")
    if args.model:
        timer.uninstall()

    if args.count_ops:
        count_ops(fresh(), prompts, params, min_decode_bs=200)

    if args.profile:
        llm = fresh()
        profiler = cProfile.Profile()
        profiler.enable()
        llm.generate(prompts, params, use_tqdm=False)
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
        print(out.getvalue())


if __name__ == "__main__":
    main()
