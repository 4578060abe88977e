"""The speculative verify step, and when to take it: the engine's one entry into speculation.

Owns: `Speculator`. `LLMEngine.step` asks `wants_step()` before scheduling; when it says yes
the engine finishes the step in flight (drafts need every token on the host) and calls
`step()`, which schedules a decode batch, drafts, verifies and reports, or returns None when
no request has a draft (the engine then runs its ordinary step, overlap loop included).

A verify step is one target forward over, per request, its last token (not yet computed)
followed by its drafts: 1 + k_i positions per request against its paged KV, run as a decode
batch with a row per position (`positions.py`), so it replays the decode CUDA graphs and
returns logits at every position. Afterwards each request gets its accepted drafts and one
token of the target's (`acceptance.py`), cut at the first stop reason (EOS, stop ids,
max_tokens, the grammar's end) exactly as the one-token path would cut it.

Invariants:
- a request's `num_computed` counts only accepted positions: its last token and the accepted
  drafts. Rejected drafts' K/V stay in the request's pages, past `num_computed`, and are
  overwritten by the tokens that follow; the prefix cache inserts `token_ids[:num_computed]`
  only, so it never holds a rejected token;
- pages for the drafts come from `Scheduler.reserve_lookahead`, which never preempts: a
  request short of pages drafts less;
- a grammar accepts exactly the emitted tokens: drafts are walked through it to build each
  position's mask and clip drafts it refuses, then it is rolled back, and the emitted tokens
  are accepted one by one as the engine does for a sampled token.

Back-off: a request whose drafts are all rejected, or that finds none, skips speculation for
1, 2, 4, ... steps (up to MAX_BACKOFF_STEPS); an accepted draft resets it. A step with more
running requests than `disable_batch_size`, or with prompts waiting, does not speculate. And
the cost gate (opt-in, `SpeculativeConfig.cost_gate`; measured slower than without it, see
docs/speculative.md): speculation stops (but for a probe every PROBE_EVERY steps, which reopens
it when it pays) while the tokens a verify step yields per request, times a plain decode step's
wall time, fall short of a verify step's wall time.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from nanoserve.config import SpeculativeConfig
from nanoserve.engine.sampler import SampleRow
from nanoserve.engine.speculative.acceptance import Verdict, accept_greedy, accept_sampled, target_distributions
from nanoserve.engine.speculative.ngram import NgramProposer
from nanoserve.engine.speculative.positions import position_batch
from nanoserve.engine.speculative.proposer import Draft, DraftContext, Proposer
from nanoserve.outputs import StepUpdate, TokenLogprobs

if TYPE_CHECKING:
    from nanoserve.scheduler.request import Request

MAX_BACKOFF_STEPS = 32
# The cost gate (see `_worth_it`): the medians of the last GATE_WINDOW plain steps' and verify
# steps' wall times (medians: a step that compiled a kernel takes 100x the usual and must not
# close the gate for long) and the mean of the tokens a verify step gave per request (the
# expected yield: on copied text most steps give all their drafts, some give one token, and
# the median of such a mix is far below what the steps yield). While verifying does not pay for
# itself, one verify step in PROBE_EVERY still runs to keep them current, and a probe that pays
# reopens the gate at once (its samples replace the window's: a request that copies again after
# a stretch of new text must not wait for a window of probes). Measured on an H200 (real
# SmolLM2-135M, copy-heavy, 2026-12-01): with probes every 64 steps joining the window the gate
# verified in 106 of the 216 steps that the gate-off run verified, 1.62x against 2.24x.
GATE_WINDOW = 15
PROBE_EVERY = 32


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters (their names in `as_metrics`)."""

    num_drafts: int = 0  # request-steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: drafts accepted at position j
    num_verify_steps: int = 0

    def as_metrics(self) -> dict[str, object]:
        return {
            "vllm:spec_decode_num_drafts": self.num_drafts,
            "vllm:spec_decode_num_draft_tokens": self.num_draft_tokens,
            "vllm:spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "vllm:spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
        }


@dataclass
class _Backoff:
    misses: int = 0  # consecutive steps without an accepted draft
    resume_at: int = 0  # the speculator's step count from which the request drafts again


class Speculator:
    def __init__(self, spec: SpeculativeConfig, engine, proposer: Proposer, plan):
        """`engine`: the LLMEngine this speculator serves (its scheduler, runner and stopping rules)."""
        self.spec = spec
        self.engine = engine
        self.k = spec.k
        self.proposer = proposer
        proposer.attach(engine, plan)
        self.generator = torch.Generator(device=engine.device).manual_seed(engine.config.seed + 1)
        self.counters = SpecCounters(accepted_per_pos=[0] * self.k)
        self.backoff: dict[Request, _Backoff] = {}
        self.num_steps = 0  # steps asked about (the back-off's clock)
        # the cost gate's recent samples and the last step's start
        self.plain_steps: deque[float] = deque(maxlen=GATE_WINDOW)
        self.verify_steps: deque[float] = deque(maxlen=GATE_WINDOW)
        self.verify_tokens: deque[float] = deque(maxlen=GATE_WINDOW)
        self._last_asked: float | None = None
        self._last_was_verify = False
        self._last_probe = 0
        self._probing = False  # the step asked for is a probe of a shut gate

    # ---- when ------------------------------------------------------------------------

    def wants_step(self) -> bool:
        """Whether the next step should be a verify step: only decode is scheduled (no prompt
        waits), the batch is small enough, and a request is not backed off."""
        self.num_steps += 1
        self._probing = False
        now = time.perf_counter()
        if self._last_asked is not None and not self._last_was_verify:
            self.plain_steps.append(now - self._last_asked)
        self._last_asked, self._last_was_verify = now, False
        sched = self.engine.scheduler
        running = sched.running
        if sched.waiting or not running or len(running) > self.spec.disable_batch_size:
            return False
        if len(self.backoff) > len(running):
            self._forget_finished()
        return self._worth_it() and any(self._eligible(r) for r in running)

    plain_step_s = property(lambda self: statistics.median(self.plain_steps) if self.plain_steps else None)
    verify_step_s = property(lambda self: statistics.median(self.verify_steps) if self.verify_steps else None)
    tokens_per_verify = property(lambda self: statistics.fmean(self.verify_tokens) if self.verify_tokens else None)

    def _worth_it(self) -> bool:
        """The cost gate: verifying pays (or has not been measured yet), or it is time to probe."""
        if not self.spec.cost_gate or len(self.verify_steps) < 3 or not self.plain_steps:
            return True
        plain, verify, tokens = self.plain_step_s, self.verify_step_s, self.tokens_per_verify
        if tokens * plain >= verify:
            return True
        if self.num_steps - self._last_probe >= PROBE_EVERY:
            self._last_probe = self.num_steps
            self._probing = True
            return True
        return False

    def _after_probe(self, seconds: float, tokens: float) -> None:
        """A probe that paid for itself (tokens x plain step >= its own time) reopens the gate."""
        self._probing = False
        plain = self.plain_step_s
        if plain is not None and tokens * plain >= seconds:
            self.verify_steps.clear()
            self.verify_tokens.clear()
            self.verify_steps.append(seconds)
            self.verify_tokens.append(tokens)

    def _eligible(self, req: Request) -> bool:
        state = self.backoff.get(req)
        return state is None or state.resume_at <= self.num_steps

    def _forget_finished(self) -> None:
        for req in [r for r in self.backoff if r.is_finished]:
            del self.backoff[req]
            self.proposer.finished(req)

    def _missed(self, req: Request) -> None:
        state = self.backoff.setdefault(req, _Backoff())
        state.resume_at = self.num_steps + min(1 << state.misses, MAX_BACKOFF_STEPS)
        state.misses += 1

    def _hit(self, req: Request) -> None:
        state = self.backoff.setdefault(req, _Backoff())
        state.misses, state.resume_at = 0, 0

    # ---- the step --------------------------------------------------------------------

    def step(self) -> list[StepUpdate] | None:
        """Draft, verify and report one decode step; None (nothing scheduled) when no request
        has a draft. Every token of every running request is on the host (no step in flight)."""
        eng = self.engine
        sched = eng.scheduler
        budgets = {r: self._budget(r) for r in sched.running if self._eligible(r)}
        early: dict[Request, Draft] = {}
        if not self.proposer.needs_pages:  # look-ups cost no forward: draft before scheduling
            for req, budget in budgets.items():
                draft = self.proposer.propose([req], [budget])[0] if budget > 0 else Draft([])
                if draft.tokens:
                    early[req] = draft
                else:
                    self._missed(req)
            if not early:
                return None
        batch = sched.schedule()
        if batch is None:
            return []
        if not batch.is_decode:  # cannot happen with nothing waiting; the ordinary path copes
            raise RuntimeError("a verify step needs a decode batch")
        reqs = batch.requests
        drafts = self._drafts(reqs, budgets, early)
        updates = self._verify(reqs, drafts)
        seconds = time.perf_counter() - self._last_asked  # the tokens' sync included
        self.verify_steps.append(seconds)
        if self._probing:
            self._after_probe(seconds, self.verify_tokens[-1])
        self._last_was_verify = True
        return updates

    def _budget(self, req: Request) -> int:
        """Drafts `req` may verify: k, fewer near max_tokens / max_model_len (the target's own
        token comes on top of the accepted drafts)."""
        return max(0, min(self.k, req.stop_len - len(req.token_ids) - 1))

    def _drafts(self, reqs: list[Request], budgets: dict, early: dict) -> list[Draft]:
        """Each scheduled request's drafts, within the pages it could reserve for them."""
        sched = self.engine.scheduler
        if not self.proposer.needs_pages:
            drafts = [early.get(r, Draft([])) for r in reqs]
            for r, d in zip(reqs, drafts):
                if d.tokens:
                    d.trim(sched.reserve_lookahead(r, len(d.tokens)))
        else:
            room = [sched.reserve_lookahead(r, budgets.get(r, 0)) for r in reqs]
            drafts = self.proposer.propose(reqs, room)
        return [self._clip_to_grammar(r, d) for r, d in zip(reqs, drafts)]

    @staticmethod
    def _clip_to_grammar(req: Request, draft: Draft) -> Draft:
        """A constrained request keeps the drafts its grammar accepts, in order."""
        m = req.matcher
        if m is None or not draft.tokens:
            return draft
        mark = m.checkpoint()
        ok = 0
        for token in draft.tokens:
            if m.is_terminated or not m.accept(token):
                break
            ok += 1
        m.rollback(mark)
        draft.trim(ok)
        return draft

    def _masks(self, reqs: list[Request], drafts: list[Draft], vocab: int) -> torch.Tensor | None:
        """The grammar bitmask of every verified position (None without a constrained request):
        row j of a constrained request allows what may follow its drafts before j."""
        eng = self.engine
        if not eng.num_constrained or all(r.matcher is None for r in reqs):
            return None
        from nanoserve.structured.matcher import bitmask_words

        words = bitmask_words(vocab)
        grammar_words = bitmask_words(eng.grammar_service().grammar_vocab_size)
        total = sum(1 + len(d.tokens) for d in drafts)
        host = torch.full((total, words), -1, dtype=torch.int32)
        row = 0
        scratch = torch.empty(1, grammar_words, dtype=torch.int32)
        for req, draft in zip(reqs, drafts):
            m = req.matcher
            if m is None:
                row += 1 + len(draft.tokens)
                continue
            mark = m.checkpoint()
            for j in range(1 + len(draft.tokens)):
                if m.needs_mask:
                    m.fill_mask(scratch, 0)
                    host[row + j, :grammar_words] = scratch[0]
                    host[row + j, grammar_words:] = 0
                if j < len(draft.tokens):
                    m.accept(draft.tokens[j])
            m.rollback(mark)
            row += 1 + len(draft.tokens)
        return host.to(eng.device)

    def _verify(self, reqs: list[Request], drafts: list[Draft]) -> list[StepUpdate]:
        eng = self.engine
        runner = eng.runner
        counts = [1 + len(d.tokens) for d in drafts]
        tokens = [[req.token_ids[-1], *d.tokens] for req, d in zip(reqs, drafts)]
        batch = position_batch(reqs, tokens, [r.num_computed for r in reqs], eng.scheduler.page_table)
        logits = runner.execute(runner.prepare(batch, list(range(len(batch.requests)))))
        rows = self._sample_rows(reqs, drafts)
        greedy, probs = target_distributions(logits, rows, self._masks(reqs, drafts, logits.shape[1]))
        greedy_host = greedy.tolist()
        verdicts: list[Verdict] = []
        offset = 0
        for req, draft, count in zip(reqs, drafts, counts):
            if req.params.greedy:
                verdict = accept_greedy(draft.tokens, greedy_host[offset : offset + count])
            else:
                gen = req.generator if req.generator is not None else self.generator
                verdict = accept_sampled(draft.tokens, probs[offset : offset + count], draft.probs, gen)
            verdicts.append(verdict)
            offset += count
        logprobs = self._logprobs(logits, reqs, counts, verdicts)
        self.counters.num_verify_steps += 1
        self.verify_tokens.append(sum(len(v.tokens) for v in verdicts) / len(verdicts))
        updates = [
            u
            for req, draft, verdict, lps in zip(reqs, drafts, verdicts, logprobs)
            if (u := self._apply(req, draft, verdict, lps)) is not None
        ]
        self.proposer.verified(reqs)
        return updates

    def _sample_rows(self, reqs: list[Request], drafts: list[Draft]) -> list[SampleRow]:
        """Each verified position's sampling row; with penalties, the drafts before it count
        as output tokens already."""
        rows = []
        for req, draft in zip(reqs, drafts):
            row = self.engine._sample_row(req)
            rows.append(row)
            for j in range(1, 1 + len(draft.tokens)):
                if req.params.has_penalties:
                    row = SampleRow(req.params, req.generator, row.prompt_ids, row.output_ids + [draft.tokens[j - 1]])
                rows.append(row)
        return rows

    @staticmethod
    def _logprobs(logits, reqs, counts, verdicts) -> list[list[TokenLogprobs] | None]:
        """Log-probabilities of the emitted tokens, from the raw logits of their positions
        (as the one-token path reports them)."""
        out: list[list[TokenLogprobs] | None] = []
        offset = 0
        for req, count, verdict in zip(reqs, counts, verdicts):
            n = req.params.logprobs
            if n is None:
                out.append(None)
            else:
                emitted = len(verdict.tokens)
                logp = logits[offset : offset + emitted].float().log_softmax(dim=-1)
                ids = torch.tensor(verdict.tokens, device=logp.device)
                chosen = logp.gather(1, ids[:, None])[:, 0].tolist()
                vals, top = logp.topk(max(n, 1), dim=-1)
                vals, top = vals.tolist(), top.tolist()
                out.append(
                    [
                        TokenLogprobs(t, c, dict(zip(top[j][:n], vals[j][:n])))
                        for j, (t, c) in enumerate(zip(verdict.tokens, chosen))
                    ]
                )
            offset += count
        return out

    def _apply(
        self, req: Request, draft: Draft, verdict: Verdict, logprobs: list[TokenLogprobs] | None
    ) -> StepUpdate | None:
        """Append the emitted tokens up to the first stop reason; count; report."""
        eng = self.engine
        c = self.counters
        if draft.tokens:
            c.num_drafts += 1
            c.num_draft_tokens += len(draft.tokens)
            c.num_accepted_tokens += verdict.num_accepted
            for j in range(verdict.num_accepted):
                c.accepted_per_pos[j] += 1
            if verdict.num_accepted:
                self._hit(req)
            else:
                self._missed(req)
        computed = req.num_computed + 1 + verdict.num_accepted  # the last token and accepted drafts
        reason = None
        for j, token in enumerate(verdict.tokens):
            req.token_ids.append(token)
            if logprobs is not None:
                req.logprobs = (req.logprobs or []) + [logprobs[j]]
            reason = eng._stop_reason(req, token, len(req.token_ids))
            if req.matcher is not None:
                reason = eng._grammar_stop(req, token, reason)
            if reason is not None:
                break
        req.num_computed = min(computed, len(req.token_ids))
        if reason is not None:
            eng._finish(req, reason)
            return eng._update(req)
        return eng._update(req) if req.stream else None


def make_proposer(spec: SpeculativeConfig, context: DraftContext) -> Proposer:
    """The drafter of `spec`; a draft model's weights are loaded (and its vocabulary checked) here."""
    if spec.algorithm == "ngram":
        return NgramProposer(spec.ngram_min_match, spec.ngram_max_match, spec.ngram_store_tokens)
    if spec.algorithm == "draft":
        from nanoserve.engine.speculative.draft_model import DraftModelProposer

        return DraftModelProposer(spec, context)
    from nanoserve.engine.speculative.eagle3 import Eagle3Proposer

    return Eagle3Proposer(spec, context)
