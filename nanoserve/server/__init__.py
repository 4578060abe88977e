"""The HTTP front end: an OpenAI-compatible API server in front of an engine process.

Modules, one job each:
- `protocol`: request models and strict validation, OpenAI error bodies;
- `messages`: the typed messages exchanged with the engine process over ZMQ;
- `engine_process`: the engine process's loop around LLMEngine;
- `engine_client`: the API server's side of that link (spawn, route, watch, stop);
- `generation`: one HTTP request's engine requests, detokenization, stop strings, metrics;
- `metrics`: the Prometheus registry;
- `app`: FastAPI routes and response shapes (JSON and SSE);
- `launch`: sockets, uvicorn, signals and exit codes of `nanoserve serve`;
- `chat`: the interactive terminal chat; `commands`: the `serve`/`chat` subcommands.
"""
