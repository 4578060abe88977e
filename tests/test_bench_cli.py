"""`nanoserve bench latency` and `nanoserve bench offline` on a tiny random model (CPU), through
the CLI's own entry point: the reports count what ran."""

from __future__ import annotations

import json

from nanoserve.cli import main
from tests.tiny import make_tiny_model

ENGINE = ["--device", "cpu", "--max-model-len", "64", "--kv-cache-tokens", "512", "--input-len", "8"]


def test_bench_latency_and_offline(tmp_path, capsys):
    model = str(make_tiny_model(tmp_path / "tiny", "llama"))
    lat = tmp_path / "latency.json"
    args = ["bench", "latency", "--model", model, *ENGINE, "--output-len", "4", "--batch-size", "2"]
    assert main([*args, "--num-iters", "3", "--num-iters-warmup", "1", "--output-json", str(lat)]) == 0
    report = json.loads(lat.read_text())
    assert len(report["latencies_s"]) == 3 and report["latencies_s"] == sorted(report["latencies_s"])
    assert 0 < report["avg_latency_s"] and report["batch_size"] == 2
    off = tmp_path / "offline.json"
    args = ["bench", "throughput", "--model", model, *ENGINE, "--output-len", "5", "--num-prompts", "6"]
    assert main([*args, "--output-json", str(off)]) == 0
    report = json.loads(off.read_text())
    assert report["num_prompts"] == 6 and report["total_output_tokens"] == 30  # ignore_eos: every token
    assert report["output_tokens_per_s"] > 0
    assert "6 requests in" in capsys.readouterr().out
