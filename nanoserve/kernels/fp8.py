"""FP8 (float8 e4m3) products for weights stored in FP8: activation quantization per token,
cuBLASLt's FP8 GEMM with row-wise scales, and the torch references.

- `quantize_rows(x)`: one Triton program per row: the row's absolute maximum, the scale
  max/448 and x / scale rounded to e4m3 (saturating). `quantize_rows_reference` is its twin.
- `scaled_mm(x, w, w_scale, ...)`: y = (x_q W_q^T) * s_x[m] * s_w[n] through
  `torch._scaled_mm` with row-wise scales (fp32 [M, 1] and [1, N], bf16 output: what torch
  accepts on sm_89/sm_90), where the device and shapes allow it (`rowwise_scaled_mm_ok`);
  otherwise W dequantized to x's dtype and a dense matmul (correct everywhere, not fast).
- `dequantize_weight`: W_q times its per-channel [N] or 128x128 block scales: the slow twin
  of every FP8 product (the decode-sized and block-scaled products run in kernels/linear.py).

Invariants: nothing reads device data on the host and every allocation's shape comes from
the inputs' shapes (CUDA-graph capturable); scales stay fp32 and are applied once per output
(row-wise) or once per 128-block (block-wise); the accumulation is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.launch import launch_options, pdl_start

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
FP8_BLOCK = 128  # the block-wise layout's tile: 128 output rows x 128 input columns
_MIN_SCALE = 1e-12  # an all-zero row gets this scale, not a division by zero


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, block: bool, dtype: torch.dtype) -> torch.Tensor:
    """W_q [N, K] times its scales (per-channel fp32 [N], or block [ceil(N/128), ceil(K/128)]) in `dtype`."""
    n, k = weight.shape
    if block:
        full = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:n, :k]
        return (weight.float() * full).to(dtype)
    return (weight.float() * scale.reshape(n, 1)).to(dtype)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q fp8 [M, K], scale fp32 [M, 1]): each row's absolute maximum mapped to 448."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


@triton.jit
def _row_scale(amax):
    """A row's scale from its elements' absolute values (or their running maxima): max / 448,
    never below the all-zero row's floor."""
    return tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)


@triton.jit
def _to_e4m3_range(v, scale):
    """v / scale, saturated to e4m3's range (the caller casts)."""
    return tl.minimum(tl.maximum(v / scale, -448.0), 448.0)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, USE_PDL: tl.constexpr
):
    """Program m: row m's absmax over K, then the row divided by its scale. ONE_PASS (K <=
    BLOCK): the row is read once and kept in registers; else read twice in BLOCK chunks. Both
    paths take the scale and the quotient from the same helpers, so they agree bit for bit."""
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = cols < K
        v = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        scale = _row_scale(tl.abs(v))
        tl.store(s_ptr + row, scale)
        q = _to_e4m3_range(v, scale)
        tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            mask = k0 + cols < K
            v = tl.load(x_ptr + row * stride_xm + k0 + cols, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = _row_scale(amax)
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            mask = k0 + cols < K
            v = tl.load(x_ptr + row * stride_xm + k0 + cols, mask=mask, other=0.0).to(tl.float32)
            q = _to_e4m3_range(v, scale)
            tl.store(q_ptr + row * stride_qm + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


ROW_BLOCK_MAX = 16384  # longest row quantized from registers (llama-3.1-8b's down input: 14336)


def quantize_rows(x: torch.Tensor, pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton twin of `quantize_rows_reference` for x [M, K] with a dense last dim."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("quantize_rows needs x [M, K] with a dense last dim")
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    block = min(ROW_BLOCK_MAX, triton.next_power_of_2(max(k, 16)))
    if m:
        _quantize_rows_kernel[(m,)](
            x, q, s, k, x.stride(0), q.stride(0), BLOCK=block, ONE_PASS=k <= block, num_warps=max(4, min(16, block // 1024)),
            **launch_options(x.device, pdl),
        )  # fmt: skip
    return q, s


def quantize_static(x: torch.Tensor, input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantized with a checkpoint's static per-tensor scale: (x_q, the scale as [M, 1])."""
    q = (x.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, input_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()


def rowwise_scaled_mm_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `torch._scaled_mm` takes this product with row-wise scales: CUDA sm_89+,
    bf16 activations (its row-wise output is bf16), K and N multiples of 16."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_scaled_mm")):
        return False
    n, k = weight.shape
    if torch.cuda.get_device_capability(x.device) < (8, 9) or k % 16 or n % 16:
        return False
    return _rowwise_probe(x.device)


_probed: dict[torch.device, bool] = {}


def _rowwise_probe(device: torch.device) -> bool:
    """Whether this torch build runs row-wise FP8 GEMMs here (a build without the CUTLASS
    row-wise kernel raises): tried once per device outside graph capture; under capture
    before any probe, assumed yes (the engine runs eagerly before it captures)."""
    if device not in _probed:
        if torch.cuda.is_current_stream_capturing():
            return True
        a = torch.ones(16, 16, device=device).to(FP8_DTYPE)
        one = torch.ones(16, 1, device=device)
        try:
            torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one.t(), out_dtype=torch.bfloat16)
            _probed[device] = True
        except RuntimeError:
            _probed[device] = False
    return _probed[device]


def scaled_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """x [M, K] (bf16/fp16) times FP8 W [N, K] with per-channel scales w_scale fp32 [N]:
    activations quantized per token (or with the static `input_scale`), cuBLASLt FP8 GEMM
    with row-wise scales, output in x's dtype (+ bias). Falls back to the dequantized weight
    where `rowwise_scaled_mm_ok` says no."""
    if not rowwise_scaled_mm_ok(x, weight):
        return torch.nn.functional.linear(x, dequantize_weight(weight, w_scale, False, x.dtype), bias)
    if input_scale is None:
        xq, sx = quantize_rows(x, pdl=pdl)
    else:
        xq, sx = quantize_static(x, input_scale)
    # weight.t() is W^T [K, N] column-major, the layout cuBLASLt's FP8 GEMM wants for mat2.
    y = torch._scaled_mm(xq, weight.t(), scale_a=sx, scale_b=w_scale.view(1, -1), out_dtype=x.dtype)
    return y if bias is None else y + bias
