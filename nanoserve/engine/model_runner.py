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
from nanoserve.engine.cuda_graph import DecodeGraphs, default_max_bs
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
        self.backend = get_backend(config.attention_backend, device, max_num_reqs=config.max_num_seqs)
        # Last sampled token of each request slot, kept on the device: a decode step whose
        # input token is still being sampled (overlap scheduling) reads it from here.
        self.token_pool = torch.zeros(config.max_num_seqs, dtype=torch.long, device=device)
        self.graphs: DecodeGraphs | None = None

    def setup_cuda_graphs(self, max_model_len: int) -> None:
        """Capture decode graphs (CUDA only, Triton attention only; off with enforce_eager
        or cuda_graph_max_bs=0)."""
        cfg = self.config
        if self.device.type != "cuda" or cfg.enforce_eager or cfg.cuda_graph_max_bs == 0:
            return
        if self.model.tp.size > 1:
            # Rank 0 alone would capture the collectives while the workers wait: a hang.
            log.info("decode CUDA graphs off: not captured on every tensor-parallel rank yet")
            return
        if self.backend.name != "triton":
            log.info("decode CUDA graphs off: the %s attention backend is eager-only", self.backend.name)
            return
        max_bs = cfg.cuda_graph_max_bs
        max_bs = default_max_bs(self.device, cfg.max_num_seqs) if max_bs is None else min(max_bs, cfg.max_num_seqs)
        self.graphs = DecodeGraphs(self, max_bs, max_model_len)
        self.graphs.capture()

    def prepare(self, batch: ScheduledBatch, sample_rows: list[int]) -> "ForwardInputs":
        """Device tensors for one forward. `sample_rows` (indices into batch.requests) are
        the requests whose last new token's logits are wanted. A token id < 0 is a token
        still being sampled on the device: it is read from `token_pool` at the request's
        slot (only a request's last token can be one). A decode batch that a captured
        graph covers is padded to the graph's size with dummy rows (slot 0 in the reserved
        page 0, sequence length 0)."""
        ps = self.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        prefix_lens: list[int] = []
        cu = [0]
        pending = False
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start = req.num_computed
            ids = req.token_ids[start : start + n]
            if ids[-1] < 0:
                pending = True
            input_ids.extend(ids)
            pages = req.pages
            if n == 1:
                positions.append(start)
                slots.append(pages[start // ps] * ps + start % ps)
            else:
                positions.extend(range(start, start + n))
                slots.extend(pages[p // ps] * ps + p % ps for p in range(start, start + n))
            prefix_lens.append(start)
            seq_lens.append(start + n)
            cu.append(cu[-1] + n)
        num_reqs = len(seq_lens)
        max_pages = -(-max(seq_lens) // ps)
        table: list[int] = []  # flat [rows, max_pages]: one torch.tensor call on a flat list is fast
        for req in batch.requests:
            row = req.pages[:max_pages]
            table += row
            if len(row) < max_pages:
                table += [0] * (max_pages - len(row))
        pool_index = None
        if pending:
            pool_index = [req.slot if (n == t) else 0 for req, n in zip(batch.requests, batch.num_new_tokens) for t in range(1, n + 1)]
        graph_bs = None
        if self.graphs is not None and batch.is_decode:
            graph_bs = self.graphs.padded_size(num_reqs)
        if graph_bs is not None and graph_bs > num_reqs:
            pad = graph_bs - num_reqs
            input_ids += [0] * pad
            positions += [0] * pad
            slots += [0] * pad
            seq_lens_dev = seq_lens + [0] * pad
            prefix_lens_dev = prefix_lens + [0] * pad
            cu_dev = cu + list(range(cu[-1] + 1, cu[-1] + pad + 1))
            table += [0] * (max_pages * pad)
            if pool_index is not None:
                pool_index += [0] * pad
        else:
            seq_lens_dev, prefix_lens_dev, cu_dev = seq_lens, prefix_lens, cu

        def dev(values, dtype):
            t = torch.tensor(values, dtype=dtype)
            return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

        ids_dev = dev(input_ids, torch.long)
        if pool_index is not None:
            ids_dev = torch.where(ids_dev < 0, self.token_pool[dev(pool_index, torch.long)], ids_dev)
        meta = AttentionMetadata(
            is_decode=batch.is_decode,
            seq_lens=dev(seq_lens_dev, torch.int32),
            prefix_lens=dev(prefix_lens_dev, torch.int32),
            cu_query_lens=dev(cu_dev, torch.int32),
            page_table=dev(table, torch.int32).view(-1, max_pages),
            slot_mapping=dev(slots, torch.int64),
            seq_lens_host=seq_lens,
            prefix_lens_host=prefix_lens,
            max_query_len=max(batch.num_new_tokens),
            max_seq_len=max(seq_lens),
        )
        if graph_bs is not None:
            return ForwardInputs(ids_dev, dev(positions, torch.long), meta, None, graph_bs, num_reqs)
        all_rows = len(sample_rows) == num_reqs and cu[-1] == num_reqs
        logit_rows = None if all_rows else dev([cu[i + 1] - 1 for i in sample_rows], torch.long)
        return ForwardInputs(ids_dev, dev(positions, torch.long), meta, logit_rows, None, num_reqs)

    @torch.inference_mode()
    def execute(self, inputs: "ForwardInputs") -> torch.Tensor:
        """Logits [number of sampled rows, vocab]: the forward pass of one batch, replayed
        from a CUDA graph when `prepare` chose one. Every tensor-parallel rank runs this
        on the same inputs."""
        if inputs.graph_bs is not None:
            return self.graphs.replay(inputs)
        return self.forward_logits(inputs)

    def forward_logits(self, inputs: "ForwardInputs") -> torch.Tensor:
        """The eager forward (also what a decode graph captures)."""
        self.backend.prepare(inputs.meta)
        batch = ForwardBatch(inputs.meta, self.backend, self.kv_cache.k, self.kv_cache.v)
        hidden = self.model(inputs.input_ids, inputs.positions, batch)
        if inputs.logit_rows is not None:
            hidden = hidden[inputs.logit_rows]
        return self.model.compute_logits(hidden)

    def forward(self, batch: ScheduledBatch, sample_rows: list[int]) -> torch.Tensor:
        return self.execute(self.prepare(batch, sample_rows))


@dataclass
class ForwardInputs:
    """Everything one forward pass reads: a plain bundle of device tensors, so it can be
    handed to other ranks or copied into a CUDA graph's static buffers."""

    input_ids: torch.Tensor  # long [T]
    positions: torch.Tensor  # long [T]
    meta: AttentionMetadata
    logit_rows: torch.Tensor | None  # long [R]: rows of the hidden states to project; None: all
    graph_bs: int | None = None  # padded size of the decode graph to replay, None: eager
    num_reqs: int = 0  # real requests (rows past it are padding)
