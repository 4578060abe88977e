"""Window groups on the GPU: `pytest -m gpu tests/test_gpu_window_pages.py`.

Tiny random gpt-oss and Gemma 3 in fp32, sliding-window layers giving back pages out of their
window (nanoserve.kvcache.window), the prefix cache off unless said: greedy tokens through
the decode CUDA graphs (the windowed layers' page tables gathered inside the graph) and
eagerly equal the CPU engine's, which tests/test_window_pages.py holds equal to transformers;
a cache small enough that given-back pages are reused; with the prefix cache on, a second
pass hits and still gives the CPU's tokens. In bf16 graphs and eager runs are bit-equal."""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from tests.tiny import WINDOWED, make_tiny_model, random_prompts

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
ENGINE = {"enable_prefix_caching": False, "page_size": 4, "chunked_prefill_size": 32, "kv_cache_tokens": 1200}


def tokens(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    llm.engine.check_invariants()
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"], stats
    assert stats["kv_window_pages_freed"] > 0, stats
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=WINDOWED)
def model(request, tmp_path_factory):
    arch = request.param
    path = make_tiny_model(tmp_path_factory.mktemp("win") / arch, arch, seed=2)
    prompts = random_prompts(11, seed=6, min_len=10, max_len=120)  # 11: padded to the graph of 16
    return path, prompts, tokens(LLM(str(path), device="cpu", **ENGINE), prompts)


@pytest.mark.parametrize("eager", [False, True])
def test_fp32_gpu_equals_cpu(model, eager):
    path, prompts, cpu = model
    llm = LLM(str(path), device="cuda", dtype="float32", enforce_eager=eager, cuda_graph_max_bs=8, **ENGINE)
    assert llm.engine.scheduler.windows is not None
    assert tokens(llm, prompts) == cpu
    assert (llm.engine.runner.graphs is None) == eager


def test_bf16_graphs_equal_eager(model):
    path, prompts, _ = model
    runs = [
        tokens(LLM(str(path), device="cuda", dtype="bfloat16", enforce_eager=e, **ENGINE), prompts)
        for e in (False, True)
    ]
    assert runs[0] == runs[1]


def test_fp32_prefix_cache_hits_equal_cpu(model):
    """The prefix cache keeps its requests' last windows: a second pass over the same prompts
    hits, through the decode graphs, with the CPU engine's tokens."""
    path, prompts, _ = model
    args = {**ENGINE, "enable_prefix_caching": True, "kv_cache_tokens": 4000}
    runs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(path), device=device, dtype="float32", cuda_graph_max_bs=8, **args)
        passes = [llm.generate(prompts, PARAMS, use_tqdm=False) for _ in range(2)]
        assert sum(o.num_cached_tokens for o in passes[1]) > 0
        llm.engine.check_invariants()
        runs[device] = [[o.outputs[0].token_ids for o in outs] for outs in passes]
    assert runs["cuda"] == runs["cpu"]


def test_fp32_fused_gpt_oss_experts_equal_cpu(model, monkeypatch):
    """NANOSERVE_FUSED_GPT_OSS=1: gpt-oss's experts through the fused MoE kernels (biases and
    the clamped SwiGLU; only the chosen experts read), in graphs and eagerly, give the CPU's tokens."""
    path, prompts, cpu = model
    if path.name != "gpt-oss":
        pytest.skip("gpt-oss only")
    monkeypatch.setenv("NANOSERVE_FUSED_GPT_OSS", "1")
    for eager in (False, True):
        llm = LLM(str(path), device="cuda", dtype="float32", enforce_eager=eager, cuda_graph_max_bs=8, **ENGINE)
        assert llm.engine.config.switches.fused_gpt_oss
        assert tokens(llm, prompts) == cpu
