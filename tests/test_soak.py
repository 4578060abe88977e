"""benchmarks/soak.py's CPU version: a real `nanoserve serve` with SmolLM2-135M under 45 s of the
changing mix (three 15-second cycles: steady, a burst above capacity, steady, idle).

soak.py itself checks that every request ended as its kind expects (200 with a complete answer,
the expected 4xx for bad input, or 503 + Retry-After), that the engine's counters show no KV page
or request slot held once the load stops, that resident memory stayed flat and the last cycle's
ITL p99 stayed near the first's (within 50% here, for 15-second cycles), and that the server logged no error. Here we also check that
the mix reached what it is meant to: every kind ran, bursts were refused in part, and clients
walked away mid-stream."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_soak_on_cpu(tmp_path):
    report_path = tmp_path / "soak.json"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "soak.py"),
        "--duration", "45", "--cycle", "15", "--rate", "2", "--burst", "12", "--max-tokens", "8",
        "--max-num-seqs", "8", "--max-queued-requests", "8",
        "--server-arg=--device", "--server-arg=cpu", "--server-arg=--max-model-len", "--server-arg=512",
        "--server-arg=--kv-cache-tokens", "--server-arg=4096",
        # A 15-second cycle gives the ITL p99 a few hundred gaps, so it moves more from cycle to
        # cycle than a minute's does: the CI run allows 50% where a long soak allows 20%, over the
        # whole cycle (its steady phase streams about 50 gaps, too few for a 99th percentile).
        "--latency-tolerance", "0.5", "--latency-phase", "cycle",
        "--output-json", str(report_path),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["passed"] and all(c["ok"] for c in report["checks"].values()), report["checks"]
    assert {"every request ended as expected", "no KV page or request slot leaked", "rss_mb_engine flat"} <= set(
        report["checks"]
    )
    summary = report["checks"]["every request ended as expected"]["detail"]
    for kind in ("completion", "chat_stream", "structured", "tools", "n2", "abort", "bad"):
        assert f"{kind} " in summary, summary
    assert sum(w["refused_503"] for w in report["windows"]) > 0, "no burst went above capacity"
    counters = report["counters_after"]
    assert counters["nanoserve_request_slots_free"] == counters["nanoserve_request_slots_total"] == 8


def test_the_latency_check_compares_the_steady_phase():
    """By default the latency check compares the steady phase's ITL p99 (requests sent before the
    burst), so a burst's stalls in the last cycle do not fail it; `--latency-phase cycle` does."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import soak

    def stream(t: float, gap_s: float) -> soak.Outcome:
        return soak.Outcome("chat_stream", t, status=200, ok=True, ttft=0.01, e2e=1.0, itl=[gap_s] * 200)

    outcomes = []
    for c, burst_gap in enumerate((0.010, 0.010, 0.050)):  # the last cycle's burst stalls 5x longer
        outcomes += [stream(10 * c + 1, 0.002), stream(10 * c + 2, 0.002), stream(10 * c + 5, burst_gap)]
    rows = soak.windows(outcomes, [], cycle=10, duration=30, lags=[(1.0, 0.5), (12.0, 3.0)])
    assert [r["itl_p99_steady_ms"] for r in rows] == pytest.approx([2.0, 2.0, 2.0])
    assert rows[2]["itl_p99_ms"] == pytest.approx(50.0) and rows[1]["client_lag_max_ms"] == 3.0
    for phase, ok in (("steady", True), ("cycle", False)):
        args = argparse.Namespace(latency_phase=phase, latency_tolerance=0.2, max_growth=0.05)
        result = soak.checks(outcomes, rows, {}, "", args)
        assert result[f"ITL p99 ({phase}) of the last cycle near the first"][0] is ok


def test_a_terminated_soak_stops_its_server():
    """`timeout` ends a soak with SIGTERM: its server (in a session of its own, so no signal to
    the soak reaches it) must not outlive it, holding a GPU."""
    script = (
        "import sys, time; sys.path.insert(0, 'benchmarks'); import soak; soak.stop_servers_on_term(); "
        "s = soak.Server([], None, cmd=[sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(s.proc.pid, flush=True); time.sleep(60)"
    )
    soak = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    server_pid = int(soak.stdout.readline())
    os.kill(server_pid, 0)  # running
    soak.send_signal(signal.SIGTERM)
    assert soak.wait(30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(server_pid, signal.SIGKILL)
    raise AssertionError("the soak's server outlived a SIGTERM to the soak")
