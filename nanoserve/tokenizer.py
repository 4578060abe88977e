"""Tokenizer loading through transformers, for Hugging Face directories and GGUF files.

Owns: `load_tokenizer`. Converting a GGUF file's vocabulary into a fast tokenizer takes
seconds, so the converted tokenizer is saved once under ~/.cache/nanoserve (keyed by the
file's path, size and mtime) and reloaded from there; nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from nanoserve.models.registry import ModelSource, resolve_model
from nanoserve.switches import cache_dir

log = logging.getLogger("nanoserve")


def _cache_dir(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "tokenizers" / key


def _load_from(source: ModelSource):
    from transformers import AutoTokenizer

    if source.kind == "hf":
        return AutoTokenizer.from_pretrained(str(source.path))
    cached = _cache_dir(source.path)
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception as exc:  # noqa: BLE001 -- a damaged cache is rebuilt, not fatal
            log.warning("ignoring unreadable tokenizer cache %s: %s", cached, exc)
    tok = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    try:
        tok.save_pretrained(str(cached))
    except OSError as exc:
        log.warning("could not cache the GGUF tokenizer in %s: %s", cached, exc)
    return tok


def load_tokenizer(source: ModelSource, override: str | None = None):
    """The tokenizer named by `override` (a model alias or path), else the model's own,
    else None (the model then takes token-id prompts only)."""
    if override is not None:
        other = resolve_model(override)
        if not other.has_tokenizer:
            raise ValueError(f"tokenizer={override!r} names a model without tokenizer files")
        return _load_from(other)
    return _load_from(source) if source.has_tokenizer else None
