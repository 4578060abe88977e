"""Torch-native attention over the paged KV cache: the reference every fast kernel is
tested against, and the backend used on CPU.

Each batch is handled the same way whether it is a prefill, an extend with a cached
prefix or a decode: gather every request's K/V from its pages into a padded
[B, max_seq_len] block, pad the queries to [B, max_query_len], and run SDPA with a mask
that is causal with respect to each request's prefix and hides the padding (and, for a
sliding-window layer, the positions before each token's window). With attention sinks the
softmax is written out (SDPA has no sink), its denominator holding each head's sink logit.
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

    def prepare(self, meta: AttentionMetadata, group_metas: tuple[AttentionMetadata, ...] = ()) -> None:
        # (group_metas differ from meta in pages only: the masks below serve them too.)
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
        self._positions = (query_pos, key_pos)
        self._window_masks: dict[int, torch.Tensor] = {}  # window -> mask, made by the first layer of each
        self._shape = (num_reqs, max_q)
        self._new_keys: tuple[torch.Tensor, torch.Tensor] | None = None  # see forward

    def store_kv(self, k_cache, v_cache, k, v, slot_mapping):
        store_kv_reference(k_cache, v_cache, k, v, slot_mapping)

    def _layer_mask(self, window: int) -> torch.Tensor:
        if window <= 0:
            return self._mask
        mask = self._window_masks.get(window)
        if mask is None:
            query_pos, key_pos = self._positions
            in_window = key_pos[None, None, :] > query_pos[:, :, None] - window
            mask = self._window_masks[window] = self._mask & in_window[:, None]
        return mask

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, kv_stored=False, window=0, sinks=None):
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
        mask = self._layer_mask(window)
        if sinks is None:
            out = self.attend(padded_q.transpose(1, 2), keys, values, attn_mask=mask, scale=scale)
        else:
            out = _attend_with_sinks(padded_q.transpose(1, 2), keys, values, mask, scale, sinks)
        out = out.transpose(1, 2)[self._valid_q]  # [T, Hq, D], rows in request order
        return out


def _attend_with_sinks(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, sinks: torch.Tensor
) -> torch.Tensor:
    """Softmax attention [B, H, Q, D] whose denominator also holds sinks[h] (a logit with no
    value), computed in q's dtype as Hugging Face's eager gpt-oss attention does."""
    logits = torch.matmul(q, keys.transpose(-1, -2)) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    sink = sinks.to(logits.dtype).view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs, values)
