"""Attention backends over the paged KV cache, and `get_backend` to pick one by name.

"torch" is the reference (any device); "triton" the fast path (CUDA, or CPU under
TRITON_INTERPRET=1); "auto" is triton on CUDA when triton imports, torch otherwise.
"""

from __future__ import annotations

import torch

from nanoserve.attention.base import AttentionBackend, AttentionMetadata
from nanoserve.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_backend"]


def get_backend(name: str, device: torch.device | str = "cpu", **kwargs) -> AttentionBackend:
    """kwargs go to the triton backend's constructor (max_num_reqs, max_splits, use_fa2, switches)."""
    if name == "auto":
        name = "torch"
        if torch.device(device).type == "cuda":
            try:
                import triton  # noqa: F401

                name = "triton"
            except ImportError:
                pass
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from nanoserve.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(**kwargs)
    raise ValueError(f"unknown attention backend {name!r} (torch, triton, auto)")
