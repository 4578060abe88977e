"""The radix prefix cache end to end (CPU): outputs identical with the cache on and off for
prompts that share prefixes, reuse reported where a prefix was shared, and no page or
cache lock leaked after any run.

Each workload is a list of rounds; a round is one `generate` call, so the KV of one
round's requests is in the cache when the next round arrives. A multi-turn chat builds
each round from the previous answers, so it is a function of them.
"""

from __future__ import annotations

import random

import pytest

from nanoserve import LLM, SamplingParams
from tests.tiny import VOCAB, make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def system_prompt_rounds(rng: random.Random) -> list[list[list[int]]]:
    system = ids(rng, 70)
    questions = [system + ids(rng, rng.randrange(1, 25)) for _ in range(6)]
    return [questions[:1], questions[1:]]


def identical_rounds(rng: random.Random) -> list[list[list[int]]]:
    prompt = ids(rng, 50)
    return [[prompt] * 3, [prompt] * 2]


def prefix_of_another_rounds(rng: random.Random) -> list[list[list[int]]]:
    long = ids(rng, 90)
    # short first: the long one extends a cached prompt; long first: the short one is
    # entirely cached and still computes its last token.
    return [[long[:40]], [long], [long[:40], long[:64], long[:17]]]


WORKLOADS = {
    "system_prompt": system_prompt_rounds,
    "identical": identical_rounds,
    "prefix_of_another": prefix_of_another_rounds,
}


def assert_idle(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"], stats
    assert stats["requests_running"] == 0 and stats["requests_waiting"] == 0, stats
    llm.engine.check_invariants()


def run_rounds(llm: LLM, rounds, params=GREEDY) -> tuple[list[list[list[int]]], list[list[int]]]:
    """Tokens of every sample of every request, and num_cached_tokens per round and request."""
    tokens, cached = [], []
    for prompts in rounds:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert_idle(llm)
        tokens += [[c.token_ids for c in out.outputs] for out in outs]
        cached.append([out.num_cached_tokens for out in outs])
    return tokens, cached


def later_rounds_reused(cached: list[list[int]]) -> bool:
    return all(c > 0 for round_ in cached[1:] for c in round_)


def chat(llm: LLM, conversations: int = 3, turns: int = 4, seed: int = 0) -> tuple[list, list[int]]:
    """Each turn resends the whole conversation (previous prompt + answer + new user
    tokens); all conversations' turn k go in one call."""
    rng = random.Random(seed)
    history = [ids(rng, 20) for _ in range(conversations)]
    tokens, cached = [], []
    for _ in range(turns):
        outs = llm.generate(history, GREEDY, use_tqdm=False)
        assert_idle(llm)
        for conv, out in zip(history, outs):
            conv.extend(out.outputs[0].token_ids + ids(rng, rng.randrange(3, 12)))
            tokens.append(out.outputs[0].token_ids)
            cached.append(out.num_cached_tokens)
    return tokens, cached


# ---- tiny models ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("prefix") / "qwen3", "qwen3")


def engine(model_dir, on: bool, overlap: bool = False, **engine_args) -> LLM:
    llm = LLM(str(model_dir), device="cpu", enable_prefix_caching=on, **engine_args)
    llm.engine.overlap = overlap  # the overlap loop (CUDA's default), forced on as in test_overlap
    return llm


ENGINE_VARIANTS = {
    "page1": {"page_size": 1},
    "page16": {"page_size": 16},
    "chunked16": {"page_size": 4, "chunked_prefill_size": 16},
    # A few pages: admissions evict, decode preempts, preempted requests re-match their own KV.
    "pressure_page16": {"page_size": 16, "kv_cache_tokens": 16 * 12},
    "pressure_page1": {"page_size": 1, "kv_cache_tokens": 150, "chunked_prefill_size": 32},
    "pressure_overlap": {"page_size": 4, "kv_cache_tokens": 4 * 40, "chunked_prefill_size": 32, "overlap": True},
}


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_same_outputs_with_cache_on_and_off(tiny, workload, variant):
    args = ENGINE_VARIANTS[variant]
    results = {}
    for on in (False, True):
        llm = engine(tiny, on, **args)
        results[on] = run_rounds(llm, WORKLOADS[workload](random.Random(1)))
        if on:
            stats = llm.stats()
            assert stats["prefix_cache_hit_tokens"] > 0, stats
            assert 0 < stats["prefix_cache_hit_rate"] <= 1
            if "pressure" in variant and workload == "system_prompt":
                assert stats["num_preemptions"] > 0, "the pressure variants should preempt"
    assert results[True][0] == results[False][0]
    assert not any(map(any, results[False][1])), "the cache is off: nothing can be reused"
    if "pressure" not in variant:  # under pressure the shared pages may be evicted in between
        assert later_rounds_reused(results[True][1]), results[True][1]


@pytest.mark.parametrize("variant", ["page1", "page16", "pressure_page16", "pressure_overlap"])
def test_multi_turn_chat(tiny, variant):
    off, _ = chat(engine(tiny, False, **ENGINE_VARIANTS[variant]))
    on, cached = chat(engine(tiny, True, **ENGINE_VARIANTS[variant]))
    assert on == off
    if "pressure" not in variant:
        assert all(cached[3:]), f"turns after the first reused nothing: {cached}"


@pytest.mark.parametrize(
    "args",
    [
        # One slot: each request runs after the previous one finished and was cached.
        {"max_num_seqs": 1},
        # Small prefill steps: later requests are admitted after the first one's prompt
        # was computed and cached, while it decodes.
        {"chunked_prefill_size": 16},
    ],
    ids=["after_finish", "while_decoding"],
)
def test_reuse_within_one_call(tiny, args):
    rounds = system_prompt_rounds(random.Random(2))
    prompts = [p for r in rounds for p in r]
    llm = engine(tiny, True, page_size=1, **args)
    tokens, (cached,) = run_rounds(llm, [prompts])
    assert cached[0] == 0 and cached[-1] >= 70, cached
    if "max_num_seqs" in args:
        assert all(c >= 70 for c in cached[1:]), cached
    reference, _ = run_rounds(engine(tiny, False, page_size=1), [prompts])
    assert tokens == reference
    # Prefill computed each prompt's unshared part only.
    assert llm.stats()["prefill_tokens_computed"] == sum(map(len, prompts)) - sum(cached)


def test_reported_reuse_is_page_aligned_and_leaves_the_last_token(tiny):
    rng = random.Random(3)
    prompt = ids(rng, 40)
    llm = engine(tiny, True, page_size=16)
    _, cached = run_rounds(llm, [[prompt], [prompt], [prompt[:32]], [prompt[:33]]])
    # 40 tokens: 2 full pages cached; 32 tokens: the second page holds the last token,
    # which must be computed, so only 1 page is reused; 33: both pages.
    assert cached == [[0], [32], [16], [32]]


@pytest.mark.parametrize("variant", ["page1", "page16", "pressure_page16", "pressure_overlap"])
def test_n_samples_with_seed(tiny, variant):
    params = SamplingParams(n=3, seed=7, temperature=0.9, max_tokens=10, ignore_eos=True)
    rounds = system_prompt_rounds(random.Random(4))
    results = {on: run_rounds(engine(tiny, on, **ENGINE_VARIANTS[variant]), rounds, params) for on in (False, True)}
    assert results[True][0] == results[False][0]
    assert all(len(samples) == 3 for samples in results[True][0])
    if "pressure" not in variant:
        assert later_rounds_reused(results[True][1]), results[True][1]


def test_cache_off_has_no_prefix_state(tiny):
    llm = engine(tiny, False)
    assert llm.engine.prefix_cache is None and llm.engine.scheduler.prefix_cache is None
    run_rounds(llm, identical_rounds(random.Random(5)))
    stats = llm.stats()
    assert stats["kv_pages_cached"] == 0 and stats["prefix_cache_query_tokens"] == 0
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


# ---- SmolLM2 (real weights, text prompts) ----------------------------------------------------


SYSTEM = (
    "You are a careful assistant for a small bakery. The bakery opens at seven in the morning, "
    "closes at six in the evening, sells sourdough, rye and spelt bread, croissants and three "
    "kinds of cake, and takes orders by phone one day ahead. Answer briefly and politely. "
)
QUESTIONS = ["When do you open?", "Do you sell rye bread?", "Can I order a cake for tomorrow?", "What is spelt?"]


@pytest.fixture(scope="module")
def smollm():
    """SmolLM2 with the cache on and off, loaded once for the module."""
    return {
        on: LLM("smollm2-135m", device="cpu", enable_prefix_caching=on, kv_cache_tokens=4096) for on in (False, True)
    }


def test_smollm_system_prompt(smollm):
    params = SamplingParams(temperature=0, max_tokens=16)
    prompts = [SYSTEM + "Question: " + q + "\nAnswer:" for q in QUESTIONS]
    outputs = {}
    for on, llm in smollm.items():
        first = llm.generate(prompts[:1], params, use_tqdm=False)
        rest = llm.generate(prompts[1:], params, use_tqdm=False)
        assert_idle(llm)
        outputs[on] = [(o.outputs[0].token_ids, o.num_cached_tokens) for o in first + rest]
    assert [t for t, _ in outputs[True]] == [t for t, _ in outputs[False]]
    assert all(c > 32 for _, c in outputs[True][1:]), outputs[True]
    assert not any(c for _, c in outputs[False])


def test_smollm_multi_turn_chat(smollm):
    params = SamplingParams(temperature=0, max_tokens=12)
    transcripts = {}
    for on, llm in smollm.items():
        text, tokens, cached = SYSTEM, [], []
        for q in QUESTIONS[:3]:
            text += "User: " + q + "\nAssistant:"
            (out,) = llm.generate([text], params, use_tqdm=False)
            assert_idle(llm)
            text += out.outputs[0].text + "\n"
            tokens.append(out.outputs[0].token_ids)
            cached.append(out.num_cached_tokens)
        transcripts[on] = (tokens, cached)
    assert transcripts[True][0] == transcripts[False][0]
    assert all(c > 0 for c in transcripts[True][1][1:]), transcripts[True][1]
