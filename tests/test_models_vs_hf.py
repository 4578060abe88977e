"""Greedy outputs equal to Hugging Face transformers (fp32, CPU) on tiny random models of
every architecture, and the engine's fast paths equal to their plain twins."""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from tests.tiny import TINY_CONFIGS, WINDOWED, hf_greedy, make_tiny_gemma3_multimodal, make_tiny_model, random_prompts

NEW_TOKENS = 64
PROMPTS = random_prompts(8, seed=1)
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> (model directory, transformers' greedy continuation of PROMPTS)."""
    root = tmp_path_factory.mktemp("tiny")
    models = {}
    for arch in TINY_CONFIGS:
        path = make_tiny_model(root / arch, arch, max_shard_size="100KB" if arch == "llama" else None)
        models[arch] = (path, hf_greedy(path, PROMPTS, NEW_TOKENS))
    return models


def run_engine(model_dir, prompts=PROMPTS, params=GREEDY, **engine_args) -> tuple[list[list[int]], dict]:
    llm = LLM(str(model_dir), device="cpu", **engine_args)
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    assert_idle(llm)
    return [o.outputs[0].token_ids for o in outs], stats


def assert_idle(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"], stats
    assert stats["requests_running"] == 0 and stats["requests_waiting"] == 0, stats
    llm.engine.check_invariants()


@pytest.mark.parametrize("arch", list(TINY_CONFIGS))
def test_greedy_matches_transformers(tiny_models, arch):
    path, reference = tiny_models[arch]
    tokens, _ = run_engine(path)
    assert tokens == reference


def test_sharded_checkpoint_was_really_sharded(tiny_models):
    path, _ = tiny_models["llama"]
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1


@pytest.mark.parametrize("arch", WINDOWED)
def test_windowed_second_pass_hits_the_prefix_cache(tiny_models, arch):
    """Sliding-window models with the prefix cache on: a second pass over the same prompts
    reuses their cached KV (windows then start inside cached pages) and still gives
    transformers' tokens; chunked prefill makes extends whose windows reach into the prefix."""
    path, reference = tiny_models[arch]
    llm = LLM(str(path), device="cpu", chunked_prefill_size=16, page_size=4)
    for attempt in range(2):
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference, f"pass {attempt}"
        cached = [o.num_cached_tokens for o in outs]
        assert (sum(cached) > 0) == (attempt == 1), cached
    assert_idle(llm)


def test_gemma3_multimodal_checkpoint_serves_its_text_part(tmp_path):
    """A `gemma3` checkpoint (vision tower and all): nanoserve loads its text decoder only, and
    greedy tokens on text prompts are those of transformers' multimodal model."""
    path = make_tiny_gemma3_multimodal(tmp_path / "gemma3-mm")
    prompts, params = PROMPTS[:3], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens, _ = run_engine(path, prompts, params)
    assert tokens == hf_greedy(path, prompts, 16)


@pytest.mark.parametrize("arch", ["qwen3", "llama3-rope"])
def test_one_at_a_time_equals_batch(tiny_models, arch):
    path, reference = tiny_models[arch]
    llm = LLM(str(path), device="cpu")
    singles = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert singles == reference
    assert_idle(llm)


@pytest.mark.parametrize("arch", ["qwen3", "llama3-rope"])
def test_chunked_prefill_equals_whole_prefill(tiny_models, arch):
    path, reference = tiny_models[arch]
    tokens, _ = run_engine(path, chunked_prefill_size=16)
    assert tokens == reference


@pytest.mark.parametrize("page_size", [1, 16])
def test_page_sizes(tiny_models, page_size):
    path, reference = tiny_models["qwen2"]
    tokens, _ = run_engine(path, page_size=page_size)
    assert tokens == reference


@pytest.mark.parametrize("page_size", [1, 16])
def test_preemption_on_a_full_cache_keeps_outputs(tiny_models, page_size):
    path, reference = tiny_models["qwen3"]
    # 8 requests of up to 144 tokens each in a cache of 320 tokens: decode must preempt.
    tokens, stats = run_engine(path, kv_cache_tokens=320, page_size=page_size, chunked_prefill_size=64)
    assert stats["num_preemptions"] > 0
    assert tokens == reference
