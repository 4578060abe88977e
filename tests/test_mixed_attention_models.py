"""gpt-oss and Gemma 3 beyond the greedy comparisons of tests/test_models_vs_hf.py: MXFP4
expert weights (the format decoded against a hand-made example, and a whole quantized
checkpoint loaded to the same greedy tokens as transformers on its dequantized twin), the
bundled configs' shapes, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve import LLM, SamplingParams
from nanoserve.distributed import TPGroup
from nanoserve.models import mxfp4
from nanoserve.models.gpt_oss import GptOssExperts
from nanoserve.models.loader import hf_parameter_shapes
from nanoserve.models.model_config import ModelConfig
from nanoserve.models.quantization import UnsupportedQuantization
from nanoserve.models.registry import resolve_model
from nanoserve.switches import KernelSwitches
from tests.tiny import hf_greedy, make_tiny_model, random_prompts, tiny_config


def e2m1(code: int) -> float:
    """An FP4 E2M1 code's value from its bits (sign, 2 exponent bits, 1 mantissa bit; bias 1)."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    if exponent == 0:  # subnormal: 0 or 0.5
        return sign * 0.5 * mantissa
    return sign * 2.0 ** (exponent - 1) * (1 + 0.5 * mantissa)


def dequantize_by_hand(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The format element by element: byte j of a group holds elements 2j (low nibble) and 2j+1."""
    rows, groups = scales.shape
    out = torch.empty(rows, groups * 32, dtype=torch.float64)
    for r in range(rows):
        for g in range(groups):
            factor = 2.0 ** (int(scales[r, g]) - 127)
            for j in range(16):
                byte = int(blocks[r, g, j])
                out[r, g * 32 + 2 * j] = e2m1(byte & 0xF) * factor
                out[r, g * 32 + 2 * j + 1] = e2m1(byte >> 4) * factor
    return out


def test_dequantize_hand_made_group():
    # One group: byte 0 = 0x92 -> low nibble 2 (+1.0), high nibble 9 (-0.5); byte 1 = 0x7F ->
    # 15 (-6.0), 7 (+6.0); the rest zero codes (8 = -0.0 in byte 2's low nibble). Scale 129: x4.
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, :3] = torch.tensor([0x92, 0x7F, 0x08], dtype=torch.uint8)
    scales = torch.tensor([[129]], dtype=torch.uint8)
    got = mxfp4.dequantize(blocks, scales, torch.float32)
    want = torch.zeros(1, 32)
    want[0, :4] = torch.tensor([4.0, -2.0, -24.0, 24.0])
    assert torch.equal(got, want)
    assert torch.signbit(got[0, 4])  # -0.0 stays negative zero


def test_dequantize_matches_the_format_by_hand():
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 2, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(120, 135, (3, 2), dtype=torch.uint8, generator=gen)
    want = dequantize_by_hand(blocks, scales)
    assert torch.equal(mxfp4.dequantize(blocks, scales, torch.float64), want)
    assert torch.equal(mxfp4.dequantize(blocks, scales, torch.bfloat16).double(), want)  # exact in bf16


def test_dequantized_pairs_blocks_and_scales_in_any_order():
    blocks = torch.randint(0, 256, (2, 3, 1, 16), dtype=torch.uint8)
    scales = torch.full((2, 3, 1), 127, dtype=torch.uint8)
    other = torch.ones(2)
    stream = [("a.down_proj_scales", scales), ("b", other), ("a.down_proj_blocks", blocks)]
    out = dict(mxfp4.dequantized(iter(stream), torch.float32))
    assert set(out) == {"b", "a.down_proj"}
    assert out["a.down_proj"].shape == (2, 32, 3)  # [E, K, rows]: Hugging Face's unquantized layout
    assert torch.equal(out["a.down_proj"].transpose(1, 2), mxfp4.dequantize(blocks, scales, torch.float32))
    with pytest.raises(ValueError, match="without their blocks or scales"):
        list(mxfp4.dequantized(iter([("x_blocks", blocks)]), torch.float32))


def quantize_experts(state: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random MXFP4 codes and scales for every expert weight of `state` (in place: the weights
    become their dequantized values, by hand); returns the blocks/scales tensors."""
    packed = {}
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, rows = state[name].shape  # [E, K, rows] (Hugging Face's layout)
        blocks = torch.randint(0, 256, (e, rows, k // 32, 16), dtype=torch.uint8, generator=gen)
        scales = torch.randint(122, 126, (e, rows, k // 32), dtype=torch.uint8, generator=gen)
        flat = dequantize_by_hand(blocks.flatten(0, 1), scales.flatten(0, 1)).view(e, rows, k)
        state[name] = flat.transpose(1, 2).float().contiguous()
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
    return packed


def test_mxfp4_checkpoint_loads_to_transformers_tokens(tmp_path):
    """A tiny gpt-oss whose experts are MXFP4 (hidden and expert widths of 64: two 32-groups):
    nanoserve on the quantized checkpoint gives transformers' greedy tokens on the same
    weights dequantized (fp32), with prompts longer than the sliding window."""
    plain = make_tiny_model(tmp_path / "plain", "gpt-oss")
    state = load_file(str(plain / "model.safetensors"))
    packed = quantize_experts(state, torch.Generator().manual_seed(1))
    save_file(state, str(plain / "model.safetensors"), metadata={"format": "pt"})
    quantized = tmp_path / "mxfp4"
    quantized.mkdir()
    save_file(
        {**{n: t for n, t in state.items() if not n.endswith(("gate_up_proj", "down_proj"))}, **packed},
        str(quantized / "model.safetensors"),
        metadata={"format": "pt"},
    )
    cfg = json.loads((plain / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (quantized / "config.json").write_text(json.dumps(cfg))

    prompts = random_prompts(3, seed=2, min_len=20, max_len=40)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(quantized), device="cpu")
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens == hf_greedy(plain, prompts, 12)
    llm.engine.check_invariants()


def mxfp4_llm(directory, packed: bool) -> LLM:
    """The tiny gpt-oss with a config that says MXFP4, on dummy (random MXFP4) weights, fp32 on
    CPU: its experts kept packed or dequantized at load (NANOSERVE_MXFP4_EXPERTS)."""
    cfg = {**tiny_config("gpt-oss"), "quantization_config": {"quant_method": "mxfp4"}}
    (directory / "config.json").write_text(json.dumps(cfg))
    switches = KernelSwitches(mxfp4_experts=packed)
    return LLM(str(directory), device="cpu", dtype="float32", load_format="dummy", switches=switches)


def test_mxfp4_experts_packed_equal_dequantized(tmp_path, monkeypatch):
    """Dummy MXFP4 experts kept packed (NANOSERVE_MXFP4_EXPERTS=1: uint8 codes and scales, which the torch twin
    dequantizes per expert on the fly) give the greedy tokens of the same weights dequantized at
    load, and take 17/128 of their fp32 bytes (half a byte and 1/32 of a scale byte an element),
    which the benchmarks' weights floor counts (its batch-1 experts: k of E a layer)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from offline_throughput import step_weight_bytes

    prompts = random_prompts(3, seed=3, min_len=20, max_len=40)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = {}
    for packed in (True, False):
        llm = mxfp4_llm(tmp_path, packed)
        runs[packed] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.engine.check_invariants()
        model = llm.engine.runner.model
        experts = model.layers[0].mlp.experts
        weights = (experts.w13, experts.w2) + ((experts.w13_scale, experts.w2_scale) if packed else ())
        assert all(w.dtype == (torch.uint8 if packed else torch.float32) for w in weights)
        runs[packed, "bytes"] = sum(w.numel() * w.element_size() for w in weights)
        runs[packed, "floor"] = step_weight_bytes(model, 1)
    assert runs[True] == runs[False]
    assert runs[True, "bytes"] * 128 == runs[False, "bytes"] * 17
    cfg = tiny_config("gpt-oss")
    per_token = cfg["num_hidden_layers"] * cfg["num_experts_per_tok"] / cfg["num_local_experts"]
    saved = (runs[False, "bytes"] - runs[True, "bytes"]) * per_token
    assert runs[False, "floor"] - runs[True, "floor"] == pytest.approx(saved)


@pytest.mark.parametrize("tied", [False, True])
def test_lookup_table_bytes_are_an_untied_embedding(tmp_path, monkeypatch, tied):
    """benchmarks/latency.py's floor without the embedding table: the table's bytes where no LM
    head shares it (a token reads one row), none where the LM head is the same tensor."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from offline_throughput import lookup_table_bytes

    cfg = {**tiny_config("gpt-oss"), "tie_word_embeddings": tied}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = LLM(str(tmp_path), device="cpu", dtype="float32", load_format="dummy").engine.runner.model
    assert lookup_table_bytes(model) == (0 if tied else cfg["vocab_size"] * cfg["hidden_size"] * 4)


@pytest.mark.parametrize("rank", [0, 1])
def test_mxfp4_experts_load_each_ranks_slice(rank):
    """Packed experts of a tensor-parallel rank (2 ranks, expert shards of two 32-groups): their
    codes and scales dequantize to the rank's slice of the dequantized-at-load experts."""
    E, H, inter, tp = 3, 64, 128, TPGroup(rank, 2)
    gen = torch.Generator().manual_seed(rank)
    ckpt = dict(mxfp4.dummy_pair("gate_up_proj", (E, H, 2 * inter), gen, "cpu"))
    ckpt |= dict(mxfp4.dummy_pair("down_proj", (E, inter, H), gen, "cpu"))
    full = dict(mxfp4.dequantized(iter(ckpt.items()), torch.float32))
    plain, packed = GptOssExperts(E, H, inter, tp), GptOssExperts(E, H, inter, tp)
    packed.use_mxfp4()
    for name, leaf in (("gate_up_proj", "w13"), ("down_proj", "w2")):
        getattr(plain, leaf).weight_loader(getattr(plain, leaf), full[name], None)
        for suffix, param in (("_blocks", leaf), ("_scales", leaf + "_scale")):
            getattr(packed, param).weight_loader(getattr(packed, param), ckpt[name + suffix], None)
    w13, w2 = packed.scales.dequantized(packed.w13, packed.w2, torch.float32)
    assert torch.equal(w13, plain.w13.data) and torch.equal(w2, plain.w2.data)


def test_mxfp4_dummy_pair_is_varied_and_scaled():
    """Dummy MXFP4 weights: every code and both scales of the rule occur, and the dequantized
    weights' variance is near 1/K (the dummy loader's rule for every matrix)."""
    blocks, scales = (t for _, t in mxfp4.dummy_pair("w", (4, 2880, 64), torch.Generator().manual_seed(0), "cpu"))
    assert blocks.shape == (4, 64, 90, 16) and scales.shape == (4, 64, 90)
    assert len(torch.unique(blocks & 15)) == 16 and len(torch.unique(scales)) == 2
    var = mxfp4.dequantize(blocks, scales, torch.float64).var().item()
    assert 0.5 / 2880 < var < 1.5 / 2880, var


def test_refusals_by_name(tmp_path):
    cfg = tiny_config("gpt-oss")
    bad_kind = {**cfg, "num_hidden_layers": 2, "layer_types": ["sliding_attention", "chunked_attention"]}
    with pytest.raises(ValueError, match="chunked_attention"):
        ModelConfig.from_hf_dict(bad_kind)
    llama = {**tiny_config("llama"), "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(UnsupportedQuantization, match="mxfp4.*llama"):
        mxfp4.is_mxfp4_checkpoint(llama)
    gptq = {**cfg, "quantization_config": {"quant_method": "gptq"}}
    (tmp_path / "config.json").write_text(json.dumps(gptq))
    with pytest.raises(UnsupportedQuantization, match="gptq"):
        LLM(str(tmp_path), device="cpu", load_format="dummy")


@pytest.mark.parametrize(
    ("name", "params", "sliding", "window"),
    [
        # Published sizes: gpt-oss-20b 20.9B, gpt-oss-120b 116.8B parameters; Gemma 3 12B and
        # 27B 12.2B and 27.4B with their 0.4B vision encoder, which the text configs leave out.
        ("gpt-oss-20b", 20.9e9, 12, 128),
        ("gpt-oss-120b", 116.8e9, 18, 128),
        ("gemma-3-12b", 12.2e9 - 0.42e9, 40, 1024),
        ("gemma-3-27b", 27.4e9 - 0.42e9, 52, 1024),
    ],
)
def test_bundled_configs(name, params, sliding, window):
    cfg = resolve_model(name).config
    total = sum(torch.Size(s).numel() for s in hf_parameter_shapes(cfg).values())
    assert abs(total - params) / params < 0.01, total
    windows = [cfg.window_of(i) for i in range(cfg.num_layers)]
    assert sum(w > 0 for w in windows) == sliding and set(windows) == {0, window}


@pytest.mark.parametrize(
    ("arch", "window_fields", "sliding"),
    [
        ("mistral", {"sliding_window": 8}, [True, True]),  # every layer, whenever the window is set
        ("qwen2", {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 1}, [False, True]),
    ],
)
def test_older_families_slide_their_windows(tmp_path, arch, window_fields, sliding):
    """Mistral's and Qwen2's sliding windows as transformers applies them, past the window
    (before sliding windows were supported, such models were capped at the window's length)."""
    path = make_tiny_model(tmp_path / arch, arch, **window_fields)
    cfg = resolve_model(str(path)).config
    assert [cfg.window_of(i) > 0 for i in range(cfg.num_layers)] == sliding
    prompts = random_prompts(3, seed=4, min_len=20, max_len=40)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in LLM(str(path), device="cpu").generate(prompts, params, use_tqdm=False)]
    assert tokens == hf_greedy(path, prompts, 12)
