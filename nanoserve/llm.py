"""The offline API: `LLM(model, **engine_args).generate(prompts, SamplingParams)`.

Owns: turning prompts (text, token ids or chat conversations) into engine requests, driving
the engine until they finish, detokenizing and applying stop strings, and returning
`RequestOutput`s in input order. Nobody streams here, so a sample without stop strings is
added with `stream=False`: the engine reports it once, when it ends, and the loop does no
per-token work for it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from nanoserve.config import EngineConfig
from nanoserve.detokenizer import SampleDetokenizer
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.models.registry import DEFAULT_MODEL
from nanoserve.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from nanoserve.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, *, config: EngineConfig | None = None, **engine_args):
        """Engine arguments are EngineConfig's fields; or pass a ready `config`. Either is run
        with the offline defaults (`EngineConfig.for_offline`: under the mixed policy, steps
        of chunked_prefill_size tokens unless max_num_batched_tokens is given)."""
        config = config if config is not None else EngineConfig.create(model, **engine_args)
        self.config = config.for_offline()
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel worker ranks (also done when the LLM is garbage
        collected and at exit); a no-op at TP=1."""
        self.engine.shutdown()

    # ---- prompts -----------------------------------------------------------------------

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token-id prompts or tokenizer=")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        # Token types checked once per distinct type, not per token (prompts are long).
        if isinstance(prompt, (list, tuple)) and all(
            issubclass(t, int) and not issubclass(t, bool) for t in set(map(type, prompt))
        ):
            return None, list(prompt)
        raise TypeError("a prompt is a string or a list of token ids")

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        encoded = [self._encode(p) for p in prompts]
        for _, ids in encoded:  # reject a bad prompt before anything is queued
            self.engine.validate_prompt(ids)
        for spec in {p.structured_outputs.key(): p.structured_outputs for p in params if p.structured_outputs}.values():
            self.engine.grammar_service().compile(spec)  # a bad schema raises GrammarError (a ValueError) here
        return self._run(encoded, params, use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Embeddings of `prompts` (an LLM made with task="embed"): each the last token's final
        hidden state, L2-normalized (nanoserve.engine.pooling), in input order. The prompts
        run as prefill batches; no KV is kept after them."""
        if self.engine.pooling is None:
            raise ValueError('embed() needs an embedding model: LLM(model, task="embed")')
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        encoded = [self._encode(p)[1] for p in prompts]
        for ids in encoded:
            self.engine.validate_prompt(ids)
        params = SamplingParams(temperature=0.0, max_tokens=1)
        order = [str(next(self._ids)) for _ in encoded]
        for rid, ids in zip(order, encoded):
            self.engine.add_request(rid, ids, params, stream=False)
        vectors: dict[str, list[float]] = {}
        bar = tqdm(total=len(order), desc="embedding", disable=not use_tqdm)
        try:
            while len(vectors) < len(order):
                for up in self.engine.step():
                    vectors[up.request_id] = up.embedding
                    bar.update(1)
        except BaseException:
            self._abort_all(order)
            raise
        finally:
            bar.close()
        return [EmbeddingRequestOutput(rid, ids, EmbeddingOutput(vectors[rid])) for rid, ids in zip(order, encoded)]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations through the model's chat template, which also
        receives `tools` (OpenAI-style function definitions) and `chat_template_kwargs` (e.g.
        {"enable_thinking": False}). The replies are raw text: tool calls and thinking are not
        parsed here (the server's --tool-call-parser and --reasoning-parser do that)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [
            self.tokenizer.apply_chat_template(
                c,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            for c in conversations
        ]
        # The template already holds the special tokens: encode without adding more.
        ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        outputs = self.generate(ids, sampling_params, use_tqdm)
        for out, text in zip(outputs, texts):
            out.prompt = text
        return outputs

    # ---- the loop ----------------------------------------------------------------------

    def _run(self, encoded, params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        detoks: dict[tuple[str, int], SampleDetokenizer | None] = {}
        order = []
        for (text, ids), p in zip(encoded, params):
            rid = str(next(self._ids))
            order.append(rid)
            results[rid] = RequestOutput(rid, text, ids)
            results[rid].outputs = [CompletionOutput(i, "", [], None) for i in range(p.n)]
            for i in range(p.n):
                detoks[(rid, i)] = SampleDetokenizer(self.tokenizer, ids, p) if self.tokenizer else None
            # Only stop strings need the text as it grows; otherwise the engine reports each
            # sample once, finished, and its text is decoded then (the same text: the
            # detokenizer works token by token either way).
            self.engine.add_request(rid, ids, p, stream=bool(self.tokenizer and p.stop_strings))
        remaining = sum(p.n for p in params)
        bar = tqdm(total=remaining, desc="generating", disable=not use_tqdm)
        try:
            while remaining:
                for up in self.engine.step():
                    out = results[up.request_id]
                    sample = out.outputs[up.index]
                    out.num_cached_tokens = up.num_cached_tokens
                    if sample.finish_reason is not None:
                        continue  # stopped by a stop string; its abort echo is dropped
                    detok = detoks[(up.request_id, up.index)]
                    kept = len(up.new_token_ids)
                    if detok is not None:
                        kept = detok.feed(up.new_token_ids)[1]  # cut at a stop string's last token
                    sample.token_ids.extend(up.new_token_ids[:kept])
                    if up.new_logprobs is not None:
                        sample.logprobs = (sample.logprobs or []) + up.new_logprobs[:kept]
                    if detok is not None:
                        if detok.stopped:
                            sample.finish_reason, sample.stop_reason = "stop", detok.stop_reason
                            self.engine.abort_request(up.request_id, up.index)
                        elif up.finished:
                            detok.flush()
                        sample.text = detok.text
                    if sample.finish_reason is None and up.finished:
                        sample.finish_reason = up.finish_reason
                        if up.finish_reason == "stop" and sample.token_ids:
                            sample.stop_reason = sample.token_ids[-1]
                    if sample.finish_reason is not None:
                        remaining -= 1
                        bar.update(1)
        except BaseException:
            self._abort_all(order)
            raise
        finally:
            bar.close()
        # Drain the abort echoes of stop-string samples so the engine is idle.
        while self.engine.has_unfinished_requests() and not self.engine.scheduler.has_work():
            self.engine.step()
        for out in results.values():
            out.finished = True
        return [results[rid] for rid in order]

    def _abort_all(self, request_ids: list[str]) -> None:
        """Leave nothing of these requests behind in the engine (the caller was interrupted)."""
        for rid in request_ids:
            self.engine.abort_request(rid)
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def stats(self) -> dict:
        return self.engine.stats()

    def get_metrics(self) -> dict[str, object]:
        """The engine's counters under vLLM's metric names (speculative decoding's
        `vllm:spec_decode_*` among them), as /metrics exports them."""
        s = self.engine.stats()
        held = s["kv_pages_total"] - s["kv_pages_free"] - s["kv_pages_cached"]
        return {
            "vllm:num_requests_running": s["requests_running"],
            "vllm:num_requests_waiting": s["requests_waiting"],
            "vllm:kv_cache_usage_perc": held / s["kv_pages_total"] if s["kv_pages_total"] else 0.0,
            **{name: value for name, value in s.items() if name.startswith("vllm:")},
        }
