"""FP8-weight GEMMs against bf16 (run on a GPU machine): the data for the FP8 per-shape rule.

    PYTHONUNBUFFERED=1 python benchmarks/probes/fp8_gemm.py [--models llama qwen3_8b] [--ms 1 2 4 8 16 64 256 2048]
    TRITON_INTERPRET=1 python benchmarks/probes/fp8_gemm.py --smoke      # CPU: every method against the reference

For each decoder-layer weight shape [N, K] and batch M, the time per call of y = x W^T as the
engine runs decode: inside one CUDA graph of back-to-back calls rotating over weight copies
together larger than 256 MB (every call streams its weight from HBM), median of 20 replays
(`attention.graph_ms`). Methods:
- "bf16": `layers.linear` on the bf16 weight (the bf16 rule: Triton or cuBLAS);
- "fp8": `layers.fp8_linear` on the per-channel FP8 weight (what the engine runs now: the
  same rule as bf16 with FP8 loads, else cuBLASLt FP8 with per-token activation quantization);
- "fp8 scaled_mm": the cuBLASLt path forced (activation quantization included);
- "fp8 <config>": the Triton kernels forced with each of a few configs;
- "fp8 block": `fp8_linear` on 128x128 block-scaled weights (Triton at every M).
Per method: µs per call and the weight bytes' TB/s; at the end, per M, the GEMM time of one
decoder layer (qkv + o + gate_up + down) per method. The rule should take, per shape and M,
the fastest FP8 method.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the repository, and benchmarks/ for shared helpers

import argparse

import torch

from nanoserve.kernels import fp8 as kfp8
from nanoserve.kernels import linear as klinear
from nanoserve.kernels.linear import LinearConfig
from nanoserve.models.layers import Fp8Weight, fp8_linear, linear
from nanoserve.models.quantization import quantize_per_channel

MODELS = {  # decoder-layer linears (label, N, K)
    "llama": [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
    "qwen3_8b": [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)],
}
ROTATE_BYTES = 256 << 20


def configs(M: int) -> list[LinearConfig]:
    """A few Triton configs worth trying at M rows (the bf16 rule's shapes)."""
    if M == 1:
        return [LinearConfig("fma", 1, 4, 1024, num_warps=2), LinearConfig("fma", 1, 8, 1024, num_warps=4)]
    if M <= 8:
        p = 1 << (M - 1).bit_length()
        return [
            LinearConfig("fma", p, 2, 512, num_warps=4),
            LinearConfig("dot", 16, 64, 128, num_warps=4, num_stages=4),
        ]
    bm = 16 if M <= 16 else 32 if M <= 32 else 64
    return [
        LinearConfig("dot", bm, 64, 128, num_warps=4, num_stages=4),
        LinearConfig("dot", bm, 128, 128, num_warps=4, num_stages=3),
        LinearConfig("dot", bm, 64, 128, num_warps=4, num_stages=4, split_k=2),
    ]


def block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    s = w.float().reshape(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3)) / 448
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return (w.float() / full).to(kfp8.FP8_DTYPE), s


def methods(M: int, N: int, K: int, device: str, copies: int):
    """name -> list of zero-argument calls (one per weight copy), and the bf16 reference output."""
    gen = torch.Generator(device=device).manual_seed(M * 7 + N)
    x = torch.randn(M, K, generator=gen, device=device).to(torch.bfloat16)
    ws = [(torch.randn(N, K, generator=gen, device=device) / K**0.5).to(torch.bfloat16) for _ in range(copies)]
    qs = [quantize_per_channel(w) for w in ws]
    bs = [block_quantize(w) for w in ws]
    found = {
        "bf16": [lambda w=w: linear(x, w) for w in ws],
        "fp8": [lambda q=q, s=s: fp8_linear(x, q, Fp8Weight(s, False)) for q, s in qs],
        "fp8 scaled_mm": [lambda q=q, s=s: kfp8.scaled_mm(x, q, s) for q, s in qs],
        "fp8 block": [lambda q=q, s=s: fp8_linear(x, q, Fp8Weight(s, True)) for q, s in bs],
    }
    for c in configs(M):
        if K % (c.split_k * c.block_k) == 0:
            name = f"fp8 {c.kernel} {c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages} k{c.split_k}"
            found[name] = [lambda q=q, s=s, c=c: klinear.small_m_linear(x, q, None, c, w_scale=s) for q, s in qs]
    ref = x.float() @ kfp8.dequantize_weight(*qs[0], False, torch.float32).t()
    return found, ref


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).norm() / ref.norm()).item()


def smoke() -> None:
    for M in (1, 3, 16):
        found, ref = methods(M, 256, 256, "cpu", 1)
        for name, calls in found.items():
            err = rel_err(calls[0](), ref)
            limit = 0.3 if name == "fp8 block" else 0.1  # block: other scales than the reference's
            print(f"M={M} {name}: rel err {err:.2e}")
            assert err < limit, name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048])
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        return smoke()
    from attention import graph_ms

    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for model in args.models:
        per_layer: dict[int, dict[str, float]] = {}
        for label, N, K in MODELS[model]:
            copies = max(2, -(-ROTATE_BYTES // (N * K)))
            for M in args.ms:
                found, ref = methods(M, N, K, "cuda", copies)
                cells = []
                for name, calls in found.items():
                    err = rel_err(calls[0](), ref)
                    if err > 0.1:
                        cells.append(f"{name} FAIL ({err:.2e})")
                        continue
                    us = graph_ms(calls) * 1e3
                    nbytes = N * K * (2 if name == "bf16" else 1)
                    cells.append(f"{name} {us:.1f} us {nbytes / us / 1e6:.2f} TB/s")
                    if name in ("bf16", "fp8", "fp8 block"):
                        sums = per_layer.setdefault(M, {})
                        sums[name] = sums.get(name, 0.0) + us
                best = min(
                    (c for c in cells if c.startswith("fp8") and "FAIL" not in c and "block" not in c),
                    key=lambda c: float(c.rsplit(" us", 1)[0].rsplit(" ", 1)[1]),
                )
                print(f"{model} {label} {N}x{K} M={M}: " + " | ".join(cells) + f" || fastest fp8: {best}", flush=True)
                del found
                torch.cuda.empty_cache()
        for M, sums in per_layer.items():
            line = ", ".join(f"{k} {v:.1f} us" for k, v in sums.items())
            print(f"{model} one decoder layer's GEMMs at M={M}: {line}", flush=True)


if __name__ == "__main__":
    main()
