"""Speculative decoding (nanoserve/engine/speculative): lossless against speculation off.

Tiny random Llama targets in fp32 on the CPU. Drafters: n-gram look-ups, and a draft model
made of the target's first layer (related to the target, so some drafts are accepted and some
rejected: acceptance varies, and the identity checks are not vacuous). Sampling is checked by
its distribution: token frequencies with speculation on and off, on a 16-token vocabulary.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.engine.speculative.acceptance import accept_greedy, accept_sampled
from nanoserve.engine.speculative.ngram import NgramIndex, SuffixStore
from nanoserve.engine.speculative.step import PROBE_EVERY
from tests.tiny import first_layer_draft, make_tiny_model

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("speculative")
    target = make_tiny_model(d / "target", "llama", seed=0)
    return {"target": target, "draft": first_layer_draft(target, d / "draft")}


def _prompts() -> list[list[int]]:
    """Prompts that repeat themselves (n-gram drafts find matches) and one that does not."""
    rng = random.Random(1)
    out = []
    for n in (5, 9, 12, 17):
        base = [rng.randrange(512) for _ in range(n)]
        out.append(base * 3 + base[: n // 2])
    out.append([rng.randrange(512) for _ in range(40)])
    return out


def _spec(algo: str, models) -> dict:
    # the cost gate off: these tests count drafts, which must not depend on the CPU's timings
    kw = {"speculative_algorithm": algo, "speculative_num_draft_tokens": 4, "speculative_cost_gate": False}
    if algo == "draft":
        kw["speculative_draft_model"] = str(models["draft"])
    return kw


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# ---- pieces ------------------------------------------------------------------------------


def test_ngram_index_prefers_longest_then_latest_match():
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 2, 3, 8, 7, 2, 3]
    # suffix (2, 3) occurs at 1-2 (then 9) and 4-5 (then 8): the latest wins; 3-grams (7, 2, 3) miss
    assert index.propose(tokens, 2) == [8, 7]
    tokens += [8, 7, 1, 2, 3]  # (1, 2, 3) now matches the start: the 3-gram wins over (2, 3)
    assert index.propose(tokens, 3) == [9, 2, 3]
    assert index.propose([5, 6], 4) == []


def test_suffix_store_is_bounded_and_forgets_evicted_sequences():
    store = SuffixStore(1, 2, max_tokens=10)
    store.add([1, 2, 3, 4, 5, 6])
    assert store.propose([9, 2, 3], 2) == [4, 5]
    store.add([7, 8, 9, 10, 11, 12])  # 12 tokens > 10: the first sequence goes
    assert store.num_tokens <= 10
    assert store.propose([9, 2, 3], 2) == []
    assert store.propose([0, 8], 3) == [9, 10, 11]
    assert all(seq_id in store.sequences for seq_id, _ in store.index.values())


def test_accept_greedy_takes_matching_prefix_and_target_token():
    assert accept_greedy([5, 6, 7], [5, 6, 1, 2]).tokens == [5, 6, 1]
    assert accept_greedy([5, 6], [5, 6, 9]).tokens == [5, 6, 9]
    assert accept_greedy([], [4]).tokens == [4]
    assert accept_greedy([3], [4, 5]).num_accepted == 0


def _chi2_same(a: list[int], b: list[int]) -> tuple[float, float]:
    """Two-sample chi-square statistic of two samples of categories, and its 0.1% critical
    value (Wilson-Hilferty approximation of the chi-square quantile)."""
    cats = sorted(set(a) | set(b))
    stat = 0.0
    na, nb = len(a), len(b)
    for c in cats:
        ca, cb = a.count(c), b.count(c)
        expect_a = (ca + cb) * na / (na + nb)
        expect_b = (ca + cb) * nb / (na + nb)
        stat += (ca - expect_a) ** 2 / expect_a + (cb - expect_b) ** 2 / expect_b
    df = max(len(cats) - 1, 1)
    z = 3.09  # the 99.9% normal quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_rejection_rule_emits_the_target_distribution(with_draft_probs):
    torch.manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.1, 0.1, 0.1, 0.6]])
    q = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1]]) if with_draft_probs else None
    gen = torch.Generator().manual_seed(3)
    firsts, n = [], 4000
    for _ in range(n):
        draft = [int(torch.multinomial(q[0], 1, generator=gen))] if q is not None else [1]
        firsts.append(accept_sampled(draft, p, q, gen).tokens[0])
    expected = [round(x * n) for x in p[0].tolist()]
    reference = [c for c, m in enumerate(expected) for _ in range(m)]
    stat, critical = _chi2_same(firsts, reference)
    assert stat < critical, (stat, critical, [firsts.count(c) for c in range(5)])


def test_bad_settings_are_refused_at_start(models, tmp_path):
    for k in (0, 17):
        with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
            EngineConfig(speculative_algorithm="ngram", speculative_num_draft_tokens=k)
    with pytest.raises(ValueError, match="speculative_algorithm"):
        EngineConfig(speculative_algorithm="medusa")
    with pytest.raises(ValueError, match="needs speculative_draft_model"):
        EngineConfig(speculative_algorithm="draft")
    with pytest.raises(ValueError, match="speculative_algorithm must be set"):
        EngineConfig(speculative_num_draft_tokens=3)
    other = make_tiny_model(tmp_path / "other", "llama")
    import json

    cfg = json.loads((other / "config.json").read_text())
    cfg["vocab_size"] = 256
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(models["target"]), device="cpu", dtype="float32", speculative_algorithm="draft",
            speculative_draft_model=str(other))  # fmt: skip


# ---- the engine --------------------------------------------------------------------------


def test_cost_gate_pauses_speculation_that_does_not_pay(models):
    llm = LLM(str(models["target"]), device="cpu", dtype="float32", speculative_algorithm="ngram")
    assert not llm.engine.speculator.spec.cost_gate  # opt-in: measured slower than without it
    llm = LLM(
        str(models["target"]), device="cpu", dtype="float32", speculative_algorithm="ngram", speculative_cost_gate=True
    )
    spec = llm.engine.speculator
    assert spec._worth_it()  # nothing measured yet
    spec.plain_steps.extend([0.5, 0.5, 50.0])  # ms; a compiling step does not move the median
    spec.verify_steps.extend([1.5, 1.6, 1.4, 90.0])
    spec.verify_tokens.extend([1, 1, 13, 1])  # a mean of 4 tokens: 4 x 0.5 >= 1.5
    assert spec._worth_it()
    spec.verify_tokens.extend([1, 1, 1, 1])  # a mean of 2.5: 2.5 x 0.5 < 1.5
    spec.num_steps = spec._last_probe + 1
    assert not spec._worth_it()
    spec.num_steps += PROBE_EVERY  # but it probes now and then
    assert spec._worth_it() and not spec._worth_it()
    spec._after_probe(1.5, 2.0)  # a probe that does not pay (2 x 0.5 < 1.5) leaves it shut
    assert not spec._worth_it()
    spec._after_probe(1.5, 4.0)  # one that pays reopens it at once
    assert list(spec.verify_tokens) == [4.0] and spec._worth_it()


@pytest.fixture(scope="module")
def reference(models):
    """Speculation off: greedy outputs of the prompts, with logprobs."""
    llm = LLM(str(models["target"]), device="cpu", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    return llm.generate(_prompts(), params, use_tqdm=False)


@pytest.mark.parametrize("algo", ["ngram", "draft"])
@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_output_is_speculation_off_output(models, reference, algo, overlap):
    llm = LLM(str(models["target"]), device="cpu", dtype="float32", **_spec(algo, models))
    llm.engine.overlap = overlap  # the overlap loop is CUDA's default; a verify step finishes it first
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    for _ in range(2):  # the second pass hits the prefix cache
        outs = llm.generate(_prompts(), params, use_tqdm=False)
        assert _tokens(outs) == _tokens(reference)
        for got, want in zip(outs, reference):
            for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
                assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert a.top.keys() == b.top.keys()
        llm.engine.check_invariants()
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] > 0
    drafted, accepted = stats["vllm:spec_decode_num_draft_tokens"], stats["vllm:spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted, (accepted, drafted)  # acceptance varies
    assert sum(stats["vllm:spec_decode_num_accepted_tokens_per_pos"]) == accepted
    metrics = llm.get_metrics()
    assert metrics["vllm:spec_decode_num_drafts"] == stats["vllm:spec_decode_num_drafts"] > 0
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]


@pytest.mark.skipif(
    not INTERPRET, reason="needs triton's interpreter (TRITON_INTERPRET=1, set by conftest without a GPU)"
)
@pytest.mark.slow
def test_verify_runs_through_the_triton_decode_kernel_losslessly(models, reference):
    """The Triton backend reads a verify step's positions of one request in one program (the
    decode kernel over runs, in the interpreter here; tests/test_triton_attention.py checks it eagerly);
    through the runs graphs (emulated), greedy output and logprobs stay speculation off's."""
    from tests.test_host_fastpath import emulate_graphs

    llm = LLM(
        str(models["target"]), device="cpu", dtype="float32", attention_backend="triton", **_spec("ngram", models)
    )
    runner = llm.engine.runner
    assert runner.max_run_rows == 5
    emulate_graphs(llm, 16)
    # the reference's first 12 tokens (greedy: a prefix of its 24), the interpreter is slow
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    assert _tokens(outs) == [t[:12] for t in _tokens(reference)]
    for got, want in zip(outs, reference):
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert runner.num_runs_steps > 0
    assert any(key[1] == "runs" for key in runner.graphs.graphs)
    llm.engine.check_invariants()


@pytest.mark.parametrize("algo", ["ngram", "draft"])
def test_stops_limits_and_penalties_match_speculation_off(models, algo):
    prompts = _prompts()
    off = LLM(str(models["target"]), device="cpu", dtype="float32")
    on = LLM(str(models["target"]), device="cpu", dtype="float32", **_spec(algo, models))
    free = off.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    params = []
    for i, out in enumerate(free):
        stop = out.outputs[0].token_ids[6 + i]  # a token the target emits mid-run: EOS-like stop
        params.append(SamplingParams(temperature=0, max_tokens=7 + 3 * i, stop_token_ids=[stop]))
    params[-1] = SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.5, frequency_penalty=0.3)
    want = off.generate(prompts, params, use_tqdm=False)
    got = on.generate(prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]
    on.engine.check_invariants()


def test_abort_mid_run_frees_every_page_of_both_models(models):
    llm = LLM(str(models["target"]), device="cpu", dtype="float32", enable_prefix_caching=False,
              **_spec("draft", models))  # fmt: skip
    engine = llm.engine
    for i, prompt in enumerate(_prompts()):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(6):
        engine.step()
    assert engine.speculator.counters.num_drafts > 0
    for i in range(len(_prompts())):
        engine.abort_request(str(i))
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_invariants()
    assert engine.allocator.num_free == engine.allocator.num_usable
    assert not engine.speculator.proposer.states or all(r.is_finished for r in engine.speculator.proposer.states)


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},
        {"temperature": 0.8, "top_p": 0.7},
        {"temperature": 1.2, "top_k": 4},
        {"temperature": 1.0, "min_p": 0.2},
    ],
    ids=["temperature", "top-p", "top-k", "min-p"],
)
def test_sampled_tokens_follow_the_target_distribution(tmp_path_factory, params):
    """1,000 samples of 4 tokens after a repetitive prompt, with n-gram drafts (accepted and
    rejected at random) and without: each position's token frequencies agree (chi-square,
    0.1% level)."""
    d = tmp_path_factory.mktemp("small_vocab")
    from tests import tiny

    vocab = 16
    spec = tiny.tiny_config("llama") | {"vocab_size": vocab, "initializer_range": 0.15}
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(d))
    prompt = list(range(vocab)) * 2  # every token occurs in it: the n-gram look-up always drafts
    n = 1000
    runs = []
    for algo in (None, "ngram"):
        extra = {"speculative_algorithm": algo, "speculative_disable_batch_size": n, "speculative_cost_gate": False}
        extra = extra if algo else {}
        llm = LLM(str(d), device="cpu", dtype="float32", max_num_seqs=n, seed=1 if algo else 2, **extra)
        outs = llm.generate([prompt] * n, SamplingParams(max_tokens=4, ignore_eos=True, **params), use_tqdm=False)
        runs.append(_tokens(outs))
        if algo:
            stats = llm.stats()
            assert 0 < stats["vllm:spec_decode_num_accepted_tokens"] < stats["vllm:spec_decode_num_draft_tokens"]
        llm.engine.check_invariants()
    for pos in range(4):
        stat, critical = _chi2_same([t[pos] for t in runs[0]], [t[pos] for t in runs[1]])
        assert stat < critical, (pos, stat, critical)


# ---- real weights: text, stop strings and grammars ---------------------------------------


@pytest.fixture(scope="module")
def smollm():
    return {
        "off": LLM("smollm2-135m", device="cpu", dtype="float32"),
        "on": LLM(
            "smollm2-135m", device="cpu", dtype="float32", speculative_algorithm="ngram", speculative_cost_gate=False
        ),
    }


COPY_PROMPT = [{"role": "user", "content": "Repeat exactly: the cat sat on the mat, the cat sat on the hat."}]


def test_stop_string_inside_an_accepted_run_cuts_there(smollm):
    free = smollm["off"].chat(COPY_PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    text = free.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    params = SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    want = smollm["off"].chat(COPY_PROMPT, params, use_tqdm=False)[0].outputs[0]
    got = smollm["on"].chat(COPY_PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    assert smollm["on"].stats()["vllm:spec_decode_num_accepted_tokens"] > 0


def test_grammar_advances_over_accepted_tokens_only(smollm):
    from nanoserve import StructuredOutputs

    ask = [{"role": "user", "content": 'Repeat this JSON: {"name": "cat", "age": 3, "name2": "cat"}'}]
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputs(json=schema))
    want = smollm["off"].chat(ask, params, use_tqdm=False)[0].outputs[0]
    got = smollm["on"].chat(ask, params, use_tqdm=False)[0].outputs[0]
    assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    smollm["on"].engine.check_invariants()


# ---- GPU: graphs on and off --------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["ngram", "draft"])
@pytest.mark.parametrize("eager", [False, True])
def test_greedy_identity_on_gpu(models, algo, eager):
    kw = {"device": "cuda", "dtype": "float32", "enforce_eager": eager}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = LLM(str(models["target"]), **kw).generate(_prompts(), params, use_tqdm=False)
    llm = LLM(str(models["target"]), **kw, **_spec(algo, models))
    for _ in range(2):
        assert _tokens(llm.generate(_prompts(), params, use_tqdm=False)) == _tokens(want)
    llm.engine.check_invariants()
    assert llm.stats()["vllm:spec_decode_num_accepted_tokens"] > 0
    assert llm.engine.runner.num_runs_steps > 0  # verify steps read each request's K/V once (runs)


def test_metrics_export_the_engine_counters_under_vllm_names():
    from nanoserve.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    base = {"kv_pages_total": 10, "kv_pages_free": 10}
    for drafts, tokens, accepted, per_pos in ((2, 8, 3, [2, 1, 0, 0]), (5, 20, 9, [4, 3, 2, 0])):
        metrics.update_engine(
            base
            | {
                "vllm:spec_decode_num_drafts": drafts,
                "vllm:spec_decode_num_draft_tokens": tokens,
                "vllm:spec_decode_num_accepted_tokens": accepted,
                "vllm:spec_decode_num_accepted_tokens_per_pos": per_pos,
            },
            0,
        )
    text = metrics.render().decode()
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 5.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 20.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 9.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 3.0' in text
