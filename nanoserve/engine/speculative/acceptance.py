"""Which drafted tokens a verify step accepts: the rule that keeps speculation lossless.

Owns: `target_distributions` (each verified position's distribution, processed exactly as the
sampler processes a row: penalties, grammar mask, then temperature, top-k, top-p, min-p) and
`accept` (the acceptance rule over one request's positions).

A request that drafted k tokens d_1..d_k is verified at k + 1 positions: row j holds the
target's logits after d_1..d_j (row 0: after the last accepted token).
- Greedy: d_{j+1} is accepted while it equals row j's argmax; the first row whose argmax
  differs, or row k when every draft matched, gives the one token the target adds. The
  output is the target's greedy output, token for token.
- Sampling (the standard rule of speculative sampling, Leviathan et al. 2023; Chen et al.
  2023): with p_j the target's and q_j the draft's distribution at row j, d_{j+1} is accepted
  with probability min(1, p_j(d) / q_j(d)); the first rejected row draws from
  max(0, p_j - q_j), renormalised; with every draft accepted, row k draws from p_k. Each
  emitted token is then distributed as the target alone would have drawn it. A proposer
  whose drafts are deterministic (n-gram look-ups) has q_j = one-hot(d_{j+1}).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.engine.sampler import SampleRow, apply_penalties, mask_logits
from nanoserve.kernels.sampling import apply_token_bitmask


@dataclass
class Verdict:
    """What one request's verify step yields: the tokens to append (accepted drafts, then
    the target's own token) and how many of them are accepted drafts."""

    tokens: list[int]
    num_accepted: int


def target_distributions(
    logits: torch.Tensor, rows: list[SampleRow], bitmask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per verified position: the greedy token (argmax after penalties and mask) [R], and for
    rows of requests that sample, their probabilities [R, V] (None when every row is greedy).
    `rows[i]` carries row i's history (the drafts before it count as output tokens)."""
    penalties = any(r.params.has_penalties for r in rows)
    every_greedy = all(r.params.greedy for r in rows)
    if every_greedy and not penalties and bitmask is None:
        # bf16 -> fp32 is exact and order-preserving: the same argmax without the copy (12 us
        # of host time on an H200's host, a verify step's serial part)
        return logits.argmax(dim=-1), None
    logits = logits.float()
    if penalties:
        logits = apply_penalties(logits.clone(), rows)
    if bitmask is not None:
        logits = apply_token_bitmask(logits.clone(), bitmask)
    greedy = logits.argmax(dim=-1)
    if every_greedy:
        return greedy, None
    device = logits.device
    params = [r.params for r in rows]
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)[:, None]
    scaled = logits / temps
    vocab = logits.shape[1]
    if any(p.top_k != -1 or p.top_p < 1 or p.min_p > 0 for p in params):
        top_k = torch.tensor([p.top_k if p.top_k != -1 else vocab for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device, dtype=torch.float32)
        min_p = torch.tensor([p.min_p for p in params], device=device, dtype=torch.float32)
        scaled = mask_logits(scaled, top_k, top_p, min_p)
    return greedy, scaled.softmax(dim=-1)


def accept_greedy(drafts: list[int], target: list[int]) -> Verdict:
    """`target[j]`: row j's greedy token (len(drafts) + 1 rows)."""
    a = 0
    while a < len(drafts) and drafts[a] == target[a]:
        a += 1
    return Verdict(drafts[:a] + [target[a]], a)


def accept_sampled(
    drafts: list[int],
    probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> Verdict:
    """The rejection rule for one request: `probs` [k + 1, V] the target's distributions,
    `draft_probs` [k, V] the draft's (None: deterministic drafts, q = one-hot)."""
    k = len(drafts)
    device = probs.device
    ids = torch.tensor(drafts, device=device, dtype=torch.long)
    p_draft = probs[:k].gather(1, ids[:, None])[:, 0] if k else probs.new_zeros(0)
    if draft_probs is None:
        q = torch.zeros_like(probs[:k]).scatter_(1, ids[:, None], 1.0)
        q_draft = torch.ones_like(p_draft)
    else:
        q = draft_probs.float()
        q_draft = q.gather(1, ids[:, None])[:, 0]
    uniforms = torch.rand(k, device=device, generator=generator)
    accepted = (uniforms * q_draft < p_draft).tolist()  # u < p/q without dividing by q = 0
    a = 0
    while a < k and accepted[a]:
        a += 1
    if a < k:
        residual = (probs[a] - q[a]).clamp_(min=0)
        dist = residual if float(residual.sum()) > 0 else probs[a]  # p == q: nothing left to correct
    else:
        dist = probs[k]
    token = int(torch.multinomial(dist, 1, generator=generator))
    return Verdict(drafts[:a] + [token], a)
