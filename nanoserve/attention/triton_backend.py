"""Triton attention backend: the fast path on CUDA (kernels in triton_kernels.py).

Owns: the choice of kernel per batch (decode, cascade decode when the metadata carries a
cascade plan, decode over runs when it carries a verify step's runs, extend with prefix, FA2
for prefix-free prefill), the decode split count, and the decode workspace. A mixed batch
runs two calls per layer on row slices into one output: its decode rows through the decode
kernel, its prompt rows through extend (or FA2).

Invariants:
- `prepare(meta)` reads host ints only (batch size, max lengths, whether any prefix exists)
  and must be called once per batch before the layers' `forward`s;
- the decode path (store + split kernel + reduce) does no host sync and allocates nothing
  whose size depends on data: its grid is (B, num_kv_heads, num_splits), num_splits comes from
  host ints in `prepare`, and the workspace grows only with that shape. For CUDA graphs, call
  `reserve_decode_workspace` for the largest captured batch before capturing, and capture
  with a meta whose max_seq_len is the largest context the graph will replay with (the split
  count then stays fixed; each request's kernel work adapts to its own device-side length);
- the output is a fresh [T, Hq, D] tensor in q's dtype (allocation sized by T, a host int).
"""

from __future__ import annotations

import torch

from nanoserve.attention.base import AttentionBackend, AttentionMetadata
from nanoserve.kernels import attention as tk
from nanoserve.kernels.attention import MAX_CASCADE_PARTS
from nanoserve.switches import KernelSwitches


class TritonAttentionBackend(AttentionBackend):
    """Args:
    max_num_reqs: largest decode batch the workspace is first sized for (it grows lazily
        on an eager call with a bigger shape).
    max_splits: cap on decode splits per (request, kv head).
    use_fa2: use torch's FlashAttention-2 varlen for prefill batches with no cached prefix
        (bf16/fp16 on CUDA); otherwise the Triton extend kernel handles every prefill.
    switches: the kernel switches it obeys (decode launch order, PDL).
    """

    name = "triton"

    def __init__(
        self,
        max_num_reqs: int = 256,
        max_splits: int = 32,
        use_fa2: bool = True,
        switches: KernelSwitches | None = None,
    ):
        self.switches = switches if switches is not None else KernelSwitches()
        self.max_num_reqs = max_num_reqs
        self.max_splits = max_splits
        self.use_fa2 = use_fa2
        self._workspace: torch.Tensor | None = None
        self._num_sms: dict[torch.device, int] = {}
        self._num_splits = 1
        self._no_prefix = False
        # A mixed batch prepared: (its metadata, that of its decode rows, that of the rest).
        # a mixed batch's (metadata, its decode part, its extend part), per page group
        self._mixed: list[tuple[AttentionMetadata, AttentionMetadata, AttentionMetadata]] | None = None

    # ------------------------------------------------------------------ per-batch state

    def num_sms(self, device: torch.device) -> int:
        if device not in self._num_sms:
            if device.type == "cuda":
                self._num_sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
            else:
                self._num_sms[device] = 8  # interpreter: few programs, several splits still used
        return self._num_sms[device]

    def decode_num_splits(self, batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
        return tk.choose_num_splits(batch, num_kv_heads, max_seq_len, self.num_sms(device), self.max_splits)

    def runs_num_splits(self, num_runs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
        """The split count of a decode over runs (`meta.runs`): per run, as per request for decode."""
        sms = self.num_sms(device)
        return tk.choose_num_splits(num_runs, num_kv_heads, max_seq_len, sms, self.max_splits, tk.RUNS_PROGRAMS_PER_SM)

    @staticmethod
    def max_run_rows(group: int) -> int:
        """The longest run the decode kernel takes for `group` query heads per kv head: its
        query tile then holds every position's heads, at most RUNS_MAX_TILE rows."""
        return RUNS_MAX_TILE // group

    def prepare(self, meta: AttentionMetadata, group_metas: tuple[AttentionMetadata, ...] = ()) -> None:
        # Host-side decisions only. The decode split count needs the kv-head count, known at
        # forward; it is computed there from host ints (B, meta.max_seq_len), no data read.
        k = meta.num_decode_rows
        if 0 < k < meta.num_requests and not meta.is_decode:
            # once per batch (and page group), not per layer
            self._mixed = [(m, *m.split_decode_rows()) for m in (meta, *group_metas)]
            self._no_prefix = not any(meta.prefix_lens_host[k:])
        else:
            self._mixed = None
            self._no_prefix = not any(meta.prefix_lens_host)

    def reserve_decode_workspace(
        self,
        max_batch: int,
        num_q_heads: int,
        head_dim: int,
        num_kv_heads: int,
        max_seq_len: int,
        device,
        cascade: bool = False,
        run_rows: int = 0,
    ) -> None:
        """Allocate the decode workspace for the largest batch/length before graph capture
        (with `cascade`, room for the cascade prefix kernel's partial results too; with
        `run_rows` > 1, for the runs graphs' splits)."""
        worst = 0
        dev = torch.device(device)
        for batch in range(1, max_batch + 1):
            splits = self.decode_num_splits(batch, num_kv_heads, max_seq_len, dev)
            cols = self.decode_num_cols(splits, cascade)
            if run_rows > 1:  # the runs graph of this size
                runs = tk.graph_run_count(batch, run_rows)
                cols = max(cols, self.runs_num_splits(runs, num_kv_heads, max_seq_len, dev))
            if cols > 1:
                worst = max(worst, tk.workspace_numel(batch, num_q_heads, head_dim, cols))
        self._get_workspace(worst, dev)

    @staticmethod
    def decode_num_cols(num_splits: int, cascade: bool) -> int:
        """Partial results per (request, head): the splits', then the cascade parts'."""
        return num_splits + (MAX_CASCADE_PARTS if cascade else 0)

    @staticmethod
    def cascade_max_members(group: int) -> int:
        """Requests one cascade work item serves, for `group` query heads per kv head."""
        return tk.cascade_max_members(group)

    def cascade_target_items(self, num_kv_heads: int, device: torch.device) -> int:
        """Cascade work items that fill the GPU: about 4 (item, kv head) programs per
        multiprocessor, as for the decode splits."""
        return max(1, 4 * self.num_sms(device) // num_kv_heads)

    def _get_workspace(self, numel: int, device: torch.device) -> torch.Tensor:
        ws = self._workspace
        if ws is None or ws.numel() < numel or ws.device != device:
            ws = torch.empty(max(numel, 1), dtype=torch.float32, device=device)
            self._workspace = ws
        return ws

    # ------------------------------------------------------------------------- forward

    def store_kv(self, k_cache, v_cache, k, v, slot_mapping):
        tk.store_kv(k_cache, v_cache, k, v, slot_mapping, pdl=self.switches.pdl)

    def forward(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta,
        scale,
        kv_stored=False,
        window: int = 0,
        sinks: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ):
        """As the base class; `out` ([T, Hq, D], q's dtype, dense last dim) is an optional
        preallocated result buffer (tests poison it to catch unwritten elements)."""
        kind = (window, sinks)
        if not kv_stored:
            tk.store_kv(k_cache, v_cache, k, v, meta.slot_mapping, pdl=self.switches.pdl)
        split = self._mixed and next((m for m in self._mixed if m[0] is meta), None)
        if split:
            _, decode, extend = split
            n = decode.num_requests
            if out is None:
                out = torch.empty_like(q, memory_format=torch.contiguous_format)
            # The decode kernel reads its K/V from the cache only: no k/v rows for it.
            self._attend(q[:n], None, None, k_cache, v_cache, decode, scale, out[:n], kind)
            self._attend(q[n:], k[n:], v[n:], k_cache, v_cache, extend, scale, out[n:], kind)
            return out
        return self._attend(q, k, v, k_cache, v_cache, meta, scale, out, kind)

    def _attend(self, q, k, v, k_cache, v_cache, meta, scale, out: torch.Tensor | None, kind) -> torch.Tensor:
        """Attention of one decode or extend batch over the cache, K/V already stored; `kind`:
        the layer's (window, sinks). A sliding-window or sink layer never takes FA2 or cascade
        (neither knows windows or sinks here): its decode reads the window only anyway."""
        window, sinks = kind
        plain = window <= 0 and sinks is None
        fa2_ok = plain and self.use_fa2 and q.is_cuda and q.dtype in _FA2_DTYPES
        if not meta.is_decode and self._no_prefix and fa2_ok:
            result = _fa2_varlen(q, k, v, meta, scale)
            return result if out is None else out.copy_(result)
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if meta.is_decode:
            batch, num_q_heads, head_dim = q.shape
            num_kv_heads = k_cache.shape[2]
            # A windowed layer splits its window, not the whole context (host ints only).
            span = meta.max_seq_len if window <= 0 else min(window, meta.max_seq_len)
            runs = meta.runs if window <= 0 else None  # a windowed layer attends row by row
            if runs is not None:
                splits = self.runs_num_splits(runs.count, num_kv_heads, span, q.device)
            else:
                splits = self.decode_num_splits(batch, num_kv_heads, span, q.device)
            cascade = meta.cascade if window <= 0 else None
            cols = self.decode_num_cols(splits, cascade is not None)
            ws = None
            if cols > 1:
                ws = self._get_workspace(tk.workspace_numel(batch, num_q_heads, head_dim, cols), q.device)
            return tk.paged_decode(
                q,
                k_cache,
                v_cache,
                meta.page_table,
                meta.seq_lens,
                scale,
                splits,
                ws,
                out,
                cascade,
                heads_first=self.switches.decode_heads_first,
                pdl=self.switches.pdl,
                window=window,
                sinks=sinks,
                runs=runs,
            )
        return tk.paged_extend(
            q,
            k,
            v,
            k_cache,
            v_cache,
            meta.cu_query_lens,
            meta.prefix_lens,
            meta.page_table,
            meta.max_query_len,
            scale,
            out,
            window=window,
            sinks=sinks,
        )


_FA2_DTYPES = (torch.float16, torch.bfloat16)
# The decode kernel's query tile over runs at most (rows = positions x query heads per kv
# head); a longer run would need a larger tile than the decode configs were measured with.
RUNS_MAX_TILE = 64


def _fa2_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Prefix-free prefill through torch's FlashAttention-2 (keys = the new tokens themselves)."""
    cu = meta.cu_query_lens
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, meta.max_query_len, meta.max_query_len, 0.0, True, False, scale=scale
    )[0]
    return out
