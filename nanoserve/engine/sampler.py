"""Batched sampling on the device.

Owns: turning a [N, vocab] block of logits (one row per sample) into N tokens, with
per-row penalties, temperature, top-k, top-p, min-p, seeds and log-probabilities.

Order, as in vLLM: penalties on the raw logits -> greedy rows take the argmax -> the rest
divide by temperature, mask (top-k, then top-p, then min-p) and draw. Drawing uses the
exponential-race trick (argmax of p / E with E ~ Exp(1)), which samples from p exactly and
lets each seeded row draw its noise from its own generator, so a seeded request gives the
same tokens whatever else is in the batch. Log-probabilities are those of the raw model
distribution (before penalties and temperature), as in OpenAI's API.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.outputs import TokenLogprobs
from nanoserve.sampling_params import SamplingParams


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
            seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), device=logits.device, dtype=torch.long)
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


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
        logits = logits.float()
        raw = logits
        if any(r.params.has_penalties for r in rows):
            logits = apply_penalties(logits.clone(), rows)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            sub = logits[idx]
            params = [rows[i].params for i in random_rows]
            temps = torch.tensor([p.temperature for p in params], device=logits.device)
            sub = sub / temps[:, None]
            if any(p.top_k != -1 or p.top_p < 1 or p.min_p > 0 for p in params):
                vocab = sub.shape[1]
                top_k = torch.tensor([p.top_k if p.top_k != -1 else vocab for p in params], device=logits.device)
                top_p = torch.tensor([p.top_p for p in params], device=logits.device)
                min_p = torch.tensor([p.min_p for p in params], device=logits.device)
                sub = mask_logits(sub, top_k, top_p, min_p)
            probs = sub.softmax(dim=-1)
            noise = self._exponential_noise(probs.shape, [rows[i].generator for i in random_rows])
            tokens[idx] = (probs / noise).argmax(dim=-1)
        token_list = tokens.tolist()
        return token_list, self._logprobs(raw, token_list, rows)

    def _exponential_noise(self, shape, generators: list[torch.Generator | None]) -> torch.Tensor:
        noise = torch.empty(shape, device=self.device).exponential_(generator=self.generator)
        for i, gen in enumerate(generators):
            if gen is not None:
                noise[i].exponential_(generator=gen)
        return noise

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: list[int], rows: list[SampleRow]) -> list[TokenLogprobs | None]:
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        result: list[TokenLogprobs | None] = [None] * len(rows)
        if not wanted:
            return result
        logp = raw[wanted].log_softmax(dim=-1)
        k = max(rows[i].params.logprobs for i in wanted)
        top_vals, top_ids = logp.topk(max(k, 1), dim=-1)
        chosen = logp[torch.arange(len(wanted)), torch.tensor([tokens[i] for i in wanted])]
        top_vals, top_ids, chosen = top_vals.tolist(), top_ids.tolist(), chosen.tolist()
        for j, i in enumerate(wanted):
            n = rows[i].params.logprobs
            result[i] = TokenLogprobs(tokens[i], chosen[j], dict(zip(top_ids[j][:n], top_vals[j][:n])))
        return result
