"""Mixed prefill+decode steps (schedule_policy="mixed") on CPU, fp32: greedy tokens equal the
prefill-first policy's (the slow twin) and transformers' for requests arriving while others
decode, prompts chunked across several mixed steps, prefix-cache hits, preemption, n > 1,
page sizes 1 and 16, the overlap loop and TP=2 (gloo). Every step is checked as it is
scheduled (decode rows first, prompt rows after, the token budget kept, pages for every row)
and the scheduler's invariants after it; every run ends with no page or slot held.
"""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.attention.base import AttentionMetadata
from nanoserve.attention.torch_backend import TorchAttentionBackend
from nanoserve.config import EngineConfig
from nanoserve.scheduler.request import Status
from nanoserve.scheduler.scheduler import (
    BURST_END_SHARE,
    BURST_MIN_CROWD,
    BURST_START_SHARE,
    MIXED_GROWTH,
    QUEUE_DRAIN_STEPS,
    ScheduledBatch,
    pages_for,
)
from tests.tiny import VOCAB, hf_greedy, make_tiny_model

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def workload(seed: int, num: int = 8, shared: bool = False) -> list[tuple[int, list[int]]]:
    """(arrival step, prompt) pairs: short and long prompts (up to 90 tokens, several chunks
    at the budgets used here) arriving over the first steps, while earlier ones decode.
    `shared`: every prompt starts with one of two common prefixes (prefix-cache hits)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(20, 40))] for _ in range(2)]
    out = []
    for i in range(num):
        body = [rng.randrange(VOCAB) for _ in range(rng.choice([2, 5, 17, 40, 90]))]
        prompt = (prefixes[i % 2] + body) if shared else body
        out.append((rng.randrange(0, 3 * MAX_TOKENS), prompt))
    out.sort(key=lambda a: a[0])
    return out


class StepChecks:
    """Wraps the engine's scheduler: checks every batch as it is scheduled and counts kinds."""

    def __init__(self, engine):
        self.engine = engine
        self.sched = engine.scheduler
        self.kinds = {"decode": 0, "prefill": 0, "mixed": 0, "burst": 0, "grown": 0}
        self.max_prompt_tokens = {"plain": 0, "grown": 0, "burst": 0}  # of mixed steps, by budget
        self.max_share_outside_burst = 0.0  # of the requests waiting when a mixed step was no burst
        self.bursting = False
        self.max_share = 0.0  # of the requests waiting, at any step
        schedule = self.sched.schedule

        def checked() -> ScheduledBatch | None:
            sched = self.sched
            waiting, running = len(sched.waiting), len(sched.running)
            share = waiting / (waiting + running) if waiting + running else 0.0
            crowd = sched.arrivals_since_step >= max(BURST_MIN_CROWD, running)
            self.bursting = share > BURST_END_SHARE if self.bursting else crowd and share > BURST_START_SHARE
            self.max_share = max(self.max_share, share)
            queued = sum(r.num_uncomputed for r in sched.waiting)
            grown = min(queued // QUEUE_DRAIN_STEPS, int(MIXED_GROWTH * (sched.mixed_budget or 0)), sched.chunk_budget)
            batch = schedule()
            if batch is not None:
                self.check(batch, self.bursting, grown)
                if batch.num_decodes and not batch.is_decode and not self.bursting:
                    self.max_share_outside_burst = max(self.max_share_outside_burst, share)
            return batch

        self.sched.schedule = checked

    def check(self, batch: ScheduledBatch, burst: bool, grown: int) -> None:
        """`burst`: a burst was on when `batch` was scheduled (begun by a crowd of arrivals
        above BURST_START_SHARE of the queued requests waiting, not yet ended at
        BURST_END_SHARE), so a mixed step may
        hold the prefill budget; else it may hold `grown` tokens if that is above the mixed
        budget (the waiting prompts over QUEUE_DRAIN_STEPS, at most MIXED_GROWTH budgets)."""
        sched, k = self.sched, batch.num_decodes
        reqs, counts = batch.requests, batch.num_new_tokens
        assert len({id(r) for r in reqs}) == len(reqs), "a request twice in one step"
        if batch.is_decode:
            limit = len(reqs)
        elif k == 0 or burst:
            limit = max(sched.chunk_budget, k)
        else:
            limit = max(sched.mixed_budget, grown, k)
        assert batch.num_tokens <= limit, (batch.num_tokens, limit, burst)
        assert all(c >= 1 for c in counts)
        for i, (req, count) in enumerate(zip(reqs, counts)):
            decode_row = i < k
            assert req.status is (Status.RUNNING if decode_row else Status.WAITING), (i, k, req.status)
            assert not decode_row or (count == 1 and req.num_uncomputed == 1)
            assert count <= req.num_uncomputed
            assert req.slot is not None
            assert len(req.pages) >= pages_for(req.num_computed + count, sched.page_size), "a row without pages"
            if not decode_row:  # a prompt row's tokens are all known (-1: a token still being sampled)
                assert -1 not in req.token_ids[req.num_computed : req.num_computed + count], (
                    "a placeholder prompt token"
                )
        if batch.is_decode:
            assert k == len(reqs)
            kind = "decode"
        else:
            kind = "mixed" if k else "prefill"
            if k:
                assert sched.mixed_budget is not None, "a mixed step under prefill-first"
                assert k < len(reqs)
                assert len(reqs) - k >= 1
                budget = "burst" if burst else "grown" if grown > sched.mixed_budget else "plain"
                if budget != "plain":  # count the steps that used the larger budget
                    self.kinds[budget] += batch.num_tokens > sched.mixed_budget
                self.max_prompt_tokens[budget] = max(self.max_prompt_tokens[budget], batch.num_tokens - k)
                # Every running request decodes in a mixed step: none waits behind the prompts.
                assert {id(r) for r in reqs[:k]} == {id(r) for r in sched.running}
        self.kinds[kind] += 1


def check_mid_run(engine) -> None:
    """The scheduler's invariants between steps. In the overlap loop a request finished while
    the step in flight uses it keeps its slot and pages until that step is processed (it is
    in neither queue then), so the slot and page counts include those."""
    inflight = engine._inflight
    deferred = inflight.deferred if inflight is not None else []
    if not deferred:
        engine.check_invariants()
        return
    sched = engine.scheduler
    reqs = [*sched.waiting, *sched.running]
    assert len({id(r) for r in reqs}) == len(reqs), "a request is queued twice"
    assert not {id(r) for r in reqs} & {id(r) for r in deferred}, "a finished request still queued"
    holders = [r for r in (*reqs, *deferred) if r.slot is not None]
    assert sum(1 + len(r.reserved_slots) for r in holders) + len(sched.free_slots) == sched.max_num_seqs
    for r in reqs:
        assert len(r.pages) * sched.page_size >= r.num_computed
    sched.check_page_table()


def drive(llm: LLM, arrivals, params=GREEDY, abort: dict[str, int] | None = None) -> tuple[dict, StepChecks]:
    """Run `arrivals` ((step, prompt) pairs) through the engine's step API, adding each
    request at its step; checks the invariants after every step and no leak at the end.
    Returns every sample's tokens by (request id, index)."""
    engine = llm.engine
    checks = StepChecks(engine)
    pending = [(at, f"r{i}", prompt) for i, (at, prompt) in enumerate(arrivals)]
    got: dict[tuple[str, int], list[int]] = {}
    finished: set[tuple[str, int]] = set()
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for rid, at in (abort or {}).items():
            if at == step:
                engine.abort_request(rid)
        for up in engine.step():
            key = (up.request_id, up.index)
            assert key not in finished, f"update after finish for {key}"
            assert all(t >= 0 for t in up.new_token_ids)
            got.setdefault(key, []).extend(up.new_token_ids)
            if up.finish_reason is not None:
                finished.add(key)
        check_mid_run(engine)
        step += 1
        assert step < 5000
    stats = engine.stats()
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"], stats
    assert stats["requests_running"] == 0 and stats["requests_waiting"] == 0, stats
    sched = engine.scheduler
    assert len(sched.free_slots) == sched.max_num_seqs, "request slots leaked"
    return got, checks


def make_llm(model_dir, policy: str, overlap: bool = False, **kwargs) -> LLM:
    base = {"device": "cpu", "dtype": "float32", "chunked_prefill_size": 32, "max_num_batched_tokens": 12}
    llm = LLM(str(model_dir), schedule_policy=policy, **{**base, **kwargs})
    llm.engine.overlap = overlap
    return llm


def both_policies(model_dir, arrivals, params=GREEDY, overlap=False, **kwargs):
    """Tokens under prefill-first and mixed (same engine arguments), and mixed's step checks."""
    slow, _ = drive(make_llm(model_dir, "prefill-first", overlap, **kwargs), arrivals, params)
    mixed_llm = make_llm(model_dir, "mixed", overlap, **kwargs)
    fast, checks = drive(mixed_llm, arrivals, params)
    assert checks.kinds["mixed"] > 0, checks.kinds  # the workload did mix prompts into decode steps
    return slow, fast, checks, mixed_llm


@pytest.fixture(scope="module")
def hf_tokens(model_dir):
    cache: dict[tuple[int, ...], list[int]] = {}

    def tokens(prompts: list[list[int]]) -> list[list[int]]:
        todo = [p for p in prompts if tuple(p) not in cache]
        for p, out in zip(todo, hf_greedy(model_dir, todo, MAX_TOKENS)):
            cache[tuple(p)] = out
        return [cache[tuple(p)] for p in prompts]

    return tokens


def by_request(arrivals, got) -> list[list[int]]:
    return [got[(f"r{i}", 0)] for i in range(len(arrivals))]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_staggered_arrivals_match_prefill_first_and_hf(model_dir, hf_tokens, page_size, overlap, seed):
    arrivals = workload(seed)
    slow, fast, checks, _ = both_policies(
        model_dir, arrivals, overlap=overlap, page_size=page_size, enable_prefix_caching=False
    )
    assert fast == slow
    assert by_request(arrivals, fast) == hf_tokens([p for _, p in arrivals])
    # A 90-token prompt at these budgets is cut into chunks; some rode in mixed steps.
    assert max(checks.max_prompt_tokens.values()) > 1


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefix_cache_hits(model_dir, hf_tokens, page_size):
    arrivals = workload(5, num=10, shared=True)
    slow, fast, _, llm = both_policies(model_dir, arrivals, overlap=True, page_size=page_size)
    assert fast == slow
    assert by_request(arrivals, fast) == hf_tokens([p for _, p in arrivals])
    assert llm.stats()["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("prefix_cache", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_preemption_with_a_tiny_kv_cache(model_dir, hf_tokens, prefix_cache, page_size):
    # 160 tokens of KV for eight requests of up to 100 tokens: running ones are preempted.
    arrivals = [(at // 3, p) for at, p in workload(2)]
    kv = {"kv_cache_tokens": 160 if page_size == 1 else 160 + 16, "page_size": page_size}
    slow, fast, _, llm = both_policies(
        model_dir, arrivals, overlap=True, enable_prefix_caching=prefix_cache, max_num_batched_tokens=24, **kv
    )
    assert fast == slow
    assert by_request(arrivals, fast) == hf_tokens([p for _, p in arrivals])
    assert llm.stats()["num_preemptions"] > 0


@pytest.mark.parametrize(("page_size", "kv_cache_tokens"), [(1, 80), (4, 64)])
def test_no_prompt_in_a_step_that_preempted_every_running_request(model_dir, hf_tokens, page_size, kv_cache_tokens):
    """Decode rows that preempt every running request leave the step empty: re-admitting a
    victim at once would compute its last token while the overlap loop still samples it
    (a placeholder, which the step checks reject) and cache KV under it."""
    arrivals = [(at // 3, p[:40]) for at, p in workload(0, shared=True)]
    kw = {"page_size": page_size, "kv_cache_tokens": kv_cache_tokens, "max_num_batched_tokens": 24}
    slow, fast, _, llm = both_policies(model_dir, arrivals, overlap=True, enable_prefix_caching=True, **kw)
    assert fast == slow
    assert by_request(arrivals, fast) == hf_tokens([p for _, p in arrivals])
    assert llm.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_n_greater_than_one(model_dir, hf_tokens, overlap):
    arrivals = workload(3, num=6)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=3)
    slow, fast, _, _ = both_policies(model_dir, arrivals, params, overlap=overlap, page_size=4)
    assert fast == slow
    want = hf_tokens([p for _, p in arrivals])
    for i in range(len(arrivals)):
        assert [fast[(f"r{i}", j)] for j in range(3)] == [want[i]] * 3


def test_abort_mid_mixed_run_leaks_nothing(model_dir):
    arrivals = workload(4)
    drive(make_llm(model_dir, "mixed", True, page_size=4), arrivals, abort={"r0": 3, "r3": 8, "r5": 20})


def test_budget_adapts_to_decoding(model_dir):
    """Tokens per step: the whole prefill budget while nothing decodes; the mixed budget
    (decode rows included) while requests decode; up to MIXED_GROWTH times that while a long
    prompt queues behind many running requests; the prefill budget again during a burst,
    which a crowd above BURST_START_SHARE of the queued requests begins and a queue that
    stays below it does not. Outputs stay prefill-first's."""
    rng = random.Random(7)

    def prompts(step: int, count: int, length: int) -> list[tuple[int, list[int]]]:
        return [(step, [rng.randrange(VOCAB) for _ in range(length)]) for _ in range(count)]

    short = prompts(0, 6, 3)
    queued = prompts(2, 1, 130)  # 1 waiting beside 6 running
    below = prompts(12, 3, 30)  # 3 beside 7: 30% waiting, no burst
    crowd = prompts(24, 12, 30)  # 12 beside 10
    arrivals = short + queued + below + crowd
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = {"chunked_prefill_size": 64, "max_num_batched_tokens": 8, "enable_prefix_caching": False}
    slow, fast, checks, _ = both_policies(model_dir, arrivals, params, **kw)
    assert fast == slow
    assert checks.kinds["prefill"] > 0 and checks.kinds["grown"] > 0 and checks.kinds["burst"] > 0, checks.kinds
    assert checks.max_prompt_tokens["grown"] <= int(MIXED_GROWTH * 8) < checks.max_prompt_tokens["burst"]
    assert 0 < checks.max_prompt_tokens["plain"] <= 8
    assert BURST_END_SHARE < checks.max_share_outside_burst <= BURST_START_SHARE, checks.max_share_outside_burst


def test_a_queue_growing_under_overload_never_bursts(model_dir):
    """Two slots, one prompt arriving per step: the queue grows past any share of the queued
    requests, but no step is a burst (no crowd ever arrives), so decode rows keep steps of the
    mixed budget. Outputs stay prefill-first's."""
    rng = random.Random(11)
    arrivals = [(step, [rng.randrange(VOCAB) for _ in range(12)]) for step in range(24)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    kw = {"chunked_prefill_size": 64, "max_num_batched_tokens": 8, "max_num_seqs": 2, "enable_prefix_caching": False}
    slow, fast, checks, _ = both_policies(model_dir, arrivals, params, **kw)
    assert fast == slow
    assert checks.max_share > 0.9 > BURST_START_SHARE, checks.max_share  # 20+ waiting beside 2 running
    assert checks.kinds["mixed"] > 0 and checks.kinds["burst"] == 0, checks.kinds
    assert checks.max_prompt_tokens["burst"] == 0


def test_config_and_cli_flags():
    from nanoserve.cli import build_parser

    assert EngineConfig().schedule_policy == "mixed"
    assert EngineConfig(schedule_policy="mixed").mixed_step_budget() == 512
    assert EngineConfig(chunked_prefill_size=256).mixed_step_budget() == 256
    assert EngineConfig(max_num_batched_tokens=2048).mixed_step_budget() == 2048
    with pytest.raises(ValueError, match="schedule_policy"):
        EngineConfig(schedule_policy="decode-first")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=0)
    from nanoserve.config import engine_config_from_args

    args = build_parser().parse_args(["serve", "m", "--schedule-policy", "mixed", "--max-num-batched-tokens", "256"])
    config = engine_config_from_args(args)
    assert (config.schedule_policy, config.max_num_batched_tokens) == ("mixed", 256)


def serving_engine(model_dir, *flags: str):
    """The engine the server builds from its flags (`nanoserve serve MODEL ...` on CPU, fp32),
    driven by `drive` like an LLM."""
    from types import SimpleNamespace

    from nanoserve.cli import build_parser
    from nanoserve.config import engine_config_from_args
    from nanoserve.engine.llm_engine import LLMEngine

    args = build_parser().parse_args(
        ["serve", "--model", str(model_dir), "--device", "cpu", "--dtype", "float32", *flags]
    )
    return SimpleNamespace(engine=LLMEngine(engine_config_from_args(args)))


def test_budget_per_entry_point(model_dir):
    """The mixed budget while requests decode: the server's (and a bare EngineConfig's) default
    is MIXED_STEP_TOKENS capped by the prefill budget; the offline LLM's and `nanoserve
    generate`'s is the prefill budget; an explicit max_num_batched_tokens wins everywhere."""
    from nanoserve.cli import build_parser
    from nanoserve.config import MIXED_STEP_TOKENS, engine_config_from_args

    assert MIXED_STEP_TOKENS == 512
    assert EngineConfig().mixed_step_budget() == 512
    assert EngineConfig().for_offline().mixed_step_budget() == 8192
    assert EngineConfig(chunked_prefill_size=2048).for_offline().mixed_step_budget() == 2048
    explicit = EngineConfig(max_num_batched_tokens=300)
    assert explicit.for_offline() is explicit and explicit.mixed_step_budget() == 300

    mixed, kv = ("--schedule-policy", "mixed"), ("--kv-cache-tokens", "4096")
    assert serving_engine(model_dir, *mixed, *kv).engine.scheduler.mixed_budget == 512
    assert serving_engine(model_dir, *mixed, *kv, "--chunked-prefill-size", "128").engine.scheduler.mixed_budget == 128
    served = serving_engine(model_dir, *mixed, *kv, "--max-num-batched-tokens", "2048")
    assert served.engine.scheduler.mixed_budget == 2048

    def offline_budget(llm: LLM) -> int:
        assert llm.config.max_num_batched_tokens == llm.engine.scheduler.mixed_budget
        return llm.engine.scheduler.mixed_budget

    kw = {"device": "cpu", "schedule_policy": "mixed", "kv_cache_tokens": 4096}
    assert offline_budget(LLM(str(model_dir), **kw)) == 8192
    assert offline_budget(LLM(str(model_dir), chunked_prefill_size=600, **kw)) == 600
    assert offline_budget(LLM(str(model_dir), max_num_batched_tokens=24, **kw)) == 24
    parse = build_parser().parse_args
    generate = ["generate", "--model", str(model_dir), "--device", "cpu", *mixed, *kv]
    assert offline_budget(LLM(config=engine_config_from_args(parse(generate)))) == 8192
    flag = ["--max-num-batched-tokens", "256"]
    assert offline_budget(LLM(config=engine_config_from_args(parse(generate + flag)))) == 256


def test_offline_and_serving_budgets_keep_outputs(model_dir, hf_tokens):
    """All prompts at once with a prefill budget above 512: the offline LLM's mixed steps fill
    the whole prefill budget; the server's only during the burst (all six arrive at once; a
    step at the plain budget holds at most 512); both give prefill-first's and transformers'
    greedy tokens, and leave nothing behind."""
    rng = random.Random(31)
    arrivals = [(0, [rng.randrange(VOCAB) for _ in range(rng.randrange(150, 500))]) for _ in range(6)]
    kw = {"device": "cpu", "dtype": "float32", "chunked_prefill_size": 600, "enable_prefix_caching": False}
    slow, _ = drive(LLM(str(model_dir), schedule_policy="prefill-first", **kw), arrivals)
    offline, offline_checks = drive(LLM(str(model_dir), schedule_policy="mixed", **kw), arrivals)
    served, served_checks = drive(
        serving_engine(model_dir, "--schedule-policy", "mixed", "--chunked-prefill-size", "600", "--no-prefix-cache"),
        arrivals,
    )
    assert offline == slow == served
    assert by_request(arrivals, offline) == hf_tokens([p for _, p in arrivals])
    assert offline_checks.kinds["mixed"] > 0 and served_checks.kinds["mixed"] > 0
    assert max(offline_checks.max_prompt_tokens.values()) > 512 >= served_checks.max_prompt_tokens["plain"]
    assert served_checks.kinds["burst"] > 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_split_rows_start_aligned(page_size):
    """The extend part of a mixed batch hands kernels tensors that start at 16-byte boundaries
    whatever the number of decode rows (one Triton variant for every mixed step), with the
    values of the unsplit metadata's rows."""
    num_reqs, width = 11, 3
    for k in range(1, num_reqs):
        prefix = [7 * i % 13 for i in range(num_reqs)]
        qlens = [1] * k + [2 + i for i in range(num_reqs - k)]
        seq = [p + q for p, q in zip(prefix, qlens)]
        cu = [0]
        for q in qlens:
            cu.append(cu[-1] + q)
        table = torch.arange(num_reqs * width, dtype=torch.int32).view(num_reqs, width)
        meta = AttentionMetadata(
            is_decode=False,
            seq_lens=torch.tensor(seq, dtype=torch.int32),
            prefix_lens=torch.tensor(prefix, dtype=torch.int32),
            cu_query_lens=torch.tensor(cu, dtype=torch.int32),
            page_table=table,
            slot_mapping=torch.arange(cu[-1]) * page_size,
            seq_lens_host=seq,
            prefix_lens_host=prefix,
            max_query_len=max(qlens),
            max_seq_len=max(seq),
            num_decode_rows=k,
        )
        decode, extend = meta.split_decode_rows()
        for name in ("prefix_lens", "cu_query_lens", "page_table"):
            got, whole = getattr(extend, name), getattr(meta, name)
            assert got.data_ptr() % 16 == 0, (k, name)
            want = whole[k:] - k if name == "cu_query_lens" else whole[k:]
            assert torch.equal(got, want), (k, name)
        assert torch.equal(decode.page_table, table[:k]) and decode.num_requests == k


def test_torch_backend_mixed_meta_equals_whole_batch():
    """The reference computes a mixed batch whole; split into its decode and extend parts
    (`split_decode_rows`, what the Triton backend runs) it gives the same rows."""
    torch.manual_seed(0)
    page, heads, kv_heads, dim = 4, 4, 2, 16
    k_cache = torch.randn(12, page, kv_heads, dim)
    v_cache = torch.randn(12, page, kv_heads, dim)
    prefix = [5, 9, 0, 3]
    qlens = [1, 1, 6, 4]
    table = torch.tensor([[1, 2, 0], [3, 4, 5], [6, 7, 0], [8, 9, 10]], dtype=torch.int32)
    seq = [p + q for p, q in zip(prefix, qlens)]
    cu = [0]
    for q in qlens:
        cu.append(cu[-1] + q)
    slots = [int(table[i, p // page]) * page + p % page for i in range(4) for p in range(prefix[i], seq[i])]
    meta = AttentionMetadata(
        is_decode=False,
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        prefix_lens=torch.tensor(prefix, dtype=torch.int32),
        cu_query_lens=torch.tensor(cu, dtype=torch.int32),
        page_table=table,
        slot_mapping=torch.tensor(slots),
        seq_lens_host=seq,
        prefix_lens_host=prefix,
        max_query_len=max(qlens),
        max_seq_len=max(seq),
        num_decode_rows=2,
    )
    total = cu[-1]
    q, k, v = torch.randn(total, heads, dim), torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    backend = TorchAttentionBackend()
    backend.prepare(meta)
    whole = backend.forward(q, k, v, k_cache, v_cache, meta, 0.25)
    decode, extend = meta.split_decode_rows()
    assert decode.is_decode and decode.num_requests == 2 and extend.cu_query_lens.tolist() == [0, 6, 10]
    parts = []
    for part, rows in ((decode, slice(0, 2)), (extend, slice(2, total))):
        backend.prepare(part)
        parts.append(backend.forward(q[rows], k[rows], v[rows], k_cache, v_cache, part, 0.25, kv_stored=True))
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-6)


def test_tp2_mixed_matches_tp1_prefill_first(model_dir):
    """TP=2 over gloo: rank 0's mixed steps reach the worker (num_decode_rows in the step
    header) and give TP=1 prefill-first's tokens, with the overlap loop on."""
    arrivals = workload(7, num=6, shared=True)
    want, _ = drive(make_llm(model_dir, "prefill-first", page_size=4), arrivals)
    tp2 = make_llm(model_dir, "mixed", True, page_size=4, tensor_parallel_size=2, dist_timeout_s=60)
    try:
        got, checks = drive(tp2, arrivals)
        assert checks.kinds["mixed"] > 0
        assert got == want
    finally:
        tp2.shutdown()


def test_step_message_carries_decode_rows():
    from nanoserve.distributed.tp_runner import (
        HEADER_LEN,
        StepHeader,
        control_len,
        control_message,
        pack_step,
        unpack_step,
    )
    from nanoserve.step import ForwardInputs

    meta = AttentionMetadata(
        is_decode=False,
        seq_lens=torch.tensor([4, 9, 6], dtype=torch.int32),
        prefix_lens=torch.tensor([3, 8, 0], dtype=torch.int32),
        cu_query_lens=torch.tensor([0, 1, 2, 8], dtype=torch.int32),
        page_table=torch.arange(9, dtype=torch.int32).view(3, 3),
        slot_mapping=torch.arange(8),
        seq_lens_host=[4, 9, 6],
        prefix_lens_host=[3, 8, 0],
        max_query_len=6,
        max_seq_len=9,
        num_decode_rows=2,
    )
    sent = ForwardInputs(torch.arange(8), torch.arange(8), meta, torch.tensor([0, 1, 7]), None, 3)
    header, host, payload = pack_step(sent)
    msg = control_message(header, host, control_len(max_num_seqs=4))
    h = StepHeader(*msg[:HEADER_LEN].tolist())
    got = unpack_step(h, msg[HEADER_LEN : HEADER_LEN + 2 * h.host_reqs].tolist(), payload.clone())
    assert got.meta.num_decode_rows == 2 and not got.meta.is_decode
    assert torch.equal(got.meta.cu_query_lens, meta.cu_query_lens)


def test_mixed_steps_through_the_piecewise_path(model_dir):
    """Mixed steps take the piecewise-graph path by total token count (run uncaptured on
    CPU, each piece's body on the padded buffers): the same tokens as eager."""
    from nanoserve.engine.piecewise_graph import PiecewiseGraphs, piecewise_sizes

    arrivals = workload(9, num=6)
    want, _ = drive(make_llm(model_dir, "mixed"), arrivals)
    llm = make_llm(model_dir, "mixed")
    runner = llm.engine.runner
    runner.piecewise = PiecewiseGraphs(runner.model, piecewise_sizes(32), runner.device, torch.float32)
    seen = []
    real = runner.piecewise.forward

    def forward(input_ids, positions, batch):
        seen.append(batch.meta.num_decode_rows)
        return real(input_ids, positions, batch)

    runner.piecewise.forward = forward
    got, checks = drive(llm, arrivals)
    assert got == want
    assert checks.kinds["mixed"] > 0 and any(seen), "no mixed step replayed the pieces"


# ---- the Triton backend: decode rows through the decode kernel, the rest through extend ----


def mixed_case(decode_lens, extend_reqs, dtype, device, seed, **kw):
    """A batch of decode rows (context lengths `decode_lens`) followed by extend rows
    ((prefix, new) pairs), as the runner lays out a mixed step."""
    import dataclasses

    from tests.test_triton_attention import make_case

    reqs = [(n - 1, 1) for n in decode_lens] + list(extend_reqs)
    case = make_case(reqs, 8, 2, 32, kw.pop("page_size", 4), dtype, device, seed=seed, **kw)
    return dataclasses.replace(case, meta=dataclasses.replace(case.meta, num_decode_rows=len(decode_lens)))


def check_mixed(case, tol: float) -> None:
    """The Triton backend on a mixed batch: close to the torch reference, and its decode
    rows bit-equal to a decode-only call (the same kernel), its other rows to an extend call."""
    from nanoserve.attention.triton_backend import TritonAttentionBackend
    from tests.test_triton_attention import check, rel_err

    check(case, tol=tol)  # against the reference, K/V stored by the call
    backend = TritonAttentionBackend()
    backend.prepare(case.meta)
    whole = backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale, kv_stored=True)
    decode, extend = case.meta.split_decode_rows()
    n = decode.num_requests
    for part, rows in ((decode, slice(0, n)), (extend, slice(n, None))):
        alone = TritonAttentionBackend()
        alone.prepare(part)
        out = alone.forward(
            case.q[rows], case.k[rows], case.v[rows], case.k_cache, case.v_cache, part, case.scale, kv_stored=True
        )
        assert torch.equal(whole[rows], out), ("decode" if part.is_decode else "extend", rel_err(whole[rows], out))


interp = pytest.mark.skipif(
    torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") != "1",
    reason="Triton's interpreter on CPU (conftest sets TRITON_INTERPRET=1 without a GPU)",
)


@interp
@pytest.mark.parametrize("page_size", [1, 4])
def test_interp_triton_mixed_batch(page_size):
    case = mixed_case([37, 5, 70], [(21, 19), (0, 6), (3, 1)], torch.float32, "cpu", seed=11, page_size=page_size)
    check_mixed(case, tol=2e-3)


@interp
@pytest.mark.slow
def test_interp_engine_mixed_matches_torch_backend(model_dir):
    """The engine with the Triton backend (interpreted) under mixed steps gives the torch
    backend's greedy tokens."""
    arrivals = workload(12, num=4)
    want, _ = drive(make_llm(model_dir, "mixed", attention_backend="torch"), arrivals)
    got, checks = drive(make_llm(model_dir, "mixed", attention_backend="triton"), arrivals)
    assert checks.kinds["mixed"] > 0
    assert got == want


# ---- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_triton_mixed_batch(dtype):
    # bf16 prompts without a prefix take FA2; with one, the extend kernel
    case = mixed_case([900, 17, 3000, 1], [(0, 300), (0, 45)], dtype, "cuda", seed=12, page_size=16)
    check_mixed(case, tol=1e-2)
    case = mixed_case([64] * 40, [(500, 200), (0, 7), (33, 1)], dtype, "cuda", seed=13, page_size=16)
    check_mixed(case, tol=1e-2)


def gpu_arrivals(seed: int, num: int = 24) -> list[tuple[int, list[int]]]:
    rng = random.Random(seed)
    return sorted(
        (rng.randrange(0, 40), [rng.randrange(VOCAB) for _ in range(rng.choice([3, 30, 200, 500, 900]))])
        for _ in range(num)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_mixed_graphs_equal_eager(tmp_path, page_size):
    """Mixed steps replaying the piecewise graphs (decode-only steps the decode graphs), with
    the overlap loop: the same greedy tokens as the same engine run eagerly (same kernels; fp32,
    so that a padded graph's matmuls cannot flip a near tie)."""
    path = make_tiny_model(tmp_path / "llama", "llama")
    kw = {
        "device": "cuda",
        "dtype": "float32",
        "page_size": page_size,
        "kv_cache_tokens": 65536,
        "max_model_len": 1024,
        "chunked_prefill_size": 1024,
        "max_num_batched_tokens": 256,
        "schedule_policy": "mixed",
    }
    arrivals = gpu_arrivals(21)
    eager, _ = drive(LLM(str(path), enforce_eager=True, **kw), arrivals)
    llm = LLM(str(path), **kw)
    runner = llm.engine.runner
    assert runner.piecewise is not None and runner.graphs is not None
    fast, checks = drive(llm, arrivals)
    assert checks.kinds["mixed"] > 0 and sum(runner.piecewise.replays.values()) > 0
    assert fast == eager


@pytest.mark.gpu
def test_gpu_mixed_equals_prefill_first_fp32(tmp_path):
    """fp32 on the GPU, graphs and overlap on: mixed and prefill-first give the same greedy
    tokens (and those of transformers, as on CPU)."""
    path = make_tiny_model(tmp_path / "qwen3", "qwen3")
    kw = {"device": "cuda", "dtype": "float32", "kv_cache_tokens": 65536, "max_model_len": 1024}
    kw |= {"chunked_prefill_size": 1024, "max_num_batched_tokens": 128}
    arrivals = gpu_arrivals(22)
    slow, _ = drive(LLM(str(path), schedule_policy="prefill-first", **kw), arrivals)
    fast, checks = drive(LLM(str(path), schedule_policy="mixed", **kw), arrivals)
    assert checks.kinds["mixed"] > 0
    assert fast == slow
    want = hf_greedy(path, [p for _, p in arrivals[:6]], MAX_TOKENS)
    assert by_request(arrivals, fast)[:6] == want


@pytest.mark.parametrize("overlap", [False, True])
def test_warm_up_runs_a_mixed_step_and_leaves_no_trace(model_dir, overlap):
    # The warm-up runs on CUDA only; called by hand here, it must run a mixed step and leave
    # nothing behind.
    llm = make_llm(model_dir, "mixed", overlap, chunked_prefill_size=64)
    checks = StepChecks(llm.engine)
    llm.engine._warm_up()
    assert checks.kinds["mixed"] > 0
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"] and stats["requests_running"] == 0, stats
    assert llm.engine.num_steps == 0 and not llm.engine.has_unfinished_requests()
