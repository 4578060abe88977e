"""The attention-backend interface and the per-batch metadata every backend reads.

Owns: `AttentionMetadata` (what a batch tells attention: where each request's new
tokens sit in the flattened query, how long each request's KV is, which pages hold
it, which cache slots the new tokens' K/V go to) and the `AttentionBackend` base
class.

Invariants of a batch's metadata (B requests, T new tokens in all):
- requests are laid out one after another in q/k/v: request i owns rows
  cu_query_lens[i]:cu_query_lens[i+1];
- seq_lens[i] = prefix_lens[i] + (cu_query_lens[i+1] - cu_query_lens[i]); the new tokens
  are the last positions of the request's sequence, so token j of request i sits at
  position prefix_lens[i] + j and attends causally to positions 0..prefix_lens[i] + j;
- the K/V of position p of request i lives in cache slot
  page_table[i, p // page_size] * page_size + p % page_size; slot_mapping[t] is that slot
  for the t-th new token, and the new K/V are written there before attention reads the
  cache: by the backend's `store_kv` inside `forward`, or, when the caller says
  `kv_stored`, already by whoever produced them through the layer's `KVSink` (the model's
  rotary kernel on CUDA, which saves a launch per layer);
- in a decode batch every request has exactly one new token (T == B);
- a mixed batch (`num_decode_rows` = k > 0, not `is_decode`) starts with k decode rows (one
  new token each, so q rows 0..k-1); a backend may run them through its decode path and the
  rest through its extend path (`split_decode_rows`), one output either way; the extend
  part's device tensors that attention kernels read (query offsets, prefix lengths, page
  table) start at 16-byte boundaries whatever k is;
- `cascade` (decode only, optional) groups requests that share a prefix of pages; it
  changes how attention is computed, never its result (see nanoserve.attention.cascade);
- `runs` (decode only, optional, never with `cascade`) marks rows that are consecutive
  positions of one request (a verify step's; nanoserve.engine.speculative.positions): same
  page-table row, lengths one apart, in order. A backend may read their K/V once per run;
  the result is each row's own attention either way.

Per layer (not per batch), `forward` takes the layer's kind: `window` > 0 for a
sliding-window layer (the token at position p attends to positions p - window + 1 .. p only,
as Hugging Face's sliding layers do; a backend need not read anything before that), and
`sinks` [Hq] for learned attention sinks (gpt-oss: one logit per head that joins the softmax's
denominator and contributes no value). Neither changes the KV layout: the cache still holds
every position (what a windowed layer no longer reads is merely never read), unless window
groups (nanoserve.kvcache.window) give such layers pages of their own: `ForwardBatch.layer_meta`
then hands each layer the metadata of its page group.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from nanoserve.kernels.attention import CascadeInputs, RunInputs
from nanoserve.kvcache.linear_state import LinearStates


@dataclass
class AttentionMetadata:
    is_decode: bool
    seq_lens: torch.Tensor  # int32 [B] on device: KV length after this step
    prefix_lens: torch.Tensor  # int32 [B] on device: KV already cached before this step
    cu_query_lens: torch.Tensor  # int32 [B+1] on device: offsets of new tokens in q
    page_table: torch.Tensor  # int32 [B, max_pages] on device: pages of each request
    slot_mapping: torch.Tensor  # int64 [T] on device: cache slot of each new token
    # Host copies, known to the scheduler without a device sync. Eager paths may use
    # them; code captured into CUDA graphs must not.
    seq_lens_host: list[int]
    prefix_lens_host: list[int]
    max_query_len: int
    max_seq_len: int
    cascade: CascadeInputs | None = None
    runs: RunInputs | None = None
    num_decode_rows: int = 0  # mixed batch: leading rows that decode one token each

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_host)

    def split_decode_rows(self) -> tuple[AttentionMetadata, AttentionMetadata]:
        """A mixed batch's metadata as a decode batch of its first `num_decode_rows` rows and
        an extend batch of the rest (their tokens start at q row k). A few small device ops:
        the extend part's query offsets, shifted by k, and aligned copies of its prefix
        lengths and page table when row k does not start at a 16-byte boundary. Triton
        compiles a kernel variant per 16-byte alignment of its pointer arguments, the first
        time each comes: with plain slices, the offline workload's mixed steps at a budget
        of 512 handed the extend kernel three alignment patterns (counted on CPU), which the
        warm-up would each have to meet; now they hand it one."""
        k = self.num_decode_rows
        decode_seq = self.seq_lens_host[:k]
        decode = AttentionMetadata(
            is_decode=True,
            seq_lens=self.seq_lens[:k],
            prefix_lens=self.prefix_lens[:k],
            cu_query_lens=self.cu_query_lens[: k + 1],
            page_table=self.page_table[:k],
            slot_mapping=self.slot_mapping[:k],
            seq_lens_host=decode_seq,
            prefix_lens_host=self.prefix_lens_host[:k],
            max_query_len=1,
            max_seq_len=max(decode_seq),
        )
        extend = AttentionMetadata(
            is_decode=False,
            seq_lens=self.seq_lens[k:],
            prefix_lens=_aligned(self.prefix_lens[k:]),
            cu_query_lens=self.cu_query_lens[k:] - k,  # a new tensor: aligned
            page_table=_aligned(self.page_table[k:]),
            slot_mapping=self.slot_mapping[k:],
            seq_lens_host=self.seq_lens_host[k:],
            prefix_lens_host=self.prefix_lens_host[k:],
            max_query_len=self.max_query_len,
            max_seq_len=max(self.seq_lens_host[k:]),
        )
        return decode, extend


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a contiguous copy of it (fresh: aligned) if it does not start at a 16-byte boundary."""
    return t if t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


class AttentionBackend(ABC):
    """Stores new K/V into the paged cache and computes attention for one layer.

    q: [T, num_q_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]; returns
    [T, num_q_heads, head_dim] in q's dtype. k_cache / v_cache: [num_pages, page_size,
    num_kv_heads, head_dim] (one pair per layer, owned by the KV cache).
    """

    name: str = "base"

    def prepare(self, meta: AttentionMetadata, group_metas: tuple[AttentionMetadata, ...] = ()) -> None:
        """Per-batch work shared by all layers (called once before the forward). `group_metas`:
        the same batch over other page groups (window groups, nanoserve.kvcache.window), which
        some layers get instead of `meta`: the same requests, positions and lengths."""

    @abstractmethod
    def store_kv(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Write the new tokens' k/v [T, num_kv_heads, head_dim] into their cache slots."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_stored: bool = False,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of q over the cache after storing k/v (unless `kv_stored`: already done);
        `window` and `sinks`: the layer's kind (module docstring)."""


@dataclass
class KVSink:
    """Where one layer's new K/V go: its caches and the batch's slots. Handed to the code that
    produces K/V so the store can ride in its kernel; `store` is the backend's own store, for
    a producer that cannot (the same bytes either way)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    backend: AttentionBackend

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.backend.store_kv(self.k_cache, self.v_cache, k, v, self.slot_mapping)


@dataclass
class ForwardBatch:
    """What the model's attention layers need for one forward: the batch's metadata, the
    backend that computes attention and the per-layer KV tensors (lists indexed by layer);
    and, where the embedding resolves the ids still being sampled (`token_pool`: the pool and
    each row's entry), what it reads them from."""

    meta: AttentionMetadata
    backend: AttentionBackend
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    token_pool: tuple[torch.Tensor, torch.Tensor] | None = None
    # Linear-attention layers' state rows (nanoserve.kvcache.linear_state); None without them.
    linear_states: LinearStates | None = None
    # Per layer, the metadata over its page group (window groups); None: `meta` for every layer.
    layer_meta: list[AttentionMetadata] | None = None

    def meta_of(self, layer_id: int) -> AttentionMetadata:
        return self.meta if self.layer_meta is None else self.layer_meta[layer_id]

    def kv_sink(self, layer_id: int) -> KVSink:
        slots = self.meta_of(layer_id).slot_mapping
        return KVSink(self.k_caches[layer_id], self.v_caches[layer_id], slots, self.backend)

    def attend(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        kv_stored: bool = False,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Layer `layer_id`'s attention; `kv_stored`: k/v went through `kv_sink(layer_id)`;
        `window`, `sinks`: the layer's kind (see `AttentionBackend.forward`)."""
        k_cache, v_cache = self.k_caches[layer_id], self.v_caches[layer_id]
        meta = self.meta_of(layer_id)
        return self.backend.forward(
            q, k, v, k_cache, v_cache, meta, scale, kv_stored=kv_stored, window=window, sinks=sinks
        )
