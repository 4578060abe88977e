"""What EAGLE-3 drafting costs against a target step (GPU): a dummy target with a random-weight
EAGLE-3 checkpoint of the real layout (nanoserve.engine.speculative.eagle3.write_random_eagle3), one
request of `--context` tokens at batch 1. Times, wall clock (host work included, as drafting
sits on the step's critical path), mean over `--iters`:
- the target's decode step (the decode graph's replay, as the engine runs it);
- the target's verify step over 1 + k tokens (an extend with logits at every position);
- the proposer's whole draft for one verify step (a catch-up extend of 1 + a accepted
  positions, then k - 1 draft decode steps), and that per draft forward;
- one draft decode step alone (its CUDA graph's replay at batch 1).
Prints each time and the draft forward's share of a target decode step, and the speedup that
follows at acceptance lengths 2, 3, 4 (tokens per verify step) from these parts:
(tokens per step) * t_decode / (t_verify + t_draft).

    python benchmarks/probes/eagle3_step.py --model llama-3.1-8b --draft-vocab 32000 --k 4
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.speculative.eagle3 import write_random_eagle3
from nanoserve.engine.speculative.positions import position_batch
from nanoserve.scheduler.scheduler import ScheduledBatch


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--accepted", type=int, default=2, help="positions the catch-up extend covers, minus one")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    from nanoserve.models.registry import resolve_model

    target = resolve_model(args.model).config
    with tempfile.TemporaryDirectory() as d:
        write_random_eagle3(d, target, min(args.draft_vocab, target.vocab_size), seed=0, dtype=torch.bfloat16)
        llm = LLM(
            args.model, load_format="dummy", max_model_len=4096, kv_cache_tokens=65536, max_num_seqs=16,
            speculative_algorithm="eagle3", speculative_draft_model=d, speculative_num_draft_tokens=args.k,
        )  # fmt: skip
    eng = llm.engine
    runner, sched = eng.runner, eng.scheduler
    speculator, eng.speculator = eng.speculator, None
    proposer = speculator.proposer
    prompt = [(i * 7919 + 1) % target.vocab_size for i in range(args.context)]
    eng.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True), stream=True)
    req = sched.waiting[0]
    while req.num_computed < args.context:
        eng.step()
    while eng._inflight is not None:  # settle the overlap loop: every token on the host
        done, eng._inflight = eng._inflight, None
        eng._process(done)
    k = args.k
    assert sched.reserve_lookahead(req, k) == k
    decode = ScheduledBatch([req], [1], True, sched.page_table, 1)
    t_decode = timed(lambda: runner.execute(runner.prepare(decode, [0])), args.iters)
    # the verify step as the engine runs it: a decode row per position, stand-in drafts
    verify = position_batch([req], [[req.token_ids[-1], *prompt[:k]]], [req.num_computed], sched.page_table)
    t_verify = timed(lambda: runner.execute(runner.prepare(verify, list(range(1 + k)))), args.iters)
    n = req.num_computed

    def draft() -> None:
        state = proposer.states.get(req)
        if state is not None:
            state.dc = n - 1 - args.accepted  # as after a verify step that accepted `accepted` drafts
        proposer.propose([req], [k])

    t_draft = timed(draft, args.iters)
    per_forward = t_draft / k
    print(f"{args.model} (dummy), context {args.context}, k={k}, draft vocab {args.draft_vocab}, batch 1")
    print(f"target decode step {t_decode:.3f} ms, verify step (1 + {k} tokens) {t_verify:.3f} ms")
    print(
        f"draft for one verify step {t_draft:.3f} ms ({k} forwards: a catch-up of {1 + args.accepted} rows, "
        f"{k - 1} decode steps), {per_forward:.3f} ms per forward = {per_forward / t_decode:.1%} of a decode step"
    )
    graphs = proposer.graphs
    if graphs is not None:  # one draft decode step alone: its graph's replay (batch 1)
        t_step = timed(graphs.graphs[1].replay, args.iters)
        print(f"draft decode step (graph replay, batch 1) {t_step:.3f} ms = {t_step / t_decode:.1%} of a decode step")
    for tokens in (2, 3, 4):
        print(f"  acceptance length {tokens}: speedup {tokens * t_decode / (t_verify + t_draft):.2f}x")
    eng.speculator = speculator


if __name__ == "__main__":
    main()
