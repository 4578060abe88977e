"""The per-token activation quantization before each cuBLASLt FP8 GEMM (`kernels.fp8.quantize_rows`)
at the offline workload's decode batches: µs per call in a CUDA graph of back-to-back calls
under PDL, as the engine launches it, per (rows, K) of llama-3.1-8b's linears (K 4096: qkv,
o_proj, gate_up; 14336: down).

    python benchmarks/probes/fp8_quantize.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch

from nanoserve.kernels import fp8 as kfp8

ROWS = (32, 128, 256)
KS = (4096, 14336)
COPIES = 8  # distinct inputs per graph


def main() -> None:
    from attention import graph_ms

    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for k in KS:
        cells = []
        for m in ROWS:
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
            q, s = kfp8.quantize_rows(xs[0])
            rq, rs = kfp8.quantize_rows_reference(xs[0])
            assert torch.equal(s, rs) and (q.float() != rq.float()).float().mean() < 1e-3
            cells.append(f"{m} rows {graph_ms([lambda x=x: kfp8.quantize_rows(x) for x in xs]) * 1e3:.2f}")
        print(f"K {k}: " + " | ".join(cells) + " (us per call)", flush=True)


if __name__ == "__main__":
    main()
