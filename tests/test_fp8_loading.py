"""FP8 checkpoints (CPU): tiny models saved by the test in every scale layout we read load and
give the same greedy tokens as the same model dequantized to fp32 and saved plain; scales are
sharded with their weights; unsupported quantization configs are refused before any weight
is read; `quantization="fp8"` quantizes an unquantized checkpoint per channel at load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve import LLM, SamplingParams
from nanoserve.distributed import TPGroup
from nanoserve.kernels.fp8 import dequantize_weight
from nanoserve.models import quantization as quant
from nanoserve.models.loader import build_model
from nanoserve.models.registry import resolve_model
from tests.test_models_vs_hf import assert_idle
from tests.tiny import hf_greedy, make_tiny_model, random_prompts, tiny_config

PROMPTS = random_prompts(4, seed=3, max_len=40)
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
FP8 = torch.float8_e4m3fn
LINEARS = quant.LINEAR_NAMES

# Layouts: (quantization_config, how each weight's scale is stored)
HF_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
LAYOUTS = {
    "fp8-tensor": (HF_FP8, "tensor"),
    "fp8-tensor-static": ({**HF_FP8, "activation_scheme": "static", "ignored_layers": ["lm_head"]}, "tensor"),
    "fp8-channel": (HF_FP8, "channel"),
    "fp8-block": ({**HF_FP8, "weight_block_size": [128, 128]}, "block"),
    "ct-tensor": (None, "tensor"),
    "ct-channel": (None, "channel"),
}


def compressed_tensors_config(strategy: str) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
            }
        },
    }


def quantize(w: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, scale as the checkpoint stores it) for one fp32 weight."""
    if layout == "tensor":
        s = w.abs().max() / 448
        return (w / s).to(FP8), s.reshape(())
    if layout == "channel":
        s = w.abs().amax(dim=1, keepdim=True) / 448
        return (w / s).to(FP8), s
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    padded = torch.zeros(nb * 128, kb * 128)
    padded[:n, :k] = w
    s = padded.reshape(nb, 128, kb, 128).abs().amax(dim=(1, 3)) / 448
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return (w / full).to(FP8), s


def dequant(q: torch.Tensor, s: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "block":
        n, k = q.shape
        return q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return q.float() * s.float().reshape(-1, 1) if s.numel() > 1 else q.float() * s.float()


def write_fp8(src: Path, dst: Path, plain: Path, name: str) -> None:
    """`dst`: src's weights in FP8 layout `name`; `plain`: the same FP8 values dequantized to fp32."""
    qconfig, layout = LAYOUTS[name]
    if qconfig is None:
        qconfig = compressed_tensors_config(layout)
    tensors = load_file(str(src / "model.safetensors"))
    fp8, dense = {}, {}
    for key, w in tensors.items():
        module, _, leaf = key.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in LINEARS:
            q, s = quantize(w, layout)
            fp8[key] = q
            fp8[f"{module}.weight_scale_inv" if layout == "block" else f"{module}.weight_scale"] = s
            if qconfig.get("activation_scheme") == "static":
                fp8[f"{module}.input_scale"] = torch.tensor(0.02)
            dense[key] = dequant(q, s, layout)
        else:
            fp8[key] = dense[key] = w
    for directory, weights, extra in ((dst, fp8, {"quantization_config": qconfig}), (plain, dense, {})):
        directory.mkdir(parents=True)
        config = json.loads((src / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, **extra}))
        save_file(weights, str(directory / "model.safetensors"))


def block_friendly(directory: Path) -> Path:
    """A tiny Qwen3 whose every linear shard (TP=2 too) is a whole number of 128-blocks."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = tiny_config("qwen3")
    spec.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return {"llama": make_tiny_model(root / "llama", "llama"), "qwen3": block_friendly(root / "qwen3"), "root": root}


def greedy(model_dir: Path, **engine_args) -> list[list[int]]:
    llm = LLM(str(model_dir), device="cpu", dtype="float32", **engine_args)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_idle(llm)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp8_checkpoint_equals_dequantized_plain(tiny, arch, layout):
    root = tiny["root"] / f"{arch}-{layout}"
    write_fp8(tiny[arch], root / "fp8", root / "plain", layout)
    tokens = greedy(root / "fp8")
    assert tokens == greedy(root / "plain")
    if layout == "fp8-channel":  # the plain twin is itself what transformers computes
        assert tokens == hf_greedy(root / "plain", PROMPTS, NEW_TOKENS)
    if layout == "fp8-block":
        # transformers (5.24, CPU) reads this layout itself, dequantizing at load. It does not
        # read the others: quant_method fp8 with `weight_scale` leaves the scales unused
        # ("UNEXPECTED") and compressed-tensors needs the compressed-tensors package.
        assert tokens == hf_greedy(root / "fp8", PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("layout", ["fp8-channel", "fp8-block", "fp8-tensor-static", "ct-tensor"])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_fp8_layers_hold_sharded_scales(tiny, layout, tp_size):
    """keep_fp8: the linears hold FP8 weights and scales; each rank's FP8 weight times its
    scales equals its slice of the dequantized weight (scales cut with their weights)."""
    root = tiny["root"] / f"shard-{layout}-{tp_size}"
    write_fp8(tiny["qwen3"], root / "fp8", root / "plain", layout)
    source = resolve_model(str(root / "fp8"))
    full = build_model(resolve_model(str(root / "plain")), "auto", torch.float32, torch.device("cpu"), 0, 64)
    full_params = dict(full.named_parameters())
    for rank in range(tp_size):
        tp = TPGroup(rank=rank, size=tp_size)
        model = build_model(source, "auto", torch.float32, torch.device("cpu"), 0, 64, tp=tp, keep_fp8=True)
        linears = [(n, m) for n, m in model.named_modules() if getattr(m, "fp8", None) is not None]
        if tp_size == 1:
            # Built on the meta device and materialized: everything but the FP8 linears equals
            # the dense model's, the rotary tables included (recomputed, not loaded).
            fp8_names = {f"{n}.{leaf}" for n, _ in linears for leaf in ("weight", "weight_scale", "weight_scale_inv")}
            for pname, p in model.named_parameters():
                if pname not in fp8_names and "input_scale" not in pname:
                    assert torch.equal(p, full_params[pname]), pname
            assert torch.equal(model.rotary.cos, full.rotary.cos) and torch.equal(model.rotary.sin, full.rotary.sin)
        assert len(linears) == 4 * 2  # qkv, o, gate_up, down in each of two layers
        for name, module in linears:
            assert module.weight.dtype == FP8
            if layout == "fp8-tensor-static":
                assert module.fp8.input_scale.item() == pytest.approx(0.02)
            got = dequantize_weight(module.weight, module.fp8.scale, module.fp8.block, torch.float32)
            ref = full_params[f"{name}.weight"]
            if module.__class__.__name__ == "RowParallelLinear":
                cols = ref.shape[1] // tp_size
                ref = ref[:, rank * cols : (rank + 1) * cols]
            else:
                ref = _rank_rows(full_params[f"{name}.weight"], module.parts, tp_size, rank)
            torch.testing.assert_close(got, ref, rtol=0, atol=0)
            # The slow twin's forward on FP8 layers equals the dense layer's on the dequantized weight.
            x = torch.randn(3, module.weight.shape[1])
            torch.testing.assert_close(module(x), x @ ref.t())


def _rank_rows(full: torch.Tensor, parts, tp_size: int, rank: int) -> torch.Tensor:
    """A column-parallel rank's rows of a merged weight: each part's rank slice, in part order."""
    sizes = [p.size * tp_size for p in parts]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return torch.cat([full[s + rank * p.size : s + (rank + 1) * p.size] for s, p in zip(starts, parts)])


REFUSED = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128},
    "gptq": {"quant_method": "gptq", "bits": 4},
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True},
    "fp8-e5m2": {"quant_method": "fp8", "fmt": "e5m2"},
    "fp8-block-64": {"quant_method": "fp8", "weight_block_size": [64, 64]},
    "ct-int": {**compressed_tensors_config("channel"), "format": "pack-quantized"},
    "ct-group": compressed_tensors_config("group"),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_unsupported_quantization_is_refused_before_loading(tiny, kind):
    qconfig = REFUSED[kind]
    root = tiny["root"] / f"refused-{kind}"
    root.mkdir()
    config = json.loads((tiny["llama"] / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "quantization_config": qconfig}))
    # Not a safetensors file: reading any weight would fail with another error.
    (root / "model.safetensors").write_bytes(b"not weights")
    with pytest.raises(quant.UnsupportedQuantization) as err:
        LLM(str(root), device="cpu")
    message = str(err.value)
    assert repr(qconfig["quant_method"]) in message and "supports" in message, message


def test_quantized_checkpoint_with_quantization_flag_is_refused(tiny):
    root = tiny["root"] / "twice"
    write_fp8(tiny["llama"], root / "fp8", root / "plain", "fp8-channel")
    with pytest.raises(quant.UnsupportedQuantization, match="already quantized"):
        LLM(str(root / "fp8"), device="cpu", quantization="fp8")
    with pytest.raises(ValueError, match="int8"):
        LLM(str(root / "plain"), device="cpu", quantization="int8")


def test_unpaired_scale_is_an_error_naming_the_tensor(tiny):
    root = tiny["root"] / "unpaired"
    write_fp8(tiny["llama"], root / "fp8", root / "plain", "fp8-channel")
    tensors = load_file(str(root / "fp8" / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, str(root / "fp8" / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj"):
        LLM(str(root / "fp8"), device="cpu")


def test_online_fp8_equals_per_channel_checkpoint(tiny):
    """quantization="fp8" on a plain checkpoint = the same weights saved per-channel FP8 by hand."""
    root = tiny["root"] / "online"
    write_fp8(tiny["llama"], root / "fp8", root / "plain", "fp8-channel")
    online = greedy(tiny["llama"], quantization="fp8")
    assert online == greedy(root / "plain")


def test_parse_accepts_compressed_tensors_static():
    cfg = compressed_tensors_config("tensor")
    cfg["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "float", "strategy": "tensor"}
    scheme = quant.parse_quantization_config({"quantization_config": cfg})
    assert scheme.static_activations and scheme.is_ignored("lm_head")
    assert not scheme.is_ignored("model.layers.0.mlp.down_proj")


@pytest.mark.parametrize("case", ["fp8-block", "online"])
def test_tp2_fp8_equals_tp1(tiny, case):
    """TP=2 (gloo) on an FP8 checkpoint and with quantization="fp8": every rank reads the
    config and quantizes or dequantizes the same way, so TP=2 gives TP=1's greedy tokens."""
    if case == "online":
        model, extra = tiny["qwen3"], {"quantization": "fp8"}
    else:
        root = tiny["root"] / "tp2-block"
        write_fp8(tiny["qwen3"], root / "fp8", root / "plain", case)
        model, extra = root / "fp8", {}
    want = greedy(model, **extra)
    tp2 = LLM(str(model), device="cpu", dtype="float32", tensor_parallel_size=2, dist_timeout_s=60, **extra)
    try:
        got = [o.outputs[0].token_ids for o in tp2.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == want
        assert_idle(tp2)
    finally:
        tp2.shutdown()
