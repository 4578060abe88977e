"""Torch-native attention over the paged KV cache: the reference every fast kernel is
tested against, and the backend used on CPU.

Each batch is handled the same way whether it is a prefill, an extend with a cached
prefix or a decode: gather every request's K/V from its pages into a padded
[B, max_seq_len] block, pad the queries to [B, max_query_len], and run SDPA with a mask
that is causal with respect to each request's prefix and hides the padding.
Uses host-side lengths, so it is for eager execution only. A cache narrower than q (fp8)
is read upcast; a prefill's new tokens then use their own unrounded K/V (see config.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.attention.base import AttentionBackend, AttentionMetadata
from nanoserve.kernels.attention import gather_kv, store_kv_reference


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    # The attention over the padded block; a subclass may swap in another correct one
    # (benchmarks/probes/greedy_agreement.py compares two).
    attend = staticmethod(F.scaled_dot_product_attention)

    def prepare(self, meta: AttentionMetadata) -> None:
        # Which padded query cells are real tokens, and the mask; shared by all layers.
        # Requests are contiguous in q, so q's rows fill the valid cells in order.
        device = meta.seq_lens.device
        num_reqs, max_q, max_s = meta.num_requests, meta.max_query_len, meta.max_seq_len
        query_lens = (meta.seq_lens - meta.prefix_lens).long()
        offsets = torch.arange(max_q, device=device)
        self._valid_q = offsets[None, :] < query_lens[:, None]  # [B, max_q]
        key_pos = torch.arange(max_s, device=device)
        query_pos = meta.prefix_lens.long()[:, None] + offsets[None, :]  # [B, max_q]
        causal = key_pos[None, None, :] <= query_pos[:, :, None]
        in_seq = key_pos[None, None, :] < meta.seq_lens.long()[:, None, None]
        self._mask = (causal & in_seq)[:, None]  # [B, 1, max_q, max_s]
        self._shape = (num_reqs, max_q)
        self._new_keys: tuple[torch.Tensor, torch.Tensor] | None = None  # see forward

    def store_kv(self, k_cache, v_cache, k, v, slot_mapping):
        store_kv_reference(k_cache, v_cache, k, v, slot_mapping)

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, kv_stored=False):
        if not kv_stored:
            store_kv_reference(k_cache, v_cache, k, v, meta.slot_mapping)
        num_reqs, max_q = self._shape
        num_q_heads, head_dim = q.shape[1], q.shape[2]
        group = num_q_heads // k_cache.shape[2]
        keys = gather_kv(k_cache, meta.page_table, meta.max_seq_len).to(q.dtype)
        values = gather_kv(v_cache, meta.page_table, meta.max_seq_len).to(q.dtype)
        if k_cache.dtype != q.dtype and not meta.is_decode:
            # A narrower cache (fp8): a prefill's new tokens attend to each other's K/V as
            # computed, before the cache's rounding, as the Triton and FA2 kernels do.
            # A mixed batch's decode rows read their own K/V from the cache, as a decode step does.
            first = meta.num_decode_rows
            if self._new_keys is None:  # (request, key position) of each new token, once per batch
                rows, offsets = self._valid_q.nonzero(as_tuple=True)
                rows, offsets = rows[first:], offsets[first:]  # rows in q order: decode rows first
                self._new_keys = (rows, meta.prefix_lens.long()[rows] + offsets)
            keys[self._new_keys] = k[first:]
            values[self._new_keys] = v[first:]
        keys = keys.transpose(1, 2).repeat_interleave(group, dim=1)  # [B, Hq, S, D]
        values = values.transpose(1, 2).repeat_interleave(group, dim=1)
        padded_q = q.new_zeros(num_reqs, max_q, num_q_heads, head_dim)
        padded_q[self._valid_q] = q
        out = self.attend(padded_q.transpose(1, 2), keys, values, attn_mask=self._mask, scale=scale)
        out = out.transpose(1, 2)[self._valid_q]  # [T, Hq, D], rows in request order
        return out
