"""Runs the model on a scheduled batch.

Owns: the model, the KV cache tensors and the attention backend on one device; turning a
`ScheduledBatch` into input tensors and `AttentionMetadata`; the KV capacity plan.

The runner returns logits only for requests whose step reaches the end of their tokens
(they sample next); rows of a prefill chunk that stops short are never projected to the
vocabulary.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from nanoserve.attention import get_backend
from nanoserve.attention.base import AttentionMetadata, ForwardBatch
from nanoserve.config import EngineConfig
from nanoserve.kvcache.pool import KVCache
from nanoserve.models.decoder import DecoderLM, kv_heads_per_rank
from nanoserve.models.model_config import ModelConfig
from nanoserve.scheduler.scheduler import ScheduledBatch

log = logging.getLogger("nanoserve")

CPU_DEFAULT_KV_GIB = 1.0
CPU_MAX_DEFAULT_TOKENS = 262_144


@dataclass(frozen=True)
class KVPlan:
    num_pages: int
    page_size: int
    bytes_per_token: int

    @property
    def num_tokens(self) -> int:
        return (self.num_pages - 1) * self.page_size  # page 0 is reserved


def plan_kv_capacity(config: EngineConfig, model_cfg: ModelConfig, kv_heads: int, dtype: torch.dtype, device: torch.device) -> KVPlan:
    """How many pages the KV cache gets: an explicit size if given, else on CUDA
    `memory_fraction` of the memory free after the weights, on CPU 1 GiB."""
    per_token = KVCache.bytes_per_token(model_cfg.num_layers, kv_heads, model_cfg.head_dim, dtype)
    if config.kv_cache_tokens is not None:
        tokens = config.kv_cache_tokens
    elif config.kv_cache_gib is not None:
        tokens = int(config.kv_cache_gib * 2**30) // per_token
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        tokens = int(free * config.memory_fraction) // per_token
    else:
        tokens = min(int(CPU_DEFAULT_KV_GIB * 2**30) // per_token, CPU_MAX_DEFAULT_TOKENS)
    num_pages = tokens // config.page_size + 1
    if num_pages < 2:
        raise ValueError(f"KV cache too small: {tokens} tokens is less than one page of {config.page_size}")
    return KVPlan(num_pages, config.page_size, per_token)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: DecoderLM, plan: KVPlan, device: torch.device, dtype: torch.dtype):
        self.config = config
        self.model = model
        self.device = device
        cfg = model.config
        self.page_size = plan.page_size
        self.kv_cache = KVCache(
            cfg.num_layers, plan.num_pages, plan.page_size, kv_heads_per_rank(cfg, model.tp), cfg.head_dim, dtype, device
        )
        self.backend = get_backend(config.attention_backend, device)

    def prepare(self, batch: ScheduledBatch, sample_rows: list[int]) -> "ForwardInputs":
        """Device tensors for one forward. `sample_rows` (indices into batch.requests) are
        the requests whose last new token's logits are wanted."""
        ps = self.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        prefix_lens: list[int] = []
        cu = [0]
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start = req.num_computed
            input_ids.extend(req.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(req.pages[p // ps] * ps + p % ps for p in range(start, start + n))
            prefix_lens.append(start)
            seq_lens.append(start + n)
            cu.append(cu[-1] + n)
        max_pages = -(-max(seq_lens) // ps)
        table = [req.pages[:max_pages] + [0] * (max_pages - min(len(req.pages), max_pages)) for req in batch.requests]

        def dev(values, dtype):
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            is_decode=batch.is_decode,
            seq_lens=dev(seq_lens, torch.int32),
            prefix_lens=dev(prefix_lens, torch.int32),
            cu_query_lens=dev(cu, torch.int32),
            page_table=dev(table, torch.int32),
            slot_mapping=dev(slots, torch.int64),
            seq_lens_host=seq_lens,
            prefix_lens_host=prefix_lens,
            max_query_len=max(batch.num_new_tokens),
            max_seq_len=max(seq_lens),
        )
        logit_rows = [cu[i + 1] - 1 for i in sample_rows]
        return ForwardInputs(dev(input_ids, torch.long), dev(positions, torch.long), meta, dev(logit_rows, torch.long))

    @torch.inference_mode()
    def execute(self, inputs: "ForwardInputs") -> torch.Tensor:
        """Logits [len(inputs.logit_rows), vocab]: the forward pass of one batch. Every
        tensor-parallel rank runs this on the same inputs."""
        self.backend.prepare(inputs.meta)
        batch = ForwardBatch(inputs.meta, self.backend, self.kv_cache.k, self.kv_cache.v)
        hidden = self.model(inputs.input_ids, inputs.positions, batch)
        return self.model.compute_logits(hidden[inputs.logit_rows])

    def forward(self, batch: ScheduledBatch, sample_rows: list[int]) -> torch.Tensor:
        return self.execute(self.prepare(batch, sample_rows))


@dataclass
class ForwardInputs:
    """Everything one forward pass reads: a plain bundle of device tensors, so it can be
    handed to other ranks or copied into a CUDA graph's static buffers."""

    input_ids: torch.Tensor  # long [T]
    positions: torch.Tensor  # long [T]
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # long [R]: rows of the hidden states to project to logits
