"""The fixed-size state of linear-attention layers (Qwen3.5's Gated DeltaNet), one row per
request slot.

Owns: `LinearStatePool` (per linear layer a conv state [rows, conv_dim, W-1] in the model's
dtype and a recurrent state [rows, Hv, Dk, Dv] in fp32) and `LinearStates`, what one forward
tells those layers: which row each of its requests uses.

Invariants:
- row r belongs to the request holding scheduler slot r (slots are < max_num_seqs); the last
  row is scratch, where a decode graph's padding rows write;
- a request's row holds the state after its first `num_computed` tokens. A forward whose
  request starts at position 0 (a new prompt, a preempted request recomputed) ignores what
  the row held and starts from zeros; any other forward continues from the row. So a row is
  never cleared when its slot changes hands;
- a fork (parallel sampling) copies the parent's row to each child's (`copy_row`);
- nothing here knows about pages: the prefix cache, which would skip tokens whose state was
  never computed, is off for models with linear layers (they recompute every prompt).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateShape:
    """What the pool needs of a model: its linear layers and their state sizes."""

    layers: tuple[int, ...]  # the model's linear-attention layers
    conv_dim: int
    conv_kernel: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int


class LinearStatePool:
    def __init__(self, shape: StateShape, max_num_seqs: int, dtype: torch.dtype, device: torch.device):
        self.rows = max_num_seqs + 1
        self.scratch_row = max_num_seqs
        self.index = {layer: j for j, layer in enumerate(shape.layers)}  # model layer -> state entry
        conv = (self.rows, shape.conv_dim, shape.conv_kernel - 1)
        rec = (self.rows, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim)
        self.conv = [torch.zeros(conv, dtype=dtype, device=device) for _ in shape.layers]
        self.recurrent = [torch.zeros(rec, dtype=torch.float32, device=device) for _ in shape.layers]

    @staticmethod
    def bytes_per_request(shape: StateShape | None, dtype: torch.dtype) -> int:
        """One request's row over every linear layer (0 without linear layers): what a decode
        step reads and writes back for it."""
        if shape is None:
            return 0
        conv = shape.conv_dim * (shape.conv_kernel - 1) * torch.tensor([], dtype=dtype).element_size()
        rec = shape.num_v_heads * shape.head_k_dim * shape.head_v_dim * 4
        return len(shape.layers) * (conv + rec)

    @staticmethod
    def bytes_needed(shape: StateShape | None, max_num_seqs: int, dtype: torch.dtype) -> int:
        """Device bytes of the pool (0 without linear layers)."""
        return (max_num_seqs + 1) * LinearStatePool.bytes_per_request(shape, dtype)

    def copy_row(self, src: int, dst: int) -> None:
        for state in (*self.conv, *self.recurrent):
            state[dst].copy_(state[src])


@dataclass
class LinearStates:
    """One forward's view of the pool: `rows` [B] (device) is each request's state row
    (the scratch row for a decode graph's padding rows, whose sequence length is 0);
    `rows_host` the same on the host for eager extend batches (None in a decode step)."""

    pool: LinearStatePool
    rows: torch.Tensor
    rows_host: list[int] | None
