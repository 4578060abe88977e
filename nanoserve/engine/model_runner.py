"""Runs the model on a scheduled batch.

Owns: the model, the KV cache tensors and the attention backend on one device; turning a
`ScheduledBatch` into input tensors and `AttentionMetadata`; the KV capacity plan.

The runner returns logits only for requests whose step reaches the end of their tokens
(they sample next); rows of a prefill chunk that stops short are never projected to the
vocabulary.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from nanoserve.attention import get_backend
from nanoserve.attention.base import AttentionMetadata, ForwardBatch
from nanoserve.attention.cascade import MIN_CASCADE_BATCH, max_cascade_items, plan_cascade
from nanoserve.config import EngineConfig
from nanoserve.engine.cuda_graph import (
    CASCADE,
    PLAIN,
    RUNS,
    DecodeGraphs,
    cascade_inputs,
    decode_layout,
    default_max_bs,
)
from nanoserve.engine.packed_inputs import PackedLayout
from nanoserve.engine.piecewise_graph import PiecewiseGraphs, piecewise_sizes
from nanoserve.kernels.attention import RunInputs, graph_run_count
from nanoserve.kernels.norm import resolve_pending
from nanoserve.kvcache.linear_state import LinearStatePool, LinearStates
from nanoserve.kvcache.pool import KVCache, KVLayout
from nanoserve.kvcache.window import WindowMap
from nanoserve.models.decoder import DecoderLM, kv_heads_per_rank
from nanoserve.models.model_config import ModelConfig
from nanoserve.scheduler.scheduler import ScheduledBatch
from nanoserve.step import ForwardInputs, KVPlan, PendingTokens

log = logging.getLogger("nanoserve")

CPU_DEFAULT_KV_GIB = 1.0
CPU_MAX_DEFAULT_TOKENS = 262_144


def plan_kv_capacity(
    config: EngineConfig,
    model_cfg: ModelConfig,
    kv_heads: int,
    dtype: torch.dtype,
    device: torch.device,
    extra_bytes_per_token: int = 0,
    layout: KVLayout | None = None,
) -> KVPlan:
    """How many pages the KV cache gets: an explicit size if given, else on CUDA
    `memory_fraction` of the memory free after the weights, on CPU 1 GiB. A token's bytes
    include `extra_bytes_per_token` (a speculative drafter's KV on the same pages); only
    layers with K/V count, or with window groups (`layout`) the layers of one page. Linear-attention
    layers' states (one per request slot) come out of the same budget first."""
    layers = model_cfg.num_kv_layers if layout is None else layout.num_tensors
    per_token = KVCache.bytes_per_token(layers, kv_heads, model_cfg.head_dim, dtype)
    per_token += extra_bytes_per_token
    states = LinearStatePool.bytes_needed(model_cfg.linear_state_shape, config.max_num_seqs, dtype)
    if config.kv_cache_tokens is not None:
        tokens = config.kv_cache_tokens
    elif config.kv_cache_gib is not None:
        tokens = max(int(config.kv_cache_gib * 2**30) - states, 0) // per_token
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        tokens = max(int(free * config.memory_fraction) - states, 0) // per_token
    else:
        budget = max(int(CPU_DEFAULT_KV_GIB * 2**30) - states, 0)
        tokens = min(budget // per_token, CPU_MAX_DEFAULT_TOKENS)
    num_pages = tokens // config.page_size + 1
    if num_pages < 2:
        raise ValueError(f"KV cache too small: {tokens} tokens is less than one page of {config.page_size}")
    return KVPlan(num_pages, config.page_size, per_token)


def kv_capacity(cfg: ModelConfig, plan: KVPlan, layout: KVLayout | None, chunk: int) -> tuple[int, int]:
    """(the longest request the pages hold alone, the tokens the same memory would hold if
    every layer kept K/V for every token), the latter logged where it differs: layers without
    K/V (linear attention) and window groups leave room to the others."""
    layers_per_page = cfg.num_kv_layers if layout is None else layout.num_tensors
    full_layout = plan.num_tokens * layers_per_page // cfg.num_layers
    if layout is not None:
        window_pages = layout.num_window_groups * layout.window_pages_per_request(plan.page_size, chunk)
        log.info(
            "sliding-window layers give back pages out of their window (%d window groups of %d layers): "
            "%d tokens of full-attention KV, a request holding at most %d pages more; %d tokens with every "
            "layer keeping every token",
            layout.num_window_groups, layers_per_page, plan.num_tokens, window_pages, full_layout,
        )  # fmt: skip
        return layout.max_tokens(plan.num_pages, plan.page_size, chunk), full_layout
    if cfg.num_kv_layers < cfg.num_layers:
        log.info(
            "%d of %d layers keep K/V: %d tokens of KV cache, %d with every layer full attention",
            cfg.num_kv_layers, cfg.num_layers, plan.num_tokens, full_layout,
        )  # fmt: skip
    return plan.num_tokens, full_layout


def plan_window_groups(config: EngineConfig, cfg: ModelConfig, tp_size: int) -> KVLayout | None:
    """Window groups (nanoserve.kvcache.window) for a model with sliding-window and full layers,
    or None. Not with speculative decoding (its lookahead pages) or tensor parallelism (the
    map's updates are not part of the step message): there sliding layers keep every page, as
    do models where window groups do not apply (`KVLayout.window_groups`) and every model with
    the switch `NANOSERVE_WINDOW_PAGES=0`."""
    layout = KVLayout.window_groups(layer_windows(cfg))
    if layout is None or not config.switches.window_pages:
        return None
    blockers = [
        name
        for name, on in (
            ("speculative decoding", config.speculative_algorithm is not None),
            ("tensor parallelism", tp_size > 1),
        )
        if on
    ]
    if blockers:
        log.info("sliding-window layers keep every page: pages out of the window are not freed with %s", blockers[0])
        return None
    return layout


def layer_windows(cfg: ModelConfig) -> list[int]:
    """Per layer: its sliding window, 0 for full attention, -1 without K/V (linear attention)."""
    return [-1 if cfg.is_linear_layer(i) else cfg.window_of(i) for i in range(cfg.num_layers)]


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model: DecoderLM,
        plan: KVPlan,
        device: torch.device,
        kv_dtype: torch.dtype,
        layout: KVLayout | None = None,
    ):
        """`layout`: which K/V tensor and page group each layer uses (default: a tensor per
        layer with K/V, every layer on the request's pages)."""
        self.config = config
        self.model = model
        self.device = device
        cfg = model.config
        self.page_size = plan.page_size
        layout = layout or KVLayout.per_layer(layer_windows(cfg))
        self.kv_cache = KVCache(
            cfg.num_layers,
            plan.num_pages,
            plan.page_size,
            kv_heads_per_rank(cfg, model.tp),
            cfg.head_dim,
            kv_dtype,
            device,
            layout,
        )
        # Window groups (nanoserve.kvcache.window): windowed layers' pages, through the map.
        self.window_map = None
        if layout.num_window_groups:
            self.window_map = WindowMap(layout.num_window_groups, plan.num_pages, plan.page_size, device)
        # Linear-attention layers' per-request states (Qwen3.5), rows indexed by request slot.
        shape = cfg.linear_state_shape
        self.linear_states = LinearStatePool(shape, config.max_num_seqs, kv_dtype, device) if shape else None
        self.backend = get_backend(
            config.attention_backend, device, max_num_reqs=config.max_num_seqs, switches=config.switches
        )
        # Last sampled token of each request slot, kept on the device: a decode step whose
        # input token is still being sampled (overlap scheduling) reads it from here.
        self.token_pool = torch.zeros(config.max_num_seqs, dtype=torch.long, device=device)
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None  # prefill/extend graphs
        # Cascade decode (nanoserve.attention.cascade): only where requests can share pages
        # (the prefix cache), with the Triton backend, at TP = 1 (its inputs are not part of
        # the tensor-parallel step message).
        attn = model.attention_module
        self.cascade_members = 0  # most requests per cascade work item; 0: cascade off
        self.cascade_target_items = 0
        if (
            config.cascade_attention
            and config.enable_prefix_caching
            and self.backend.name == "triton"
            and model.tp.size == 1
        ):
            self.cascade_members = self.backend.cascade_max_members(attn.num_heads // attn.num_kv_heads)
            self.cascade_target_items = self.backend.cascade_target_items(attn.num_kv_heads, device)
        self.num_cascade_steps = 0
        # Decode over runs (nanoserve.kernels.attention.RunInputs): a verify step's positions
        # of one request read its K/V once. Cascade's conditions but the prefix cache, and a
        # run (the last token and its drafts) short enough for the kernel's tile; else a
        # verify step's rows attend one by one.
        spec = config.speculative_config()
        self.max_run_rows = 0  # 0: verify steps attend row by row
        self.num_runs_steps = 0
        if spec is not None and self.backend.name == "triton" and model.tp.size == 1:
            longest = spec.k + 1
            if longest <= self.backend.max_run_rows(attn.num_heads // attn.num_kv_heads):
                self.max_run_rows = longest

    def setup_cuda_graphs(self, max_model_len: int) -> None:
        """Capture decode graphs (off with cuda_graph_max_bs=0) and piecewise prefill graphs
        (off with piecewise_cuda_graphs=False); CUDA only, Triton attention only, both off
        with enforce_eager."""
        cfg = self.config
        if self.device.type != "cuda" or cfg.enforce_eager:
            return
        if self.backend.name != "triton":
            log.info("CUDA graphs off: the %s attention backend is eager-only", self.backend.name)
            return
        # Tensor parallelism: every rank builds the same engine and runs this at the same
        # point, so all capture the same graphs in the same order. The warm-ups run the
        # sharded layers' NCCL collectives eagerly, which needs every rank there; workers then
        # replay the graph that rank 0's step names (tp_runner). The decisions below read only
        # the shared config, except the default decode size and the piecewise sizes that beat
        # eager (timed on each rank), which all ranks agree on.
        tp = self.model.tp
        sizes = piecewise_sizes(cfg.chunked_prefill_size) if cfg.piecewise_cuda_graphs else []
        if sizes:
            self.piecewise = PiecewiseGraphs(
                self.model, sizes, self.device, self.model.embed_tokens.weight.dtype, agree=tp.agree_all
            )
            self.piecewise.capture()
        if cfg.cuda_graph_max_bs == 0:
            return
        max_bs = cfg.cuda_graph_max_bs
        max_bs = default_max_bs(self.device, cfg.max_num_seqs) if max_bs is None else min(max_bs, cfg.max_num_seqs)
        max_bs = tp.agree_min(max_bs, self.device)
        self.graphs = DecodeGraphs(
            self,
            max_bs,
            max_model_len,
            cascade=self.cascade_members > 0,
            reads_pool=tp.size == 1,
            run_rows=self.max_run_rows,
        )
        self.graphs.capture(self)

    @torch.inference_mode()  # writes into graph buffers whose views were made in inference mode
    def prepare(self, batch: ScheduledBatch, sample_rows: list[int]) -> ForwardInputs:
        """Device tensors for one forward. `sample_rows` (indices into batch.requests) are
        the requests whose last new token's logits are wanted. A token id < 0 is a token
        still being sampled on the device: it is read from `token_pool` at the request's
        slot when the forward is launched (`execute`), so a step can be prepared before the
        sampling it reads is queued (only a request's last token can be one). A decode batch that a captured
        graph covers is padded to the graph's size with dummy rows (slot 0 in the reserved
        page 0, sequence length 0) and its inputs are copied straight into the graph's.

        Host work per step: a few passes over the requests, then numpy over the batch; page
        tables are rows of the scheduler's `PageTable`, gathered by slot; every integer
        input goes into one packed buffer and to the device in one copy."""
        if batch.is_decode and len(sample_rows) == len(batch.requests):
            return self._prepare_decode(batch)
        return self._prepare_extend(batch, sample_rows)

    def _prepare_decode(self, batch: ScheduledBatch) -> ForwardInputs:
        reqs = batch.requests
        n, ps = len(reqs), self.page_size
        prefix_host = [r.num_computed for r in reqs]
        prefix = np.array(prefix_host, dtype=np.int64)
        slots = np.array([r.slot for r in reqs], dtype=np.int64)
        max_seq = int(prefix.max()) + 1
        width = -(-max_seq // ps)
        rows = batch.page_table.rows  # indexed by slot
        graph_bs = self.graphs.padded_size(n) if self.graphs is not None else None
        bs = n if graph_bs is None else graph_bs
        runs = batch.runs if self.max_run_rows > 1 and batch.runs and max(batch.runs) > 1 else None
        if runs is not None and max(runs) > self.max_run_rows:
            raise ValueError(f"a run of {max(runs)} rows; this engine's verify steps have at most {self.max_run_rows}")
        may_cascade = runs is None and self.cascade_members > 0 and n >= MIN_CASCADE_BATCH
        layout = decode_layout(bs, width, RUNS if runs is not None else CASCADE if may_cascade else PLAIN)
        host, h = self._staging(layout)
        ids = h["input_ids"]
        ids[:n] = [r.token_ids[-1] for r in reqs]
        h["positions"][:n] = prefix
        h["slot_mapping"][:n] = rows[slots, prefix // ps].astype(np.int64) * ps + prefix % ps
        h["req_slots"][:n] = slots
        h["pool_index"][:n] = slots
        h["seq_lens"][:n] = prefix + 1
        h["prefix_lens"][:n] = prefix
        h["cu_query_lens"][:] = np.arange(bs + 1)
        table = h["page_table"].reshape(bs, width)
        table[:n] = rows[slots, :width]
        if bs > n:  # padding rows: token 0 at position 0, length 0, KV write to slot 0
            for name in _PER_ROW_FIELDS:
                h[name][n:] = 0
            table[n:] = 0
        plan = None
        if may_cascade:
            plan = plan_cascade(
                table[:n], h["seq_lens"][:n], ps, self.cascade_members, max_cascade_items(bs), self.cascade_target_items
            )
        if plan is not None:
            self.num_cascade_steps += 1
            for name, values in (("prefix_len", plan.prefix_len), ("num_parts", plan.num_parts)):
                h[f"cascade_{name}"][:n] = values
                h[f"cascade_{name}"][n:] = 0  # padding rows
            h["cascade_members"][:n] = plan.members
            h["cascade_items"][:] = plan.items.reshape(-1)
        if runs is not None:  # a run's length at its first row; padding rows: runs of their own
            self.num_runs_steps += 1
            run_rows = h["run_rows"]
            run_rows[:] = 1
            run_rows[:n] = 0
            run_rows[np.cumsum([0, *runs[:-1]])] = runs
        variant = RUNS if runs is not None else CASCADE if plan is not None else PLAIN
        pending = ids[:n] < 0
        if graph_bs is not None:
            g = self.graphs
            g.static[: layout.nbytes].copy_(host, non_blocking=True)
            d = g.views(bs, variant)
            page_table = g.staged_page_table(layout, bs, width, host=table)
        else:
            d = layout.torch_views(self._to_device(host))
            page_table = d["page_table"].view(bs, width)
        run_inputs = None
        if runs is not None:  # a graph's split count follows from its size, an eager step's from its runs
            count = len(runs) if graph_bs is None else graph_run_count(bs, self.max_run_rows)
            run_inputs = RunInputs(d["run_rows"], self.max_run_rows, count)
        inputs = self._decode_inputs(d, page_table, prefix_host, max_seq, graph_bs, n, variant, run_inputs)
        inputs.pending = self._pending_tokens(d, pending)
        return inputs

    def _decode_inputs(
        self,
        d: dict[str, torch.Tensor],
        page_table: torch.Tensor,
        prefix_host: list[int],
        max_seq: int,
        graph_bs: int | None,
        n: int,
        variant: str,
        runs: RunInputs | None = None,
    ) -> ForwardInputs:
        """A decode step's inputs from its packed fields `d` on the device (n real rows)."""
        meta = AttentionMetadata(
            is_decode=True,
            seq_lens=d["seq_lens"],
            prefix_lens=d["prefix_lens"],
            cu_query_lens=d["cu_query_lens"],
            page_table=page_table,
            slot_mapping=d["slot_mapping"],
            seq_lens_host=[p + 1 for p in prefix_host],
            prefix_lens_host=prefix_host,
            max_query_len=1,
            max_seq_len=max_seq,
            cascade=cascade_inputs(d) if variant == CASCADE else None,
            runs=runs,
        )
        return ForwardInputs(d["input_ids"], d["positions"], meta, None, graph_bs, n, d["req_slots"][:n])

    def graph_step_bytes(self, inputs: ForwardInputs) -> torch.Tensor | None:
        """The decode graphs' packed static inputs that `inputs` were prepared into (the
        prefix of `graphs.static` that `decode_layout` gives them), or None when they live
        elsewhere (an eager step, a cascade step). A tensor-parallel rank 0 broadcasts these
        bytes as they are and the workers receive them into their own static buffer."""
        g, bs = self.graphs, inputs.graph_bs
        if bs is None or self.cascade_members > 0:  # cascade off: the layout has no plan fields
            return None
        if inputs.input_ids.data_ptr() != g.views(bs)["input_ids"].data_ptr():
            return None
        return g.step_bytes(bs, inputs.meta.page_table.shape[1])

    def graph_step_in_place(self, bs: int, width: int, n: int, prefix_host: list[int], max_seq: int) -> ForwardInputs:
        """Tensor-parallel workers: the inputs of a decode step whose packed fields (rank 0's
        `graph_step_bytes`) were received straight into `graphs.static`."""
        g = self.graphs
        page_table = g.staged_page_table(decode_layout(bs, width), bs, width)
        return self._decode_inputs(g.views(bs), page_table, prefix_host, max_seq, bs, n, PLAIN)

    def _prepare_extend(self, batch: ScheduledBatch, sample_rows: list[int]) -> ForwardInputs:
        """Any batch (prefill chunks, prefix-cache extends, mixed lengths): numpy over tokens."""
        reqs, counts = batch.requests, batch.num_new_tokens
        n, ps = len(reqs), self.page_size
        prefix_host = [r.num_computed for r in reqs]
        prefix = np.array(prefix_host, dtype=np.int64)
        qlens = np.array(counts, dtype=np.int64)
        slots = np.array([r.slot for r in reqs], dtype=np.int64)
        seq = prefix + qlens
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(qlens, out=cu[1:])
        total = int(cu[-1])
        max_seq = int(seq.max())
        width = -(-max_seq // ps)
        rows = batch.page_table.rows  # indexed by slot
        all_rows = len(sample_rows) == n and total == n
        num_rows = 0 if all_rows else len(sample_rows)
        layout = PackedLayout(
            input_ids=total, positions=total, slot_mapping=total, req_slots=n, pool_index=total, logit_rows=num_rows,
            seq_lens=n, prefix_lens=n, cu_query_lens=n + 1, page_table=n * width,
        )  # fmt: skip
        host, h = self._staging(layout)
        flat: list[int] = []
        for req, start, count in zip(reqs, prefix_host, counts):
            flat += req.token_ids[start : start + count]
        ids = h["input_ids"]
        ids[:] = flat
        positions = np.arange(total) + np.repeat(prefix - cu[:-1], qlens)
        h["positions"][:] = positions
        h["slot_mapping"][:] = rows[np.repeat(slots, qlens), positions // ps].astype(np.int64) * ps + positions % ps
        h["req_slots"][:] = slots
        h["pool_index"][:] = np.repeat(slots, qlens)
        if not all_rows:
            h["logit_rows"][:] = cu[np.asarray(sample_rows, dtype=np.int64) + 1] - 1
        h["seq_lens"][:] = seq
        h["prefix_lens"][:] = prefix
        h["cu_query_lens"][:] = cu
        h["page_table"].reshape(n, width)[:] = rows[slots, :width]
        pending = ids < 0
        d = layout.torch_views(self._to_device(host))
        meta = AttentionMetadata(
            is_decode=batch.is_decode,
            seq_lens=d["seq_lens"],
            prefix_lens=d["prefix_lens"],
            cu_query_lens=d["cu_query_lens"],
            page_table=d["page_table"].view(n, width),
            slot_mapping=d["slot_mapping"],
            seq_lens_host=seq.tolist(),
            prefix_lens_host=prefix_host,
            max_query_len=max(counts),
            max_seq_len=max_seq,
            num_decode_rows=batch.num_decodes if not batch.is_decode else 0,
        )
        logit_rows = None if all_rows else d["logit_rows"]  # may be empty: no row samples
        inputs = ForwardInputs(d["input_ids"], d["positions"], meta, logit_rows, None, n, d["req_slots"])
        inputs.req_slots_host = slots.tolist()
        inputs.pending = self._pending_tokens(d, pending)
        return inputs

    def _staging(self, layout: PackedLayout) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        """A host buffer for one step's packed inputs, and its typed numpy views. On CUDA it
        is pinned (an asynchronous copy); torch's pinned-memory cache hands a block out again
        only after the copies that read it have run, so a new buffer per step is safe."""
        buf = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        return buf, layout.numpy_views(buf.numpy())

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host if self.device.type == "cpu" else host.to(self.device, non_blocking=True)

    @staticmethod
    def _pending_tokens(d: dict[str, torch.Tensor], pending: np.ndarray) -> PendingTokens | None:
        """Which input ids (`pending`: ids < 0 on the host, for the real rows) the token pool
        supplies; padding rows keep token 0."""
        if not pending.any():
            return None
        n = len(pending)
        ids, index = d["input_ids"][:n], d["pool_index"][:n]
        return PendingTokens(ids, index, bool(pending.all()))

    @torch.inference_mode()  # writes into graph buffers whose views were made in inference mode
    def read_pending_tokens(self, inputs: ForwardInputs) -> None:
        """Fill in the input ids still being sampled from the token pool, in place (queued on
        the device after whatever sampling was queued before this call)."""
        p, inputs.pending = inputs.pending, None
        if p is None:
            return
        if p.every_row:
            torch.index_select(self.token_pool, 0, p.pool_index, out=p.ids)
        else:
            resolve_pending(p.ids, self.token_pool, p.pool_index)

    @torch.inference_mode()
    def execute(self, inputs: ForwardInputs) -> torch.Tensor:
        """Logits [number of sampled rows, vocab]: the forward pass of one batch, replayed
        from a CUDA graph when `prepare` chose one. Every tensor-parallel rank runs this
        on the same inputs. Pending input ids are read from the token pool first (by the
        graph's own embedding kernel where the graphs read the pool)."""
        self._flush_window_map()  # the window pages this step's requests got, before it reads them
        if inputs.graph_bs is not None and self.graphs.reads_pool:
            inputs.pending = None
            return self.graphs.replay(inputs)
        self.read_pending_tokens(inputs)
        if inputs.graph_bs is not None:
            return self.graphs.replay(inputs)
        return self.forward_logits(inputs)

    def _flush_window_map(self) -> None:
        if self.window_map is not None:
            self.window_map.flush()

    def uses_piecewise(self, inputs: ForwardInputs) -> bool:
        """Whether this runner's piecewise graphs cover `inputs` (a prefill/extend batch of at
        most their largest size)."""
        pw = self.piecewise
        return pw is not None and not inputs.meta.is_decode and pw.padded_size(inputs.input_ids.shape[0]) is not None

    def forward_logits(self, inputs: ForwardInputs) -> torch.Tensor:
        """The eager forward (also what a decode graph captures); a prefill/extend batch that
        the piecewise graphs cover runs them, with eager attention between (`inputs.piecewise`
        decides where set: under tensor parallelism every rank must run the same kernels and
        collectives, so the workers follow rank 0)."""
        meta = inputs.meta
        group_metas = ()
        if self.window_map is not None:  # the windowed layers' pages (device gathers: graphs capture them)
            tables = self.window_map.group_tables(meta.page_table, meta.slot_mapping)
            group_metas = tuple(dataclasses.replace(meta, page_table=t, slot_mapping=s) for t, s in tables)
        self.backend.prepare(meta, group_metas)
        if self.model.feature_sink is not None:  # the slots the pieces store features at (EAGLE-3)
            self.model.feature_sink.set_slots(meta.slot_mapping)
        pool = None if inputs.pool_index is None else (self.token_pool, inputs.pool_index)
        batch = ForwardBatch(meta, self.backend, self.kv_cache.k, self.kv_cache.v, pool)
        if group_metas:
            metas = (meta, *group_metas)
            batch.layer_meta = [metas[g] for g in self.kv_cache.layout.group_of_layer]
        if self.linear_states is not None:
            batch.linear_states = self._linear_states(inputs)
        piecewise = self.uses_piecewise(inputs) if inputs.piecewise is None else inputs.piecewise
        if piecewise:
            if self.piecewise is None:
                raise RuntimeError("rank 0 runs this batch through piecewise graphs that this rank has not captured")
            hidden = self.piecewise.forward(inputs.input_ids, inputs.positions, batch)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, batch)
        if inputs.logit_rows is not None:
            hidden = hidden[inputs.logit_rows]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def logits_of_zeros(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """The logits of `rows` zero hidden states: the tail of an eager step (the lm_head over
        its sampled rows), which the warm-up runs at every row count."""
        hidden = torch.zeros(rows, self.model.config.hidden_size, dtype=dtype, device=self.device)
        return self.model.compute_logits(hidden)

    def _linear_states(self, inputs: ForwardInputs) -> LinearStates:
        """The state row of each request of `inputs`: its slot's; a decode graph's padding rows
        (sequence length 0) get the scratch row. A decode step's rows stay on the device (the
        step may be a graph); other batches also name them on the host."""
        pool, meta = self.linear_states, inputs.meta
        if meta.is_decode:
            scratch = torch.full_like(inputs.req_slots, pool.scratch_row)
            return LinearStates(pool, torch.where(meta.seq_lens > 0, inputs.req_slots, scratch), None)
        return LinearStates(pool, inputs.req_slots, inputs.req_slots_host)

    def forward(self, batch: ScheduledBatch, sample_rows: list[int]) -> torch.Tensor:
        return self.execute(self.prepare(batch, sample_rows))


# The fields of a decode step with one entry per row (cu_query_lens and the table aside).
_PER_ROW_FIELDS = ("input_ids", "positions", "slot_mapping", "req_slots", "pool_index", "seq_lens", "prefix_lens")
