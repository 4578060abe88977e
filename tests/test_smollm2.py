"""The embedded default model with real weights and tokenizer: equal to transformers,
stop strings, n > 1, chat, bad prompts, and `make run`'s answer."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.models.registry import smollm2_gguf_path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
    "The three primary colors are",
    "Water boils at",
    "In machine learning, a transformer is a neural network architecture that relies on",
    "Hello",
]


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m", device="cpu")


def assert_idle(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"], stats
    assert stats["requests_running"] == 0 and stats["requests_waiting"] == 0, stats
    llm.engine.check_invariants()


def test_greedy_matches_transformers_on_real_weights(llm):
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # like ignore_eos: EOS is a token like any other
    tok = llm.tokenizer
    # 40 tokens a prompt: transformers' generate on one CPU thread is most of this test's time
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    with torch.no_grad():
        for prompt, out in zip(PROMPTS, outs):
            ids = tok(prompt, return_tensors="pt").input_ids
            ref = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False, pad_token_id=0
            )
            assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist(), prompt
    assert_idle(llm)


def test_chat_answers_paris(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=32)
    )
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"  # ended by the model's EOS, <|im_end|>
    assert_idle(llm)


def test_stop_strings_cut_the_text_even_across_tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate(["1, 2, 3, 4,"], params, use_tqdm=False)[0].outputs[0]
    text = full.text
    assert " 7, 8" in text
    # A stop string that starts inside one token and ends in another.
    stop = " 7, 8"
    cut = llm.generate(
        ["1, 2, 3, 4,"],
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "zzz"]),
        use_tqdm=False,
    )
    sample = cut[0].outputs[0]
    assert sample.text == text[: text.index(stop)]
    assert sample.finish_reason == "stop" and sample.stop_reason == stop
    assert len(sample.token_ids) < len(full.token_ids)
    assert_idle(llm)


def test_stop_token_ids_and_max_tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate(["1, 2, 3, 4,"], params, use_tqdm=False)[0].outputs[0]
    stop_id = full.token_ids[5]
    out = llm.generate(
        ["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id]), use_tqdm=False
    )
    first = full.token_ids.index(stop_id)
    assert out[0].outputs[0].token_ids == full.token_ids[: first + 1]
    assert out[0].outputs[0].finish_reason == "stop"
    short = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert short.token_ids == full.token_ids[:3] and short.finish_reason == "length"
    assert_idle(llm)


def test_n_samples_share_the_prompt_and_differ(llm):
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    out = llm.generate(["Tell me a story about a dragon."], params, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 12 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    again = llm.generate(["Tell me a story about a dragon."], params, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    greedy = llm.generate(["Hello"], SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[
        0
    ]
    assert len({tuple(o.token_ids) for o in greedy.outputs}) == 1
    assert_idle(llm)


def test_over_long_prompt_is_rejected_and_the_engine_keeps_serving(llm):
    too_long = [1] * llm.engine.max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([too_long], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[10**9]], SamplingParams(max_tokens=4))
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert_idle(llm)


def test_logprobs(llm):
    out = llm.generate(
        ["The capital of France is"], SamplingParams(temperature=0, max_tokens=3, logprobs=5), use_tqdm=False
    )
    sample = out[0].outputs[0]
    assert len(sample.logprobs) == 3
    for token, lp in zip(sample.token_ids, sample.logprobs):
        assert lp.token_id == token
        assert len(lp.top) == 5
        assert max(lp.top.values()) == pytest.approx(lp.logprob)  # greedy picks the top-1
        assert all(v <= 0 for v in lp.top.values())


def test_make_run_command_answers_paris():
    proc = subprocess.run(
        [sys.executable, "-m", "nanoserve.cli", "generate", "--device", "cpu", "--max-tokens", "24"],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    answer = proc.stdout.split("### What is the capital of France?")[1].split("###")[0]
    assert "Paris" in answer
