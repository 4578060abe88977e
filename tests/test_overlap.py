"""The overlap loop's bookkeeping on CPU, forced on: the same tokens as the simple loop
(greedy, stop tokens, max_tokens, n > 1, seeded sampling), no token reported after a
request finished, aborts mid-run, and nothing leaked (stats and invariants)."""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from tests.tiny import make_tiny_model, random_prompts

PROMPTS = random_prompts(6, seed=3, max_len=40)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3")


def make_llm(model_dir, overlap: bool, **kwargs) -> LLM:
    llm = LLM(str(model_dir), device="cpu", **kwargs)
    llm.engine.overlap = overlap
    return llm


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"], stats
    assert stats["requests_running"] == 0 and stats["requests_waiting"] == 0, stats
    engine.check_invariants()


def run(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_idle(llm)
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]


def drive(engine, requests: dict[str, tuple[list[int], SamplingParams]], abort_at: dict[str, int] | None = None):
    """Step the engine by hand; checks that no update follows a finished one and that no
    placeholder is ever reported. abort_at: request id -> step number to abort it at."""
    for rid, (ids, p) in requests.items():
        engine.add_request(rid, ids, p)
    got: dict[tuple[str, int], list[int]] = {}
    finished: dict[tuple[str, int], str] = {}
    step = 0
    while engine.has_unfinished_requests():
        for rid, at in (abort_at or {}).items():
            if at == step:
                engine.abort_request(rid)
        for up in engine.step():
            key = (up.request_id, up.index)
            assert key not in finished, f"update after finish for {key}: {up}"
            assert all(t >= 0 for t in up.new_token_ids), up
            got.setdefault(key, []).extend(up.new_token_ids)
            if up.finish_reason is not None:
                finished[key] = up.finish_reason
        step += 1
        assert step < 10_000
    return got, finished


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("max_num_seqs", [256, 3])
def test_greedy_same_as_simple_loop(model_dir, max_num_seqs):
    kw = {"max_num_seqs": max_num_seqs, "chunked_prefill_size": 64}
    simple = run(make_llm(model_dir, False, **kw), PROMPTS, GREEDY)
    overlap = run(make_llm(model_dir, True, **kw), PROMPTS, GREEDY)
    assert overlap == simple
    assert all(len(s[0][0]) == 24 for s in simple)


def test_stop_tokens_and_lengths(model_dir):
    reference = run(make_llm(model_dir, False), PROMPTS, GREEDY)
    # Stop on the 5th greedy token of the first prompt; vary max_tokens per prompt.
    stop = reference[0][0][0][4]
    params = [
        SamplingParams(temperature=0, max_tokens=5 + 3 * i, ignore_eos=True, stop_token_ids=[stop])
        for i in range(len(PROMPTS))
    ]
    simple = run(make_llm(model_dir, False), PROMPTS, params)
    overlap = run(make_llm(model_dir, True), PROMPTS, params)
    assert overlap == simple
    first = reference[0][0][0].index(stop)
    assert simple[0][0] == (reference[0][0][0][: first + 1], "stop")
    for (tokens, reason), p in zip((s[0] for s in overlap), params):
        assert len(tokens) <= p.max_tokens
        assert reason == "stop" or len(tokens) == p.max_tokens


def test_n_samples_and_seeds(model_dir):
    params = [
        SamplingParams(temperature=0, n=3, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, n=2, max_tokens=10, ignore_eos=True, seed=7),
        SamplingParams(temperature=1.0, top_k=5, max_tokens=9, ignore_eos=True, seed=11),
    ]
    prompts = PROMPTS[:3]
    simple = run(make_llm(model_dir, False, page_size=4), prompts, params)
    overlap = run(make_llm(model_dir, True, page_size=4), prompts, params)
    assert overlap == simple
    assert len(simple[0]) == 3 and len(simple[1]) == 2


def test_penalties_fall_back_to_sync(model_dir):
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3), GREEDY]
    simple = run(make_llm(model_dir, False), PROMPTS[:2], params)
    overlap = run(make_llm(model_dir, True), PROMPTS[:2], params)
    assert overlap == simple


def test_preemption_same_tokens(model_dir):
    # A KV cache of a few pages forces preemption and recomputation mid-run.
    kw = {"page_size": 4, "kv_cache_tokens": 96, "enable_prefix_caching": False}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [p[:20] for p in PROMPTS]
    simple_llm = make_llm(model_dir, False, **kw)
    simple = run(simple_llm, prompts, params)
    overlap_llm = make_llm(model_dir, True, **kw)
    overlap = run(overlap_llm, prompts, params)
    assert overlap == simple
    assert overlap_llm.stats()["num_preemptions"] > 0


def test_abort_mid_run_and_no_extra_tokens(model_dir):
    reference = run(make_llm(model_dir, False), PROMPTS[:4], GREEDY)
    for overlap in (False, True):
        llm = make_llm(model_dir, overlap)
        requests = {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS[:4])}
        got, finished = drive(llm.engine, requests, abort_at={"1": 3, "2": 0, "3": 9})
        assert_idle(llm)
        for i in range(4):
            key = (str(i), 0)
            tokens = got.get(key, [])
            assert tokens == reference[i][0][0][: len(tokens)], (overlap, i)
        assert finished[("0", 0)] == "length" and got[("0", 0)] == reference[0][0][0]
        assert finished[("1", 0)] == "abort" and finished[("2", 0)] == "abort" and finished[("3", 0)] == "abort"
        assert len(got.get(("3", 0), [])) < 24


def test_finished_request_extra_token_dropped(model_dir):
    # max_tokens=1: the request finishes on its first token, while the overlap loop has
    # already launched a decode step for it; that extra token must never appear.
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = make_llm(model_dir, True)
    got, finished = drive(llm.engine, {"a": (PROMPTS[0], params), "b": (PROMPTS[1], long)})
    assert_idle(llm)
    assert len(got[("a", 0)]) == 1 and finished[("a", 0)] == "length"
    assert len(got[("b", 0)]) == 8


@pytest.mark.parametrize("overlap", [False, True])
def test_warm_up_leaves_no_trace(model_dir, overlap):
    """The start-up warm-up (run on CUDA; forced here) frees every page, empties the prefix
    cache, zeroes the counters, and the engine then answers exactly as a fresh one."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    fresh = make_llm(model_dir, overlap, chunked_prefill_size=32)
    want = run(fresh, PROMPTS, params)
    warmed = make_llm(model_dir, overlap, chunked_prefill_size=32)
    before = warmed.engine.stats()
    warmed.engine._warm_up()
    assert warmed.engine.stats() == before
    assert warmed.engine.num_steps == 0 and warmed.engine.step_s == 0.0
    assert run(warmed, PROMPTS, params) == want
