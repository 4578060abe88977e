"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral) on CPU in fp32: greedy outputs
equal transformers' on tiny random checkpoints (single and sharded safetensors), with chunked
prefill, page sizes 1 and 16, the prefix cache, and TP=2 over gloo; no page or slot leaked.
Also: the per-expert checkpoint tensors land in the stacked expert weights (TP slices
included), sparse and dense layers where Hugging Face puts them, dummy weights whose greedy
outputs vary, bundled configs (FP8 experts: tests/test_fp8_moe.py).
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from tiny import VOCAB, hf_greedy, random_prompts

from nanoserve import LLM, SamplingParams
from nanoserve.distributed import TPGroup
from nanoserve.kernels.moe import fused_moe_every_expert, fused_moe_reference, route_reference
from nanoserve.models.loader import dummy_checkpoint, hf_parameter_shapes
from nanoserve.models.model_config import ModelConfig
from nanoserve.models.moe import SparseMoE
from nanoserve.models.registry import resolve_model
from nanoserve.switches import KernelSwitches

_BASE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "eos_token_id": None,
    "bos_token_id": None,
    "pad_token_id": None,
}

# Top-k renormalised and not; dense layers through mlp_only_layers and decoder_sparse_step;
# the shared expert; Mixtral (every layer sparse, always renormalised). 8 experts, so that
# some are left without tokens in decode steps.
MOE_CONFIGS = {
    "qwen3_moe-norm": {
        "model_type": "qwen3_moe",
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
        "head_dim": 32,
    },
    "qwen3_moe-plain": {
        "model_type": "qwen3_moe",
        "num_experts": 8,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 32,
        "norm_topk_prob": False,
        "decoder_sparse_step": 2,
    },
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "norm_topk_prob": False,
    },
    "mixtral": {
        "model_type": "mixtral",
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "sliding_window": None,
    },
}
SPARSE_LAYERS = {"qwen3_moe-norm": [0, 2], "qwen3_moe-plain": [1], "qwen2_moe": [0, 1, 2], "mixtral": [0, 1, 2]}
SHARDED = "qwen2_moe"  # saved in several safetensors files with an index

NEW_TOKENS = 24
PROMPTS = random_prompts(6, seed=11, min_len=3, max_len=60)
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def moe_config(arch: str) -> dict:
    return {**_BASE, **MOE_CONFIGS[arch]}


def make_moe_model(directory, arch: str, seed: int = 0, overrides: dict | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {**moe_config(arch), **(overrides or {})}
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, p in model.named_parameters():
        # A router initialised to zeros ties every expert: the test would compare tie-breaking.
        assert not name.endswith("gate.weight") or p.std() > 0, name
    model.save_pretrained(str(directory), **({"max_shard_size": "100KB"} if arch == SHARDED else {}))
    return directory


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """arch -> (model directory, transformers' greedy continuation of PROMPTS)."""
    root = tmp_path_factory.mktemp("tiny_moe")
    models = {}
    for arch in MOE_CONFIGS:
        path = make_moe_model(root / arch, arch)
        models[arch] = (path, hf_greedy(path, PROMPTS, NEW_TOKENS))
    return models


def assert_idle(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"], stats
    assert stats["requests_running"] == 0 and stats["requests_waiting"] == 0, stats
    llm.engine.check_invariants()


def generate(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_greedy_matches_transformers(moe_models, arch):
    path, reference = moe_models[arch]
    llm = LLM(str(path), device="cpu", dtype="float32")
    layers = llm.engine.runner.model.layers
    assert [i for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoE)] == SPARSE_LAYERS[arch]
    assert generate(llm) == reference
    assert_idle(llm)


def test_sharded_checkpoint_was_really_sharded(moe_models):
    path, _ = moe_models[SHARDED]
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1


@pytest.mark.parametrize("arch", ["qwen3_moe-norm", "mixtral"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill_and_page_sizes(moe_models, arch, page_size):
    path, reference = moe_models[arch]
    llm = LLM(str(path), device="cpu", dtype="float32", chunked_prefill_size=16, page_size=page_size)
    assert generate(llm) == reference
    assert_idle(llm)


def test_mixed_prefill_decode_steps(moe_models):
    """Decode rows and prompt chunks in one step: the MoE block is row-wise, outputs unchanged."""
    path, reference = moe_models["qwen2_moe"]
    llm = LLM(str(path), device="cpu", dtype="float32", chunked_prefill_size=16, schedule_policy="mixed")
    assert generate(llm) == reference
    assert_idle(llm)


@pytest.mark.parametrize("arch", ["qwen3_moe-plain", "qwen2_moe"])
def test_prefix_cache_hits_keep_outputs(moe_models, arch):
    path, reference = moe_models[arch]
    llm = LLM(str(path), device="cpu", dtype="float32", page_size=4, enable_prefix_caching=True)
    assert generate(llm) == reference
    assert generate(llm) == reference  # every prompt's pages are now cached
    assert llm.stats()["prefix_cache_hit_tokens"] > 0
    assert_idle(llm)


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral", "qwen3_moe-norm"])
def test_tp2_matches_transformers(moe_models, arch):
    # Experts sharded along their intermediate dimension (the shared expert too), the router
    # replicated; chunked prefill and the prefix cache on; simple and overlap loops.
    path, reference = moe_models[arch]
    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        tensor_parallel_size=2,
        dist_timeout_s=60,
        chunked_prefill_size=16,
        enable_prefix_caching=True,
    )
    try:
        assert generate(llm) == reference
        llm.engine.overlap = True
        assert generate(llm) == reference
        assert llm.engine.stats()["prefix_cache_hit_tokens"] > 0
        assert_idle(llm)
    finally:
        llm.shutdown()


def test_rank_slices_of_experts(moe_models):
    """Each rank's stacked w13/w2 hold its slice of every expert's gate, up and down."""
    path, _ = moe_models["qwen2_moe"]
    from safetensors.torch import load_file

    full = {}
    for f in path.glob("*.safetensors"):
        full |= load_file(str(f))
    cfg = resolve_model(str(path)).config
    from nanoserve.models.loader import load_weights, safetensors_checkpoint

    for rank in (0, 1):
        with torch.device("cpu"):
            from nanoserve.models.decoder import DecoderLM

            model = DecoderLM(cfg, max_positions=64, tp=TPGroup(rank=rank, size=2))
        with torch.no_grad():
            load_weights(model, safetensors_checkpoint(path))
        mlp = model.layers[2].mlp
        s = cfg.moe.intermediate_size // 2
        cut = slice(rank * s, (rank + 1) * s)
        for e in (0, 5):
            p = f"model.layers.2.mlp.experts.{e}."
            assert torch.equal(mlp.experts.w13[e, :s], full[p + "gate_proj.weight"][cut])
            assert torch.equal(mlp.experts.w13[e, s:], full[p + "up_proj.weight"][cut])
            assert torch.equal(mlp.experts.w2[e], full[p + "down_proj.weight"][:, cut])
        s = cfg.moe.shared_expert_intermediate_size // 2
        gate_up = mlp.shared_expert.gate_up_proj.weight
        assert torch.equal(
            gate_up[:s], full["model.layers.2.mlp.shared_expert.gate_proj.weight"][rank * s : (rank + 1) * s]
        )
        assert torch.equal(mlp.shared_expert_gate.weight, full["model.layers.2.mlp.shared_expert_gate.weight"])


def test_missing_expert_is_an_error(moe_models, tmp_path):
    path, _ = moe_models["mixtral"]
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match="checkpoint lacks 1 tensors"):
        LLM(str(tmp_path), device="cpu", dtype="float32")


@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_dummy_weights_vary(tmp_path, arch):
    """Dummy MoE weights give varied greedy outputs, as dense dummy models do (test_dummy_weights)."""
    cfg = moe_config(arch)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), device="cpu", load_format="dummy", dtype="float32", max_model_len=256)
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(20, 60))] for _ in range(6)]
    tokens = generate(llm, prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert len({tuple(t) for t in tokens}) == len(prompts), tokens
    assert all(len(set(t[1:])) > 1 for t in tokens), tokens
    assert sum(len(set(t)) for t in tokens) / len(tokens) >= 16 / 3, tokens
    assert_idle(llm)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_bundled_configs(name):
    cfg = resolve_model(name).config
    moe = cfg.moe
    assert moe is not None and all(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    shapes = hf_parameter_shapes(cfg)
    expert_params = sum(
        torch.Size(s).numel() for n, s in shapes.items() if ".experts." in n and n.startswith("model.layers.0.")
    )
    assert expert_params == moe.num_experts * 3 * cfg.hidden_size * moe.intermediate_size
    total = sum(torch.Size(s).numel() for s in shapes.values())
    # Published sizes: Qwen3-30B-A3B 30.5B parameters, Mixtral-8x7B 46.7B.
    want = {"qwen3-30b-a3b": 30.5e9, "mixtral-8x7b": 46.7e9}[name]
    assert abs(total - want) / want < 0.01, total


def test_dummy_checkpoint_names_match_the_model():
    cfg = ModelConfig.from_hf_dict(moe_config("qwen2_moe"))
    names = [n for n, _ in dummy_checkpoint(cfg, 0, torch.device("cpu"), torch.float32)]
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.0.mlp.shared_expert_gate.weight" in names


def test_every_expert_path_equals_reference():
    """The host-sync-free slow twin of the CUDA path computes the reference's sum."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 16, generator=gen, dtype=torch.float64)
    w13 = torch.randn(5, 12, 16, generator=gen, dtype=torch.float64)
    w2 = torch.randn(5, 16, 6, generator=gen, dtype=torch.float64)
    w, ids = route_reference(torch.randn(9, 5, generator=gen), 2, renormalize=False)
    assert torch.allclose(fused_moe_every_expert(x, w13, w2, w, ids), fused_moe_reference(x, w13, w2, w, ids))


# ---- GPU (pytest -m gpu tests/test_moe_models.py) ----------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("triton_ops", [True, False])
@pytest.mark.parametrize("arch", ["qwen3_moe-norm", "qwen2_moe", "mixtral"])
def test_gpu_fp32_fast_path_equals_transformers(moe_models, arch, triton_ops):
    """On CUDA in fp32, decode CUDA graphs, piecewise prefill graphs and the overlap loop, with
    the fused MoE kernels (and the other Triton kernels) or with their torch twins (the
    every-expert sum), give transformers' greedy tokens."""
    path, reference = moe_models[arch]
    llm = LLM(
        str(path),
        device="cuda",
        dtype="float32",
        cuda_graph_max_bs=8,
        chunked_prefill_size=64,
        switches=KernelSwitches(triton_ops=triton_ops),
    )
    assert llm.engine.runner.graphs is not None
    assert generate(llm) == reference
    assert_idle(llm)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_moe-plain", "mixtral"])
def test_gpu_bf16_graphs_equal_eager(moe_models, arch):
    """The same kernels with and without CUDA graphs (decode and piecewise prefill): identical."""
    path, _ = moe_models[arch]
    prompts = random_prompts(12, seed=4, min_len=3, max_len=120)
    runs = []
    for eager in (False, True):
        llm = LLM(str(path), device="cuda", dtype="bfloat16", enforce_eager=eager, cuda_graph_max_bs=8)
        runs.append(generate(llm, prompts))
        assert_idle(llm)
        del llm
    assert runs[0] == runs[1]


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_dummy_weights_in_transformers_layout(tmp_path, arch):
    """The dummy checkpoint, put in transformers' layout (stacked experts in transformers >= 5,
    as hf_reference does for the GPU tests and the benchmark's peer), loads with nothing
    missing or unexpected and gives the engine's greedy tokens on the same dummy weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from nanoserve.models.hf_reference import _as_hf_layout

    spec = moe_config(arch)
    (tmp_path / "config.json").write_text(json.dumps(spec))
    cfg = ModelConfig.from_hf_dict(spec)
    hf_spec = dict(spec)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(hf_spec.pop("model_type"), **hf_spec), dtype=torch.float32
    )
    state = _as_hf_layout(dict(dummy_checkpoint(cfg, 0, torch.device("cpu"), torch.float32)), model)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing[:4], unexpected[:4])
    model.eval()
    prompts = PROMPTS[:3]
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
            want.append(gen[0, len(p) :].tolist())
    llm = LLM(str(tmp_path), device="cpu", load_format="dummy", dtype="float32", seed=0)
    assert generate(llm, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) == want
    assert_idle(llm)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter (conftest sets it without a GPU)"
)
@pytest.mark.parametrize("path", ["decode", "grouped"])
def test_tp_shard_through_fused_kernels(path):
    """A TP rank's stacked expert slices (I/N wide, contiguous) through route + fused_moe, in
    Triton's interpreter, give the torch references' routing and sum."""
    from nanoserve.kernels import moe as moe_kernels

    torch.manual_seed(0)
    cfg = ModelConfig.from_hf_dict(moe_config("qwen2_moe"))
    block = SparseMoE(cfg, TPGroup(rank=1, size=2))
    for p in block.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(5, cfg.hidden_size)
    logits = (x @ block.gate.weight.t()).contiguous()
    w, ids = moe_kernels.route(logits, block.top_k, block.renormalize)
    w_ref, ids_ref = route_reference(logits, block.top_k, block.renormalize)
    assert torch.equal(ids, ids_ref) and torch.allclose(w, w_ref, atol=1e-6)
    w13, w2 = block.experts.w13, block.experts.w2
    out = moe_kernels.fused_moe(x, w13, w2, w, ids, path=path)
    assert torch.allclose(out, fused_moe_reference(x, w13, w2, w_ref, ids_ref), atol=1e-5)
