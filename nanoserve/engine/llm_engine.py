"""The engine core: requests in, tokens out, one scheduler step at a time.

Owns: the scheduler, the model runner and the sampler for one model; the page allocator
and the radix prefix cache (`enable_prefix_caching`, handed to the scheduler, which alone
changes them); request ids; the token-level stopping rules (EOS, stop token ids,
max_tokens, max_model_len).
Stop *strings* need text and are the front end's job (`nanoserve.detokenizer`), which
aborts a sample once its text contains one.

Invariant: after `step()` returns, every finished request holds no page and no slot, and
each output token was reported exactly once, in order. A request added with `stream=False`
is reported once, when it finishes (with all its tokens): callers that do not stream (the
offline `LLM`) skip the per-token update objects.

Constrained requests (SamplingParams.structured_outputs): the grammar compiles on
nanoserve.structured's worker threads while the request waits outside the scheduler (it is
queued once compiled; a failed compile finishes it with "abort"). Each such sample carries a
GrammarMatcher that accepts its token when a step is processed; before sampling, the rows of
constrained requests get a token bitmask filled on the host (every other row allows all;
nanoserve.structured.step_masks), which the sampler applies on the device. In the overlap loop
the mask needs the previous step's tokens, so a step with a constrained row launches its
forward first and then processes the step in flight (the device runs the forward meanwhile):
as soon as the grammars have taken that step's tokens, its masks are filled on this thread
and its sampling is queued behind its forward, before the rest of the processing. Steps
without one keep the plain overlap loop. A grammar that ends finishes its request with "stop";
max_tokens before that is "length".

Host cost: in the overlap loop the host prepares step N+1 while the device runs step N, so
everything `step()` does per request is paid on every step; the decode path keeps it to a
few passes over the batch (see benchmarks/probes/host_overhead.py for the per-phase figures).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Container
from concurrent import futures

import torch

from nanoserve.config import EngineConfig
from nanoserve.distributed.tp_runner import agree_kv_plan, init_tensor_parallel, wrap_runner
from nanoserve.engine.compile_watch import log_compiles
from nanoserve.engine.model_runner import ModelRunner, kv_capacity, plan_kv_capacity, plan_window_groups
from nanoserve.engine.pooling import LastTokenPooling
from nanoserve.engine.sampler import Sampler, SampleRow, warm_up_row_counts
from nanoserve.engine.speculative.proposer import DraftContext
from nanoserve.engine.speculative.step import Speculator, make_proposer
from nanoserve.kvcache.pool import PageAllocator, PageTable, pages_for
from nanoserve.kvcache.radix import RadixCache
from nanoserve.kvcache.window import WindowPager
from nanoserve.models.decoder import kv_heads_per_rank
from nanoserve.models.loader import build_model
from nanoserve.models.registry import resolve_model
from nanoserve.outputs import StepUpdate
from nanoserve.sampling_params import SamplingParams
from nanoserve.scheduler.request import Request
from nanoserve.scheduler.scheduler import ScheduledBatch, Scheduler
from nanoserve.step import ForwardInputs
from nanoserve.structured.compiler import GrammarError, GrammarService, PendingGrammar
from nanoserve.structured.matcher import GrammarMatcher
from nanoserve.structured.step_masks import StepMasks, grammar_end
from nanoserve.switches import log_nondefault
from nanoserve.tokenizer import load_tokenizer

log = logging.getLogger("nanoserve")


def serve_worker_rank(config: EngineConfig) -> None:
    """What a tensor-parallel worker rank runs (spawned by distributed.tp_runner): the same
    engine as rank 0, whose runner then executes rank 0's broadcast steps until shutdown."""
    LLMEngine(config).runner.serve()


class LLMEngine:
    def __init__(self, config: EngineConfig):
        if config.tensor_parallel_size > 1 and resolve_model(config.model).config.linear is not None:
            # refused before any worker is spawned (nothing to clean up)
            raise ValueError("tensor parallelism is not supported for models with linear-attention layers (Qwen3.5)")
        tp = init_tensor_parallel(config, serve_worker_rank)  # TP > 1: rank 0 spawns and joins the worker ranks
        log_nondefault(config.switches)
        log_compiles(False)  # building compiles by design (see compile_watch)
        self.config = config
        started = time.perf_counter()
        source = resolve_model(config.model)
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(source.config.torch_dtype)
        self.tokenizer = load_tokenizer(source, config.tokenizer)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            source = dataclasses.replace(source, config=source.config.with_eos([self.tokenizer.eos_token_id]))
        cfg = source.config
        if cfg.linear is not None:  # no prefix cache, no piecewise graphs, no speculation
            if config.enable_prefix_caching or config.piecewise_cuda_graphs:
                log.info("linear-attention layers: prefix caching and piecewise prefill graphs are off")
            self.config = config = config.for_linear_layers()
        wanted_len = config.max_model_len or cfg.max_position_embeddings
        torch.manual_seed(config.seed)
        model = build_model(
            source,
            config.load_format,
            self.dtype,
            self.device,
            config.seed,
            max_positions=wanted_len,
            tp=tp,
            switches=config.switches,
            quantization=config.quantization,
        )
        self.kv_dtype = config.torch_kv_dtype(self.dtype)
        # A draft model loads before the KV plan, which gives its KV a share of the same pages.
        spec = config.speculative_config()
        proposer = None
        if spec is not None:
            context = DraftContext(config, source, self.tokenizer, self.dtype, self.kv_dtype, self.device, wanted_len)
            proposer = make_proposer(spec, context)
        kv_heads = kv_heads_per_rank(cfg, model.tp)
        extra = proposer.kv_bytes_per_token if proposer is not None else 0
        layout = plan_window_groups(config, cfg, tp.size)  # None: every layer on the request's pages
        plan = plan_kv_capacity(config, cfg, kv_heads, self.kv_dtype, self.device, extra, layout)
        plan = agree_kv_plan(plan, tp)
        self.runner = wrap_runner(ModelRunner(config, model, plan, self.device, self.kv_dtype, layout), tp)
        self.pooling = LastTokenPooling(model) if config.task == "embed" else None  # embedding model
        # window groups hold a window and one prefill chunk, and no chunk is longer than a request
        capacity, self.kv_tokens_full_layout = kv_capacity(
            cfg, plan, layout, min(config.chunked_prefill_size, wanted_len)
        )
        self.max_model_len = min(wanted_len, capacity)
        self.model_config = cfg
        self.allocator = PageAllocator(plan.num_pages)
        self.prefix_cache = RadixCache(self.allocator, plan.page_size) if config.enable_prefix_caching else None
        windows = None
        if layout is not None:  # sliding-window layers' pages (nanoserve.kvcache.window)
            window_map, copy_page = self.runner.window_map, self.runner.kv_cache.copy_page
            windows = WindowPager(self.allocator, plan.page_size, layout, window_map.set, copy_page)
        self.scheduler = Scheduler(
            self.allocator,
            plan.page_size,
            config.max_num_seqs,
            config.chunked_prefill_size,
            copy_page=self.runner.kv_cache.copy_page,
            copy_slot_state=None if self.runner.linear_states is None else self.runner.linear_states.copy_row,
            page_table=PageTable(config.max_num_seqs, pages_for(self.max_model_len, plan.page_size)),
            prefix_cache=self.prefix_cache,
            mixed_budget=config.mixed_step_budget() if config.schedule_policy == "mixed" else None,
            windows=windows,
        )
        self.sampler = Sampler(
            self.device, config.seed, fused=config.switches.fused_sampler and self.device.type == "cuda"
        )
        # Before the graphs are captured: a drafter may attach what the target's forward writes.
        self.speculator = (
            Speculator(spec, self, proposer, plan) if spec is not None else None
        )  # nanoserve.engine.speculative
        self.runner.setup_cuda_graphs(self.max_model_len)
        # Overlap scheduling (CUDA by default; tests force it on CPU by setting the attribute).
        self.overlap = config.overlap_schedule and self.device.type == "cuda"
        self._inflight: _InFlight | None = None
        # Sampled tokens go to the host on a stream of their own: on the compute stream the
        # copy engine's start-up (about 7 us on an H200) sat between every two decode steps.
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Profiling counters (benchmarks reset them): host time inside step(), the part of
        # it spent waiting for sampled tokens, and the number of steps.
        self.gpu_wait_s = 0.0
        self.step_s = 0.0
        self.num_steps = 0
        self._arrivals = itertools.count()
        self._pending_updates: list[StepUpdate] = []
        self._grammars: GrammarService | None = None  # built on the first constrained request
        self._compiling: list[tuple[Request, PendingGrammar]] = []  # constrained requests not yet queued
        self.num_constrained = 0  # queued requests with a matcher (the step loop skips grammar work at 0)
        # Constrained steps' bitmasks (nanoserve/structured/step_masks.py; benchmarks/structured.py reads its counters).
        self.step_masks = StepMasks(self.device)
        if self.device.type == "cuda" and tp.rank == 0:  # worker ranks follow rank 0's steps
            self._warm_up()
            log_compiles(True)  # what the warm-up missed, as it happens
        log.info(
            "nanoserve: %s on %s (%s), attention=%s, KV cache %d tokens (%s, %d pages of %d, %.2f GiB), "
            "prefix cache %s, max_model_len %d, ready in %.1f s",
            cfg.name,
            self.device,
            str(self.dtype).removeprefix("torch."),
            self.runner.backend.name,
            plan.num_tokens,
            str(self.kv_dtype).removeprefix("torch."),
            plan.num_pages,
            plan.page_size,
            plan.num_pages * plan.page_size * plan.bytes_per_token / 2**30,
            "on" if self.prefix_cache is not None else "off",
            self.max_model_len,
            time.perf_counter() - started,
        )

    def _warm_up(self) -> None:
        """Run a few requests through every kind of step before serving, so that the Triton
        kernels and compiled ops the first real requests need are compiled (and cached on
        disk) now rather than while they wait: a long prompt in chunks (prefill, then extend
        over its own prefix), a prompt sharing its first half (a prefix-cache hit), a short
        one, decode at batch 1 and 2, greedy and random sampling (torch's sampling path and the
        fused kernels); under the mixed policy a mixed step; on CUDA the lm_head and sampler
        at every row count (`warm_up_row_counts`). Leaves no trace: every page is freed, the
        prefix cache emptied and the counters zeroed."""
        started = time.perf_counter()
        vocab = self.model_config.vocab_size
        long_len = max(2, min(self.max_model_len - 8, self.config.chunked_prefill_size + 64))
        long_prompt = [(i * 7919 + 1) % vocab for i in range(long_len)]
        rounds = [
            [(long_prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))],
            [
                (long_prompt[: long_len // 2] + [3, 5, 7], SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=3, ignore_eos=True)),
                ([11, 13, 17, 19, 23], SamplingParams(temperature=0.6, max_tokens=3, ignore_eos=True)),
            ],
            [  # plain temperature beside greedy: the fused sampling kernels (the round above takes torch's path)
                ([29, 31, 37], SamplingParams(temperature=0.7, max_tokens=3, ignore_eos=True)),
                ([41, 43, 47], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)),
            ],
        ]  # fmt: skip
        for i, work in enumerate(rounds):
            for j, (prompt, params) in enumerate(work):
                self.add_request(f"warm-up-{i}-{j}", prompt, params, stream=False)
            while self.has_unfinished_requests():
                self.step()
        if self.scheduler.mixed_budget is not None:
            # A prompt arriving while a request decodes: a mixed step, whose row slices are
            # kernel arguments of other alignments (Triton compiles those variants now).
            greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            self.add_request("warm-up-mixed-0", long_prompt[:9], greedy, stream=False)
            self.step()
            self.step()
            self.add_request("warm-up-mixed-1", long_prompt[-21:], greedy, stream=False)
            while self.has_unfinished_requests():
                self.step()
        if self.device.type == "cuda" and self.pooling is None and self.config.tensor_parallel_size == 1:
            # (not under TP: the lm_head's all-gather needs every rank)
            logits_of = functools.partial(self.runner.logits_of_zeros, dtype=self.dtype)
            warm_up_row_counts(self.sampler, logits_of, self.config.max_num_seqs, self.runner.token_pool)
            torch.cuda.synchronize(self.device)
        if self.prefix_cache is not None:
            self.prefix_cache.reset()
        self.scheduler.num_preemptions = self.scheduler.num_prefill_tokens = 0
        self.gpu_wait_s = self.step_s = 0.0
        self.num_steps = 0
        if hasattr(self.runner, "num_cascade_steps"):
            self.runner.num_cascade_steps = 0
        self.check_invariants()
        log.info("warm-up requests ran in %.1f s", time.perf_counter() - started)

    # ---- requests ----------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, stream: bool = True
    ) -> None:
        """Queue a request. `stream=False`: no update until it finishes (then one with
        every token), for callers that only want the end result."""
        self.validate_prompt(prompt_token_ids)
        req = Request(
            request_id=request_id,
            params=params,
            prompt_len=len(prompt_token_ids),
            token_ids=list(prompt_token_ids),
            arrival=next(self._arrivals),
            generator=self._generator(params.seed),
            stream=stream,
        )
        self._set_stop_filter(req)
        if params.structured_outputs is None:
            self.scheduler.add(req)
            return
        self._compiling.append((req, self.grammar_service().submit(params.structured_outputs)))
        self._queue_compiled()

    def grammar_service(self) -> GrammarService:
        """The grammar compiler (worker threads and cache), made on first use."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs need a tokenizer: this model has none")
            self._grammars = GrammarService(
                self.tokenizer, self.model_config.vocab_size, list(self.model_config.eos_token_ids)
            )
        return self._grammars

    def _queue_compiled(self) -> None:
        """Queue the constrained requests whose grammar has compiled; finish ("abort") those
        whose compile failed or ran out of time. Never waits."""
        still = []
        for req, pending in self._compiling:
            try:
                compiled = pending.poll()
            except GrammarError as exc:
                log.warning("request %s: %s", req.request_id, exc)
                req.finish_reason = "abort"
                self._pending_updates.append(self._update(req))
                continue
            if compiled is None:
                still.append((req, pending))
                continue
            req.matcher = GrammarMatcher(compiled, req.params.structured_outputs.after_reasoning)
            self.num_constrained += 1
            self.scheduler.add(req)
        self._compiling = still

    def _set_stop_filter(self, req: Request) -> None:
        """The stopping rules `_stop_reason` checks per token, gathered once per request."""
        p = req.params
        stop_len = self.max_model_len
        if p.max_tokens is not None:
            stop_len = min(stop_len, req.prompt_len + p.max_tokens)
        stop_ids = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            stop_ids.update(self.model_config.eos_token_ids)
        req.stop_len = stop_len
        req.stop_ids = frozenset(stop_ids) if stop_ids else None

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        if len(prompt_token_ids) + (self.pooling is None) > self.max_model_len:  # embedding: no token after it
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens, but max_model_len is {self.max_model_len} "
                "(the prompt and at least one generated token must fit)"
            )
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) >= 0 and max(prompt_token_ids) < vocab:  # C-speed scan of the common case
            return
        bad = next((t for t in prompt_token_ids if not (0 <= t < vocab)), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")

    def _generator(self, seed: int | None) -> torch.Generator | None:
        return None if seed is None else torch.Generator(device=self.device).manual_seed(seed)

    def abort_request(self, request_id: str, index: int | None = None) -> None:
        for req, _ in [c for c in self._compiling if c[0].request_id == request_id]:
            self._compiling = [c for c in self._compiling if c[0] is not req]
            req.finish_reason = "abort"
            self._pending_updates.append(self._update(req))
        for req in self.scheduler.find(request_id):
            if index is None or req.index == index:
                self._finish(req, "abort")
                self._pending_updates.append(self._update(req))

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_work()
            or bool(self._pending_updates)
            or self._inflight is not None
            or bool(self._compiling)
        )

    # ---- stepping ----------------------------------------------------------------------

    def step(self) -> list[StepUpdate]:
        """One scheduler step. Simple loop: launch the step and process its results.
        Overlap loop: launch step N+1, then process step N's results while the GPU runs
        N+1 (its input tokens are read on the device from the runner's token pool).
        A constrained step N+1 (overlap loop) launches its forward, then processes step N,
        queueing N+1's sampling (its masks need N's tokens) as soon as the grammars have them
        (`_launch_constrained`)."""
        started = time.perf_counter()
        updates, self._pending_updates = self._pending_updates, []
        if self._inflight is not None and self.scheduler.num_with_penalties:
            # Penalties read each request's tokens on the host: finish the step in flight.
            done, self._inflight = self._inflight, None
            updates += self._process(done)
        if self._compiling:
            self._queue_compiled()
            if not self.scheduler.has_work() and self._inflight is None and self._compiling:
                # Only compiles are pending: wait for one a little rather than spin on them.
                futures.wait([c[1].future for c in self._compiling], timeout=0.005, return_when=futures.FIRST_COMPLETED)
                self._queue_compiled()
        if self.speculator is not None and self.speculator.wants_step():
            if self._inflight is not None:  # drafts need every token on the host
                done, self._inflight = self._inflight, None
                updates += self._process(done)
            verified = self.speculator.step()
            if verified is not None:
                return self._end_step(updates + verified, started)
        batch = self.scheduler.schedule()
        inputs = self._prepare(batch) if batch is not None else None
        launched = None
        if batch is not None:
            launched, logits = self._forward(batch, inputs)
            if self.pooling is not None:  # an embedding model: the rows are vectors, their requests end now
                updates += self.pooling.finish(self, launched.reqs, logits)
                launched = None
            elif launched.constrained and self.overlap:
                updates += self._launch_constrained(launched, logits)
                return self._end_step(updates, started)
            else:
                self._sample(launched, logits)
        if self.overlap:
            done, self._inflight = self._inflight, launched
        else:
            done = launched
        if done is not None:
            updates += self._process(done)
        return self._end_step(updates, started)

    def _launch_constrained(self, launched: _InFlight, logits: torch.Tensor) -> list[StepUpdate]:
        """Overlap loop, a constrained step whose forward is queued: process the step in
        flight now, while the device runs that forward (requests finishing meanwhile are
        deferred to `launched`, as in the plain overlap loop). Its masks need the tokens of
        the step in flight: they are filled, and the sampling queued, as soon as the grammars
        have taken those tokens, before the rest of the processing, so that the device never
        waits for it (xgrammar's fill of 64 rows takes tens of microseconds on one thread;
        on a mask thread it had traded the GIL at every call, benchmarks/results/2026-12-02.md)."""
        done, self._inflight = self._inflight, launched
        sample = functools.partial(self._sample, launched, logits)
        updates = [] if done is None else self._process(done, fill_first=sample)
        if launched.result is None:  # no step in flight, or one that sampled nothing
            sample({})
        return updates

    def _end_step(self, updates: list[StepUpdate], started: float) -> list[StepUpdate]:
        updates += self._pending_updates  # aborts/finishes noticed while processing
        self._pending_updates = []
        self.step_s += time.perf_counter() - started
        self.num_steps += 1
        return updates

    def _prepare(self, batch: ScheduledBatch) -> tuple[ForwardInputs, list[int]]:
        """The inputs of one batch (host work and copies; tokens still being sampled are read
        when the forward is launched), and which requests sample."""
        reqs = batch.requests
        if batch.is_decode:  # every request samples, none forks (forks happen after a prompt)
            samplers = list(range(len(reqs)))
        else:
            samplers = [i for i, (r, n) in enumerate(zip(reqs, batch.num_new_tokens)) if n == r.num_uncomputed]
        return self.runner.prepare(batch, samplers), samplers

    def _forward(
        self, batch: ScheduledBatch, prepared: tuple[ForwardInputs, list[int]]
    ) -> tuple[_InFlight, torch.Tensor]:
        """The forward of one prepared batch, queued on the device; returns its record
        (sampling requests, forks included) and the logits rows they sample from."""
        inputs, samplers = prepared
        reqs = batch.requests
        logits = self.runner.execute(inputs)
        self.scheduler.complete_step(batch)
        if batch.is_decode:
            rows, sample_reqs = None, reqs
        else:
            rows, sample_reqs = self._expand_forks(batch, samplers)
            if rows == list(range(len(reqs))) and len(sample_reqs) == len(reqs):
                rows, sample_reqs = None, reqs  # every request samples its own row, no fork
        record = _InFlight(sample_reqs, reqs)
        if not sample_reqs:
            return record, logits
        if rows is not None:
            logits = logits[_on_device(rows, self.device)]
        if sample_reqs is reqs and inputs.req_slots is not None:
            record.slots = inputs.req_slots  # already on the device
        record.constrained = self.num_constrained > 0 and any(r.matcher is not None for r in sample_reqs)
        return record, logits

    def _sample(self, record: _InFlight, logits: torch.Tensor, ended: Container[int] = ()) -> None:
        """Sampling of a launched forward, queued on the device now; a constrained step's
        masks are filled first, on this thread (no mask for requests whose grammar has just
        ended, `ended`: their tokens are dropped)."""
        if not record.reqs:
            return
        self._add_placeholders(record)
        mask = None
        if record.constrained:
            rows, host = self.step_masks.rows(record.reqs, self._grammars.grammar_vocab_size, ended)
            self.step_masks.fill([record.reqs[i].matcher for i in rows], rows, host)
            mask = self.step_masks.device_mask(len(record.reqs), rows, host, logits.shape[1])
        self._queue_sampling(record, logits, mask)

    def _add_placeholders(self, record: _InFlight) -> None:
        """Each sampling request gets a placeholder token (-1) that `_process` fills in, and
        its sampling parameters are taken (before the placeholder: penalties read the
        tokens). A request finished since the forward (only when a constrained step
        processed the step before it) gets no placeholder: its token is dropped."""
        record.rows = [r.sample_row or self._sample_row(r) for r in record.reqs]
        positions = record.positions
        for req in record.reqs:
            ids = req.token_ids
            positions.append(len(ids))
            if req.finish_reason is None:
                ids.append(-1)

    def _queue_sampling(self, record: _InFlight, logits: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Queue the sampler on the device; its tokens also go to the token pool at each
        request's slot, where the next step reads them, and to pinned host memory."""
        slots = record.slots
        if slots is None:
            slots = _on_device([r.slot for r in record.reqs], self.device)
        record.result = self.sampler.sample(logits, record.rows, mask, pool=(self.runner.token_pool, slots))
        tokens = record.result.tokens
        if tokens.is_cuda:
            # `record.result` holds `tokens` until `_process` has waited for this copy, so the
            # allocator cannot hand their memory out while the copy stream reads it.
            record.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                record.host.copy_(tokens, non_blocking=True)
                record.event = torch.cuda.Event()
                record.event.record()

    def _process(self, record: _InFlight, fill_first=None) -> list[StepUpdate]:
        """Fill in the sampled tokens of a launched step, apply the stopping rules and
        report. A request finished (or aborted) since the launch drops its token. With
        `fill_first` the grammars take their tokens first, then `fill_first` gets the requests
        whose grammar ended (id -> "stop" / "abort") before the rest is processed."""
        updates: list[StepUpdate] = []
        if record.reqs:
            if record.event is not None:
                waited = time.perf_counter()
                record.event.synchronize()
                self.gpu_wait_s += time.perf_counter() - waited
                host = record.host.tolist()
            else:
                host = None
            tokens, logprobs = record.result.to_host(host)
            ended = None
            if fill_first is not None:
                ended = self.step_masks.advance(record.reqs, record.positions, tokens)
                fill_first(ended)
            for req, pos, token, lp in zip(record.reqs, record.positions, tokens, logprobs):
                if req.finish_reason is not None or pos >= len(req.token_ids):
                    continue  # finished in an earlier step: this extra token is never shown
                req.token_ids[pos] = token
                if lp is not None:
                    req.logprobs = (req.logprobs or []) + [lp]
                reason = self._stop_reason(req, token, pos + 1)
                if req.matcher is not None:
                    reason = self._grammar_stop(req, token, reason) if ended is None else ended.get(id(req), reason)
                if reason is not None:
                    self._finish(req, reason)
                    updates.append(self._update(req))
                    continue
                if req.stream:
                    updates.append(self._update(req))
        for req in record.deferred:
            self.scheduler.finish(req, req.finish_reason)
        return updates

    @staticmethod
    def _grammar_stop(req: Request, token: int, reason: str | None) -> str | None:
        """Advance the request's grammar by `token`: a grammar that has ended stops the request
        ("stop", even at max_tokens: the output is complete); a token the grammar refuses
        (the mask makes it impossible) aborts it rather than return text that breaks it."""
        return grammar_end(req, token) or reason

    def _finish(self, req: Request, reason: str) -> None:
        """Finish `req` for the caller now; its pages and slot go back now, or, if a
        launched step still uses it, once that step has been processed. Tokens still
        being sampled for it (placeholders) are dropped, and so is its grammar state."""
        if req.matcher is not None:
            req.matcher = None
            self.num_constrained -= 1
        while req.token_ids and req.token_ids[-1] < 0 and len(req.token_ids) > req.num_computed:
            req.token_ids.pop()
        inflight = self._inflight
        if inflight is not None and not req.is_finished and inflight.uses(req):
            self.scheduler.dequeue(req)
            req.finish_reason = reason
            inflight.deferred.append(req)
        else:
            self.scheduler.finish(req, reason)

    def _expand_forks(self, batch: ScheduledBatch, samplers: list[int]) -> tuple[list[int], list[Request]]:
        """Each sampling request samples from its logits row; a request with n > 1 whose
        prompt just finished is forked here and its samples share that row."""
        rows, reqs = [], []
        for row, i in enumerate(samplers):
            req = batch.requests[i]
            group = [req]
            if req.params.n > 1 and not req.forked:
                group += self.scheduler.fork(req, lambda k, parent=req: self._child(parent, k))
            self.num_constrained += sum(r.matcher is not None for r in group[1:])
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
            matcher=parent.matcher.fork() if parent.matcher is not None else None,
            stream=parent.stream,
            stop_len=parent.stop_len,
            stop_ids=parent.stop_ids,
        )

    @staticmethod
    def _sample_row(req: Request) -> SampleRow:
        if not req.params.has_penalties:  # only penalties read the history: skip the copies
            req.sample_row = SampleRow(req.params, req.generator, [], [])  # the same every step
            return req.sample_row
        return SampleRow(req.params, req.generator, req.token_ids[: req.prompt_len], req.output_token_ids)

    @staticmethod
    def _stop_reason(req: Request, token: int, length: int) -> str | None:
        """Why `req` stops after `token`, its token number `length` (prompt included), by the
        rules `_set_stop_filter` gathered: a stop id once min_tokens are out, or the length."""
        if req.stop_ids is not None and token in req.stop_ids and length - req.prompt_len >= req.params.min_tokens:
            return "stop"
        if length >= req.stop_len:
            return "length"
        return None

    def _update(self, req: Request) -> StepUpdate:
        end = len(req.token_ids)
        while end > req.prompt_len and req.token_ids[end - 1] < 0:
            end -= 1  # tokens still being sampled are reported by a later step
        n_out = end - req.prompt_len
        new = req.token_ids[req.prompt_len + req.num_reported : end]
        new_lp = req.logprobs[req.num_reported : n_out] if req.logprobs is not None else None
        req.num_reported = n_out
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
        """Counters and gauges. KV pages: free + cached + held by requests == total, where
        `kv_pages_cached` counts pages only the prefix cache holds (reclaimable at once if
        unlocked); idle, free + cached == total. Prefix-cache counters are prompt tokens
        looked up and found at admission (a re-admission after preemption counts again);
        `prefill_tokens_computed` is what prefill steps actually ran."""
        sched = self.scheduler
        cache = self.prefix_cache
        return {
            "kv_pages_total": self.allocator.num_usable,
            "kv_pages_free": self.allocator.num_free,
            "kv_pages_cached": cache.num_cache_only_pages() if cache is not None else 0,
            "page_size": sched.page_size,
            "requests_running": len(sched.running),
            "requests_waiting": len(sched.waiting),
            "request_slots_free": len(sched.free_slots),  # all of max_num_seqs once idle (no slot leaked)
            "request_slots_total": sched.max_num_seqs,
            "num_preemptions": sched.num_preemptions,
            "max_model_len": self.max_model_len,
            "kv_tokens_full_layout": self.kv_tokens_full_layout,  # the same memory if every layer kept K/V
            # window groups (nanoserve.kvcache.window): pages given back out of the window
            "kv_window_pages_freed": sched.windows.num_dropped * sched.windows.num_groups if sched.windows else 0,
            "prefix_caching": cache is not None,
            "prefix_cache_query_tokens": cache.query_tokens if cache is not None else 0,
            "prefix_cache_hit_tokens": cache.hit_tokens if cache is not None else 0,
            "prefix_cache_hit_rate": cache.hit_rate if cache is not None else 0.0,
            "prefill_tokens_computed": sched.num_prefill_tokens,
            # decode steps that read shared prefixes once per group (nanoserve.attention.cascade)
            "cascade_decode_steps": getattr(self.runner, "num_cascade_steps", 0),
            **(self.speculator.counters.as_metrics() if self.speculator is not None else {}),
        }

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker ranks (nothing to do at TP=1); idempotent."""
        stop = getattr(self.runner, "shutdown", None)
        if callable(stop):
            stop()

    def check_invariants(self) -> None:
        window_map = getattr(self.runner, "window_map", None)  # window groups: checked against the device too
        self.scheduler.check_invariants(None if window_map is None else window_map.host_copy())


class _InFlight:
    """A launched step whose sampled tokens have not been processed yet."""

    def __init__(self, reqs: list[Request], batch_reqs: list[Request]):
        self.reqs = reqs  # the sampling requests (forks included), one per sampled token
        self.batch_reqs = batch_reqs  # the requests the forward ran for
        self._members: set[int] | None = None  # id() of every request the step uses, built on demand
        self.positions: list[int] = []  # index of each request's placeholder in token_ids
        self.result = None  # SampleResult
        self.host: torch.Tensor | None = None  # pinned copy of the tokens (CUDA)
        self.event: torch.cuda.Event | None = None
        self.deferred: list[Request] = []  # finished meanwhile: release after processing
        self.slots: torch.Tensor | None = None  # device slots of `reqs`, when the inputs had them
        self.constrained = False  # a sampling request has a grammar
        self.rows: list[SampleRow] = []  # each sampling request's parameters

    def uses(self, req: Request) -> bool:
        """Whether the step runs or samples for `req` (asked only when a request finishes)."""
        if self._members is None:
            self._members = {id(r) for r in self.batch_reqs} | {id(r) for r in self.reqs}
        return id(req) in self._members


def _on_device(values: list[int], device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.long)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)
