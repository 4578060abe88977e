"""Qwen3.5 (Gated DeltaNet layers) on the GPU: `pytest -m gpu tests/test_gpu_linear_attention.py`.

A tiny random Qwen3.5 in fp32: greedy tokens through the decode CUDA graphs (state rows read
and written inside the graph, padding rows on the scratch row) and eagerly equal the CPU
engine's, which tests/test_linear_attention.py holds equal to transformers. More requests than the largest
captured graph and a batch padded up to a graph size are covered; nothing leaks. In bf16 the
graph and eager runs use the same kernels: bit-equal (their prefill through fla-core where it
imports). fp32 prefill stays on the torch twin even with fla (fla's fp32 products are TF32), so
the fp32 runs here hold the twin on the GPU to the CPU's tokens; the fla path against the twin
is tests/test_gpu_fla.py's.
"""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from tests.tiny import make_tiny_model, random_prompts

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def tokens(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    llm.engine.check_invariants()
    stats = llm.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"], stats
    assert stats["request_slots_free"] == stats["request_slots_total"], stats
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("q35") / "qwen3.5", "qwen3.5", seed=1)
    prompts = random_prompts(11, seed=5, min_len=4, max_len=150)  # 11: padded to the graph of 16
    return path, prompts, tokens(LLM(str(path), device="cpu"), prompts)


@pytest.mark.parametrize("eager", [False, True])
def test_fp32_gpu_equals_cpu(model, eager):
    path, prompts, cpu = model
    llm = LLM(str(path), device="cuda", dtype="float32", enforce_eager=eager, cuda_graph_max_bs=8)
    assert tokens(llm, prompts) == cpu  # 11 requests: batches above the largest graph (8) too
    assert (llm.engine.runner.graphs is None) == eager


def test_bf16_graphs_equal_eager(model):
    path, prompts, _ = model
    runs = [tokens(LLM(str(path), device="cuda", dtype="bfloat16", enforce_eager=e), prompts) for e in (False, True)]
    assert runs[0] == runs[1]
