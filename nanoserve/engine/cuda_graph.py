"""Decode CUDA graphs: one graph per padded batch size, replayed with static buffers.

Owns: the static input buffers every decode graph reads (token ids, positions, sequence
and prefix lengths, query offsets, KV slots, all in one flat buffer; a fixed-width page
table), the captured graphs and their output logits, and the choice of the padded batch
size for a decode batch.

Invariants:
- graphs are captured for sizes 1, 2, 4, 8, then every 16 up to `max_bs` (and `max_bs`
  itself), largest first, all in one memory pool, after an eager warm-up of each size;
  with `cascade`, sizes >= MIN_CASCADE_BATCH get a second graph whose attention runs the
  cascade kernels (nanoserve.attention.cascade), replayed for steps that carry a plan; with
  `run_rows` > 1 (speculative decoding), sizes >= 2 get one whose attention reads each run's
  K/V once (runs of at most run_rows rows), replayed for verify steps. A graph's variant is
  one of VARIANTS;
- the captured metadata says max_seq_len = the engine's max_model_len, so the Triton
  decode split count is fixed at capture while each request's work follows its device-side
  length; the page table is [max_bs, ceil(max_model_len / page_size)] and a replay writes
  only the columns the batch uses (the kernel never reads past a row's length);
- padding rows (a dummy request) have seq_len 0 (attention gives zeros) and write their K/V
  to slot 0, which lies in the reserved page 0; their logits are never returned;
- a replay's output is a view into the graph's static logits, valid until the next replay
  (the sampler reads it on the same stream before that);
- the graph of size bs reads its inputs but the page table from `static` laid out as
  `decode_layout(bs, ...)` of its variant (`nanoserve.engine.packed_inputs`): `ModelRunner.prepare` copies a
  decode step's packed inputs there in one host-to-device copy and its page table into
  `page_table`, so such a replay copies nothing; inputs from elsewhere (another rank's
  broadcast) are copied in field by field. Sizes share the buffer, so a replay of size bs
  relies only on what the step for bs wrote.
"""

from __future__ import annotations

import functools
import logging
import time

import numpy as np
import torch
from tqdm import tqdm

from nanoserve.attention.base import AttentionMetadata, CascadeInputs, RunInputs
from nanoserve.attention.cascade import ITEM_FIELDS, MIN_CASCADE_BATCH, max_cascade_items
from nanoserve.engine.packed_inputs import PackedLayout
from nanoserve.kernels.attention import graph_run_count
from nanoserve.step import ForwardInputs

log = logging.getLogger("nanoserve")


MEMO_TABLE_ENTRIES = 1 << 16  # page tables up to this size are compared with the last one staged
# A decode graph's attention: one row per request, a cascade plan, or runs of positions.
PLAIN, CASCADE, RUNS = "plain", "cascade", "runs"
VARIANTS = (PLAIN, CASCADE, RUNS)


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs]
    sizes += list(range(16, max_bs + 1, 16))
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sorted(set(sizes))


@functools.lru_cache(maxsize=4096)  # built per step otherwise: 16 of a verify step's 170 us of prepare under cProfile
def decode_layout(bs: int, width: int = 0, variant: str = PLAIN) -> PackedLayout:
    """The packed inputs of a decode step padded to `bs` rows, page table `width` wide, with
    room for a cascade plan or the runs of `variant` (shared: a layout is never changed)."""
    plan = {
        "cascade_prefix_len": bs, "cascade_num_parts": bs, "cascade_members": bs,
        "cascade_items": max_cascade_items(bs) * len(ITEM_FIELDS),
    } if variant == CASCADE else {"run_rows": bs} if variant == RUNS else {}  # fmt: skip
    return PackedLayout(
        input_ids=bs, positions=bs, slot_mapping=bs, req_slots=bs, pool_index=bs,
        seq_lens=bs, prefix_lens=bs, cu_query_lens=bs + 1, page_table=bs * width, **plan,
    )  # fmt: skip


def variant_of(meta: AttentionMetadata) -> str:
    """The graph variant a decode step's metadata replays."""
    return CASCADE if meta.cascade is not None else RUNS if meta.runs is not None else PLAIN


def cascade_inputs(views: dict[str, torch.Tensor]) -> CascadeInputs:
    """The cascade plan's fields of a packed decode step, as the attention backend reads them."""
    return CascadeInputs(
        views["cascade_prefix_len"],
        views["cascade_num_parts"],
        views["cascade_members"],
        views["cascade_items"].view(-1, len(ITEM_FIELDS)),
    )


def default_max_bs(device: torch.device, max_num_seqs: int) -> int:
    """256 on a GPU with 32 GiB or more, less on smaller ones; never above max_num_seqs."""
    total = torch.cuda.get_device_properties(device).total_memory
    cap = 256 if total >= 32 * 2**30 else 128 if total >= 16 * 2**30 else 64
    return min(cap, max_num_seqs)


class DecodeGraphs:
    def __init__(
        self,
        runner,
        max_bs: int,
        max_seq_len: int,
        cascade: bool = False,
        reads_pool: bool = False,
        run_rows: int = 0,
    ):
        """`reads_pool`: the graphs' embedding reads the input ids still being sampled from
        the runner's token pool (one GPU; a tensor-parallel worker has no pool, rank 0
        resolves the ids before it broadcasts them). `run_rows`: the longest run of a
        verify step (0: no runs graphs)."""
        # `runner` is not kept: it owns these graphs, and a reference back would make the pair a
        # cycle that only the garbage collector frees (with the KV cache behind it).
        self.max_bs = max_bs
        self.reads_pool = reads_pool
        self.max_seq_len = max_seq_len
        self.sizes = graph_batch_sizes(max_bs)
        self.cascade = cascade
        self.run_rows = run_rows
        self.max_pages = -(-max_seq_len // runner.page_size)
        dev = runner.device
        # Room for the largest step, its packed page table included (prepare copies that
        # part on into `page_table`).
        nbytes = max(decode_layout(max_bs, self.max_pages, v).nbytes for v in VARIANTS)
        self.static = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        self.page_table = torch.zeros(max_bs, self.max_pages, dtype=torch.int32, device=dev)
        self._views: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        # keyed by (batch size, variant)
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, str], torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.memory_bytes = 0
        self._staged_host: np.ndarray | None = None  # the table last staged into page_table[:bs, :width]

    def padded_size(self, batch: int) -> int | None:
        """The smallest captured size >= batch, or None (run eagerly)."""
        if batch > self.max_bs:
            return None
        for size in self.sizes:
            if size >= batch:
                return size
        return None

    def has_variant(self, bs: int, variant: str) -> bool:
        """Whether size bs has a graph of `variant`."""
        if variant == CASCADE:
            return self.cascade and bs >= MIN_CASCADE_BATCH
        if variant == RUNS:
            return self.run_rows > 1 and bs >= 2
        return True

    def views(self, bs: int, variant: str = PLAIN) -> dict[str, torch.Tensor]:
        """The typed fields of `static` that the graph of size bs reads (page table aside)."""
        views = self._views.get((bs, variant))
        if views is None:
            views = self._views[(bs, variant)] = decode_layout(bs, 0, variant).torch_views(self.static)
        return views

    def step_bytes(self, bs: int, width: int) -> torch.Tensor:
        """The prefix of `static` that a decode step of graph bs with a `width`-column page
        table (cascade off) is packed into: what a tensor-parallel rank 0 sends of it and a
        worker receives into its own."""
        return self.static[: decode_layout(bs, width).nbytes]

    def staged_page_table(
        self, layout: PackedLayout, bs: int, width: int, host: np.ndarray | None = None
    ) -> torch.Tensor:
        """Graph bs's page table [bs, width], filled from the table a step packed into `static`
        (laid out by `layout`): the one field that does not lie where the graph reads it.
        `host`: that table on the host, if the caller has it. When it equals the last one
        staged at the same size, `page_table` already holds it and the copy is skipped: a
        decode batch's table changes only when a request enters a new page or the batch
        changes (a device-to-device copy and its gap, ~2.7 us per batch-1 step on an H200,
        2026-11-27)."""
        table = self.page_table[:bs, :width]
        last = self._staged_host
        if host is not None and last is not None and last.shape == host.shape and np.array_equal(last, host):
            return table
        table.copy_(layout.torch_view(self.static, "page_table").view(bs, width))
        # Large tables are always copied: comparing them would cost the host more than the gap.
        keep = host is not None and host.size <= MEMO_TABLE_ENTRIES
        self._staged_host = host.copy() if keep else None
        return table

    def _static_inputs(self, bs: int, variant: str) -> ForwardInputs:
        v = self.views(bs, variant)
        runs = RunInputs(v["run_rows"], self.run_rows, graph_run_count(bs, self.run_rows)) if variant == RUNS else None
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
            cascade=cascade_inputs(v) if variant == CASCADE else None,
            runs=runs,
        )
        inputs = ForwardInputs(v["input_ids"], v["positions"], meta, None, req_slots=v["req_slots"])
        inputs.pool_index = v["pool_index"] if self.reads_pool else None
        return inputs

    @torch.inference_mode()
    def capture(self, runner) -> None:
        """Capture every graph by running `runner`'s forward on the static inputs."""
        dev = runner.device
        cfg = runner.model.config
        attn = runner.model.attention_module
        reserve = getattr(runner.backend, "reserve_decode_workspace", None)
        if reserve is not None:
            cascade = self.has_variant(self.max_bs, CASCADE)
            reserve(
                self.max_bs, attn.num_heads, cfg.head_dim, attn.num_kv_heads, self.max_seq_len, dev, cascade,
                self.run_rows,
            )  # fmt: skip
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()  # capture empties the cache too: do it first, so the delta is the graphs'
        free_before, _ = torch.cuda.mem_get_info(dev)
        started = time.perf_counter()
        pool = None
        keys = [(bs, v) for bs in reversed(self.sizes) for v in VARIANTS if self.has_variant(bs, v)]
        bar = tqdm(keys, desc="capturing decode graphs", leave=False)
        for key in bar:
            bs = key[0]
            inputs = self._static_inputs(*key)
            # One token per row; an all-zero cascade plan (no items, prefix lengths 0); every
            # row a run of its own.
            inputs.meta.cu_query_lens.copy_(torch.arange(bs + 1, dtype=torch.int32))
            plan = inputs.meta.cascade
            if plan is not None:
                for field in (plan.prefix_len, plan.num_parts, plan.items):
                    field.zero_()
            if inputs.meta.runs is not None:
                inputs.meta.runs.rows.fill_(1)
            for _ in range(2):  # warm-up: Triton JIT, torch.compile, allocator
                runner.forward_logits(inputs)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = runner.forward_logits(inputs)
            if pool is None:
                pool = graph.pool()
            self.graphs[key] = graph
            self.outputs[key] = out
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
        key = (bs, variant_of(inputs.meta))
        v = self.views(*key)
        if inputs.input_ids.data_ptr() != v["input_ids"].data_ptr():  # not prepared in place
            meta = inputs.meta
            assert key[1] == PLAIN, "cascade and runs steps are prepared in place"
            assert not self.reads_pool, "one-GPU steps are prepared in place (pool_index too)"
            v["input_ids"].copy_(inputs.input_ids, non_blocking=True)
            v["positions"].copy_(inputs.positions, non_blocking=True)
            v["seq_lens"].copy_(meta.seq_lens, non_blocking=True)
            v["prefix_lens"].copy_(meta.prefix_lens, non_blocking=True)
            v["cu_query_lens"].copy_(meta.cu_query_lens, non_blocking=True)
            v["slot_mapping"].copy_(meta.slot_mapping, non_blocking=True)
            width = meta.page_table.shape[1]
            self.page_table[:bs, :width].copy_(meta.page_table, non_blocking=True)
            self._staged_host = None
        self.graphs[key].replay()
        return self.outputs[key][:n]
