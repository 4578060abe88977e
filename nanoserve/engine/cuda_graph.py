"""Decode CUDA graphs: one graph per padded batch size, replayed with static buffers.

Owns: the static input buffers every decode graph reads (token ids, positions, sequence
and prefix lengths, query offsets, KV slots, all in one flat buffer; a fixed-width page
table), the captured graphs and their output logits, and the choice of the padded batch
size for a decode batch.

Invariants:
- graphs are captured for sizes 1, 2, 4, 8, then every 16 up to `max_bs` (and `max_bs`
  itself), largest first, all in one memory pool, after an eager warm-up of each size;
- the captured metadata says max_seq_len = the engine's max_model_len, so the Triton
  decode split count is fixed at capture while each request's work follows its device-side
  length; the page table is [max_bs, ceil(max_model_len / page_size)] and a replay writes
  only the columns the batch uses (the kernel never reads past a row's length);
- padding rows (a dummy request) have seq_len 0 (attention gives zeros) and write their K/V
  to slot 0, which lies in the reserved page 0; their logits are never returned;
- a replay's output is a view into the graph's static logits, valid until the next replay
  (the sampler reads it on the same stream before that);
- the graph of size bs reads its inputs but the page table from `static` laid out as
  `decode_layout(bs)` (`nanoserve.engine.packed_inputs`): `ModelRunner.prepare` copies a
  decode step's packed inputs there in one host-to-device copy and its page table into
  `page_table`, so such a replay copies nothing; inputs from elsewhere (another rank's
  broadcast) are copied in field by field. Sizes share the buffer, so a replay of size bs
  relies only on what the step for bs wrote.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from nanoserve.attention.base import AttentionMetadata
from nanoserve.engine.packed_inputs import PackedLayout

if TYPE_CHECKING:
    from nanoserve.engine.model_runner import ForwardInputs, ModelRunner

log = logging.getLogger("nanoserve")


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs]
    sizes += list(range(16, max_bs + 1, 16))
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sorted(set(sizes))


def decode_layout(bs: int, width: int = 0) -> PackedLayout:
    """The packed inputs of a decode step padded to `bs` rows, page table `width` wide."""
    return PackedLayout(
        input_ids=bs, positions=bs, slot_mapping=bs, req_slots=bs, pool_index=bs,
        seq_lens=bs, prefix_lens=bs, cu_query_lens=bs + 1, page_table=bs * width,
    )  # fmt: skip


def default_max_bs(device: torch.device, max_num_seqs: int) -> int:
    """256 on a GPU with 32 GiB or more, less on smaller ones; never above max_num_seqs."""
    total = torch.cuda.get_device_properties(device).total_memory
    cap = 256 if total >= 32 * 2**30 else 128 if total >= 16 * 2**30 else 64
    return min(cap, max_num_seqs)


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_bs: int, max_seq_len: int):
        self.runner = runner
        self.max_bs = max_bs
        self.max_seq_len = max_seq_len
        self.sizes = graph_batch_sizes(max_bs)
        self.max_pages = -(-max_seq_len // runner.page_size)
        dev = runner.device
        # Room for the largest step, its packed page table included (prepare copies that
        # part on into `page_table`).
        self.static = torch.zeros(decode_layout(max_bs, self.max_pages).nbytes, dtype=torch.uint8, device=dev)
        self.page_table = torch.zeros(max_bs, self.max_pages, dtype=torch.int32, device=dev)
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.memory_bytes = 0

    def padded_size(self, batch: int) -> int | None:
        """The smallest captured size >= batch, or None (run eagerly)."""
        if batch > self.max_bs:
            return None
        for size in self.sizes:
            if size >= batch:
                return size
        return None

    def views(self, bs: int) -> dict[str, torch.Tensor]:
        """The typed fields of `static` that the graph of size bs reads (page table aside)."""
        views = self._views.get(bs)
        if views is None:
            views = self._views[bs] = decode_layout(bs).torch_views(self.static)
        return views

    def _static_inputs(self, bs: int) -> ForwardInputs:
        from nanoserve.engine.model_runner import ForwardInputs

        v = self.views(bs)
        meta = AttentionMetadata(
            is_decode=True,
            seq_lens=v["seq_lens"],
            prefix_lens=v["prefix_lens"],
            cu_query_lens=v["cu_query_lens"],
            page_table=self.page_table[:bs],
            slot_mapping=v["slot_mapping"],
            seq_lens_host=[self.max_seq_len] * bs,
            prefix_lens_host=[self.max_seq_len - 1] * bs,
            max_query_len=1,
            max_seq_len=self.max_seq_len,
        )
        return ForwardInputs(v["input_ids"], v["positions"], meta, None)

    @torch.inference_mode()
    def capture(self) -> None:
        runner = self.runner
        dev = runner.device
        cfg = runner.model.config
        attn = runner.model.layers[0].self_attn
        reserve = getattr(runner.backend, "reserve_decode_workspace", None)
        if reserve is not None:
            reserve(self.max_bs, attn.num_heads, cfg.head_dim, attn.num_kv_heads, self.max_seq_len, dev)
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()  # capture empties the cache too: do it first, so the delta is the graphs'
        free_before, _ = torch.cuda.mem_get_info(dev)
        started = time.perf_counter()
        pool = None
        bar = tqdm(list(reversed(self.sizes)), desc="capturing decode graphs", leave=False)
        for bs in bar:
            inputs = self._static_inputs(bs)
            inputs.meta.cu_query_lens.copy_(torch.arange(bs + 1, dtype=torch.int32))  # one token per row
            for _ in range(2):  # warm-up: Triton JIT, torch.compile, allocator
                runner.forward_logits(inputs)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = runner.forward_logits(inputs)
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
            self.outputs[bs] = out
            free, _ = torch.cuda.mem_get_info(dev)
            bar.set_postfix(bs=bs, free_gib=f"{free / 2**30:.1f}")
        bar.close()
        torch.cuda.synchronize(dev)
        free_after, _ = torch.cuda.mem_get_info(dev)
        self.capture_seconds = time.perf_counter() - started
        self.memory_bytes = free_before - free_after
        log.info(
            "captured %d decode CUDA graphs (batch 1..%d) in %.1f s, %.2f GiB",
            len(self.graphs),
            self.max_bs,
            self.capture_seconds,
            self.memory_bytes / 2**30,
        )

    def replay(self, inputs: ForwardInputs) -> torch.Tensor:
        bs, n = inputs.graph_bs, inputs.num_reqs
        v = self.views(bs)
        if inputs.input_ids.data_ptr() != v["input_ids"].data_ptr():  # not prepared in place
            meta = inputs.meta
            v["input_ids"].copy_(inputs.input_ids, non_blocking=True)
            v["positions"].copy_(inputs.positions, non_blocking=True)
            v["seq_lens"].copy_(meta.seq_lens, non_blocking=True)
            v["prefix_lens"].copy_(meta.prefix_lens, non_blocking=True)
            v["cu_query_lens"].copy_(meta.cu_query_lens, non_blocking=True)
            v["slot_mapping"].copy_(meta.slot_mapping, non_blocking=True)
            width = meta.page_table.shape[1]
            self.page_table[:bs, :width].copy_(meta.page_table, non_blocking=True)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
