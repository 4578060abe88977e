"""The MLP's silu(gate) * up, one launch over rows x column blocks, under PDL (the
torch.compile'd reference it replaces cannot let the down projection launch early).
`silu_and_mul_reference` is the torch reference (and the CPU path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from nanoserve.kernels.launch import INTERPRET, launch_options, pdl_start


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def silu_mul_rounded(gate, up, dtype: tl.constexpr, PRECISE: tl.constexpr):
    """silu(gate) * up in `dtype`, from fp32 gate and up that hold `dtype` values, rounded as
    the reference does: silu in fp32 rounded to dtype, times up in fp32, rounded again. PRECISE
    (compiled kernels): torch's CUDA silu, x / (1 + expf(-x)) with IEEE expf and division;
    otherwise Triton's fast exp (the interpreter has no libdevice; the MoE kernels use it).
    Shared by the kernel below, the GEMV's gated epilogue (`linear._linear_fma_kernel`) and
    the MoE kernels' gate_up epilogues (`moe.py`)."""
    if PRECISE:
        act = tl.math.div_rn(gate, 1.0 + libdevice.exp(-gate))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    return (act.to(dtype).to(tl.float32) * up).to(dtype)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, I, stride_x, stride_o,
    BLOCK: tl.constexpr, EVEN: tl.constexpr, PRECISE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program (t, j): row t, output columns j*BLOCK .. (j+1)*BLOCK of silu(gate) * up."""
    pdl_start(USE_PDL)  # the down projection starts streaming its weights now
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    gate_ptrs = x_ptr + row * stride_x + cols
    if EVEN:
        gate = tl.load(gate_ptrs).to(tl.float32)
        up = tl.load(gate_ptrs + I).to(tl.float32)
    else:
        mask = cols < I
        gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_ptrs + I, mask=mask, other=0.0).to(tl.float32)
    y = silu_mul_rounded(gate, up, out_ptr.dtype.element_ty, PRECISE)
    if EVEN:
        tl.store(out_ptr + row * stride_o + cols, y)
    else:
        tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None, pdl: bool = True) -> torch.Tensor:
    """silu(gate) * up for gate_up [M, 2I] (gate columns first, then up; dense last dim),
    into `out` [M, I] (dense rows) or a new tensor in gate_up's dtype. As the reference
    (`silu_and_mul_reference`) rounds: silu in fp32 rounded to the dtype, times up in fp32,
    rounded again. On CUDA silu uses IEEE expf and division as torch's kernel does, so the two
    should agree bit for bit; the tests allow one rounding step (the interpreter's exp and
    its bf16 conversion differ)."""
    M, width = gate_up.shape
    if width % 2 or gate_up.stride(1) != 1:
        raise ValueError("silu_and_mul needs gate_up [M, 2I] with a dense last dim")
    inter = width // 2
    if out is None:
        out = torch.empty(M, inter, dtype=gate_up.dtype, device=gate_up.device)
    elif out.shape != (M, inter) or out.stride(1) != 1:
        raise ValueError(f"silu_and_mul: out must be [{M}, {inter}] with a dense last dim")
    if M and inter:
        # 1024 columns (16-byte loads on 4 warps) per program; rows on grid axis 0, which
        # has room for any prefill length.
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(M, triton.cdiv(inter, block))](
            gate_up, out, inter, gate_up.stride(0), out.stride(0),
            BLOCK=block, EVEN=inter % block == 0, PRECISE=not INTERPRET, num_warps=4,
            **launch_options(gate_up.device, pdl),
        )  # fmt: skip
    return out
