"""Replicas behind the smg gateway, measured with `nanoserve bench serve` (nanoserve/bench/serving.py).

Starts each server configuration in turn, runs the serving benchmark against it and prints one
table (and writes it to $OUT/scale_out.md when OUT is set):

- throughput: all requests at once, output tok/s of `--dp 2` against `--dp 1` (target 1.9x on
  2 GPUs);
- multi-turn: `--num-conversations` x `--turns` conversations that grow on their own history,
  `--dp 2` under cache_aware against round_robin: prefix-cache hit rate and TTFT p50 (target:
  cache_aware 1.5x better in TTFT p50);
- gateway overhead: one replica behind smg (`--dp 1`) against the bare server, all-at-once
  throughput (target within 2%) and TTFT p50 one request at a time (target within 1 ms).

    python benchmarks/scale_out.py --model smollm2-135m --device cpu          # 2 CPU replicas
    python benchmarks/scale_out.py --model llama-3.1-8b --load-format dummy    # 2 GPUs, one each

Engine flags after `--` go to every server unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class Server:
    """`nanoserve serve` (with or without --dp) in a subprocess, ready once its URL is logged."""

    def __init__(self, args: list[str], gateway: bool, log: Path):
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nanoserve.cli", "serve", *args, "--port", "0"],
            cwd=REPO,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )
        pattern = (
            r"nanoserve is ready: .* at (http://\S+) .* through smg" if gateway else r"is ready: .* at (http://\S+) "
        )
        deadline = time.monotonic() + 900
        while not (m := re.search(pattern, log.read_text(errors="replace"))):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
        self.url = m.group(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def bench(url: str, out: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "nanoserve.bench.serving", "--base-url", url, "--output-json", str(out), *extra]
    subprocess.run(cmd, cwd=REPO, check=True)
    return json.loads(out.read_text())["results"][-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--num-prompts", type=int, default=64, help="throughput runs")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--opening-words", type=int, default=64, help="multi-turn: words in each conversation's opening")
    ap.add_argument("--turn-output-len", type=int, default=8)
    ap.add_argument("--latency-prompts", type=int, default=32, help="gateway overhead: requests one at a time")
    ap.add_argument("engine_args", nargs=argparse.REMAINDER, help="after --: flags for every server")
    args = ap.parse_args()
    engine = [args.model, "--device", args.device, "--load-format", args.load_format]
    engine += args.engine_args[1:] if args.engine_args[:1] == ["--"] else args.engine_args
    throughput = ["--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
                  "--random-output-len", str(args.output_len), "--request-rate", "inf", "--random-text"]  # fmt: skip
    latency = ["--num-prompts", str(args.latency_prompts), "--random-input-len", str(args.input_len),
               "--random-output-len", "8", "--max-concurrency", "1", "--random-text", "--seed", "100"]  # fmt: skip
    multiturn = ["--dataset-name", "multiturn", "--num-conversations", str(args.num_conversations), "--turns",
                 str(args.turns), "--random-input-len", str(args.opening_words), "--random-output-len",
                 str(args.turn_output_len)]  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="scale_out_"))
    runs: dict[str, dict] = {}

    def measure(name: str, server_args: list[str], gateway: bool, jobs: dict[str, list[str]]) -> None:
        srv = Server([*engine, *server_args], gateway, tmp / f"{name}.log")
        try:
            for job, flags in jobs.items():
                runs[f"{name}/{job}"] = bench(srv.url, tmp / f"{name}-{job}.json", flags)
        finally:
            srv.stop()

    measure("bare", [], False, {"throughput": throughput, "latency": latency})
    measure("dp1", ["--dp", "1"], True, {"throughput": throughput, "latency": latency})
    measure("dp2_cache_aware", ["--dp", "2"], True, {"throughput": throughput, "multiturn": multiturn})
    measure("dp2_round_robin", ["--dp", "2", "--router-policy", "round_robin"], True, {"multiturn": multiturn})

    def tput(key: str) -> float:
        return runs[key]["output_throughput"]

    def ttft(key: str) -> float:
        return runs[key]["ttft_ms"]["p50"]

    def ratio(a: float, b: float, unit: str = "") -> str:
        return f"{a:.1f} / {b:.1f}{unit} = {a / b:.2f}x"

    ca, rr = runs["dp2_cache_aware/multiturn"], runs["dp2_round_robin/multiturn"]
    dp1, bare = tput("dp1/throughput"), tput("bare/throughput")
    overhead_ms = ttft("dp1/latency") - ttft("bare/latency")
    rows = [
        ("2 replicas / 1, all-at-once output tok/s", ratio(tput("dp2_cache_aware/throughput"), dp1), ">= 1.9x"),
        (
            f"multi-turn {args.num_conversations}x{args.turns}, prefix hits cache_aware / round_robin",
            f"{ca['prefix_hit_rate']:.1%} / {rr['prefix_hit_rate']:.1%}",
            "",
        ),
        (
            "multi-turn TTFT p50 round_robin / cache_aware",
            ratio(ttft("dp2_round_robin/multiturn"), ttft("dp2_cache_aware/multiturn"), " ms"),
            ">= 1.5x",
        ),
        ("gateway overhead: all-at-once output tok/s, dp1 / bare", ratio(dp1, bare), ">= 0.98x"),
        (
            "gateway overhead: TTFT p50 one at a time, dp1 - bare",
            f"{ttft('dp1/latency'):.1f} - {ttft('bare/latency'):.1f} = {overhead_ms:+.2f} ms",
            "<= 1 ms",
        ),
    ]
    failed = {k: v["failed"] for k, v in runs.items() if v["failed"]}
    table = ["| figure | measured | target |", "|---|---|---|", *(f"| {a} | {b} | {c} |" for a, b, c in rows)]
    text = "\n".join(table) + (f"\n\nfailed requests: {failed}" if failed else "") + f"\n\nlogs and reports: {tmp}\n"
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "scale_out.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
