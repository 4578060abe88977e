"""Batched sampling on the device.

Owns: turning a [N, vocab] block of logits (one row per sample) into N tokens, with
per-row penalties, temperature, top-k, top-p, min-p, seeds and log-probabilities.

Order, as in vLLM: penalties on the raw logits -> the token bitmask of structured outputs
(disallowed words to -inf; an int32 [N, ceil(vocab / 32)] device tensor, see
nanoserve.kernels.sampling) -> greedy rows take the argmax -> the rest
divide by temperature, mask (top-k, then top-p, then min-p) and draw. Drawing uses the
exponential-race trick (argmax of p / E with E ~ Exp(1)), which samples from p exactly and
lets each seeded row draw its noise from its own generator, so a seeded request gives the
same tokens whatever else is in the batch. Log-probabilities are those of the raw model
distribution (before penalties and temperature), as in OpenAI's API.

Fast path (CUDA): a batch whose rows are all greedy or plain temperature sampling (no
penalties, masks or seeds) goes through one Triton kernel (nanoserve/kernels/sampling.py) that reads
the logits once in their own dtype and draw by inverse transform sampling, one uniform
per row keyed by the sampler's seed and a count of its calls. Everything else, and every batch when
KernelSwitches.fused_sampler off, takes the torch path above (its slow twin): greedy rows give the
same tokens on both, sampled rows the same distribution (not the same draws).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanoserve.kernels.sampling import apply_token_bitmask, fused_sample
from nanoserve.models.layers import fused
from nanoserve.outputs import TokenLogprobs
from nanoserve.sampling_params import SamplingParams
from nanoserve.structured.matcher import bitmask_words


@dataclass
class SampleRow:
    params: SamplingParams
    generator: torch.Generator | None  # per-request generator when a seed was given
    prompt_ids: list[int]
    output_ids: list[int]


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties:
            continue
        if p.repetition_penalty != 1:
            seen = torch.tensor(
                sorted(set(row.prompt_ids) | set(row.output_ids)), device=logits.device, dtype=torch.long
            )
            values = logits[i, seen]
            logits[i, seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if row.output_ids and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(torch.tensor(row.output_ids, device=logits.device), minlength=logits.shape[1])
            counts = counts[: logits.shape[1]].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def mask_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside a row's top-k, top-p nucleus or min-p floor.

    top_k: [N] long (vocab size = off); top_p: [N] float (1 = off); min_p: [N] (0 = off).
    The most likely token always survives."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    drop = ranks[None, :] >= top_k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep a token if the mass strictly before it is below top_p (the first always is).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def _device_tensor(values, device: torch.device, dtype=None) -> torch.Tensor:
    """A host list as a device tensor without a stream sync (pageable non-blocking copy)."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


@dataclass
class SampleResult:
    """Sampled tokens still on the device, and what log-probabilities need: converted to
    host values only by `to_host` (the one host sync, done when results are processed)."""

    tokens: torch.Tensor  # long [N] on the device
    rows: list[SampleRow]
    lp_rows: list[int]  # rows that asked for logprobs
    lp_chosen: torch.Tensor | None = None  # [len(lp_rows)]
    lp_top_vals: torch.Tensor | None = None  # [len(lp_rows), k]
    lp_top_ids: torch.Tensor | None = None

    def to_host(self, tokens: list[int] | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
        """`tokens`: host copy of `self.tokens` if the caller already has one."""
        if tokens is None:
            tokens = self.tokens.tolist()
        result: list[TokenLogprobs | None] = [None] * len(self.rows)
        if self.lp_rows:
            chosen, vals, ids = self.lp_chosen.tolist(), self.lp_top_vals.tolist(), self.lp_top_ids.tolist()
            for j, i in enumerate(self.lp_rows):
                n = self.rows[i].params.logprobs
                result[i] = TokenLogprobs(tokens[i], chosen[j], dict(zip(ids[j][:n], vals[j][:n])))
        return tokens, result


class _BatchPlan:
    """What `sample` derives from a batch's rows that depends only on their params and
    generators: reused while the same row objects come back in the same order (a decode
    batch whose requests did not change), so a step does no per-row Python work. Holding
    `rows` keeps those objects alive, so an identity match cannot be a recycled id."""

    def __init__(self, rows: list[SampleRow], vocab: int, device: torch.device, fused: bool):
        self.rows = list(rows)
        params = [r.params for r in rows]
        self.penalties = any(p.has_penalties for p in params)
        self.random_rows = [i for i, p in enumerate(params) if not p.greedy]
        self.all_random = bool(rows) and len(self.random_rows) == len(rows)
        self.random_index = None if self.all_random else _device_tensor(self.random_rows, device, torch.long)
        chosen = [params[i] for i in self.random_rows]
        temps = [p.temperature for p in chosen]
        self.temperature: float | torch.Tensor = temps[0] if temps else 1.0
        if any(t != temps[0] for t in temps):
            self.temperature = _device_tensor(temps, device, torch.float32)[:, None]
        self.masks = None  # (top_k, top_p, min_p) of the random rows, when any is set
        if any(p.top_k != -1 or p.top_p < 1 or p.min_p > 0 for p in chosen):
            self.masks = (
                _device_tensor([p.top_k if p.top_k != -1 else vocab for p in chosen], device, torch.long),
                _device_tensor([p.top_p for p in chosen], device, torch.float32),
                _device_tensor([p.min_p for p in chosen], device, torch.float32),
            )
        self.seeded = [(j, rows[i].generator) for j, i in enumerate(self.random_rows) if rows[i].generator is not None]
        self.lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        # The fused kernel covers greedy and plain temperature rows; it reads each row's
        # temperature (0 = greedy) from this device tensor. Small all-greedy batches take it
        # too: its GPU time is what a decode step waits for (llama-3.1-8b's batch-1 step on an
        # H200, 2026-11-27: torch's fp32 copy and argmax took 31 us between graph replays).
        # Its host launch cost, larger than torch's, overlaps the GPU in the overlap loop.
        covered = bool(rows) and not self.penalties and self.masks is None and not self.seeded
        self.fused = fused and covered
        self.row_temperature = None
        if self.fused:
            self.row_temperature = _device_tensor([p.temperature for p in params], device, torch.float32)

    def matches(self, rows: list[SampleRow]) -> bool:
        return len(rows) == len(self.rows) and all(map(operator.is_, rows, self.rows))


def _race_argmax(scaled_logits: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return (scaled_logits - noise.log()).argmax(dim=-1)


race_argmax = fused(_race_argmax)  # one fused kernel on CUDA


class Sampler:
    def __init__(self, device: torch.device, seed: int, fused: bool | None = None):
        """`fused`: use the Triton kernel where it applies (default: on CUDA; the engine
        passes KernelSwitches.fused_sampler; tests force it on CPU under Triton's interpreter)."""
        self.device = torch.device(device)
        self.seed = seed
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.fused = self.device.type == "cuda" if fused is None else fused
        self.calls = 0  # keys the fused kernel's uniforms: new ones for every call
        self._plan: _BatchPlan | None = None

    def __call__(
        self, logits: torch.Tensor, rows: list[SampleRow], bitmask: torch.Tensor | None = None
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Host tokens and logprobs (syncs); the engine uses `sample` and converts later."""
        return self.sample(logits, rows, bitmask).to_host()

    def sample(
        self,
        logits: torch.Tensor,
        rows: list[SampleRow],
        bitmask: torch.Tensor | None = None,
        pool: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SampleResult:
        """Tokens as a device tensor. No host sync unless a row has penalties (they read
        the request's history, built on the host). `bitmask`: int32 [N, ceil(vocab / 32)]
        on the logits' device, the words each row may draw (structured outputs), or None.
        `pool` (long [P], long [N]): the tokens are also stored at pool[0][pool[1]] (by the
        fused kernel itself, else by a copy)."""
        plan = self._plan
        if plan is None or not plan.matches(rows):
            plan = self._plan = _BatchPlan(rows, logits.shape[1], logits.device, self.fused)
        if plan.fused:
            tokens = fused_sample(logits, plan.row_temperature, self.seed, self.calls, bitmask=bitmask, pool=pool)
            self.calls += 1
        else:
            tokens = self._sample_torch(logits, rows, plan, bitmask)
            if pool is not None:
                pool[0].index_copy_(0, pool[1], tokens)
        result = SampleResult(tokens, rows, plan.lp_rows)
        if result.lp_rows:
            idx = _device_tensor(result.lp_rows, logits.device, torch.long)
            logp = logits[idx].float().log_softmax(dim=-1)
            k = max(rows[i].params.logprobs for i in result.lp_rows)
            result.lp_top_vals, result.lp_top_ids = logp.topk(max(k, 1), dim=-1)
            result.lp_chosen = logp.gather(1, tokens[idx][:, None])[:, 0]
        return result

    def _sample_torch(
        self, logits: torch.Tensor, rows: list[SampleRow], plan: _BatchPlan, bitmask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The slow twin: every feature, on an fp32 copy of the logits."""
        logits = logits.float()
        if plan.penalties:
            logits = apply_penalties(logits.clone(), rows)
        if bitmask is not None:
            logits = apply_token_bitmask(logits.clone() if not plan.penalties else logits, bitmask)
        tokens = None if plan.all_random else logits.argmax(dim=-1)
        if plan.random_rows:
            sub = logits if plan.all_random else logits[plan.random_index]
            sub = sub / plan.temperature
            if plan.masks is not None:
                sub = mask_logits(sub, *plan.masks)
            # argmax(p / E) == argmax(log p - log E) == argmax(logits / T - log E): no softmax.
            noise = self._exponential_noise(sub.shape, plan.seeded)
            drawn = race_argmax(sub, noise)
            if plan.all_random:
                tokens = drawn
            else:
                tokens[plan.random_index] = drawn
        return tokens

    def _exponential_noise(self, shape, seeded: list[tuple[int, torch.Generator]]) -> torch.Tensor:
        """Exp(1) noise from the sampler's generator; row i of `seeded` from its own."""
        noise = torch.empty(shape, device=self.device).exponential_(generator=self.generator)
        for i, gen in seeded:
            noise[i].exponential_(generator=gen)
        return noise


# One batch of each sampling path: greedy and plain temperature (the fused kernel), top-p
# (torch's sort), log-probabilities (log-softmax and top-k); the fused ones also under a
# structured output's bitmask (every word allowed).
_WARM_UP_PARAMS = (
    (SamplingParams(temperature=0.0), False),
    (SamplingParams(temperature=0.7), False),
    (SamplingParams(temperature=0.8, top_p=0.9), False),
    (SamplingParams(temperature=0.0, logprobs=1), False),
    (SamplingParams(temperature=0.0), True),
    (SamplingParams(temperature=0.7), True),
)


def warm_up_row_counts(
    sampler: Sampler, logits_of: Callable[[int], torch.Tensor], max_rows: int, pool: torch.Tensor | None = None
) -> None:
    """Run the lm_head and every sampling path once at each row count from `max_rows` down
    to 1, storing the tokens in `pool` (the runner's token pool, zeroed afterwards) as steps
    do. An eager step (a prefill or mixed one) samples any number of rows, and the first step
    at a row count no earlier step had took twice a step's time in a server (llama-3.1-8b on
    an H200, 2026-12-02: at 16, 32, 48, ... running requests, each once per process);
    largest first, so the allocator's cache also holds the largest step's blocks."""
    words = slots = None  # every word allowed, and the pool's slots: made at the largest count, sliced
    for count in range(max_rows, 0, -1):
        logits = logits_of(count)
        if words is None:
            words = torch.full((count, bitmask_words(logits.shape[1])), -1, dtype=torch.int32, device=logits.device)
            if pool is not None:
                slots = torch.arange(count, device=pool.device) % pool.numel()
        into = None if pool is None else (pool, slots[:count])
        for params, masked in _WARM_UP_PARAMS:
            rows = [SampleRow(params, None, [], [])] * count
            sampler.sample(logits, rows, words[:count] if masked else None, pool=into)
    if pool is not None:
        pool.zero_()
