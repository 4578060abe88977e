"""The gateway in front of nanoserve replicas: smg (Shepherd Model Gateway), started as a process.

nanoserve does not route requests itself. `nanoserve serve --dp N` starts smg in front of its N
replicas (nanoserve.server.replicas), and `nanoserve router` is a thin wrapper over `smg launch`
for replicas on several hosts: worker URLs, or smg's file or Kubernetes discovery.

Owns: the check that smg is installed (the `router` extra), the smg command line with the
settings nanoserve's replicas need, and the `router` subcommand.

Settings it passes, and why:
- health checks every HEALTH_INTERVAL_S, a replica out of rotation after HEALTH_FAILURES failed
  checks and back after one good one: a replica that dies is restarted by its supervisor within
  seconds, and smg's default (60 s between checks) would keep sending requests to it meanwhile;
- `--disable-tokenizer-autoload`: smg would otherwise try to fetch the model's tokenizer from
  the Hugging Face Hub; the replicas tokenize, and cache-aware routing matches request text;
- its Prometheus listener on a free local port (smg's default port 29000 would collide between
  two gateways on one host) unless the caller names one.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys

POLICIES = ("cache_aware", "round_robin", "power_of_two", "least_load", "prefix_hash", "random")
DEFAULT_POLICY = "cache_aware"
ROUTER_EXTRA = "pip install 'nanoserve[router]'"
HEALTH_INTERVAL_S = 1
HEALTH_FAILURES = 2


class GatewayUnavailable(RuntimeError):
    """smg is not installed."""


def require_smg(what: str) -> None:
    """Raise GatewayUnavailable, naming the extra to install, when smg cannot be imported."""
    if importlib.util.find_spec("smg") is None:
        raise GatewayUnavailable(f"{what} needs the smg gateway, which is not installed: {ROUTER_EXTRA}")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def smg_command(
    *,
    host: str,
    port: int,
    policy: str,
    worker_urls: list[str] | None = None,
    discovery_file: str | None = None,
    api_key: str | None = None,
    prometheus_port: int | None = None,
    extra: list[str] | None = None,
) -> list[str]:
    """`python -m smg launch ...` for these workers (URLs or a discovery manifest)."""
    if policy not in POLICIES:
        raise ValueError(f"router policy must be one of {POLICIES}, got {policy!r}")
    cmd = [sys.executable, "-m", "smg", "launch", "--host", host, "--port", str(port), "--policy", policy]
    if worker_urls:
        cmd += ["--worker-urls", *worker_urls]
    if discovery_file:
        cmd += ["--discovery-provider", "file", "--discovery-file", discovery_file]
    cmd += [
        "--health-check-interval-secs",
        str(HEALTH_INTERVAL_S),
        "--health-failure-threshold",
        str(HEALTH_FAILURES),
        "--health-success-threshold",
        "1",
        "--disable-tokenizer-autoload",
        "--disable-circuit-breaker",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(prometheus_port or free_port()),
        "--log-level",
        "warn",
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd + list(extra or [])


# ----------------------------------------------------------------------------------- `nanoserve router`


def register(subparsers) -> None:
    router = subparsers.add_parser(
        "router",
        help="the smg gateway in front of running nanoserve servers (replicas on other hosts)",
        description="Start the smg gateway in front of nanoserve servers started elsewhere, named by URL or by "
        "a discovery manifest. Arguments after `--` go to `smg launch` unchanged.",
    )
    router.add_argument("--worker-urls", nargs="+", default=None, metavar="URL", help="the replicas' base URLs")
    router.add_argument(
        "--discovery-file",
        default=None,
        metavar="FILE",
        help='smg file discovery: a JSON manifest {"version": 1, "workers": [{"url": ...}]}, reread on change',
    )
    router.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    router.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    router.add_argument("--router-policy", choices=POLICIES, default=DEFAULT_POLICY, help="default cache_aware")
    router.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' at the gateway")
    router.add_argument(
        "--prometheus-port", type=int, default=None, help="the gateway's own /metrics port (default: a free one)"
    )
    router.add_argument("smg_args", nargs=argparse.REMAINDER, help="after --: more `smg launch` arguments")
    router.set_defaults(func=_router)


def _router(args: argparse.Namespace) -> int:
    if bool(args.worker_urls) == bool(args.discovery_file):
        raise SystemExit("nanoserve router: give --worker-urls or --discovery-file (one of them)")
    try:
        require_smg("nanoserve router")
    except GatewayUnavailable as exc:
        raise SystemExit(f"nanoserve router: {exc}") from None
    extra = args.smg_args[1:] if args.smg_args[:1] == ["--"] else args.smg_args
    cmd = smg_command(
        host=args.host,
        port=args.port,
        policy=args.router_policy,
        worker_urls=args.worker_urls,
        discovery_file=args.discovery_file,
        api_key=args.api_key,
        prometheus_port=args.prometheus_port,
        extra=extra,
    )
    # smg takes over this process: its signals, its exit code.
    os.execv(cmd[0], cmd)
    return 0  # not reached
