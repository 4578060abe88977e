"""One-row GEMVs (decode at batch 1) with and without a software-pipelined K loop: the fma
kernel (bf16 and per-channel FP8 weights) and the "fp8" kernel's late-reduced variant, each
config at loop stages 1 (the loop as the rule runs it) and 2-4 (cp.async into shared memory,
`_linear_fma_kernel`'s LOOP_STAGES), against cuBLAS (bf16) and the engine's rule.

    PYTHONUNBUFFERED=1 python benchmarks/probes/gemv_stages.py [--shapes NAME ...] [--jobs 16]
    TRITON_INTERPRET=1 python benchmarks/probes/gemv_stages.py --smoke   # CPU: the flow on tiny shapes

Timing as fp8_decode_sweep.py: one CUDA graph of back-to-back calls rotating over weight copies
together larger than 256 MB, median of 20 replays, under PDL as the engine launches. Each
config's output is first checked against x W^T in fp32 (max |error| / max |ref| < 2e-2, else
FAIL, not timed). Printed per shape and weight dtype: µs and TB/s of weight bytes per method,
best first; then per model the four decoder GEMMs' µs per layer for the rule and the best
config per shape.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "probes")]

import argparse
import functools
import json
import math
import os
import time

import torch
import torch.nn.functional as F
import triton
from compile_ahead import precompile

from nanoserve.kernels import fp8 as kfp8
from nanoserve.kernels import linear as klinear
from nanoserve.kernels.launch import INTERPRET
from nanoserve.kernels.linear import LinearConfig
from nanoserve.models.quantization import quantize_per_channel

DT = torch.bfloat16
SHAPES = [  # (label, N, K)
    ("llama_qkv", 6144, 4096),
    ("llama_o", 4096, 4096),
    ("llama_gate_up", 28672, 4096),
    ("llama_down", 4096, 14336),
    ("q30_qkv", 5120, 2048),  # qwen3-30b-a3b's attention block
    ("q30_o", 2048, 4096),
    ("llama_lm_head", 128256, 4096),
    ("qwen3_gate_up", 24576, 4096),  # qwen3-8b (its qkv and o_proj are llama's)
    ("qwen3_down", 4096, 12288),
    ("q06_qkv", 4096, 1024),  # qwen3-0.6b
    ("q06_o", 1024, 2048),
    ("q06_gate_up", 6144, 1024),
    ("q06_down", 1024, 3072),
    ("q06_lm_head", 151936, 1024),
    ("oss_qkv", 5120, 2880),  # gpt-oss-20b: K = 2880 is no power of two (every tile masks its last step)
    ("oss_o", 2880, 4096),
    ("oss_router", 32, 2880),
    ("oss_lm_head", 201088, 2880),
]
LAYERS = {
    "llama-3.1-8b": ("llama_qkv", "llama_o", "llama_gate_up", "llama_down"),
    "qwen3-8b": ("llama_qkv", "llama_o", "qwen3_gate_up", "qwen3_down"),
    "qwen3-30b-a3b": ("q30_qkv", "q30_o"),
    "qwen3-0.6b": ("q06_qkv", "q06_o", "q06_gate_up", "q06_down"),
    "gpt-oss-20b": ("oss_qkv", "oss_o", "oss_router"),
}
ROTATE_BYTES = 256 << 20
TOL = 2e-2


TILES = [  # (block_n, block_k, warps) of the one-row fma kernel; (4, 1024, 2) is the rule's
    (4, 1024, 2), (8, 512, 4), (4, 512, 2), (16, 256, 4), (8, 256, 2), (16, 128, 2),
    (32, 128, 4), (16, 512, 8), (8, 1024, 4), (32, 256, 8), (2, 2048, 8), (2, 1024, 2),
]  # fmt: skip
STAGES = (1, 2, 3, 4, 6)


def candidates(K: int, fp8: bool) -> list[LinearConfig]:
    found = [
        LinearConfig("fma", 1, bn, min(bk, triton.next_power_of_2(K)), num_warps=w, num_stages=s)
        for bn, bk, w in TILES
        for s in STAGES
    ]
    if fp8:  # the bit-operation e4m3 conversion, on the two leading tiles
        for s in (3, 4):
            found.append(LinearConfig("fp8", 1, 16, 256, num_warps=4, num_stages=s, reduce_late=True, bit_cvt=True))
            found.append(LinearConfig("fp8", 1, 4, 1024, num_warps=2, num_stages=s, reduce_late=True, bit_cvt=True))
    return list(dict.fromkeys(found))


def describe(c: LinearConfig) -> str:
    kind = "late" if c.kernel == "fp8" else c.kernel
    return f"{kind} {c.block_n}x{c.block_k} w{c.num_warps} st{c.num_stages}" + (" bits" if c.bit_cvt else "")


def weights(N: int, K: int, copies: int, device: str, fp8: bool):
    gen = torch.Generator(device=device).manual_seed(N + K)
    found = []
    for _ in range(copies):
        w = (torch.randn(N, K, generator=gen, device=device) / K**0.5).to(DT)
        found.append(quantize_per_channel(w) if fp8 else (w, None))
    return found


def compile_launches(shapes):
    for label, N, K in shapes:
        for fp8 in (False, True):
            x = torch.empty(1, K, device="cuda", dtype=DT)
            w = torch.empty(N, K, device="cuda", dtype=kfp8.FP8_DTYPE if fp8 else DT)
            s = torch.empty(N, device="cuda") if fp8 else None
            out = torch.empty(1, N, device="cuda", dtype=DT)
            for c in candidates(K, fp8):
                yield f"{label} {describe(c)}", functools.partial(klinear.compile_linear, x, w, None, c, out, w_scale=s)


def measure(label, N, K, fp8, ws, timer) -> dict[str, float]:
    """µs per method ("cublas" for bf16, "rule", then each candidate); nan where not timed."""
    dev = ws[0][0].device
    x = torch.randn(1, K, generator=torch.Generator(device=dev).manual_seed(K), device=dev).to(DT)
    w0, s0 = ws[0]
    ref = x.float() @ (kfp8.dequantize_weight(w0, s0, False, torch.float32) if fp8 else w0.float()).t()
    out = torch.empty(1, N, device=dev, dtype=DT)
    rule = klinear.fp8_linear_config(1, N, K, DT) if fp8 else klinear.linear_config(1, N, K, DT)
    methods = [] if fp8 else [("cublas", lambda w, s: F.linear(x, w))]
    methods.append((f"rule[{describe(rule)}]", lambda w, s: klinear.small_m_linear(x, w, None, rule, out, w_scale=s)))
    for c in candidates(K, fp8):
        methods.append((describe(c), lambda w, s, c=c: klinear.small_m_linear(x, w, None, c, out, w_scale=s)))
    found = {}
    for name, call in methods:
        found[name] = math.nan
        try:
            err = ((call(w0, s0).float() - ref).abs().max() / ref.abs().max()).item()
            if not err < TOL:
                print(f"  {label} {name}: FAIL, error {err:.2e}", flush=True)
                continue
            found[name] = timer([lambda w=w, s=s, call=call: call(w, s) for w, s in ws])
        except Exception as exc:  # noqa: BLE001 - compile or resource errors: reported, not fatal
            print(f"  {label} {name}: {type(exc).__name__}: {str(exc).strip()[:100]}", flush=True)
    return found


def probe_timer(smoke: bool):
    """(device, bytes of weight copies to rotate over, timer(calls) -> µs per call): with
    `smoke` Triton's interpreter on the CPU (one call timed, nothing rotated), else CUDA
    graphs of back-to-back calls over ROTATE_BYTES of copies (also gemv_silu.py's)."""
    if smoke:
        if not INTERPRET:
            sys.exit("--smoke runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")

        def timer(calls):
            t = time.perf_counter()
            calls[0]()
            return (time.perf_counter() - t) * 1e6

        return "cpu", 0, timer
    from attention import graph_ms

    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    return "cuda", ROTATE_BYTES, lambda calls: graph_ms(calls) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", choices=[s for s, _, _ in SHAPES], help="default: all")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    shapes = [s for s in SHAPES if not args.shapes or s[0] in args.shapes]
    device, rotate, timer = probe_timer(args.smoke)
    if args.smoke:
        shapes = [("tiny", 24, 320)]
    else:
        precompile(compile_launches(shapes), args.jobs)

    per_layer: dict[tuple[str, bool], dict[str, float]] = {}
    records = []
    for label, N, K in shapes:
        for fp8 in (False, True):
            nbytes = N * K * (1 if fp8 else 2)
            ws = weights(N, K, max(2, -(-rotate // nbytes)), device, fp8)
            got = measure(label, N, K, fp8, ws, timer)
            records.append({"shape": label, "N": N, "K": K, "fp8": fp8, "us": got})
            del ws
            ranked = sorted((v, k) for k, v in got.items() if not math.isnan(v))
            rule = next(v for k, v in got.items() if k.startswith("rule"))
            per_layer.setdefault((label, fp8), {}).update(rule=rule, best=ranked[0][0] if ranked else math.nan)
            print(f"{label} {N}x{K} {'fp8' if fp8 else 'bf16'}: " + " | ".join(
                f"{k} {v:.1f} {nbytes / v / 1e6:.2f}" for v, k in ranked[:6]) + f" || rule {rule:.1f}", flush=True)  # fmt: skip
            if device == "cuda":
                torch.cuda.empty_cache()
    for model, labels in LAYERS.items():
        for fp8 in (False, True):
            if all((lb, fp8) in per_layer for lb in labels):
                rule = sum(per_layer[(lb, fp8)]["rule"] for lb in labels)
                best = sum(per_layer[(lb, fp8)]["best"] for lb in labels)
                print(f"{model} {'fp8' if fp8 else 'bf16'}: GEMVs per layer rule {rule:.1f} us, best {best:.1f} us")
    if os.environ.get("OUT"):
        meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "triton": triton.__version__}
        Path(os.environ["OUT"], "gemv_stages.json").write_text(json.dumps({**meta, "records": records}, indent=1))


if __name__ == "__main__":
    main()
