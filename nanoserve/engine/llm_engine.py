"""The engine core: requests in, tokens out, one scheduler step at a time.

Owns: the scheduler, the model runner and the sampler for one model; request ids; the
token-level stopping rules (EOS, stop token ids, max_tokens, max_model_len).
Stop *strings* need text and are the front end's job (`nanoserve.detokenizer`), which
aborts a sample once its text contains one.

Invariant: after `step()` returns, every finished request holds no page and no slot, and
each output token was reported exactly once, in order.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from nanoserve.config import EngineConfig
from nanoserve.engine.model_runner import ModelRunner, plan_kv_capacity
from nanoserve.engine.sampler import SampleRow, Sampler
from nanoserve.kvcache.pool import PageAllocator
from nanoserve.models.decoder import kv_heads_per_rank
from nanoserve.models.loader import build_model
from nanoserve.models.registry import resolve_model
from nanoserve.outputs import StepUpdate
from nanoserve.sampling_params import SamplingParams
from nanoserve.scheduler.request import Request, Status
from nanoserve.scheduler.scheduler import ScheduledBatch, Scheduler
from nanoserve.tokenizer import load_tokenizer

log = logging.getLogger("nanoserve")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        if config.tensor_parallel_size != 1:
            raise NotImplementedError("tensor parallelism is not available yet (tensor_parallel_size must be 1)")
        self.config = config
        started = time.perf_counter()
        source = resolve_model(config.model)
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(source.config.torch_dtype)
        self.tokenizer = load_tokenizer(source, config.tokenizer)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            source = type(source)(source.kind, source.path, source.config.with_eos([self.tokenizer.eos_token_id]), True)
        cfg = source.config
        wanted_len = config.max_model_len or cfg.max_position_embeddings
        torch.manual_seed(config.seed)
        model = build_model(source, config.load_format, self.dtype, self.device, config.seed, max_positions=wanted_len)
        plan = plan_kv_capacity(config, cfg, kv_heads_per_rank(cfg, model.tp), self.dtype, self.device)
        self.runner = ModelRunner(config, model, plan, self.device, self.dtype)
        self.max_model_len = min(wanted_len, plan.num_tokens)
        self.model_config = cfg
        self.allocator = PageAllocator(plan.num_pages)
        self.scheduler = Scheduler(
            self.allocator,
            plan.page_size,
            config.max_num_seqs,
            config.chunked_prefill_size,
            copy_page=self.runner.kv_cache.copy_page,
        )
        self.sampler = Sampler(self.device, config.seed)
        self._arrivals = itertools.count()
        self._pending_updates: list[StepUpdate] = []
        log.info(
            "nanoserve: %s on %s (%s), attention=%s, KV cache %d tokens (%d pages of %d, %.2f GiB), "
            "max_model_len %d, ready in %.1f s",
            cfg.name,
            self.device,
            str(self.dtype).removeprefix("torch."),
            self.runner.backend.name,
            plan.num_tokens,
            plan.num_pages,
            plan.page_size,
            plan.num_pages * plan.page_size * plan.bytes_per_token / 2**30,
            self.max_model_len,
            time.perf_counter() - started,
        )

    # ---- requests ----------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.validate_prompt(prompt_token_ids)
        req = Request(
            request_id=request_id,
            params=params,
            prompt_len=len(prompt_token_ids),
            token_ids=list(prompt_token_ids),
            arrival=next(self._arrivals),
            generator=self._generator(params.seed),
        )
        self.scheduler.add(req)

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens, but max_model_len is {self.max_model_len} "
                "(the prompt and at least one generated token must fit)"
            )
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not (0 <= t < vocab)), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")

    def _generator(self, seed: int | None) -> torch.Generator | None:
        return None if seed is None else torch.Generator(device=self.device).manual_seed(seed)

    def abort_request(self, request_id: str, index: int | None = None) -> None:
        for req in self.scheduler.find(request_id):
            if index is None or req.index == index:
                self.scheduler.finish(req, "abort")
                self._pending_updates.append(self._update(req))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending_updates)

    # ---- stepping ----------------------------------------------------------------------

    def step(self) -> list[StepUpdate]:
        updates, self._pending_updates = self._pending_updates, []
        batch = self.scheduler.schedule()
        if batch is None:
            return updates
        samplers = [i for i, (r, n) in enumerate(zip(batch.requests, batch.num_new_tokens)) if n == r.num_uncomputed]
        logits = self.runner.forward(batch, samplers)
        self.scheduler.complete_step(batch)
        rows, sample_reqs = self._expand_forks(batch, samplers)
        tokens, logprobs = self.sampler(logits[rows], [self._sample_row(r) for r in sample_reqs])
        for req, token, lp in zip(sample_reqs, tokens, logprobs):
            self._append_token(req, token, lp)
            updates.append(self._update(req))
        return updates

    def _expand_forks(self, batch: ScheduledBatch, samplers: list[int]) -> tuple[list[int], list[Request]]:
        """Each sampling request samples from its logits row; a request with n > 1 whose
        prompt just finished is forked here and its samples share that row."""
        rows, reqs = [], []
        for row, i in enumerate(samplers):
            req = batch.requests[i]
            group = [req]
            if req.params.n > 1 and not req.forked:
                group += self.scheduler.fork(req, lambda k, parent=req: self._child(parent, k))
            rows += [row] * len(group)
            reqs += group
        return rows, reqs

    def _child(self, parent: Request, index: int) -> Request:
        seed = None if parent.params.seed is None else parent.params.seed + index
        return Request(
            request_id=parent.request_id,
            params=parent.params,
            prompt_len=parent.prompt_len,
            token_ids=list(parent.token_ids),
            arrival=parent.arrival,
            index=index,
            num_cached_tokens=parent.num_cached_tokens,
            generator=self._generator(seed),
            forked=True,
        )

    @staticmethod
    def _sample_row(req: Request) -> SampleRow:
        return SampleRow(req.params, req.generator, req.token_ids[: req.prompt_len], req.output_token_ids)

    def _append_token(self, req: Request, token: int, logprob) -> None:
        req.token_ids.append(token)
        if logprob is not None:
            req.logprobs = (req.logprobs or []) + [logprob]
        p = req.params
        n_out = req.num_output_tokens
        reason = None
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.model_config.eos_token_ids:
                reason = "stop"
            elif p.stop_token_ids and token in p.stop_token_ids:
                reason = "stop"
        if reason is None and p.max_tokens is not None and n_out >= p.max_tokens:
            reason = "length"
        if reason is None and len(req.token_ids) >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(req, reason)

    def _update(self, req: Request) -> StepUpdate:
        new = req.output_token_ids[req.num_reported :]
        new_lp = req.logprobs[req.num_reported :] if req.logprobs is not None else None
        req.num_reported = req.num_output_tokens
        return StepUpdate(
            request_id=req.request_id,
            index=req.index,
            new_token_ids=new,
            new_logprobs=new_lp,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.prompt_len,
            num_cached_tokens=req.num_cached_tokens,
        )

    # ---- introspection -----------------------------------------------------------------

    def stats(self) -> dict:
        sched = self.scheduler
        return {
            "kv_pages_total": self.allocator.num_usable,
            "kv_pages_free": self.allocator.num_free,
            "kv_pages_cached": 0,
            "page_size": sched.page_size,
            "requests_running": len(sched.running),
            "requests_waiting": len(sched.waiting),
            "num_preemptions": sched.num_preemptions,
            "max_model_len": self.max_model_len,
        }

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
