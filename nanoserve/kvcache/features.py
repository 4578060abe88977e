"""The paged feature cache: hidden states of chosen target layers, stored like the KV cache.

Owns: `FeatureCache`, a [num_slots, len(layers), hidden] tensor on the KV cache's pages, and the
slots the current forward writes. EAGLE-3 drafts from the residual stream entering a few of
the target's layers (nanoserve.engine.speculative.eagle3); the target writes it for every position
it computes, and the draft reads it lazily, steps later, so it is kept per position.

Invariants:
- the feature of position p of a request lives at cache slot page_table[p // P] * P + p % P,
  the slot of the same position's K/V: pages are allocated, shared through the prefix cache
  and freed with the KV cache's, with no bookkeeping of their own (a page copy copies both);
- `slots[:T]` are the slots of the T rows of the forward running now, and the rows past T are
  0 (the reserved page: padding rows of a graph write there): `set_slots` is called before
  every target forward, inside the decode graphs' captured forward too, so a replay reads
  the step's own slots; the buffer never moves, so captured graphs stay valid;
- a layer may be listed more than once (a small target's defaults can coincide); each of its
  columns is written.
"""

from __future__ import annotations

import torch


class FeatureCache:
    def __init__(
        self,
        layers: tuple[int, ...],
        hidden_size: int,
        num_slots: int,
        max_rows: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.layers = tuple(layers)
        self.hidden_size = hidden_size
        self.data = torch.zeros(num_slots, len(layers), hidden_size, dtype=dtype, device=device)
        self.columns: dict[int, list[int]] = {}
        for j, layer in enumerate(self.layers):
            self.columns.setdefault(layer, []).append(j)
        self.slots = torch.zeros(max_rows, dtype=torch.long, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, hidden_size: int, dtype: torch.dtype) -> int:
        return num_layers * hidden_size * torch.tensor([], dtype=dtype).element_size()

    @property
    def width(self) -> int:
        return len(self.layers) * self.hidden_size

    def set_slots(self, slot_mapping: torch.Tensor) -> None:
        """The slots of the next forward's rows (the batch's slot_mapping)."""
        n = slot_mapping.shape[0]
        if n > self.slots.shape[0]:
            raise RuntimeError(f"a forward of {n} rows exceeds the feature cache's {self.slots.shape[0]}")
        self.slots[:n].copy_(slot_mapping)
        self.slots[n:].zero_()

    def write(self, layer: int, stream: torch.Tensor) -> None:
        """Store the residual stream entering `layer` ([T, hidden], one row per token) if the
        cache keeps that layer."""
        columns = self.columns.get(layer)
        if columns is None:
            return
        slots = self.slots[: stream.shape[0]]
        for j in columns:
            self.data[:, j].index_copy_(0, slots, stream.to(self.data.dtype))

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The features at `slots` [T], concatenated over the layers in order: [T, len(layers) * hidden]."""
        return self.data.index_select(0, slots).view(slots.shape[0], self.width)

    def copy_page(self, src: int, dst: int, page_size: int) -> None:
        self.data[dst * page_size : (dst + 1) * page_size].copy_(self.data[src * page_size : (src + 1) * page_size])
