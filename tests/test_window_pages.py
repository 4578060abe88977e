"""Window groups (nanoserve.kvcache.window): sliding-window layers give back the pages that fell
out of their window. Greedy fp32 tokens stay transformers' (prompts several windows long,
chunked prefill, mixed steps, forks, preemption), pages really go back, nothing leaks, and the
layouts of the bundled models are what the hybrid allocator promises."""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.kvcache.pool import KVLayout, PageAllocator
from nanoserve.kvcache.window import WindowMap, WindowPager
from nanoserve.models.registry import resolve_model
from nanoserve.scheduler.request import Request
from nanoserve.switches import KernelSwitches
from tests.tiny import WINDOWED, hf_greedy, make_tiny_model, random_prompts

PROMPTS = random_prompts(6, seed=3, min_len=20, max_len=70)  # windows of 8: several per prompt
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# Prefix cache off unless a test turns it on (it keeps window pages of its own).
ENGINE = {"device": "cpu", "enable_prefix_caching": False, "page_size": 4, "chunked_prefill_size": 16}


@pytest.fixture(scope="module")
def windowed_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("windowed")
    models = {}
    for arch in WINDOWED:
        path = make_tiny_model(root / arch, arch)
        models[arch] = (path, hf_greedy(path, PROMPTS, NEW_TOKENS))
    return models


def finish(llm: LLM) -> dict:
    """The engine's stats after a run, with every page back and the invariants checked."""
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"], stats
    llm.engine.check_invariants()
    return stats


def windows_of(llm: LLM) -> WindowPager:
    windows = llm.engine.scheduler.windows
    assert windows is not None, "window groups are off"
    return windows


@pytest.mark.parametrize("arch", WINDOWED)
def test_greedy_matches_transformers_with_pages_given_back(windowed_models, arch):
    path, reference = windowed_models[arch]
    llm = LLM(str(path), **ENGINE)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert windows_of(llm).num_dropped > 0
    finish(llm)


def test_a_prefill_chunk_longer_than_any_request(windowed_models):
    """A request's window groups hold at most a window and one prefill chunk, and no chunk is
    longer than max_model_len: with the default 8,192-token chunk a 1,000-token cache serves
    128-token requests (counting the whole chunk in each group, the capacity came out 0)."""
    path, reference = windowed_models["gemma3"]
    llm = LLM(str(path), **{**ENGINE, "chunked_prefill_size": 8192, "kv_cache_tokens": 1000, "max_model_len": 128})
    assert llm.engine.max_model_len == 128
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    finish(llm)


@pytest.mark.parametrize("arch", WINDOWED)
def test_one_at_a_time_and_prefill_first(windowed_models, arch):
    """Each request alone (decode windows sliding page by page) and the prefill-first policy
    (no mixed steps) give the same tokens."""
    path, reference = windowed_models[arch]
    llm = LLM(str(path), schedule_policy="prefill-first", **ENGINE)
    for prompt, want in zip(PROMPTS, reference):
        (out,) = llm.generate([prompt], GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == want
    finish(llm)


def test_preemption_on_a_small_cache(windowed_models):
    """A cache that holds the batch only because windows give pages back, then not even so:
    decode preempts, and the tokens stay transformers'."""
    path, reference = windowed_models["gemma3"]
    llm = LLM(str(path), **{**ENGINE, "kv_cache_tokens": 400})
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.stats()["num_preemptions"] > 0
    finish(llm)


def test_forks_share_and_copy_window_pages(windowed_models):
    """n = 3 samples of a prompt fork after it: they share its window pages and copy the
    partly filled one; seeded sampling gives the same samples as with every page kept."""
    path, _ = windowed_models["gpt-oss"]
    params = SamplingParams(temperature=0.9, n=3, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = PROMPTS[:3]
    freeing = LLM(str(path), **ENGINE)
    got = [[c.token_ids for c in o.outputs] for o in freeing.generate(prompts, params, use_tqdm=False)]
    finish(freeing)
    keeping = LLM(str(path), switches=KernelSwitches(window_pages=False), **ENGINE)  # every page kept
    assert keeping.engine.scheduler.windows is None
    want = [[c.token_ids for c in o.outputs] for o in keeping.generate(prompts, params, use_tqdm=False)]
    assert got == want


@pytest.mark.parametrize("arch", WINDOWED)
def test_prefix_cache_keeps_the_last_window(windowed_models, arch):
    """With the prefix cache on, a request's cached KV keeps its last window's pages: the same
    prompts again hit (their prompts' ends), a conversation's next turn hits its whole previous
    turn, and tokens stay transformers'. Nothing leaks, the cache's pages aside."""
    path, reference = windowed_models[arch]
    llm = LLM(str(path), **{**ENGINE, "enable_prefix_caching": True, "kv_cache_tokens": 1600})  # pages reused
    assert windows_of(llm) is not None
    for attempt in range(2):
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference, f"pass {attempt}"
        cached = [o.num_cached_tokens for o in outs]
        assert (sum(cached) > 0) == (attempt == 1), cached
    # The next turn: the previous prompt and its output, then more.
    turn = PROMPTS[0] + reference[0] + [5, 6, 7, 8, 9]
    (out,) = llm.generate([turn], GREEDY, use_tqdm=False)
    assert out.num_cached_tokens >= len(PROMPTS[0]) + NEW_TOKENS - 4 - 4  # up to the last page boundary
    assert out.outputs[0].token_ids == hf_greedy(path, [turn], NEW_TOKENS)[0]
    # A prompt sharing only the first 40 tokens of a cached one: the window before token 40 was
    # given back while that prompt was computed, so the hit stops where a whole window is kept.
    branch = PROMPTS[3][:40] + [11, 12, 13] * 7
    assert len(PROMPTS[3]) > 60
    (out,) = llm.generate([branch], GREEDY, use_tqdm=False)
    assert out.num_cached_tokens < 40 - 8
    assert out.outputs[0].token_ids == hf_greedy(path, [branch], NEW_TOKENS)[0]
    assert windows_of(llm).num_dropped > 0
    stats = llm.stats()
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"], stats
    llm.engine.check_invariants()


def test_memory_held_while_decoding_is_the_window():
    """A request 100 tokens into decoding holds its full pages and only its window's worth of
    window pages (scheduler bookkeeping, no model)."""
    layout = KVLayout.window_groups([8, 8, 0, 8])
    allocator = PageAllocator(200)
    kv_map = WindowMap(layout.num_window_groups, 200, 4, torch.device("cpu"))
    pager = WindowPager(allocator, 4, layout, kv_map.set, lambda s, d: None)
    req = Request("r", GREEDY, 1, [1], arrival=0)
    for position in range(100):
        req.num_computed = position
        pager.drop(req)
        if position // 4 >= len(req.pages):
            req.pages += allocator.alloc(1)
        pager.grow(req, position + 1)
        kv_map.flush()
        pager.check(req, kv_map.map.numpy())
        # The window of position p is p-7..p: at most 3 pages of 4 positions, in 3 groups.
        assert len(pager.held(req)) <= 3 * layout.num_window_groups
    assert allocator.num_usable - allocator.num_free == len(req.pages) + len(pager.held(req))
    pager.release(req)
    allocator.release(req.pages)
    assert allocator.num_free == allocator.num_usable


@pytest.mark.parametrize(
    "name, full, groups",
    [("gemma-3-12b", 8, 5), ("gemma-3-27b", 10, 6), ("gpt-oss-20b", 12, 1), ("gpt-oss-120b", 18, 1)],
)
def test_bundled_layouts(name, full, groups):
    cfg = resolve_model(name).config
    windows = [cfg.window_of(i) for i in range(cfg.num_layers)]
    layout = KVLayout.window_groups(windows)
    assert (layout.num_tensors, layout.num_window_groups) == (full, groups)
    # Every windowed layer has a tensor and a group; no two layers of a group share a tensor.
    used = {(layout.group_of_layer[i], layout.tensor_of_layer[i]) for i in range(cfg.num_layers)}
    assert len(used) == cfg.num_layers


def test_layouts_where_window_groups_do_not_apply():
    assert KVLayout.window_groups([0, 0, 0]) is None  # no windowed layer
    assert KVLayout.window_groups([8, 8]) is None  # no full layer (every page is a window's)
    assert KVLayout.window_groups([0, 0, 8]) is None  # more full layers than windowed
    assert KVLayout.window_groups([0, 8, 16]) is None  # two window sizes
    assert KVLayout.window_groups([0, -1, 8]).tensor_of_layer == (0, -1, 0)


def test_overlap_loop(windowed_models):
    """The overlap loop schedules a step before the last one's tokens are in: pages are given
    back on what is computed, never on what is still running."""
    path, reference = windowed_models["gemma3"]
    llm = LLM(str(path), **{**ENGINE, "kv_cache_tokens": 600})
    llm.engine.overlap = True
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.stats()["kv_window_pages_freed"] > 0
    finish(llm)
