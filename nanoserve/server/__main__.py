"""`python -m nanoserve.server serve|chat ...`: the server subcommands without the full CLI."""

from __future__ import annotations

import argparse
import sys

from nanoserve.server.commands import register


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanoserve.server")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `serve --dp` hands it to its replicas
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
