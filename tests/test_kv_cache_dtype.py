"""The fp8 KV cache end to end on CPU (torch backend): half a bf16 cache's bytes per token,
the prefill unaffected (its tokens attend to each other's unrounded K/V), decode reading the
cache as stored, nothing leaked. The kernels' fp8 paths are tested in test_triton_attention.py
(the interpreter on CPU, and the stored bytes against torch's cast on the GPU)."""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from tests.tiny import make_tiny_model, random_prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("kvdtype") / "qwen3", "qwen3")


def run(path, kv_cache_dtype: str) -> tuple[list, dict]:
    llm = LLM(
        str(path), device="cpu", dtype="bfloat16", attention_backend="torch", kv_cache_gib=0.01,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    outs = llm.generate(random_prompts(4, seed=7, max_len=30), params, use_tqdm=False)
    stats = llm.stats()
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    dtype = llm.engine.runner.kv_cache.k[0].dtype
    llm.shutdown()
    return [o.outputs[0] for o in outs], {**stats, "dtype": dtype}


def test_fp8_cache_halves_bytes_and_keeps_prefill(tiny):
    base, base_stats = run(tiny, "auto")
    fp8, fp8_stats = run(tiny, "fp8")
    assert base_stats["dtype"] == torch.bfloat16 and fp8_stats["dtype"] == torch.float8_e4m3fn
    # the same 0.01 GiB holds twice the pages (up to the rounding down to whole pages)
    assert abs(fp8_stats["kv_pages_total"] - 2 * base_stats["kv_pages_total"]) <= 2
    for a, b in zip(base, fp8):
        # the first token comes from the prefill alone: exactly the same logprobs
        assert a.token_ids[0] == b.token_ids[0] and a.logprobs[0] == b.logprobs[0]
    # later tokens read the rounded cache: their logprobs move
    assert any(a.logprobs[k] != b.logprobs[k] for a, b in zip(base, fp8) for k in range(1, 8))


def test_kv_cache_dtype_validated():
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8"
    assert EngineConfig().torch_kv_dtype(torch.bfloat16) == torch.bfloat16
    assert EngineConfig(kv_cache_dtype="fp8").torch_kv_dtype(torch.bfloat16) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
