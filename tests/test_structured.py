"""Structured outputs offline, with the embedded SmolLM2-135M (real weights) on CPU: sampled
outputs (temperature 1, several seeds) follow their JSON schema (checked with jsonschema),
regex, choice, JSON object or EBNF grammar, in the simple and the overlap loop; constrained
and free requests share batches without changing the free ones' tokens; max_tokens before
the grammar ends gives "length"; n > 1 forks, preemption and aborts keep every sample's
grammar right and leak nothing (pages, slots, matchers). Also the bitmask in the torch and
the fused sampler, the tool-call grammar and the compiler's cache, errors and time limit."""

from __future__ import annotations

import gc
import json
import re

import jsonschema
import pytest
import torch

from nanoserve import LLM, SamplingParams, StructuredOutputs
from nanoserve.engine.sampler import Sampler, SampleRow
from nanoserve.kernels.sampling import apply_token_bitmask
from nanoserve.sampling_params import ReasoningGate
from nanoserve.structured import GrammarError, GrammarMatcher, live_matchers, tool_call_constraint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "score", "tags", "address"],
    "additionalProperties": False,
}
# A short record (about 25 tokens) for the tests of batching, forks, preemption and aborts:
# those check the grammar state's bookkeeping, which the schema's size does not change, and
# each sampled token costs a forward of the 135M model on one CPU thread.
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "role", "address"],
    "additionalProperties": False,
}
PROMPT = "Write a JSON record describing a person:"


@pytest.fixture(scope="module")
def llm():
    llm = LLM("smollm2-135m", device="cpu")
    yield llm
    llm.shutdown()


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"], stats
    engine.check_invariants()
    assert engine.num_constrained == 0
    gc.collect()
    assert live_matchers() == 0, "a grammar matcher outlived its request"


def constrained(seed: int, max_tokens: int = 120, **kind) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=StructuredOutputs(**kind)
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_sampled_outputs_follow_their_constraints(llm, overlap):
    llm.engine.overlap = overlap
    try:
        params = [constrained(s, json=SCHEMA) for s in range(4)]
        params += [constrained(7, max_tokens=20, regex=r"[0-9]{3}-[0-9]{3}-[0-9]{4}")]
        params += [constrained(8, max_tokens=8, choice=["positive", "negative", "neutral"])]
        params += [constrained(9, max_tokens=60, json_object=True)]
        params += [constrained(10, max_tokens=20, grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"')]
        outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    finally:
        llm.engine.overlap = False
    texts = [o.outputs[0].text for o in outs]
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", (o.outputs[0].text, o.outputs[0].finish_reason)
    for text in texts[:4]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts[:4])) > 1, "different seeds gave the same record"
    assert re.fullmatch(r"[0-9]{3}-[0-9]{3}-[0-9]{4}", texts[4])
    assert texts[5] in ("positive", "negative", "neutral")
    assert isinstance(json.loads(texts[6]), dict)
    assert re.fullmatch(r"\([0-9]+(\+[0-9]+)*\)", texts[7])
    assert_idle(llm)


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_batch_free_requests_unchanged(llm, overlap):
    """Free greedy requests give the same tokens alone and beside constrained ones."""
    llm.engine.overlap = overlap
    try:
        free = SamplingParams(temperature=0, max_tokens=12)
        prompts = ["The capital of France is", "One, two, three,"]
        alone = llm.generate(prompts, [free] * 2, use_tqdm=False)
        mixed = llm.generate(
            prompts + [PROMPT] * 2,
            [free, free, constrained(1, json=RECORD), constrained(2, json=RECORD)],
            use_tqdm=False,
        )
    finally:
        llm.engine.overlap = False
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in mixed[:2]]
    for o in mixed[2:]:
        jsonschema.validate(json.loads(o.outputs[0].text), RECORD)
    assert_idle(llm)


def test_max_tokens_before_the_grammar_ends_is_length(llm):
    (out,) = llm.generate([PROMPT], constrained(0, max_tokens=5, json=SCHEMA), use_tqdm=False)
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 5
    with pytest.raises(ValueError):
        json.loads(out.outputs[0].text)
    assert_idle(llm)


def test_forks_each_get_their_own_grammar(llm):
    params = SamplingParams(
        n=3, temperature=1.0, seed=5, max_tokens=120, structured_outputs=StructuredOutputs(json=RECORD)
    )
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), RECORD)
    assert_idle(llm)


def test_preemption_keeps_the_grammar_state():
    # A tiny KV cache: decode preempts and recomputes; each matcher keeps its accepted tokens.
    small = LLM("smollm2-135m", device="cpu", page_size=4, kv_cache_tokens=80, enable_prefix_caching=False)
    try:
        small.engine.overlap = True
        params = [constrained(s, json=RECORD) for s in range(4)]
        outs = small.generate([PROMPT] * 4, params, use_tqdm=False)
        assert small.stats()["num_preemptions"] > 0
        for o in outs:
            assert o.outputs[0].finish_reason == "stop"
            jsonschema.validate(json.loads(o.outputs[0].text), RECORD)
        assert_idle(small)
    finally:
        small.shutdown()


def test_overlap_loop_gives_the_simple_loops_tokens():
    """The overlap loop processes the step in flight after a constrained step's forward and
    fills its masks midway through that processing: the same tokens as the simple loop, for
    seeded and greedy, constrained and free samples, through preemptions (a small KV cache)."""
    small = LLM("smollm2-135m", device="cpu", page_size=4, kv_cache_tokens=120, enable_prefix_caching=False)
    try:
        params = [constrained(s, json=RECORD) for s in range(3)]
        params += [SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputs(json=RECORD))]
        params += [SamplingParams(temperature=1.0, seed=3, max_tokens=30), SamplingParams(temperature=0, max_tokens=30)]
        prompts = [PROMPT] * 4 + ["The capital of France is", "One, two, three,"]
        runs = {}
        for overlap in (False, True):
            small.engine.overlap = overlap
            outs = small.generate(prompts, params, use_tqdm=False)
            runs[overlap] = [o.outputs[0].token_ids for o in outs]
            assert_idle(small)
        assert small.stats()["num_preemptions"] > 0
        assert runs[True] == runs[False]
    finally:
        small.shutdown()


CHOICES = ["positive", "negative", "neutral"]


def _first_new(tokens: list[int], at_least: int) -> int:
    """The first index >= at_least whose token did not occur before it."""
    return next(i for i in range(at_least, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.mark.parametrize("overlap", [False, True])
def test_reasoning_gate_leaves_the_thinking_free(llm, overlap):
    """With a ReasoningGate the thinking is the free run's (greedy), the grammar starts after
    its end token; a gated output that does not open the thinking is constrained at once."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (free,) = llm.generate([PROMPT], greedy, use_tqdm=False)
    free = free.outputs[0].token_ids
    end = _first_new(free, 4)  # the "</think>" of this test: the 5th free token or a later new one

    def gated(gate: ReasoningGate) -> SamplingParams:
        return SamplingParams(
            temperature=0, max_tokens=40, structured_outputs=StructuredOutputs(choice=CHOICES, after_reasoning=gate)
        )

    params = [
        gated(ReasoningGate(start_token=free[0], end_token=free[end], starts_open=True)),  # opened by the prompt
        gated(ReasoningGate(start_token=free[0], end_token=free[end])),  # the output opens it
        gated(ReasoningGate(start_token=llm.tokenizer.vocab_size - 1, end_token=free[end])),  # never opened
    ]
    llm.engine.overlap = overlap
    try:
        outs = [o.outputs[0] for o in llm.generate([PROMPT] * 3, params, use_tqdm=False)]
    finally:
        llm.engine.overlap = False
    for out in outs[:2]:
        assert out.token_ids[: end + 1] == free[: end + 1], "the thinking was constrained"
        assert llm.tokenizer.decode(out.token_ids[end + 1 :], skip_special_tokens=True) in CHOICES
        assert out.finish_reason == "stop"
    assert outs[2].text in CHOICES and outs[2].finish_reason == "stop"
    assert_idle(llm)


def test_abort_frees_the_matcher(llm):
    engine = llm.engine
    ids = llm.tokenizer.encode(PROMPT)
    engine.overlap = True
    try:
        engine.add_request("a", ids, constrained(0, json=RECORD))
        engine.add_request("b", ids, constrained(1, json=RECORD))
        for _ in range(4):
            engine.step()
        engine.abort_request("a")
        engine.add_request("c", ids, constrained(2, json=RECORD))
        engine.abort_request("c")  # possibly still compiling (cached here: queued at once)
        finished = {}
        while engine.has_unfinished_requests():
            for up in engine.step():
                if up.finish_reason:
                    finished[up.request_id] = up.finish_reason
    finally:
        engine.overlap = False
    assert finished["a"] == "abort" and finished["c"] == "abort" and finished["b"] == "stop"
    assert_idle(llm)


def test_bad_constraints_raise_value_errors_naming_the_problem(llm):
    with pytest.raises(GrammarError, match="regex"):
        llm.generate([PROMPT], constrained(0, regex="([a-"), use_tqdm=False)
    with pytest.raises(GrammarError, match="JSON schema"):
        llm.generate([PROMPT], constrained(0, json={"type": "nosuchtype"}), use_tqdm=False)
    with pytest.raises(GrammarError, match="EBNF"):
        llm.generate([PROMPT], constrained(0, grammar="root ::= undefined_rule"), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputs(choice=[])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})
    assert_idle(llm)


def test_compile_cache_and_time_limit(llm):
    service = llm.engine.grammar_service()
    spec = StructuredOutputs(json={"type": "object", "properties": {"x": {"type": "integer"}}})
    before = service.num_compiles
    first = service.compile(spec)
    again = service.compile(
        StructuredOutputs(json=json.dumps({"properties": {"x": {"type": "integer"}}, "type": "object"}))
    )
    assert again is first and service.num_compiles == before + 1, "equal schemas compiled twice"
    slow = StructuredOutputs(
        json={"type": "object", "properties": {f"f{i}": {"type": "string", "maxLength": 300 + i} for i in range(40)}}
    )
    with pytest.raises(GrammarError, match="time limit"):
        service.compile(slow, timeout_s=0.001)
    # Other compiles go on meanwhile (the slow one holds one worker).
    service.compile(StructuredOutputs(regex="[a-z]+"), timeout_s=5)


def test_tool_call_constraint_admits_only_calls(llm):
    functions = [
        {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
        {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"], "additionalProperties": False}},
    ]  # fmt: skip
    spec = tool_call_constraint("<tool_call>", "</tool_call>", functions, at_least_one=True, allow_many=True)
    compiled = llm.engine.grammar_service().compile(spec)
    tok = llm.tokenizer

    def admits(text: str) -> bool:
        m = GrammarMatcher(compiled)
        return (
            all(m.accept(t) for t in tok.encode(text, add_special_tokens=False) + [tok.eos_token_id])
            and m.is_terminated
        )

    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert admits(call) and admits(call + "\n" + call.replace("add", "add"))
    assert not admits('<tool_call>{"name": "sub", "arguments": {}}</tool_call>')
    assert not admits('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    assert not admits("hello " + call)
    assert not admits("")
    one = tool_call_constraint("[", "]", functions[:1], at_least_one=False, allow_many=False, name_key="function")
    compiled = llm.engine.grammar_service().compile(one)
    assert admits("") and admits('[{"function": "get_weather", "arguments": {"city": "Oslo"}}]')
    assert not admits(
        '[{"function": "get_weather", "arguments": {"city": "Oslo"}}] [{"function": "get_weather", "arguments": {"city": "Oslo"}}]'
    )
    single = tool_call_constraint("<tool_call>", "</tool_call>", functions, at_least_one=True, allow_many=False)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=80, structured_outputs=single)
    (out,) = llm.generate(["Call a tool:"], params, use_tqdm=False)
    text = out.outputs[0].text
    body = re.fullmatch(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.DOTALL)
    assert out.outputs[0].finish_reason == "stop" and body, text
    call_obj = json.loads(body.group(1))
    fn = next(f for f in functions if f["name"] == call_obj["name"])
    jsonschema.validate(call_obj["arguments"], fn["parameters"])
    assert_idle(llm)


def test_model_rows_past_the_tokenizer_are_never_allowed(tmp_path):
    """A model with more logits rows than its tokenizer has ids (padding rows, as Qwen's): the
    grammar knows only the tokenizer's ids and the engine masks the rest off."""
    from tests.chat_tokenizers import _CONFIG

    tokens = 49152  # SmolLM2's tokenizer
    small = {**_CONFIG, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    small |= {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": tokens + 1000}
    (tmp_path / "config.json").write_text(json.dumps(small))
    llm = LLM(str(tmp_path), load_format="dummy", tokenizer="smollm2-135m", device="cpu", max_model_len=256)
    try:
        assert llm.engine.grammar_service().grammar_vocab_size == tokens
        params = [constrained(s, max_tokens=40, json_object=True) for s in range(3)]
        params += [SamplingParams(temperature=1.0, seed=9, max_tokens=40, ignore_eos=True)]
        outs = [o.outputs[0] for o in llm.generate([PROMPT] * 4, params, use_tqdm=False)]
        for out in outs[:3]:
            assert max(out.token_ids) < tokens
            if out.finish_reason == "stop":
                assert isinstance(json.loads(out.text), dict)
        assert len(outs[3].token_ids) == 40
        free = SamplingParams(temperature=1.0, seed=2, max_tokens=60, ignore_eos=True)
        (alone,) = llm.generate([PROMPT], free, use_tqdm=False)
        assert max(alone.outputs[0].token_ids) >= tokens, "this seed draws padding ids when free"
        for overlap in (False, True):
            llm.engine.overlap = overlap
            # every row constrained (the mask is copied whole), then a free row beside them,
            # which keeps the ids past the tokenizer's as it has them alone
            for out in [o.outputs[0] for o in llm.generate([PROMPT] * 3, params[:3], use_tqdm=False)]:
                assert max(out.token_ids) < tokens
            beside = llm.generate([PROMPT] * 3, params[:2] + [free], use_tqdm=False)
            assert beside[2].outputs[0].token_ids == alone.outputs[0].token_ids
        llm.engine.overlap = False
        assert_idle(llm)
    finally:
        llm.shutdown()


def test_batch_mask_fill_equals_one_at_a_time(llm, monkeypatch):
    """`fill_masks` writes the rows `fill_mask` writes, for matchers of different grammars in
    different states, rows out of order, on one thread and on xgrammar's pool (taken after a
    slow one-thread fill for POOL_FILLS fills, then one thread again)."""
    from nanoserve.structured import matcher as matcher_module
    from nanoserve.structured.matcher import bitmask_words, fill_masks

    service = llm.engine.grammar_service()
    tok = llm.tokenizer
    specs = [
        StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
        StructuredOutputs(regex="(yes|no)[0-9]{2,4}"),
        StructuredOutputs(choice=["red", "green", "blue"]),
    ]
    prefixes = ['{"a": 1', "yes1", "gr", "", '{"', "no", "yes12", '{"a"']
    matchers = []
    for i, prefix in enumerate(prefixes):
        m = GrammarMatcher(service.compile(specs[i % 3] if prefix or i < 3 else specs[0]))
        for t in tok.encode(prefix, add_special_tokens=False):
            if not m.accept(t):
                break
        matchers.append(m)
    words = bitmask_words(service.grammar_vocab_size)
    rows = [5, 0, 7, 2, 1, 6, 3, 4]
    one = torch.zeros(len(matchers), words, dtype=torch.int32)
    for row, m in zip(rows, matchers):
        m.fill_mask(one, row)
    monkeypatch.setattr(matcher_module, "_pool_fills_left", 0)
    monkeypatch.setattr(matcher_module, "POOL_FILLS", 2)
    monkeypatch.setattr(matcher_module, "SLOW_ROW_S", 0.0)  # every one-thread fill counts as slow
    for on_pool in (False, True, True, False):
        assert (matcher_module._pool_fills_left > 0) == on_pool
        batched = torch.zeros_like(one)
        fill_masks(matchers, batched, rows)
        assert torch.equal(one, batched), on_pool
    assert len({tuple(r.tolist()) for r in one}) > 3, "the states should allow different tokens"


def test_a_grammar_ends_only_at_its_stop_token_and_rolls_back(llm):
    """is_terminated asks xgrammar only after a stop token: a complete answer is not ended
    until the stop token comes; a rollback over the stop token un-ends it."""
    service = llm.engine.grammar_service()
    m = GrammarMatcher(service.compile(StructuredOutputs(choice=["yes"])))
    for t in llm.tokenizer.encode("yes", add_special_tokens=False):
        assert m.accept(t) and not m.is_terminated
    mark = m.checkpoint()
    stop = min(m._stop_ids)
    assert m.accept(stop) and m.is_terminated
    m.rollback(mark)
    assert not m.is_terminated


@pytest.mark.parametrize("overlap", [False, True])
def test_a_token_outside_the_grammar_aborts_its_request(llm, monkeypatch, overlap):
    """With the masks taken away the sampler draws what the grammar refuses: the request
    ends with "abort" right after that token in both loops (the overlap loop's grammars take
    their tokens before the rest of the step is processed), and the free request beside it
    runs on."""
    monkeypatch.setattr(llm.engine.step_masks, "device_mask", lambda *args: None)
    llm.engine.overlap = overlap
    try:
        outs = llm.generate(
            [PROMPT, PROMPT],
            [constrained(0, choice=["positive", "negative"]), SamplingParams(temperature=0, max_tokens=6)],
            use_tqdm=False,
        )
    finally:
        llm.engine.overlap = False
    bad, free = outs[0].outputs[0], outs[1].outputs[0]
    assert bad.finish_reason == "abort" and len(bad.token_ids) == 1
    assert free.finish_reason == "length" and len(free.token_ids) == 6
    assert_idle(llm)


def test_a_chunked_constrained_prompt_in_the_overlap_loop(llm):
    """A constrained prompt prefilled in chunks: the step in flight when its last chunk samples
    sampled nothing (an earlier chunk), and the constrained step's masks still fill and its
    sampling still launches; the output equals the simple loop's."""
    prompt = PROMPT + " " + " ".join(["Write it as a JSON record, with every field."] * 6)
    engine, runs = llm.engine, {}
    chunk, mixed = engine.scheduler.chunk_budget, engine.scheduler.mixed_budget
    engine.scheduler.chunk_budget = engine.scheduler.mixed_budget = 16
    try:
        assert len(llm.tokenizer.encode(prompt)) > 3 * 16
        for overlap in (False, True):
            engine.overlap = overlap
            engine.prefix_cache.reset()  # every run prefills the prompt in chunks
            (out,) = llm.generate([prompt], constrained(4, json=RECORD), use_tqdm=False)
            runs[overlap] = out.outputs[0].token_ids
            assert out.outputs[0].finish_reason == "stop"
            jsonschema.validate(json.loads(out.outputs[0].text), RECORD)
    finally:
        engine.overlap = False
        engine.scheduler.chunk_budget, engine.scheduler.mixed_budget = chunk, mixed
    assert runs[True] == runs[False]
    assert_idle(llm)


# ------------------------------------------------------------------ the bitmask in the sampler


def random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, vocab, generator=gen) < 0.1
    allowed[:, 0] = False
    allowed[0] = False
    allowed[0, vocab - 3] = True  # a row with one allowed word, far from the argmax
    words = torch.zeros(rows, (vocab + 31) // 32 * 32, dtype=torch.int64)
    words[:, :vocab] = allowed.long()
    packed = (words.view(rows, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32), allowed


def test_torch_sampler_draws_only_allowed_words():
    rows, vocab = 6, 203
    mask, allowed = random_bitmask(rows, vocab, 0)
    x = torch.randn(rows, vocab)
    assert torch.equal(apply_token_bitmask(x.clone(), mask) > float("-inf"), allowed)
    for temperature in (0.0, 1.0):
        sampler = Sampler(torch.device("cpu"), seed=0, fused=False)
        rs = [SampleRow(SamplingParams(temperature=temperature, top_k=50 if temperature else -1), None, [], [])] * rows
        for _ in range(5):
            tokens, _ = sampler(x, rs, mask)
            assert all(allowed[i, t] for i, t in enumerate(tokens)), tokens
        if temperature == 0:
            assert tokens == x.masked_fill(~allowed, float("-inf")).argmax(-1).tolist()


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@pytest.mark.parametrize(
    "device",
    [
        pytest.param("cpu", marks=pytest.mark.skipif(not _interpreting(), reason="needs TRITON_INTERPRET=1")),
        pytest.param("cuda", marks=pytest.mark.gpu),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_sampler_with_bitmask_matches_torch(device, dtype):
    """CPU under TRITON_INTERPRET=1 (conftest) on tiny shapes, GPU on the LM head's shape: the
    kernels with a bitmask give exactly the tokens they give for logits masked beforehand in
    torch (same uniforms), greedy rows the masked argmax, and never a disallowed word."""
    pytest.importorskip("triton")
    from nanoserve.kernels.sampling import fused_sample

    rows, vocab = (5, 203) if device == "cpu" else (64, 151936)
    mask, allowed = random_bitmask(rows, vocab, 1)
    x = torch.randn(rows, vocab).to(dtype)
    temps = torch.tensor([0.0, 0.7, 1.0, 0.0, 1.3] * (rows // 5) + [1.0] * (rows % 5))
    mask_d, x_d, temps_d = mask.to(device), x.to(device), temps.to(device)
    for step in range(3):
        got = fused_sample(x_d, temps_d, seed=4, step=step, bitmask=mask_d).cpu()
        want = fused_sample(apply_token_bitmask(x_d.float(), mask_d), temps_d, seed=4, step=step).cpu()
        assert torch.equal(got, want), (got, want)
        assert all(allowed[i, t] for i, t in enumerate(got.tolist()))
    greedy = temps == 0
    masked = x.float().masked_fill(~allowed, float("-inf"))
    assert torch.equal(got[greedy], masked.argmax(-1)[greedy])
