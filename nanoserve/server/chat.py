"""`nanoserve chat`: an interactive terminal chat that streams answers and keeps the conversation.

Two backends behind one method, `stream(messages) -> Iterator[str]` (text pieces as they come):
- `HttpChat` talks to a running server's /v1/chat/completions (SSE) with httpx;
- `LocalChat` loads the model in this process and drives LLMEngine.step() itself.

Commands: `/reset` forgets the conversation (keeps the system prompt), `/exit` (or Ctrl-D) quits.
Ctrl-C while an answer streams stops that answer (the request is aborted) and keeps the chat;
the partial answer is kept in the conversation.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator


class HttpChat:
    def __init__(self, url: str, api_key: str | None, params: dict):
        import httpx

        self._base = url.rstrip("/")
        self._base = self._base.removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(headers=headers, timeout=httpx.Timeout(None, connect=10.0))
        self._params = params
        resp = self._http.get(f"{self._base}/v1/models")
        _raise_for_error(resp)
        self.model = resp.json()["data"][0]["id"]

    def stream(self, messages: list[dict]) -> Iterator[str]:
        body = {"model": self.model, "messages": messages, "stream": True, **self._params}
        with self._http.stream("POST", f"{self._base}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                resp.read()
                _raise_for_error(resp)
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message", "server error"))
                for choice in chunk.get("choices", []):
                    text = choice.get("delta", {}).get("content")
                    if text:
                        yield text


def _raise_for_error(resp) -> None:
    if resp.status_code == 200:
        return
    try:
        message = resp.json()["error"]["message"]
    except Exception:  # noqa: BLE001 - not our error body; show the raw text
        message = resp.text
    raise RuntimeError(f"HTTP {resp.status_code}: {message}")


class LocalChat:
    def __init__(self, config, params: dict):
        from nanoserve.engine.llm_engine import LLMEngine

        self._engine = LLMEngine(config)
        self._tokenizer = self._engine.tokenizer
        if self._tokenizer is None or not getattr(self._tokenizer, "chat_template", None):
            raise SystemExit(f"nanoserve chat: model {config.model!r} has no chat template")
        self._params = params
        self.model = config.model

    def stream(self, messages: list[dict]) -> Iterator[str]:
        from nanoserve.detokenizer import SampleDetokenizer
        from nanoserve.sampling_params import SamplingParams

        text = self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        room = self._engine.max_model_len - len(ids)
        if room < 1:
            raise RuntimeError("the conversation no longer fits the model's context; /reset to start over")
        params = SamplingParams(
            temperature=self._params["temperature"],
            top_p=self._params["top_p"],
            max_tokens=min(self._params["max_tokens"], room),
        )
        request_id = uuid.uuid4().hex
        self._engine.add_request(request_id, ids, params)
        detok = SampleDetokenizer(self._tokenizer, ids, params)
        done = False
        try:
            while not done:
                for update in self._engine.step():
                    if update.request_id != request_id:
                        continue
                    piece = detok.append(update.new_token_ids)
                    if update.finished:
                        piece += detok.flush()
                        done = True
                    if piece:
                        yield piece
        finally:
            if not done:  # interrupted: free the request's pages
                self._engine.abort_request(request_id)
                while self._engine.has_unfinished_requests():
                    self._engine.step()


def _read_line(session) -> str:
    if session is not None:
        return session.prompt("you> ")
    return input("you> ")


def run_chat(args) -> int:
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p}
    try:
        if args.url:
            backend = HttpChat(args.url, args.api_key, params)
        else:
            from nanoserve.config import engine_config_from_args

            print(f"loading {args.model} ...", file=sys.stderr)
            backend = LocalChat(engine_config_from_args(args), params)
    except (RuntimeError, OSError, ValueError) as exc:
        print(f"nanoserve chat: {exc}", file=sys.stderr)
        return 1

    session = None
    if sys.stdin.isatty():
        try:
            from prompt_toolkit import PromptSession

            session = PromptSession()
        except ImportError:
            pass

    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    print(f"chatting with {backend.model}; /reset clears the conversation, /exit quits", file=sys.stderr)
    while True:
        try:
            line = _read_line(session).strip()
        except EOFError:
            break
        except KeyboardInterrupt:
            continue
        if not line:
            continue
        if line == "/exit":
            break
        if line == "/reset":
            messages = list(system)
            print("(conversation cleared)", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        answer = []
        try:
            for piece in backend.stream(messages):
                answer.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            sys.stdout.write(" [interrupted]")
        except Exception as exc:  # noqa: BLE001 - a failed turn must not end the chat
            print(f"\n[error: {exc}]", file=sys.stderr)
            messages.pop()
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": "".join(answer)})
    return 0
