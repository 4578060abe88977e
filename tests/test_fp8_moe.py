"""FP8 mixture-of-experts models: checkpoints in the Qwen3-30B-A3B-FP8 layout (every expert's
gate/up/down in e4m3 with 128x128 block scales), per-channel and compressed-tensors ones, Mixtral's
w1/w3/w2 experts, and `quantization="fp8"` on an unquantized MoE checkpoint.

CPU (fp32): the FP8 checkpoint's greedy tokens equal those of the same weights dequantized and
saved plain, and transformers' on that plain copy; built with `keep_fp8` (the CUDA layout) the
experts are dequantized at load by default, and with NANOSERVE_FP8_EXPERTS the stacked experts
hold e4m3 weights and scales cut with their TP=2 slices, and the block's forward (its slow twin
dequantizes) equals the plain block's. Refused by name: static activation scales
on experts, FP8 for gpt-oss. GPU (`pytest -m gpu tests/test_fp8_moe.py`): the fused kernels on
e4m3 experts against their twin and transformers, fp32, eager and in CUDA graphs.
"""

from __future__ import annotations

import json

import pytest
import torch

from nanoserve import LLM
from nanoserve.distributed import TPGroup
from nanoserve.models.loader import build_model
from nanoserve.models.moe import SparseMoE
from nanoserve.models.quantization import UnsupportedQuantization
from nanoserve.models.registry import resolve_model
from nanoserve.switches import KernelSwitches
from tests.test_fp8_loading import GREEDY, HF_FP8, NEW_TOKENS, PROMPTS, greedy, write_fp8
from tests.test_moe_models import make_moe_model, moe_config
from tests.tiny import hf_greedy, make_tiny_model

FP8 = torch.float8_e4m3fn
EXPERTS_FP8 = KernelSwitches(fp8_experts=True)  # NANOSERVE_FP8_EXPERTS=1
# Every linear and expert in whole 128-row blocks on each of two TP ranks.
WIDE = {"moe_intermediate_size": 256, "intermediate_size": 256, "head_dim": 128}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_moe")
    return {
        "qwen3_moe": make_moe_model(root / "qwen3_moe", "qwen3_moe-norm", overrides=WIDE),
        "mixtral": make_moe_model(root / "mixtral", "mixtral"),
        "root": root,
    }


def _fp8_pair(models, arch: str, layout: str):
    root = models["root"] / f"{arch}-{layout}"
    if not root.exists():
        write_fp8(models[arch], root / "fp8", root / "plain", layout)
    return root / "fp8", root / "plain"


@pytest.mark.parametrize(
    ("arch", "layout"),
    [("qwen3_moe", "fp8-block"), ("qwen3_moe", "fp8-channel"), ("qwen3_moe", "ct-channel"), ("mixtral", "fp8-channel")],
)
def test_fp8_moe_checkpoint_equals_dequantized_plain(models, arch, layout):
    fp8, plain = _fp8_pair(models, arch, layout)
    tokens = greedy(fp8)
    assert tokens == greedy(plain) == hf_greedy(plain, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("layout", ["fp8-block", "fp8-channel"])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_fp8_experts_hold_scales_cut_with_their_slices(models, layout, tp_size):
    """keep_fp8: e4m3 experts, each rank's weights times their scales equal to its slice of the
    dequantized experts; the block's forward equals the plain block's on the same input."""
    fp8, plain = _fp8_pair(models, "qwen3_moe", layout)
    cpu = torch.device("cpu")
    full = build_model(resolve_model(str(plain)), "auto", torch.float32, cpu, 0, 64)
    full_blocks = {n: m for n, m in full.named_modules() if isinstance(m, SparseMoE)}
    for rank in range(tp_size):
        tp = TPGroup(rank=rank, size=tp_size)
        model = build_model(
            resolve_model(str(fp8)), "auto", torch.float32, cpu, 0, 64, tp=tp, keep_fp8=True, switches=EXPERTS_FP8
        )
        blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, SparseMoE)]
        assert len(blocks) == len(full_blocks) == 2
        for name, block in blocks:
            experts, ref = block.experts, full_blocks[name].experts
            assert experts.w13.dtype == experts.w2.dtype == FP8
            s = experts.shard
            inter = s * tp_size  # gate rows [0, inter), up rows [inter, 2 * inter) of the full experts
            gate, up = ref.w13[:, rank * s : (rank + 1) * s], ref.w13[:, inter + rank * s : inter + (rank + 1) * s]
            rows = torch.cat([gate, up], 1)
            got13, got2 = experts.scales.dequantized(experts.w13, experts.w2, torch.float32)
            torch.testing.assert_close(got13, rows, rtol=0, atol=0)
            torch.testing.assert_close(got2, ref.w2[:, :, rank * s : (rank + 1) * s], rtol=0, atol=0)
            if tp_size == 1:
                x = torch.randn(5, experts.hidden_size)
                torch.testing.assert_close(block(x), full_blocks[name](x))


def test_experts_dequantized_at_load_by_default(models):
    """keep_fp8 without NANOSERVE_FP8_EXPERTS (CUDA's default today): the linears hold FP8, the
    experts their dequantized values in the compute dtype."""
    fp8, plain = _fp8_pair(models, "qwen3_moe", "fp8-block")
    cpu = torch.device("cpu")
    full = dict(build_model(resolve_model(str(plain)), "auto", torch.float32, cpu, 0, 64).named_parameters())
    model = build_model(resolve_model(str(fp8)), "auto", torch.float32, cpu, 0, 64, keep_fp8=True)
    params = dict(model.named_parameters())
    assert params["layers.0.self_attn.qkv_proj.weight"].dtype == FP8
    for name in ("layers.0.mlp.experts.w13", "layers.2.mlp.experts.w2"):
        assert params[name].dtype == torch.float32 and torch.equal(params[name], full[name])


def test_online_fp8_on_moe_equals_per_channel_checkpoint(models):
    """quantization="fp8" quantizes the experts per channel as the attention linears."""
    _, plain = _fp8_pair(models, "qwen3_moe", "fp8-channel")
    assert greedy(models["qwen3_moe"], quantization="fp8") == greedy(plain)


def test_static_activation_scales_on_experts_are_refused(models, tmp_path):
    config = json.loads((models["qwen3_moe"] / "config.json").read_text())
    qconfig = {**HF_FP8, "activation_scheme": "static"}
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": qconfig}))
    (tmp_path / "model.safetensors").write_bytes(b"not weights")  # refused before any read
    with pytest.raises(UnsupportedQuantization, match="static activation scales on mixture-of-experts"):
        LLM(str(tmp_path), device="cpu")


def test_fp8_refused_for_gpt_oss(tmp_path):
    model = make_tiny_model(tmp_path / "gpt-oss", "gpt-oss")
    with pytest.raises(UnsupportedQuantization, match="gpt-oss"):
        LLM(str(model), device="cpu", dtype="float32", quantization="fp8")


@pytest.mark.parametrize("arch", ["qwen3_moe-norm", "mixtral"])
def test_dummy_moe_weights_quantized_at_load(tmp_path, arch):
    """Dummy weights with quantization="fp8" (the benchmarks' path) on CPU: every expert row
    is its scale (absmax / 448) times e4m3 values, which an unrounded random row is not."""
    (tmp_path / "config.json").write_text(json.dumps(moe_config(arch)))
    llm = LLM(str(tmp_path), device="cpu", load_format="dummy", dtype="float32", quantization="fp8")
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outs)
    block = next(m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE))
    for w in (block.experts.w13[0], block.experts.w2[3]):
        scale = w.abs().amax(dim=1, keepdim=True) / 448
        torch.testing.assert_close((w / scale).to(FP8).float() * scale, w, rtol=1e-5, atol=0)


# ---- GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["fp8-block", "fp8-channel"])
def test_gpu_fp8_moe_fused_kernels_equal_twin_and_transformers(models, layout, monkeypatch):
    """fp32 on CUDA with e4m3 experts (NANOSERVE_FP8_EXPERTS=1): the fused kernels (in decode
    graphs and eager) and their twin (NANOSERVE_TRITON_OPS=0: the dequantized experts) give the
    greedy tokens of transformers on the dequantized weights."""
    fp8, plain = _fp8_pair(models, "qwen3_moe", layout)
    want = hf_greedy(plain, PROMPTS, NEW_TOKENS)
    monkeypatch.setenv("NANOSERVE_FP8_EXPERTS", "1")
    for env, extra in (({}, {}), ({}, {"enforce_eager": True}), ({"NANOSERVE_TRITON_OPS": "0"}, {})):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        llm = LLM(str(fp8), device="cuda", dtype="float32", cuda_graph_max_bs=8, piecewise_cuda_graphs=False, **extra)
        block = next(m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE))
        assert block.experts.w13.dtype == FP8
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == want, (env, extra)
        del llm
