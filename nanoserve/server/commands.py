"""The `serve`, `chat` and `router` subcommands of the `nanoserve` CLI (registered by nanoserve.cli).

nanoserve serve [MODEL] [engine flags] [--host H] [--port P] [--api-key KEY] [--dp N --router-policy P]
nanoserve chat [--url URL | MODEL engine flags] [--system TEXT] [--max-tokens N] ...
nanoserve router --worker-urls URL... | --discovery-file FILE   (nanoserve.server.gateway)
"""

from __future__ import annotations

import argparse

from nanoserve.config import add_engine_args, engine_config_from_args
from nanoserve.models.registry import DEFAULT_MODEL
from nanoserve.server.chat_features import ChatOptions
from nanoserve.server.gateway import DEFAULT_POLICY, POLICIES
from nanoserve.server.gateway import register as register_router
from nanoserve.server.harmony import NAME as HARMONY
from nanoserve.server.reasoning import FORMATS as REASONING_FORMATS
from nanoserve.server.tool_parsers import AUTO, NONE
from nanoserve.server.tool_parsers import FORMATS as TOOL_FORMATS
from nanoserve.switches import api_key_from_env


def register(subparsers) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="start the OpenAI-compatible HTTP server",
        description="Start the OpenAI-compatible HTTP server (API server process + engine process).",
    )
    _add_model_args(serve, f"model alias, GGUF file or HF directory (default {DEFAULT_MODEL})")
    add_engine_args(serve)
    g = serve.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    g.add_argument(
        "--api-key",
        default=api_key_from_env(),
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $NANOSERVE_API_KEY)",
    )
    g.add_argument("--served-model-name", default=None, help="the model name clients send (default: MODEL)")
    g.add_argument("--show-examples", action="store_true", help="print a curl command and an openai snippet when ready")
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="most requests waiting to be scheduled; more are refused at once with 503 + Retry-After (default: no limit)",
    )
    g.add_argument(
        "--queue-timeout",
        type=float,
        default=None,
        help="seconds a request may wait to be scheduled before it is answered 503 (default: no limit)",
    )
    g.add_argument(
        "--watchdog-timeout",
        type=float,
        default=60.0,
        help="/health answers 503 while the engine has work but finished no step for this many seconds (default 60)",
    )
    g.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=None,
        help="seconds an idle HTTP connection stays open; keep it above the idle time of clients' connection pools "
        "(default 120)",
    )
    g.add_argument(
        "--allowed-origins",
        default=None,
        metavar="ORIGINS",
        help="enable CORS for these comma-separated origins ('*' for any; default: CORS off)",
    )
    g = serve.add_argument_group("replicas (needs the router extra: pip install 'nanoserve[router]')")
    g.add_argument(
        "--dp",
        type=int,
        default=None,
        metavar="N",
        help="N replicas of the server, each on its own --tp GPUs (on CPU, N processes), behind the smg gateway on "
        "--host:--port; a replica that dies is restarted",
    )
    g.add_argument(
        "--router-policy",
        choices=POLICIES,
        default=DEFAULT_POLICY,
        help=f"with --dp: how the gateway picks a replica (default {DEFAULT_POLICY}: the one holding the longest "
        "shared prefix, unless it is much busier)",
    )
    g = serve.add_argument_group("chat")
    g.add_argument(
        "--chat-template", default=None, metavar="FILE", help="a Jinja chat template to use instead of the model's"
    )
    g.add_argument(
        "--tool-call-parser",
        choices=[AUTO, NONE, *sorted([*TOOL_FORMATS, HARMONY])],
        default=AUTO,
        help="parse tool calls in this format (default auto: picked from the chat template and logged; "
        "none: tool_choice 'auto' is refused, 'required' and named ones use hermes)",
    )
    g.add_argument(
        "--reasoning-parser",
        choices=sorted([*REASONING_FORMATS, HARMONY]),
        default=None,
        help="return <think>...</think> (harmony: gpt-oss's analysis channel) as reasoning_content; constraints then "
        "apply after the thinking",
    )
    serve.set_defaults(func=_serve)

    chat = subparsers.add_parser(
        "chat",
        help="interactive terminal chat (against a server, or with the model in-process)",
        description="Interactive chat that streams answers and keeps the conversation. "
        "Commands: /reset clears the conversation, /exit quits.",
    )
    _add_model_args(chat, "model to load in-process when no --url is given")
    add_engine_args(chat)
    g = chat.add_argument_group("chat")
    g.add_argument(
        "--url", default=None, help="a running nanoserve (or other OpenAI) server, e.g. http://127.0.0.1:8000"
    )
    g.add_argument("--api-key", default=api_key_from_env(), help="bearer key for --url")
    g.add_argument("--system", default=None, help="a system prompt")
    g.add_argument("--max-tokens", type=int, default=512)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=0.95)
    chat.set_defaults(func=_chat)
    register_router(subparsers)


def _add_model_args(parser: argparse.ArgumentParser, help_text: str) -> None:
    # `nanoserve serve MODEL` as the issue writes it, and `--model MODEL` like `nanoserve generate`.
    parser.add_argument("model_positional", nargs="?", default=None, metavar="MODEL", help=help_text)
    parser.add_argument("--model", default=None, help="same as the positional MODEL")


def _resolve_model(args: argparse.Namespace, command: str) -> None:
    if args.model_positional and args.model and args.model_positional != args.model:
        raise SystemExit(f"nanoserve {command}: two different models given ({args.model_positional!r}, {args.model!r})")
    args.model = args.model_positional or args.model or DEFAULT_MODEL


def _serve(args: argparse.Namespace) -> int:
    _resolve_model(args, "serve")
    from nanoserve.server.launch import ServerLimits, run_server

    try:
        config = engine_config_from_args(args)
        limits = ServerLimits(
            max_queued_requests=args.max_queued_requests,
            queue_timeout_s=args.queue_timeout,
            watchdog_timeout_s=args.watchdog_timeout,
            **({} if args.timeout_keep_alive is None else {"keep_alive_s": args.timeout_keep_alive}),
            allowed_origins=tuple(o.strip() for o in (args.allowed_origins or "").split(",") if o.strip()),
        )
        chat = ChatOptions(
            chat_template=_read_template(args.chat_template),
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
        )
    except ValueError as exc:
        raise SystemExit(f"nanoserve serve: {exc}") from None
    if args.dp is not None:
        return _serve_replicas(args, config)
    if config.node_rank > 0:  # multi-host tensor parallelism: this host runs worker ranks only
        from nanoserve.distributed.tp_runner import run_worker_node
        from nanoserve.engine.llm_engine import serve_worker_rank

        return run_worker_node(config, serve_worker_rank)
    return run_server(
        config,
        served_name=args.served_model_name or args.model,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        show_examples=args.show_examples,
        limits=limits,
        chat=chat,
    )


def _serve_replicas(args: argparse.Namespace, config) -> int:
    from nanoserve.server.gateway import GatewayUnavailable, require_smg
    from nanoserve.server.launch import setup_logging
    from nanoserve.server.replicas import DataParallelServer

    try:
        if args.dp < 1:
            raise ValueError(f"--dp must be at least 1, got {args.dp}")
        if config.nnodes > 1:
            raise ValueError(
                "--dp runs replicas on this host; for several hosts run `serve` on each and "
                "`nanoserve router` in front (docs/scale_out.md)"
            )
        require_smg("--dp")
        argv = getattr(args, "argv", None) or []
        supervisor = DataParallelServer(
            serve_argv=argv[argv.index("serve") + 1 :] if "serve" in argv else [],
            dp=args.dp,
            tp=config.tensor_parallel_size,
            device=config.device,
            host=args.host,
            port=args.port,
            policy=args.router_policy,
            api_key=args.api_key,
            served_name=args.served_model_name or args.model,
        )
    except (ValueError, GatewayUnavailable) as exc:
        raise SystemExit(f"nanoserve serve: {exc}") from None
    setup_logging()
    return supervisor.run()


def _read_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"--chat-template: cannot read {path}: {exc.strerror}") from None


def _chat(args: argparse.Namespace) -> int:
    _resolve_model(args, "chat")
    from nanoserve.server.chat import run_chat

    return run_chat(args)
