"""The probes that reach into the engine's internals run on the CPU (their plumbing modes), so an
engine change that renames what they wrap fails here rather than on a GPU machine later.

- `benchmarks/probes/profile_offline.py --smoke`: wraps `LLMEngine._forward` per step;
- `benchmarks/probes/host_overhead.py`: stubs the forward and times the engine's phases;
- `benchmarks/probes/overload_steps.py`: wraps the scheduler's schedule() and sets its constants.

And `benchmarks/latency.py`'s runs, on a tiny model: each prefills its whole prompt (until
2026-11-27 every run re-sent the warm-up's prompt and its TTFT timed a prefix-cache hit).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_probe(name: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "probes" / name), *args],
        check=False, capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.parametrize(
    "probe, args, expected",
    [
        ("profile_offline.py", ["--smoke"], ["GPU busy", "step kind", "decode bs", "prefill / mixed"]),
        ("host_overhead.py", ["--output-scale", "0.05"], ["mean host ms per step", "decode bs>=200"]),
    ],
)
def test_probe_runs_on_cpu(probe, args, expected):
    out = run_probe(probe, *args)
    missing = [line for line in expected if line not in out]
    assert not missing, f"{probe} printed no {missing}:\n{out[-2000:]}"


def test_latency_runs_prefill_their_whole_prompt(tmp_path):
    """latency.py's warm-up and timed runs, as its main() sends them, on a tiny qwen3 (prefix
    cache on, as by default): no prompt token is ever found in the cache."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from latency import fresh_prompt, one_run

    from nanoserve import LLM
    from tests.tiny import VOCAB, make_tiny_model

    llm = LLM(str(make_tiny_model(tmp_path / "qwen3", "qwen3")), device="cpu", dtype="float32", max_model_len=1024)
    assert llm.config.enable_prefix_caching
    for run in range(3):
        one_run(llm.engine, [t % VOCAB for t in fresh_prompt(run)], f"r{run}")
    stats = llm.stats()
    assert stats["prefix_cache_query_tokens"] > 0 and stats["prefix_cache_hit_tokens"] == 0, stats


def test_overload_steps_runs_on_cpu(tmp_path):
    """benchmarks/probes/overload_steps.py (the device call's overload probe) on a tiny llama: it
    wraps the scheduler's schedule(), overrides its constants and drives the engine's loop."""
    from tests.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "llama", "llama")
    args = ["--model", str(model), "--load-format", "auto", "--device", "cpu", "--rate", "40", "--num-prompts", "8",
            "--input-len", "40", "--output-len", "6", "--itl-bound", "1", "--max-queued", "8", "--burst-start", "2"]  # fmt: skip
    out = run_probe("overload_steps.py", *args)
    assert "burst 2.0 -> 0.1" in out and "8 requests served" in out, out
    for line in ("ITL  p50", "TTFT p50", "steps with decode rows over 1 ms", "queue over time"):
        assert line in out, out
    assert "  burst " not in out, out  # --burst-start 2: the queue can never be more than all of it
