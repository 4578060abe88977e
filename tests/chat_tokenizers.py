"""Tokenizer directories for chat tests: SmolLM2's vocabulary with a Qwen-style, a
Llama-3.1-style or a gpt-oss-style (harmony) chat template (tests/data/*.jinja) and the
marker tokens those families use.

SmolLM2-135M has no `<think>` or `<tool_call>` tokens, so some of its rarely used special
tokens (ids 3..10) are renamed to the markers, as single, non-special tokens (Qwen's are
plain added tokens, shown in decoded text) or special ones (Llama's headers). The vocabulary
keeps its size, so the real SmolLM2 weights can run with these tokenizers.
"""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).parent / "data"

# id -> (new text, special)
_MARKERS = {
    "qwen": {3: ("<think>", False), 4: ("</think>", False), 5: ("<tool_call>", False), 6: ("</tool_call>", False)},
    "llama31": {
        7: ("<|start_header_id|>", True),
        8: ("<|end_header_id|>", True),
        9: ("<|eot_id|>", True),
        10: ("<|python_tag|>", True),
    },
    "harmony": {
        3: ("<|start|>", True),
        4: ("<|channel|>", True),
        5: ("<|message|>", True),
        6: ("<|end|>", True),
        7: ("<|call|>", True),
        8: ("<|return|>", True),
        9: ("<|constrain|>", True),
    },
}
_TEMPLATES = {"qwen": "qwen_tools.jinja", "llama31": "llama31_tools.jinja", "harmony": "harmony_tools.jinja"}

# SmolLM2-135M's shape, only so that the directory resolves as a model (--tokenizer DIR).
_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "eos_token_id": 2,
}


def make_tokenizer_dir(root: Path, style: str) -> Path:
    """Write SmolLM2's tokenizer with the `style` ("qwen", "llama31" or "harmony") markers and template."""
    from nanoserve.models.registry import resolve_model
    from nanoserve.tokenizer import load_tokenizer

    out = root / f"tokenizer-{style}"
    out.mkdir(parents=True, exist_ok=True)
    load_tokenizer(resolve_model("smollm2-135m")).save_pretrained(str(out))
    spec = json.loads((out / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    for entry in spec["added_tokens"]:
        if entry["id"] in _MARKERS[style]:
            text, special = _MARKERS[style][entry["id"]]
            del vocab[entry["content"]]
            vocab[text] = entry["id"]
            entry["content"], entry["special"] = text, special
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    (out / "chat_template.jinja").write_text((DATA / _TEMPLATES[style]).read_text())
    (out / "config.json").write_text(json.dumps(_CONFIG))
    return out


def load_tokenizer_dir(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
