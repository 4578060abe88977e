"""Drafts from a small model of the target's tokenizer, with its own KV on the target's pages.

Owns: `DraftModelProposer`: the draft model (loaded before the engine plans its KV, whose
budget it shares), its `ModelRunner` (its own KV tensors, attention backend and decode CUDA
graphs) and, per request, how far its KV is computed.

Pages: the draft's KV cache has as many pages as the target's and is addressed through the
scheduler's page table: the draft's K/V of a request's position p lives where the target's
does (same page, same offset), in the draft's own tensors. So the draft needs no allocator of
its own: the pages a request holds (its drafts' included, `Scheduler.reserve_lookahead`)
cover both, a page freed or cached serves both, and the prefix cache stays the target's.

Drafting is lazy: per request, `computed` positions of its draft KV are valid. A step first
catches up over positions [computed, n], n the request's last position, whose last row gives
draft token 1 (a decode batch with a row per position when short, as after a verify step;
one extend when long, as for a new prompt), then runs k - 1 decode steps over its own drafts;
decode batches replay the draft runner's decode graphs on CUDA. After verification the draft KV is valid up to the
smaller of what it computed and what the target accepted. Invariant: outside a step,
`computed` <= the request's `num_computed`, and those positions' draft KV was computed from
the request's tokens; a request preempted since (its pages went back) starts again from 0. Draft KV that is
stale for any other reason (a page shared through the prefix cache, a fork's copied page)
only lowers acceptance: verification decides every token.

Sampling: a greedy request drafts the argmax; a sampled one draws from the draft's
distribution processed with its temperature, top-k, top-p and min-p (penalties and grammars
are left to verification), returned as `Draft.probs` for the rejection rule.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.config import SpeculativeConfig
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.sampler import SampleRow
from nanoserve.engine.speculative.acceptance import target_distributions
from nanoserve.engine.speculative.positions import PositionRow, position_batch
from nanoserve.engine.speculative.proposer import Draft, DraftContext
from nanoserve.kvcache.pool import KVCache
from nanoserve.models.decoder import kv_heads_per_rank
from nanoserve.models.loader import build_model
from nanoserve.models.registry import resolve_model
from nanoserve.scheduler.scheduler import ScheduledBatch
from nanoserve.step import KVPlan
from nanoserve.tokenizer import load_tokenizer

# A catch-up of at most this many positions per request runs as a decode batch with a row per
# position (nanoserve.engine.speculative.positions), replayed from the decode graphs; longer ones (a
# request's prompt, the first time it drafts) run as one extend.
CATCH_UP_AS_DECODE = 17


class VocabularyMismatch(ValueError):
    pass


def check_same_vocabulary(draft_source, draft_tokenizer, target_source, target_tokenizer) -> None:
    """The draft's tokens must mean what the target's mean: equal tokenizer vocabularies when
    both have tokenizers, else equal model vocabulary sizes."""
    if draft_tokenizer is not None and target_tokenizer is not None:
        if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
            raise VocabularyMismatch(
                f"the draft model {draft_source.config.name!r} has another tokenizer vocabulary than the target "
                f"{target_source.config.name!r} ({len(draft_tokenizer.get_vocab())} against "
                f"{len(target_tokenizer.get_vocab())} entries): speculative decoding needs the same tokenizer"
            )
        return
    draft_vocab, target_vocab = draft_source.config.vocab_size, target_source.config.vocab_size
    if draft_vocab != target_vocab:
        raise VocabularyMismatch(
            f"the draft model's vocabulary has {draft_vocab} tokens, the target's {target_vocab}: speculative "
            "decoding needs the same tokenizer"
        )


@dataclass
class _DraftState:
    computed: int = 0  # positions of the request whose draft KV is valid
    drafted_until: int = 0  # positions the draft computed in the last step
    preemptions: int = 0  # the request's num_preemptions when `computed` was last valid


class DraftModelProposer:
    needs_pages = True

    def __init__(self, spec: SpeculativeConfig, context: DraftContext):
        config = context.config
        source = resolve_model(spec.draft_model)
        tokenizer = load_tokenizer(source) if source.has_tokenizer else None
        check_same_vocabulary(source, tokenizer, context.target_source, context.tokenizer)
        self.config = dataclasses.replace(
            config,
            cascade_attention=False,
            piecewise_cuda_graphs=False,
            speculative_algorithm=None,
            speculative_num_draft_tokens=None,
            speculative_draft_model=None,
        )
        self.device = context.device
        self.kv_dtype = context.kv_dtype
        self.target_vocab = context.target_source.config.vocab_size
        self.model = build_model(
            source,
            config.load_format,
            context.dtype,
            context.device,
            config.seed + 1,
            max_positions=context.max_len,
            switches=config.switches,
        )
        cfg = source.config
        self.kv_bytes_per_token = KVCache.bytes_per_token(
            cfg.num_layers, kv_heads_per_rank(cfg, self.model.tp), cfg.head_dim, context.kv_dtype
        )
        self.runner: ModelRunner | None = None
        self.page_table = None
        self.generator = torch.Generator(device=context.device).manual_seed(config.seed + 2)
        self.states: dict[object, _DraftState] = {}

    def attach(self, engine, plan: KVPlan) -> None:
        """The draft runner: a KV cache of the target's page count, decode graphs on CUDA."""
        draft_plan = KVPlan(plan.num_pages, plan.page_size, self.kv_bytes_per_token)
        self.runner = ModelRunner(self.config, self.model, draft_plan, self.device, self.kv_dtype)
        self.runner.setup_cuda_graphs(engine.max_model_len)
        self.page_table = engine.scheduler.page_table

    # ---- drafting --------------------------------------------------------------------

    def propose(self, reqs: list, budgets: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in reqs]
        active = [i for i, b in enumerate(budgets) if b > 0]
        if not active:
            return drafts
        rows, todo = [], []
        for i in active:
            req = reqs[i]
            state = self.states.setdefault(req, _DraftState())
            if state.preemptions != req.num_preemptions or state.computed > req.num_computed:
                state.computed, state.preemptions = 0, req.num_preemptions
            rows.append(PositionRow(list(req.token_ids), state.computed, req.slot))
            todo.append(budgets[i])
        counts = [len(r.token_ids) - r.num_computed for r in rows]
        if max(counts) <= CATCH_UP_AS_DECODE:  # a row per position: the decode graphs
            ends = np.cumsum(counts) - 1
            tokens = [r.token_ids[r.num_computed :] for r in rows]
            batch = position_batch(rows, tokens, [r.num_computed for r in rows], self.page_table)
            logits = self._forward(batch)[torch.as_tensor(ends, device=self.device)]
        else:  # a long catch-up (a new prompt): one extend, the last row of each request
            logits = self._forward(ScheduledBatch(rows, counts, False, self.page_table))
        for row, count in zip(rows, counts):
            row.num_computed += count
        live = list(range(len(rows)))  # indexes into rows / active
        q_rows: dict[int, list[torch.Tensor]] = {}  # sampled requests' draft distributions
        while True:
            self._draw(logits, [reqs[active[j]] for j in live], [drafts[active[j]] for j in live], live, q_rows)
            for j in live:
                rows[j].token_ids.append(drafts[active[j]].tokens[-1])
            live = [j for j in live if len(drafts[active[j]].tokens) < todo[j]]
            if not live:
                break
            step_rows = [rows[j] for j in live]
            logits = self._forward(ScheduledBatch(step_rows, [1] * len(live), True, self.page_table, len(live)))
            for row in step_rows:
                row.num_computed += 1
        for j, i in enumerate(active):
            self.states[reqs[i]].drafted_until = rows[j].num_computed
        for j, q in q_rows.items():
            drafts[active[j]].probs = torch.stack(q)
        return drafts

    def _forward(self, batch: ScheduledBatch) -> torch.Tensor:
        runner = self.runner
        logits = runner.execute(runner.prepare(batch, list(range(len(batch.requests)))))
        vocab = self.target_vocab
        if logits.shape[1] > vocab:  # the draft's padding rows: no token of the target's
            logits = logits[:, :vocab]
        elif logits.shape[1] < vocab:
            pad = logits.new_full((logits.shape[0], vocab - logits.shape[1]), float("-inf"))
            logits = torch.cat([logits, pad], dim=1)
        return logits

    def _draw(self, logits: torch.Tensor, reqs: list, drafts: list[Draft], keys: list[int], q_rows: dict) -> None:
        """Each request's next draft token from its row of `logits` (greedy: argmax; sampled:
        a draw from the processed distribution, appended to q_rows[keys[j]] for the rejection
        rule)."""
        rows = [SampleRow(r.params, r.generator, [], []) for r in reqs]
        greedy, probs = target_distributions(logits, rows, None)
        greedy = greedy.tolist()
        for j, (req, draft) in enumerate(zip(reqs, drafts)):
            if req.params.greedy:
                draft.tokens.append(greedy[j])
                continue
            gen = req.generator if req.generator is not None else self.generator
            token = int(torch.multinomial(probs[j], 1, generator=gen))
            draft.tokens.append(token)
            q_rows.setdefault(keys[j], []).append(probs[j])

    # ---- bookkeeping -----------------------------------------------------------------

    def verified(self, reqs: list) -> None:
        for req in reqs:
            state = self.states.get(req)
            if state is not None and state.drafted_until:
                state.computed = min(state.drafted_until, req.num_computed)
                state.drafted_until = 0

    def finished(self, req) -> None:
        self.states.pop(req, None)
