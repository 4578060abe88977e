"""One step's integer inputs packed into one flat buffer, so the host fills one buffer
and makes one host-to-device copy per step.

Owns: `PackedLayout`, where each field lies in the buffer.

Layout: the int64 fields, then the int32 fields, each contiguous, in the order of
`I64_FIELDS` and `I32_FIELDS`; the page table ([rows, width], row-major) comes last. So
every field but the page table lies at an offset that depends only on the field sizes
before it: a decode CUDA graph captured for batch size `bs` reads its inputs at the same
offsets whatever the page-table width of the step (see `nanoserve.engine.cuda_graph`).
The cascade and run fields come after all the others but the page table, so a layout with
them has every other field where a layout without them has it: a step laid out for cascade
can still replay the plain graph. Offsets are multiples of 16 bytes (FIELD_ALIGN), so byte
views can be reinterpreted and every field is as aligned as a fresh tensor.
"""

from __future__ import annotations

import numpy as np
import torch

# Every field starts at a multiple of 16 bytes. Triton specializes a kernel on whether each
# pointer argument is 16-byte aligned; with fields packed back to back, a field's alignment
# would depend on the sizes before it, so a kernel could compile a new variant in the middle
# of serving whenever a batch size flipped it.
FIELD_ALIGN = 16
# input_ids, positions, slot_mapping: [T]; req_slots: [B] each request's slot; pool_index:
# [T] the slot whose token pool entry replaces a token id < 0; logit_rows: [R].
I64_FIELDS = ("input_ids", "positions", "slot_mapping", "req_slots", "pool_index", "logit_rows")
# seq_lens, prefix_lens: [B]; cu_query_lens: [B + 1]; the cascade plan (decode steps only,
# nanoserve.attention.cascade): prefix_len, num_parts, members [B], items [W * fields];
# run_rows [B]: a verify step's runs (nanoserve.kernels.attention.RunInputs); page_table:
# [B * width].
I32_FIELDS = (
    "seq_lens", "prefix_lens", "cu_query_lens",
    "cascade_prefix_len", "cascade_num_parts", "cascade_members", "cascade_items", "run_rows",
    "page_table",
)  # fmt: skip


class PackedLayout:
    def __init__(self, **sizes: int):
        unknown = set(sizes) - set(I64_FIELDS) - set(I32_FIELDS)
        if unknown:
            raise ValueError(f"unknown packed fields {sorted(unknown)}")
        self.spans: dict[str, tuple[int, int]] = {}  # field -> (byte offset, number of elements)
        offset = 0
        for fields, size in ((I64_FIELDS, 8), (I32_FIELDS, 4)):
            for name in fields:
                n = sizes.get(name, 0)
                self.spans[name] = (offset, n)
                offset += -(-n * size // FIELD_ALIGN) * FIELD_ALIGN
        self.nbytes = offset

    def torch_view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        """One field of a uint8 tensor of at least `nbytes`."""
        dtype, size = (torch.int64, 8) if name in I64_FIELDS else (torch.int32, 4)
        off, n = self.spans[name]
        return buf[off : off + n * size].view(dtype)

    def numpy_views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        """Views of a uint8 array of at least `nbytes` as the typed fields."""
        out = {}
        for fields, dtype in ((I64_FIELDS, np.int64), (I32_FIELDS, np.int32)):
            size = np.dtype(dtype).itemsize
            for name in fields:
                off, n = self.spans[name]
                out[name] = buf[off : off + n * size].view(dtype)
        return out

    def torch_views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of a uint8 tensor of at least `nbytes` as the typed fields."""
        return {name: self.torch_view(buf, name) for name in self.spans}
