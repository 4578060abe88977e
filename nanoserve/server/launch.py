"""Starting and stopping the server: engine process, HTTP socket, uvicorn, signals, exit code.

Process layout of `nanoserve serve`:

    API server process (this one; asyncio + uvicorn)       engine process (spawned child)
      HTTP, OpenAI protocol, tokenize, detokenize,  --ZMQ-->  LLMEngine.step() loop
      stream, metrics                               <--ZMQ--  (scheduler + model)

Invariants:
- The URL is logged only once the model is loaded and the socket accepts connections.
- SIGINT/SIGTERM (first): stop accepting, give open requests a short grace, abort the rest, stop
  the engine (killing its process group if it lingers), exit 0. A second signal forces the exit.
  During model loading a signal stops the loading at once.
- If the engine dies, requests in flight get 503 (open streams an error event), the server logs
  why and exits with code 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from dataclasses import dataclass

import uvicorn

from nanoserve.heap import DeferredFullCollections, GcPauseWatch, freeze_startup_heap
from nanoserve.server.app import ServerState, build_app
from nanoserve.server.chat_features import ChatFeatures, ChatOptions
from nanoserve.server.engine_client import EngineClient, EngineStartError
from nanoserve.server.metrics import ServerMetrics

logger = logging.getLogger("nanoserve.server")

GRACEFUL_SHUTDOWN_S = 2  # open streams get this long to finish after a shutdown signal
ENGINE_STOP_GRACE_S = 3  # then the engine process gets this long before it is killed
# How long an idle HTTP connection stays open. It must outlast the idle expiry of the client
# pools that keep connections (httpx, so the openai SDK: 5 s; aiohttp: 15 s; Go's net/http and
# reqwest: 90 s): at uvicorn's own default of 5 s, a pool could send a request on a connection
# at the moment the server closed it, and the request failed on the client with nothing in the
# server's log (aiohttp: ServerDisconnectedError; benchmarks/results/2026-11-28.md).
KEEP_ALIVE_S = 120.0


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: `_serve` installs ours on the running loop."""

    @contextlib.contextmanager
    def capture_signals(self):  # uvicorn >= 0.29
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


@dataclass(frozen=True)
class ServerLimits:
    """Admission control, watchdog and CORS of the API server (flags of `nanoserve serve`)."""

    max_queued_requests: int | None = None  # requests not yet scheduled; more are refused with 503
    queue_timeout_s: float | None = None  # a request not scheduled within this is answered 503
    watchdog_timeout_s: float = 60.0  # /health is 503 while the engine has work and no step for this long
    allowed_origins: tuple[str, ...] = ()  # CORS; empty: off
    keep_alive_s: float = KEEP_ALIVE_S  # an idle HTTP connection is closed after this long

    def __post_init__(self):
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be at least 1, got {self.max_queued_requests}")
        if self.queue_timeout_s is not None and self.queue_timeout_s <= 0:
            raise ValueError(f"--queue-timeout must be positive, got {self.queue_timeout_s}")
        if self.watchdog_timeout_s <= 0:
            raise ValueError(f"--watchdog-timeout must be positive, got {self.watchdog_timeout_s}")
        if self.keep_alive_s <= 0:
            raise ValueError(f"--timeout-keep-alive must be positive, got {self.keep_alive_s}")


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it. A response goes out as two writes (head, then body);
    # with Nagle's algorithm the body waited for the client's delayed ACK of the head, 40 ms
    # on Linux, on every request of a kept-alive connection (the openai SDK's pool, smg's).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.set_inheritable(False)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def launch_info(config, info) -> dict:
    """The launch settings /server_info and /model_info report (fields named as SGLang's)."""
    return {
        "model_path": config.model,
        "tokenizer_path": config.tokenizer or config.model,
        "model_type": info.model_type,
        "tp_size": config.tensor_parallel_size,
        "max_running_requests": config.max_num_seqs,
        "page_size": config.page_size,
        "chunked_prefill_size": config.chunked_prefill_size,
        "dtype": config.dtype,
        "device": config.device,
        "enable_prefix_caching": config.enable_prefix_caching,
        "speculative_algorithm": config.speculative_algorithm,
    }


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def run_server(
    config,
    served_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    engine_factory: str | None = None,
    show_examples: bool = False,
    limits: ServerLimits | None = None,
    chat: ChatOptions | None = None,
) -> int:
    """Serve until a signal (exit code 0) or until the engine dies or fails to load (code 1)."""
    setup_logging()
    try:
        sock = bind_socket(host, port)  # bind before loading: a busy port fails fast
    except OSError as exc:
        logger.error("cannot listen on %s:%s: %s", host, port, exc)
        return 1
    try:
        return asyncio.run(
            _serve(
                config,
                served_name,
                sock,
                api_key,
                engine_factory,
                show_examples,
                limits or ServerLimits(),
                chat or ChatOptions(),
            )
        )
    finally:
        sock.close()


def examples(url: str, model: str, api_key: str | None) -> str:
    """A ready-to-paste curl command and openai client snippet for this server."""
    auth = f' -H "Authorization: Bearer {api_key}"' if api_key else ""
    return f"""
Try it:

  curl {url}/v1/chat/completions -H "Content-Type: application/json"{auth} \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 64}}'

  python -c '
from openai import OpenAI
client = OpenAI(base_url="{url}/v1", api_key="{api_key or "none"}")
stream = client.chat.completions.create(model="{model}", stream=True, max_tokens=64,
    messages=[{{"role": "user", "content": "Write a haiku about the sea."}}])
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()'

  nanoserve chat --url {url}{" --api-key " + api_key if api_key else ""}
"""


async def _serve(
    config,
    served_name: str,
    sock: socket.socket,
    api_key: str | None,
    engine_factory,
    show_examples: bool,
    limits: ServerLimits,
    chat: ChatOptions,
) -> int:
    loop = asyncio.get_running_loop()
    client = EngineClient(
        config,
        served_name,
        engine_factory,
        max_queued_requests=limits.max_queued_requests,
        queue_timeout_s=limits.queue_timeout_s,
    )
    server: _Server | None = None
    main_task = asyncio.current_task()
    exit_code = 0

    def on_signal(signum: int) -> None:
        if server is None:  # still loading: stop right away
            logger.info("got %s while loading; stopping", signal.Signals(signum).name)
            main_task.cancel()
        elif server.should_exit:
            server.force_exit = True
        else:
            logger.info("got %s; shutting down", signal.Signals(signum).name)
            server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)

    try:
        logger.info("loading model %s in the engine process ...", config.model)
        try:
            info = await client.start()
        except EngineStartError as exc:
            logger.error("%s", exc)
            return 1
        except asyncio.CancelledError:
            return 0

        try:
            features = ChatFeatures(info.tokenizer, chat)
        except ValueError as exc:
            logger.error("%s", exc)
            return 1
        state = ServerState(
            client=client,
            served_name=served_name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            tokenizer=info.tokenizer,
            metrics=ServerMetrics(served_name),
            api_key=api_key,
            watchdog_timeout_s=limits.watchdog_timeout_s,
            allowed_origins=list(limits.allowed_origins) or None,
            chat=features,
            task=info.task,
            hidden_size=info.hidden_size,
            launch=launch_info(config, info),
        )
        uv_config = uvicorn.Config(
            build_app(state),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            timeout_keep_alive=limits.keep_alive_s,
        )
        server = _Server(uv_config)
        # Full collections stall every stream (heap.py): freeze the startup heap, and run them
        # only while no request is in flight, or every few minutes under constant load.
        freeze_startup_heap(logger, "API server")
        gc_watch = GcPauseWatch(logger).install()
        full_collections = DeferredFullCollections(lambda: client.num_tracked_requests == 0).start()

        def on_death(reason: str) -> None:
            nonlocal exit_code
            exit_code = 1
            logger.error("the engine is gone; the server exits (requests in flight were answered 503)")
            # A moment for the 503s already queued to be written, then stop.
            loop.call_later(0.5, setattr, server, "should_exit", True)

        client.on_death = on_death

        async def announce() -> None:
            while not server.started:
                await asyncio.sleep(0.05)
            url = url_of(sock)
            logger.info("nanoserve is ready: serving '%s' at %s (OpenAI API: %s/v1)", served_name, url, url)
            if show_examples:
                print(examples(url, served_name, api_key), flush=True)

        async def collect_when_due() -> None:
            try:
                while True:
                    await asyncio.sleep(1.0)
                    full_collections.tick()
            except Exception:  # never leave the process without full collections
                logger.exception("deferred full collections failed; the collector's own schedule is back")
                full_collections.stop()

        announcer = loop.create_task(announce())
        collector = loop.create_task(collect_when_due())
        try:
            await server.serve(sockets=[sock])
        finally:
            announcer.cancel()
            collector.cancel()
            full_collections.stop()
            gc_watch.remove()
        return exit_code
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await client.shutdown(ENGINE_STOP_GRACE_S)
        logger.info("server stopped")
