"""The host-side fast path of an engine step, against slow twins, on CPU.

- `ModelRunner.prepare` (numpy over the scheduler's `PageTable`, one packed buffer) equals
  the list-based prepare it replaced (`reference_prepare` below) on every step of random
  runs with chunked prefill, prefix-cache hits, n > 1 forks and preemption, with and
  without the overlap loop and (emulated) decode graphs; the scheduler's invariants,
  which include "page table rows == the requests' page lists", hold after every step.
- Decode graphs emulated on CPU (each "replay" runs the eager forward on the static
  buffers, as a captured graph would) give the same greedy tokens as eager decode, and a
  replay of inputs prepared elsewhere (another rank's) copies them in correctly.
- `stream=False` reports each sample once, finished, with the tokens streaming reports.
- The sampler's per-batch plan cache gives what a fresh plan gives.
- An engine with decode graphs is freed by `del`, without the garbage collector.
"""

from __future__ import annotations

import dataclasses
import gc
import random
import weakref

import numpy as np
import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.cuda_graph import VARIANTS, DecodeGraphs
from nanoserve.engine.sampler import Sampler, SampleRow
from nanoserve.kvcache.pool import PageTable
from tests.tiny import VOCAB, make_tiny_model, random_prompts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3")


# ---- slow twin of ModelRunner.prepare ----------------------------------------------------


def reference_prepare(runner, batch, sample_rows) -> dict:
    """Step inputs built from each request's Python lists (the engine's former prepare)."""
    ps = runner.page_size
    input_ids, positions, slots, seq_lens, prefix_lens, cu = [], [], [], [], [], [0]
    for req, n in zip(batch.requests, batch.num_new_tokens):
        start = req.num_computed
        input_ids += req.token_ids[start : start + n]
        positions += range(start, start + n)
        slots += [req.pages[p // ps] * ps + p % ps for p in range(start, start + n)]
        prefix_lens.append(start)
        seq_lens.append(start + n)
        cu.append(cu[-1] + n)
    num_reqs = len(seq_lens)
    width = -(-max(seq_lens) // ps)
    table = [(req.pages[:width] + [0] * width)[:width] for req in batch.requests]
    pool = [req.slot if t == n else 0 for req, n in zip(batch.requests, batch.num_new_tokens) for t in range(1, n + 1)]
    graph_bs = None
    if runner.graphs is not None and batch.is_decode:
        graph_bs = runner.graphs.padded_size(num_reqs)
    pad = 0 if graph_bs is None else graph_bs - num_reqs
    ids = torch.tensor(input_ids + [0] * pad)
    ids = torch.where(ids < 0, runner.token_pool[torch.tensor(pool + [0] * pad)], ids)
    all_rows = len(sample_rows) == num_reqs and cu[-1] == num_reqs
    logit_rows = None if all_rows or graph_bs is not None else [cu[i + 1] - 1 for i in sample_rows]
    return {
        "input_ids": ids,
        "positions": torch.tensor(positions + [0] * pad),
        "seq_lens": torch.tensor(seq_lens + [0] * pad, dtype=torch.int32),
        "prefix_lens": torch.tensor(prefix_lens + [0] * pad, dtype=torch.int32),
        "cu_query_lens": torch.tensor(cu + list(range(cu[-1] + 1, cu[-1] + pad + 1)), dtype=torch.int32),
        "page_table": torch.tensor(table + [[0] * width] * pad, dtype=torch.int32).view(-1, width),
        "slot_mapping": torch.tensor(slots + [0] * pad),
        "logit_rows": None if logit_rows is None else torch.tensor(logit_rows, dtype=torch.long),
        "seq_lens_host": seq_lens,
        "prefix_lens_host": prefix_lens,
        "max_query_len": max(batch.num_new_tokens),
        "max_seq_len": max(seq_lens),
        "cascade": None,  # the torch backend: no cascade plan (tests/test_cascade.py covers it)
        "runs": None,  # nor runs (tests/test_speculative.py covers them)
        "num_decode_rows": 0 if batch.is_decode else batch.num_decodes,  # a mixed batch's decode rows
        "graph_bs": graph_bs,
        "num_reqs": num_reqs,
        "req_slots": torch.tensor([r.slot for r in batch.requests]),
    }


def flatten(inputs) -> dict:
    meta = inputs.meta
    out = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta) if f.name != "is_decode"}
    out.update(
        input_ids=inputs.input_ids,
        positions=inputs.positions,
        logit_rows=inputs.logit_rows,
        graph_bs=inputs.graph_bs,
        num_reqs=inputs.num_reqs,
        req_slots=inputs.req_slots,
    )
    return out


def assert_same_inputs(got, want: dict) -> None:
    got = flatten(got)
    assert set(got) == set(want)
    for name, w in want.items():
        g = got[name]
        if isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype, (name, g.dtype, w.dtype)
            assert torch.equal(g.cpu(), w), (name, g, w)
        else:
            assert g == w, (name, g, w)


def check_every_prepare(llm: LLM) -> dict:
    """Make the runner compare each prepare with the reference; returns counters."""
    runner = llm.engine.runner
    real = runner.prepare
    seen = {"steps": 0, "graph": 0, "extend": 0, "pending": 0, "mixed": 0}

    def checked(batch, sample_rows):
        want = reference_prepare(runner, batch, sample_rows)  # before prepare: same state
        got = real(batch, sample_rows)
        pending = got.pending is not None
        runner.read_pending_tokens(got)  # what `execute` does first (no sampling queued between here)
        assert_same_inputs(got, want)
        seen["steps"] += 1
        seen["graph"] += got.graph_bs is not None
        seen["extend"] += any(r.num_computed > 0 for r in batch.requests) and not batch.is_decode
        seen["pending"] += pending
        assert pending == any(r.token_ids[-1] < 0 for r in batch.requests)
        seen["mixed"] += not batch.is_decode and batch.num_decodes > 0
        return got

    runner.prepare = checked
    return seen


# ---- decode graphs emulated on CPU -------------------------------------------------------


class _EagerGraph:
    """Stands in for the captured graph of size bs and its variant (plain, cascade, runs):
    runs the eager forward on the static inputs (what the graph captured) and writes the
    static output."""

    def __init__(self, graphs: DecodeGraphs, runner, bs: int, variant: str):
        self.graphs, self.runner, self.bs, self.variant = graphs, runner, bs, variant

    def replay(self) -> None:
        g = self.graphs
        inputs = g._static_inputs(self.bs, self.variant)
        # The torch backend counts a row's queries as seq_len - prefix_len; a padding row
        # (length 0) still holds one query in a decode batch: prefix -1 says so (a real
        # decode row has prefix == seq_len - 1 already).
        inputs.meta = dataclasses.replace(inputs.meta, prefix_lens=inputs.meta.seq_lens - 1)
        g.outputs[(self.bs, self.variant)].copy_(self.runner.forward_logits(inputs))


def emulate_graphs(llm: LLM, max_bs: int, reads_pool: bool = False) -> DecodeGraphs:
    runner = llm.engine.runner
    g = DecodeGraphs(
        runner,
        max_bs,
        llm.engine.max_model_len,
        cascade=runner.cascade_members > 0,
        reads_pool=reads_pool,
        run_rows=runner.max_run_rows,
    )
    for bs in g.sizes:
        for variant in (v for v in VARIANTS if g.has_variant(bs, v)):
            with torch.inference_mode():  # as in `capture`: views made there are inference views
                g.views(bs, variant)
            g.graphs[(bs, variant)] = _EagerGraph(g, runner, bs, variant)
            g.outputs[(bs, variant)] = torch.zeros(bs, runner.model.config.vocab_size)
    runner.graphs = g
    return g


def test_engine_with_graphs_freed_without_the_collector(model_dir):
    # The runner owns its decode graphs and they keep no reference back to it: deleting the
    # LLM frees the engine at once (on a GPU: its KV cache and graph memory pool), not at the
    # next cyclic collection, which an engine process's frozen heap may never run.
    llm = LLM(str(model_dir), device="cpu")
    llm.generate(random_prompts(4, seed=7, min_len=3, max_len=20), SamplingParams(max_tokens=5), use_tqdm=False)
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner, 4, llm.engine.max_model_len)  # static buffers, nothing captured
    refs = [weakref.ref(o) for o in (llm.engine, runner, runner.graphs, runner.kv_cache)]
    del runner
    gc.disable()
    try:
        del llm
        alive = [r() is not None for r in refs]
    finally:
        gc.enable()
    assert not any(alive), alive


def make_llm(model_dir, overlap: bool, graphs_bs: int = 0, reads_pool: bool = False, **kw) -> LLM:
    llm = LLM(str(model_dir), device="cpu", **kw)
    llm.engine.overlap = overlap
    if graphs_bs:
        emulate_graphs(llm, graphs_bs, reads_pool)
    return llm


def assert_idle(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"], stats
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_invariants()
    assert not llm.engine.scheduler.page_table.rows.any()  # every slot free: all rows zero


# ---- random runs ---------------------------------------------------------------------------


def random_workload(seed: int) -> list[tuple[int, list[int], SamplingParams]]:
    """(step to add it at, prompt, params): prompts sharing prefixes (cache hits, some
    arriving while others run), n > 1 samples, mixed lengths."""
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randint(5, 30))] for _ in range(3)]
    work = []
    for i in range(14):
        prompt = rng.choice(systems) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
        n = rng.choice([1, 1, 1, 2, 3])
        temperature = 0 if n == 1 and rng.random() < 0.5 else 0.8
        params = SamplingParams(temperature=temperature, n=n, max_tokens=rng.randint(1, 14), ignore_eos=True, seed=i)
        work.append((rng.choice([0, 0, 2, 5, 9]), prompt, params))
    return work


def drive(llm: LLM, work, check: bool = True) -> dict:
    engine = llm.engine
    got: dict[tuple[str, int], list[int]] = {}
    step = 0
    while step == 0 or engine.has_unfinished_requests() or any(at >= step for at, _, _ in work):
        for i, (at, prompt, params) in enumerate(work):
            if at == step:
                engine.add_request(str(i), prompt, params)
        for up in engine.step():
            got.setdefault((up.request_id, up.index), []).extend(up.new_token_ids)
        if check:
            engine.scheduler.check_page_table()
            if engine._inflight is None:  # mid-run in the overlap loop, finished requests keep slots
                engine.check_invariants()
        step += 1
        assert step < 2000
    return got


@pytest.mark.parametrize("policy", ["prefill-first", "mixed"])
@pytest.mark.parametrize("graphs_bs", [0, 4])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_prepare_equals_reference_on_random_runs(model_dir, overlap, graphs_bs, seed, policy):
    # 4-token pages, a small KV cache (preemption), a 24-token prefill budget (chunks), 6 slots;
    # mixed: steps of 12 tokens while requests decode.
    kw = {"page_size": 4, "kv_cache_tokens": 20 * 4, "chunked_prefill_size": 24, "max_num_seqs": 6, "max_model_len": 64}
    llm = make_llm(model_dir, overlap, graphs_bs, schedule_policy=policy, max_num_batched_tokens=12, **kw)
    seen = check_every_prepare(llm)
    work = random_workload(seed)
    got = drive(llm, work)
    assert_idle(llm)
    for i, (_, _, params) in enumerate(work):
        for k in range(params.n):
            assert len(got[(str(i), k)]) == params.max_tokens
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0, stats
    assert seen["extend"] > 0 and seen["steps"] > 20, seen
    assert (seen["graph"] > 0) == (graphs_bs > 0), seen
    assert (seen["pending"] > 0) == overlap, seen
    assert (seen["mixed"] > 0) == (policy == "mixed"), seen


def test_emulated_graphs_same_greedy_tokens(model_dir):
    # 3, 5 and 6 requests against graphs of 1, 2, 4, 6, 8: padded batches and exact sizes.
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = {"max_num_seqs": 8, "max_model_len": 128, "page_size": 8}
    for num in (3, 5, 6):
        prompts = random_prompts(num, seed=num, max_len=50)
        eager = make_llm(model_dir, True, **kw).generate(prompts, params, use_tqdm=False)
        llm = make_llm(model_dir, True, graphs_bs=8, **kw)
        seen = check_every_prepare(llm)
        graphs = llm.generate(prompts, params, use_tqdm=False)
        assert_idle(llm)
        assert seen["graph"] > 0
        assert [o.outputs[0].token_ids for o in graphs] == [o.outputs[0].token_ids for o in eager]


def test_emulated_graphs_reading_the_token_pool_same_greedy_tokens(model_dir, monkeypatch):
    """Graphs whose forward reads the pending ids from the token pool itself (one GPU), and
    whose page table is copied only when it changed: the same tokens as eager runs, with
    copies skipped on some steps and made on others (pages of 4 tokens)."""
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    kw = {"max_num_seqs": 8, "max_model_len": 128, "page_size": 4}
    copies = {"made": 0, "skipped": 0}
    real = DecodeGraphs.staged_page_table

    def counted(self, layout, bs, width, host=None):
        before = self._staged_host
        table = real(self, layout, bs, width, host)
        copies["skipped" if before is not None and self._staged_host is before else "made"] += 1
        return table

    monkeypatch.setattr(DecodeGraphs, "staged_page_table", counted)
    for num in (1, 5):
        prompts = random_prompts(num, seed=num, max_len=30)
        eager = make_llm(model_dir, True, **kw).generate(prompts, params, use_tqdm=False)
        llm = make_llm(model_dir, True, graphs_bs=8, reads_pool=True, **kw)
        graphs = llm.generate(prompts, params, use_tqdm=False)
        assert_idle(llm)
        assert [o.outputs[0].token_ids for o in graphs] == [o.outputs[0].token_ids for o in eager]
    assert copies["made"] > 0 and copies["skipped"] > 0, copies


def first_decode_step(llm: LLM, seed: int):
    """Three greedy requests prefilled, then their first decode batch scheduled and prepared
    (not run): (batch, inputs). The caller completes the step by hand."""
    engine = llm.engine
    for i, prompt in enumerate(random_prompts(3, seed=seed, max_len=20)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while not engine.scheduler.running or engine.scheduler.waiting:
        engine.step()
    batch = engine.scheduler.schedule()
    assert batch.is_decode
    return batch, engine.runner.prepare(batch, list(range(len(batch.requests))))


def test_replay_copies_inputs_prepared_elsewhere(model_dir):
    """A tensor-parallel worker replays from broadcast tensors, not from the static
    buffers: the replay must copy every field in and compute the same logits."""
    llm = make_llm(model_dir, False, graphs_bs=4, max_num_seqs=4, max_model_len=64, page_size=4)
    engine, runner = llm.engine, llm.engine.runner
    batch, inputs = first_decode_step(llm, seed=5)
    assert inputs.graph_bs == 4 and inputs.num_reqs == 3
    want = runner.execute(inputs).clone()
    g = runner.graphs
    snapshot = {k: v.clone() for k, v in g.views(4).items()}
    table = g.page_table[:4].clone()
    meta = inputs.meta
    foreign = dataclasses.replace(
        inputs,
        input_ids=inputs.input_ids.clone(),
        positions=inputs.positions.clone(),
        meta=dataclasses.replace(
            meta,
            **{f: getattr(meta, f).clone() for f in ("seq_lens", "prefix_lens", "cu_query_lens", "slot_mapping")},
            page_table=meta.page_table.clone(),
        ),
    )
    g.static.fill_(7)  # what another size's step could have left there
    g.page_table.fill_(0)
    got = runner.execute(foreign)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for k in ("input_ids", "positions", "seq_lens", "prefix_lens", "cu_query_lens", "slot_mapping"):
        assert torch.equal(g.views(4)[k], snapshot[k]), k
    width = meta.page_table.shape[1]
    assert torch.equal(g.page_table[:4, :width], table[:, :width])
    engine.scheduler.complete_step(batch)  # leave the engine consistent, then finish the run
    for req in batch.requests:
        req.token_ids.append(int(want[batch.requests.index(req)].argmax()))
    while engine.has_unfinished_requests():
        engine.step()
    assert_idle(llm)


def test_tp_worker_receives_graph_inputs_in_place(model_dir):
    """Tensor parallelism's in-place decode step: rank 0's packed static bytes, received as
    they are into a worker's static buffer (here: copied, as the broadcast would), give the
    worker the same inputs and the same logits as rank 0, with nothing else sent but the
    control message's header and host ints."""
    from nanoserve.distributed.tp_runner import HEADER_LEN, StepHeader, control_len, control_message, pack_step

    kw = {"max_num_seqs": 4, "max_model_len": 64, "page_size": 4}
    llm = make_llm(model_dir, False, graphs_bs=4, **kw)
    worker = make_llm(model_dir, False, graphs_bs=4, **kw).engine.runner
    engine, runner = llm.engine, llm.engine.runner
    batch, inputs = first_decode_step(llm, seed=6)
    graph_bytes = runner.graph_step_bytes(inputs)
    assert graph_bytes is not None and graph_bytes.data_ptr() == runner.graphs.static.data_ptr()
    header, host, payload = pack_step(inputs, graph_bytes)
    assert payload is graph_bytes
    msg = control_message(header, host, control_len(kw["max_num_seqs"]))
    h = StepHeader(*msg[:HEADER_LEN].tolist())
    host = msg[HEADER_LEN : HEADER_LEN + 2 * h.host_reqs].tolist()
    assert h.in_place == 1 and h.graph_bs == 4 and h.num_reqs == 3
    worker.graphs.static.fill_(7)  # stale bytes outside what is sent must not matter
    worker.graphs.page_table.fill_(9)
    worker.graphs.step_bytes(h.graph_bs, h.table_width).copy_(payload)  # the broadcast, into what the worker receives
    n = h.host_reqs
    got = worker.graph_step_in_place(h.graph_bs, h.table_width, h.num_reqs, host[n : 2 * n], h.max_seq_len)
    for name in ("input_ids", "positions"):
        assert torch.equal(getattr(got, name), getattr(inputs, name)), name
    for name in ("seq_lens", "prefix_lens", "cu_query_lens", "page_table", "slot_mapping"):
        assert torch.equal(getattr(got.meta, name), getattr(inputs.meta, name)), name
    for name in ("seq_lens_host", "prefix_lens_host", "max_query_len", "max_seq_len", "is_decode"):
        assert getattr(got.meta, name) == getattr(inputs.meta, name), name
    assert (got.graph_bs, got.num_reqs) == (inputs.graph_bs, inputs.num_reqs)
    # The worker's model has the same (tiny, seeded) weights: the same logits.
    for mine, theirs in zip(worker.kv_cache.k + worker.kv_cache.v, runner.kv_cache.k + runner.kv_cache.v):
        mine.copy_(theirs)
    torch.testing.assert_close(worker.execute(got), runner.execute(inputs), rtol=0, atol=0)
    # Steps prepared elsewhere (eager, no graph) still travel packed.
    eager = dataclasses.replace(inputs, input_ids=inputs.input_ids.clone())
    assert runner.graph_step_bytes(eager) is None
    assert runner.graph_step_bytes(dataclasses.replace(inputs, graph_bs=None)) is None
    engine.scheduler.complete_step(batch)
    for req in batch.requests:
        req.token_ids.append(0)
    while engine.has_unfinished_requests():
        engine.step()
    assert_idle(llm)


# ---- reporting -----------------------------------------------------------------------------


def test_stream_false_reports_once_with_the_same_tokens(model_dir):
    work = [
        (0, p, SamplingParams(temperature=t, n=n, max_tokens=m, ignore_eos=True, seed=3, logprobs=2))
        for p, t, n, m in zip(random_prompts(4, seed=8, max_len=30), (0, 0.7, 0.9, 0), (1, 2, 1, 3), (5, 9, 1, 7))
    ]
    runs = {}
    for stream in (True, False):
        llm = make_llm(model_dir, True, page_size=4)
        engine = llm.engine
        for i, (_, prompt, params) in enumerate(work):
            engine.add_request(str(i), prompt, params, stream=stream)
        updates = []
        while engine.has_unfinished_requests():
            updates += engine.step()
        assert_idle(llm)
        runs[stream] = updates
    merged = {}
    for up in runs[True]:
        tokens, lps, _ = merged.get((up.request_id, up.index), ([], [], None))
        merged[(up.request_id, up.index)] = (tokens + up.new_token_ids, lps + up.new_logprobs, up.finish_reason)
    once = {(up.request_id, up.index): (up.new_token_ids, up.new_logprobs, up.finish_reason) for up in runs[False]}
    assert len(once) == len(runs[False]) == sum(p.n for _, _, p in work)  # one update per sample
    assert all(up.finished for up in runs[False])
    assert once == merged


def test_llm_generate_outputs_unchanged_by_stream_off(model_dir):
    # LLM.generate adds samples without stop strings with stream=False: same results as
    # an engine driven with streaming updates.
    prompts = random_prompts(5, seed=4, max_len=40)
    params = SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True, seed=1, logprobs=1)
    outs = make_llm(model_dir, True).generate(prompts, params, use_tqdm=False)
    llm = make_llm(model_dir, True)
    for i, p in enumerate(prompts):
        llm.engine.add_request(str(i), p, params)
    tokens: dict[str, list[int]] = {}
    while llm.engine.has_unfinished_requests():
        for up in llm.engine.step():
            tokens.setdefault(up.request_id, []).extend(up.new_token_ids)
    assert [o.outputs[0].token_ids for o in outs] == [tokens[str(i)] for i in range(len(prompts))]
    assert all(len(o.outputs[0].logprobs) == 10 and o.outputs[0].finish_reason == "length" for o in outs)


# ---- sampler plan cache ------------------------------------------------------------------


def test_sampler_plan_cache_equals_fresh_plans():
    rng = random.Random(0)
    gens = {i: torch.Generator().manual_seed(100 + i) for i in (1, 4)}
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.2, top_k=5),
        SamplingParams(temperature=0.5, top_p=0.8, logprobs=3),
        SamplingParams(temperature=0.9, min_p=0.1),
    ]
    rows = [SampleRow(kinds[i % len(kinds)], gens.get(i), [], []) for i in range(8)]
    # Repeats (the cache is used), and changes of the same length (it must not be).
    batches = [rows, rows, rows[::-1], rows[:4], rows[4:], rows[4:], rows[2:], [rows[0]], rows[1:2], rows[1:2]]
    cached, fresh = Sampler("cpu", seed=5), Sampler("cpu", seed=5)
    fresh_gens = {i: torch.Generator().manual_seed(100 + i) for i in gens}
    fresh_rows = [dataclasses.replace(r, generator=fresh_gens.get(i)) for i, r in enumerate(rows)]
    index = {id(r): i for i, r in enumerate(rows)}
    for batch in batches:
        logits = torch.randn(len(batch), 50, generator=torch.Generator().manual_seed(rng.randrange(10**6)))
        got_tokens, got_lps = cached(logits, batch)
        fresh._plan = None  # the slow twin: derive everything anew
        want_tokens, want_lps = fresh(logits, [fresh_rows[index[id(r)]] for r in batch])
        assert got_tokens == want_tokens and got_lps == want_lps


# ---- the page table itself ---------------------------------------------------------------


def test_page_table_rows():
    t = PageTable(num_slots=3, max_pages=4)
    t.assign(1, [5, 6])
    t.extend(1, 2, [9])
    assert t.rows[1].tolist() == [5, 6, 9, 0] and not t.rows[[0, 2]].any()
    with pytest.raises(ValueError, match="5 pages"):
        t.extend(1, 3, [1, 2])
    with pytest.raises(ValueError, match="without a slot"):
        t.extend(None, 0, [1])
    t.clear(1)
    assert not t.rows.any()
    assert np.array_equal(t.rows, np.zeros((3, 4), dtype=np.int32))
