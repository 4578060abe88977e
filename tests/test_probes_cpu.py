"""The probes that reach into the engine's internals run on the CPU (their plumbing modes), so an
engine change that renames what they wrap fails here rather than on a GPU machine later.

- `benchmarks/probes/profile_offline.py --smoke`: wraps `LLMEngine._forward` per step;
- `benchmarks/probes/host_overhead.py`: stubs the forward and times the engine's phases.
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
