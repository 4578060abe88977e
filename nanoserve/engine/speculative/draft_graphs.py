"""CUDA graphs for the EAGLE-3 draft's forwards as decode rows: its decode steps (a row per
request) and its catch-ups (a row per position, each with the sequence length of its position).

Owns: `DraftDecodeGraphs`, a graph per padded batch size (the target's size ladder) of the
draft forward and its logits, over static inputs: each row's input token and hidden state,
position, sequence and prefix length, KV slot and page-table row.

Invariants (as the target's decode graphs, nanoserve.engine.cuda_graph):
- captured with max_seq_len = the engine's max_model_len and a page table as wide as it needs,
  so the attention kernel's split count is fixed at capture and each row's work follows its
  device-side length;
- padding rows have sequence length 0 (attention gives zeros) and write their K/V to slot 0,
  in the reserved page 0; their outputs are never returned;
- a step's outputs are views of the graph's static outputs, valid until the next replay;
- the inputs are device tensors (the eager preparation's, copied device to device): a replay
  never waits for the host.
"""

from __future__ import annotations

import torch

from nanoserve.attention.base import AttentionMetadata, ForwardBatch
from nanoserve.engine.cuda_graph import graph_batch_sizes


class DraftDecodeGraphs:
    def __init__(self, draft, backend, kv, max_bs: int, max_seq_len: int, page_size: int, dtype, device):
        """`draft`: the Eagle3Draft; `backend`: its own attention backend instance; `kv`: its
        one-layer KV cache."""
        self.draft, self.backend, self.kv = draft, backend, kv
        self.max_bs, self.max_seq_len = max_bs, max_seq_len
        self.sizes = graph_batch_sizes(max_bs)
        hidden = draft.config.model.hidden_size
        with torch.inference_mode():
            long = {"dtype": torch.long, "device": device}
            int32 = {"dtype": torch.int32, "device": device}
            self.ids = torch.zeros(max_bs, **long)
            self.positions = torch.zeros(max_bs, **long)
            self.slot_mapping = torch.zeros(max_bs, **long)
            self.seq_lens = torch.zeros(max_bs, **int32)
            self.prefix_lens = torch.zeros(max_bs, **int32)
            self.cu_query_lens = torch.arange(max_bs + 1, **int32)
            self.page_table = torch.zeros(max_bs, -(-max_seq_len // page_size), **int32)
            self.hidden = torch.zeros(max_bs, hidden, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.num_replays = 0

    def padded_size(self, batch: int) -> int | None:
        """The smallest captured size >= batch, or None (run eagerly)."""
        return next((size for size in self.sizes if size >= batch), None)

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_decode=True,
            seq_lens=self.seq_lens[:bs],
            prefix_lens=self.prefix_lens[:bs],
            cu_query_lens=self.cu_query_lens[: bs + 1],
            page_table=self.page_table[:bs],
            slot_mapping=self.slot_mapping[:bs],
            seq_lens_host=[self.max_seq_len] * bs,
            prefix_lens_host=[self.max_seq_len - 1] * bs,
            max_query_len=1,
            max_seq_len=self.max_seq_len,
        )

    def _forward(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        meta = self._meta(bs)
        self.backend.prepare(meta)
        batch = ForwardBatch(meta, self.backend, self.kv.k, self.kv.v)
        prenorm, normed = self.draft(self.positions[:bs], self.ids[:bs], self.hidden[:bs], batch)
        return prenorm, self.draft.logits(normed)

    @torch.inference_mode()
    def capture(self) -> None:
        attn = self.draft.midlayer.self_attn
        device = self.ids.device
        reserve = getattr(self.backend, "reserve_decode_workspace", None)
        if reserve is not None:
            reserve(self.max_bs, attn.num_heads, attn.head_dim, attn.num_kv_heads, self.max_seq_len, device)
        torch.cuda.synchronize(device)
        pool = None
        for bs in reversed(self.sizes):
            for _ in range(2):  # warm-up: Triton JIT, allocator
                self._forward(bs)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self._forward(bs)
            pool = pool or graph.pool()
            self.graphs[bs] = graph

    @torch.inference_mode()
    def step(self, inputs, ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pre-norm output [n, H], logits [n, draft vocab]) of one draft decode step over the n
        rows that `inputs` (the eager preparation of the step: one position per row) describe,
        fed `ids` [n] and `hidden` [n, H]."""
        n = ids.shape[0]
        bs = self.padded_size(n)
        meta = inputs.meta
        for static, value in (
            (self.ids, ids),
            (self.hidden, hidden),
            (self.positions, inputs.positions),
            (self.slot_mapping, meta.slot_mapping),
            (self.seq_lens, meta.seq_lens),
            (self.prefix_lens, meta.prefix_lens),
        ):
            static[:n].copy_(value[:n])
            static[n:bs].zero_()  # padding rows: length 0, slot 0
        width = meta.page_table.shape[1]
        self.page_table[:n, :width].copy_(meta.page_table)
        self.graphs[bs].replay()
        self.num_replays += 1
        prenorm, logits = self.outputs[bs]
        return prenorm[:n], logits[:n]
