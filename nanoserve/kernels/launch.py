"""How the kernels launch: Triton's interpreter flag and programmatic dependent launch (PDL,
Hopper and later).

Owns `INTERPRET` (Triton's own TRITON_INTERPRET, read once here: under the interpreter the
kernels pick small blocks and skip what it cannot run), `launch_options(device, pdl)` (a
kernel's USE_PDL constexpr and Triton's launch_pdl option; `pdl` is the caller's switch,
`KernelSwitches.pdl`), the grid-dependency calls `gdc_wait` / `gdc_launch_dependents` (no-ops
on a Triton without them) and `pdl_start`, the prologue that calls both.

A kernel launched with PDL may start while the previous kernel in the stream (or CUDA graph)
is still running. Invariants every such kernel keeps:
- every program calls `gdc_wait()` before it reads anything a previous kernel may have
  written, and before it writes anything; until then it may only read weights (never written
  during a forward) and the step's inputs (positions, lengths, page tables, cache slots),
  which are in place before the forward's first kernel starts: that kernel, the embedding
  lookup (a torch op, or `norm.embed_rms_norm`), is never a PDL launch, so it starts only
  after the copy (or, on a tensor-parallel worker, the broadcast) that wrote them has
  completed, and every later kernel starts after it. `gdc_wait` returns once the previous
  kernel has completed and its writes are visible, so results never depend on the overlap;
- `gdc_launch_dependents()` lets the next kernel launch early; that kernel still waits for
  this one to complete in its own `gdc_wait`, so calling it first thing is always safe.
Measured on an H200 (batch-1 decode step, benchmarks/probes/profile_decode.py --pdl off on): the
decoder's kernels under PDL took qwen3-0.6b 1.003 -> 0.958 ms, llama-3.1-8b 4.363 -> 4.256 ms
(benchmarks/results/2026-11-21.md).
"""

from __future__ import annotations

import os
from dataclasses import fields

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # an older Triton: the kernels never take the PDL branches
    HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    """Every PDL kernel's prologue (see the invariants): let the next kernel launch now, then
    wait until the previous one has completed. A no-op without PDL."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()


_supported: dict[int, bool] = {}


def enabled(device: torch.device, pdl: bool = True) -> bool:
    """Whether a launch on `device` uses PDL: asked for, and the GPU and Triton have it."""
    if not pdl or INTERPRET or not HAS_GDC or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _supported:
        from triton.backends.nvidia.compiler import CUDAOptions

        has_option = any(f.name == "launch_pdl" for f in fields(CUDAOptions))
        _supported[index] = has_option and torch.cuda.get_device_capability(index)[0] >= 9
    return _supported[index]


def launch_options(device: torch.device, pdl: bool = True) -> dict:
    """The kernels' USE_PDL constexpr and, when on, Triton's launch_pdl option."""
    return {"USE_PDL": True, "launch_pdl": True} if enabled(device, pdl) else {"USE_PDL": False}
