"""`nanoserve bench`: benchmarks installed with the package.

- `serve` loads a running server (serving.py; `benchmarks/serving.py` is the same command);
- `latency` and `offline` run the engine in this process (offline.py).

Registered on the CLI by nanoserve.cli.
"""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    from nanoserve.bench import offline, serving

    bench = subparsers.add_parser("bench", help="benchmarks: serve (a running server), latency, offline")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    serve = kinds.add_parser(
        "serve",
        help="load a running OpenAI-compatible server: TTFT, ITL, TPOT, throughput, goodput",
        description=serving.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serving.add_serve_args(serve)
    serve.set_defaults(func=serving.run)
    for name, aliases, add_args, run, help_text in (
        ("latency", [], offline.add_latency_args, offline.run_latency, "time one batch end to end, in this process"),
        (
            "offline",
            ["throughput"],
            offline.add_offline_args,
            offline.run_offline,
            "offline throughput, in this process",
        ),
    ):
        cmd = kinds.add_parser(
            name,
            aliases=aliases,
            help=help_text,
            description=offline.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_args(cmd)
        cmd.set_defaults(func=run)
