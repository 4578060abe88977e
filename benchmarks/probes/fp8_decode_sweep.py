"""FP8-weight decode GEMMs at M = 1..8 rows: the "fp8" kernel's configs against bf16 cuBLAS,
cuBLASLt FP8 and the engine's current rule (run on one GPU; the data for the FP8 few-row rule).

    PYTHONUNBUFFERED=1 python benchmarks/probes/fp8_decode_sweep.py [--out fp8_decode_sweep.json]
        [--ms 1 2 3 4 6 8] [--shapes qkv o_proj ...] [--jobs 16] [--budget 165]
    TRITON_INTERPRET=1 python benchmarks/probes/fp8_decode_sweep.py --smoke   # CPU: the whole flow on tiny shapes

Shapes: the decoder-layer linears of llama-3.1-8b and qwen3-8b (qkv and o_proj are the same
in both). Per (shape, M), each method's time per call of y = x W^T (bf16 x and y) as the engine
runs decode: one CUDA graph of back-to-back calls rotating over weight copies together larger
than 256 MB (every call streams its weight from HBM), median of 20 replays
(`attention.graph_ms`), under programmatic dependent launch as the engine launches. Methods:
- "bf16": F.linear on the bf16 weight (cuBLAS);
- "smm": `kernels.fp8.scaled_mm` (per-token activation quantization + cuBLASLt FP8 GEMM);
- "rule": `layers.fp8_linear` on the per-channel FP8 weight: what the engine runs now
  (`fp8_linear_config`'s Triton config, else smm; its x_fp8 configs are checked at 0.15);
- every config of `candidates(M)`: the "fp8" kernel's variants (rows / late / mma, with and
  without the bit-operation e4m3 conversion `bits`, split-K `k<S>`, prefetching `pf`, x
  quantized to e4m3 `xq`: cuBLASLt's precision class, the others keep x exact) and one config
  of the older "dot" kernel.
Each method's output is first checked against x W_deq^T in fp32 (max |error| / max |ref|; a
Triton config above 2e-2, or 0.15 for `xq`, is marked FAIL and not timed; smm quantizes x, so
it is only printed).
Printed per (shape, M): the baselines, the fastest fp8-kernel config and the next ones, µs and
TB/s of FP8 weight bytes (bf16: µs only); at the end per M the GEMM µs of one decoder layer
of each model (bf16, smm, rule, best candidate per shape) and the winning config per shape.
Everything measured goes to --out (JSON). Triton kernels compile up front in a thread pool;
past --budget seconds the remaining cells are skipped (so the run stays under ~3 minutes).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the repository, and benchmarks/ for shared helpers

import argparse
import dataclasses
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
from nanoserve.kernels.launch import launch_options
from nanoserve.kernels.linear import LinearConfig
from nanoserve.models.layers import Fp8Weight, fp8_linear
from nanoserve.models.quantization import quantize_per_channel

DT = torch.bfloat16
SHAPES = [  # (label, N, K): qkv and o_proj are llama-3.1-8b's and qwen3-8b's
    ("qkv", 6144, 4096),
    ("o_proj", 4096, 4096),
    ("llama_gate_up", 28672, 4096),
    ("llama_down", 4096, 14336),
    ("qwen3_gate_up", 24576, 4096),
    ("qwen3_down", 4096, 12288),
]
LAYERS = {  # one decoder layer's linears per model
    "llama-3.1-8b": ("qkv", "o_proj", "llama_gate_up", "llama_down"),
    "qwen3-8b": ("qkv", "o_proj", "qwen3_gate_up", "qwen3_down"),
}
ROTATE_BYTES = 256 << 20
TOL = 2e-2  # max |error| / max |ref| of a Triton config (bf16 output rounding is ~4e-3 of an element)
TOL_X_FP8 = 0.15  # ... of an x_fp8 config, which rounds x to e4m3 (as smm does; a broken kernel gives ~1)


def fp8(bm, bn, bk, warps=4, stages=1, split=1, mma=False, bits=False, late=False, pf=False, xq=False):
    return LinearConfig(
        "fp8", bm, bn, bk, warps, stages, split, mma=mma, bit_cvt=bits, reduce_late=late, prefetch=pf, x_fp8=xq
    )


def candidates(M: int) -> list[LinearConfig]:
    """The configs timed at M rows (14: the compile count keeps the run short; tensor-core and
    late-reduced configs compile once for every M > 1, row-at-a-time ones once per M). FMA
    variants mostly with Triton's cast (F2FP + HADD2: fewer instructions than the bit
    conversion's shifts and masks), tensor-core ones mostly with the bits (Triton's cast to bf16
    adds an F2F per element there)."""
    if M == 1:
        return [
            fp8(1, 4, 1024, 2, late=True),  # = the fma GEMV (the rule's config)
            fp8(1, 4, 1024, 2, late=True, bits=True),
            fp8(1, 4, 1024, 2, late=True, pf=True),
            fp8(1, 8, 1024, 4, late=True),
            fp8(1, 8, 1024, 4, late=True, pf=True),
            fp8(1, 4, 2048, 4, late=True),
            fp8(1, 4, 512, 4),  # a row per warp, 16-byte loads, reduced every step
            fp8(1, 8, 512, 8),
            fp8(1, 8, 1024, 4),
            fp8(1, 4, 512, 4, bits=True),
            fp8(16, 64, 128, 4, 3, split=4, mma=True, bits=True),
            fp8(16, 64, 256, 4, 3, split=4, mma=True, bits=True),
            fp8(16, 64, 128, 4, 4, split=8, mma=True, bits=True),
            fp8(16, 64, 256, 4, 2, split=2, mma=True, bits=True),
            fp8(16, 64, 128, 4, 3, split=4, mma=True, xq=True),  # x in e4m3: cuBLASLt's precision
            fp8(16, 128, 128, 8, 3, split=4, mma=True, xq=True),
        ]
    p = triton.next_power_of_2(M)
    found = [
        fp8(p, 8, 512, 4),  # rows: one converted W tile, a static loop over the rows
        fp8(p, 8, 512, 4, bits=True),
        fp8(p, 16, 256, 4),
        fp8(p, 16, 512, 8),
        fp8(16, 64, 128, 4, split=4, mma=True, bits=True),  # tensor cores, x^T padded to 16 columns
        fp8(16, 64, 128, 4, 3, split=4, mma=True, bits=True),  # stages: cp.async W and x buffers
        fp8(16, 64, 128, 4, 4, split=8, mma=True, bits=True),
        fp8(16, 64, 256, 4, 2, split=2, mma=True, bits=True),
        fp8(16, 64, 256, 4, 3, split=4, mma=True, bits=True),
        fp8(16, 128, 128, 8, 3, split=4, mma=True, bits=True),
        fp8(16, 64, 128, 4, 3, split=4, mma=True),
        fp8(16, 64, 128, 4, 3, split=4, mma=True, xq=True),  # x in e4m3: cuBLASLt's precision
        fp8(16, 64, 256, 4, 3, split=4, mma=True, xq=True),
        fp8(16, 128, 128, 8, 3, split=4, mma=True, xq=True),
        fp8(16, 64, 128, 4, 4, split=8, mma=True, xq=True),
        LinearConfig("dot", 16, 64, 128, num_warps=4, num_stages=4, split_k=4),
    ]
    if M <= 4:
        found.append(fp8(p, 4, 512, 4, late=True))  # [p, 4, 512] accumulator: registers grow with M
    return found


def describe(c: LinearConfig | None) -> str:
    if c is None:
        return "smm"
    kind = c.kernel if c.kernel != "fp8" else "mma" if c.mma else "late" if c.reduce_late else "rows"
    name = f"{kind} {c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps}"
    name += f" st{c.num_stages}" if c.num_stages > 1 else ""
    name += f" k{c.split_k}" if c.split_k > 1 else ""
    return name + (" bits" if c.bit_cvt else "") + (" pf" if c.prefetch else "") + (" xq" if c.x_fp8 else "")


def max_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def compile_launches(plan: list[tuple[int, int, int, list[LinearConfig]]]):
    """(label, launch) of every (M, N, K, configs) of `plan`, for `precompile`."""
    for M, N, K, cfgs in plan:
        x = torch.empty(M, K, device="cuda", dtype=DT)
        w = torch.empty(N, K, device="cuda", dtype=kfp8.FP8_DTYPE)
        s = torch.empty(N, device="cuda")
        out = torch.empty(M, N, device="cuda", dtype=DT)
        for cfg in cfgs:
            yield f"{describe(cfg)} M={M}", functools.partial(klinear.compile_linear, x, w, None, cfg, out, w_scale=s)


def weights(N: int, K: int, copies: int, device: str):
    """`copies` random weights: (bf16 W, FP8 W, fp32 per-channel scales) each."""
    gen = torch.Generator(device=device).manual_seed(N + K)
    found = []
    for _ in range(copies):
        w = (torch.randn(N, K, generator=gen, device=device) / K**0.5).to(DT)
        q, s = quantize_per_channel(w)
        found.append((w, q, s))
    return found


def measure_cell(label, N, K, M, ws, timer) -> list[dict]:
    """One record per method at (shape, M): us (nan if not timed), TB/s, max error, note."""
    dev = ws[0][0].device
    x = torch.randn(M, K, generator=torch.Generator(device=dev).manual_seed(M), device=dev).to(DT)
    ref = x.float() @ kfp8.dequantize_weight(ws[0][1], ws[0][2], False, torch.float32).t()
    out = torch.empty(M, N, device=dev, dtype=DT)
    methods = [
        ("bf16", None, lambda w, q, s: F.linear(x, w)),
        ("smm", None, lambda w, q, s: kfp8.scaled_mm(x, q, s)),
        ("rule", klinear.fp8_linear_config(M, N, K, DT), lambda w, q, s: fp8_linear(x, q, Fp8Weight(s, False))),
    ]
    for c in candidates(M):
        methods.append((describe(c), c, lambda w, q, s, c=c: klinear.small_m_linear(x, q, None, c, out, w_scale=s)))
    records = []
    for name, cfg, call in methods:
        rec = {"shape": label, "N": N, "K": K, "M": M, "method": name, "us": math.nan, "tbs": math.nan}
        rec["config"] = dataclasses.asdict(cfg) if cfg is not None else None
        if name == "rule":
            rec["rule_config"] = describe(cfg)
        try:
            got = call(*ws[0])
            rec["max_err"] = max_err(got, ref) if name != "bf16" else max_err(got, x.float() @ ws[0][0].float().t())
            tol = TOL_X_FP8 if cfg is not None and cfg.x_fp8 else TOL
            if name not in ("bf16", "smm") and not rec["max_err"] < tol:
                rec["note"] = "FAIL"
            else:
                rec["us"] = timer([lambda w=w, q=q, s=s, call=call: call(w, q, s) for w, q, s in ws])
                rec["tbs"] = N * K * (2 if name == "bf16" else 1) / rec["us"] / 1e6
        except Exception as exc:  # noqa: BLE001 - compile, launch or resource errors: reported, not fatal
            rec["note"] = f"{type(exc).__name__}: {str(exc).strip()[:100]}"
        records.append(rec)
    return records


def cell_line(records: list[dict]) -> str:
    by = {r["method"]: r for r in records}
    r0 = records[0]
    head = f"{r0['shape']} {r0['N']}x{r0['K']} M={r0['M']}:"
    smm, rule = by["smm"], by["rule"]
    line = (
        f"{head} bf16 {by['bf16']['us']:.1f} | smm {smm['us']:.1f} {smm['tbs']:.2f} e{smm.get('max_err', math.nan):.0e}"
    )
    line += f" | rule[{rule['rule_config']}] {rule['us']:.1f} {rule['tbs']:.2f}"
    cands = sorted((r for r in records[3:] if not math.isnan(r["us"])), key=lambda r: r["us"])
    if cands:
        b = cands[0]
        line += f" | best {b['method']} {b['us']:.1f} {b['tbs']:.2f} e{b['max_err']:.0e}"
        line += "".join(f" | {r['method']} {r['us']:.1f}" for r in cands[1:2])
    bad = [r for r in records if r.get("note")]
    if bad:  # each method's first message in full, then only its name
        notes = [r["method"] + ("" if r["method"] in _noted else f": {r['note'][:80]}") for r in bad]
        _noted.update(r["method"] for r in bad)
        line += " !! " + "; ".join(notes)
    return line


_noted: set[str] = set()  # methods whose failure message was printed


def summary(records: list[dict], ms: list[int]) -> str:
    cell: dict[tuple[str, int], list[dict]] = {}
    for r in records:
        cell.setdefault((r["shape"], r["M"]), []).append(r)

    def us(rs: list[dict], method: str | None) -> float:
        if method is None:  # the fastest candidate config
            return min((r["us"] for r in rs[3:] if not math.isnan(r["us"])), default=math.nan)
        return next(r["us"] for r in rs if r["method"] == method)

    lines = ["", "GEMM us per decoder layer (qkv + o_proj + gate_up + down): bf16 | smm | rule | best fp8 config"]
    for model, labels in LAYERS.items():
        for M in ms:
            if all((lb, M) in cell for lb in labels):
                sums = [sum(us(cell[(lb, M)], m) for lb in labels) for m in ("bf16", "smm", "rule", None)]
                lines.append(f"  {model} M={M}: " + " | ".join(f"{v:.1f}" for v in sums))
    lines += ["", "fastest fp8 config per shape and M: us (its time / the faster of smm and rule)"]
    for label, _, _ in SHAPES:
        got = []
        for M in ms:
            rs = cell.get((label, M))
            if rs is None:
                continue
            cands = [r for r in rs[3:] if not math.isnan(r["us"])]
            if not cands:
                continue
            b = min(cands, key=lambda r: r["us"])
            base = min(us(rs, "smm"), us(rs, "rule"))
            got.append(f"M{M} {b['method']} {b['us']:.1f} ({b['us'] / base:.2f})")
        if got:
            lines.append(f"  {label}: " + " | ".join(got))
    return "\n".join(lines)


def run(shapes, ms, timer, device, budget, start, rotate_bytes) -> list[dict]:
    records = []
    for label, N, K in shapes:
        if time.perf_counter() - start > budget:
            print(f"{label}: skipped (past the {budget:.0f} s budget)", flush=True)
            continue
        copies = max(2, -(-rotate_bytes // (N * K)))
        ws = weights(N, K, copies, device)
        for M in ms:
            if time.perf_counter() - start > budget:
                print(f"{label} M={M}: skipped (past the {budget:.0f} s budget)", flush=True)
                continue
            cell = measure_cell(label, N, K, M, ws, timer)
            records += cell
            print(cell_line(cell), flush=True)
        del ws
        if device == "cuda":
            torch.cuda.empty_cache()
    return records


def smoke(out: str | None) -> None:
    """CPU (TRITON_INTERPRET=1): every candidate on tiny shapes through the real flow, with each
    call's wall time standing in for the graph timing."""
    from gemv_stages import probe_timer  # (this script's folder)

    _, _, timer = probe_timer(smoke=True)  # exits unless TRITON_INTERPRET=1
    shapes = [("qkv", 48, 512), ("o_proj", 32, 320), ("llama_gate_up", 64, 256), ("llama_down", 32, 640)]
    ms = [1, 3, 8]
    start = time.perf_counter()
    records = run(shapes, ms, timer, "cpu", math.inf, start, 0)
    print(summary(records, ms))
    bad = [r for r in records if r.get("note")]
    assert not bad, bad
    if out:
        Path(out).write_text(json.dumps({"device": "cpu (interpreter)", "records": records}, indent=1))
    print(f"smoke ok: {len(records)} records in {time.perf_counter() - start:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    ap.add_argument("--shapes", nargs="+", choices=[s for s, _, _ in SHAPES], help="default: all")
    ap.add_argument("--out", default=None, help="JSON path for every record (default $OUT/fp8_decode_sweep.json)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile threads")
    ap.add_argument("--budget", type=float, default=165.0, help="seconds after which cells are skipped")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    out = args.out or (os.path.join(os.environ["OUT"], "fp8_decode_sweep.json") if os.environ.get("OUT") else None)
    if args.smoke:
        return smoke(out)
    from attention import graph_ms

    start = time.perf_counter()
    shapes = [s for s in SHAPES if not args.shapes or s[0] in args.shapes]
    device = torch.cuda.get_device_name()
    print(f"device {device}, torch {torch.__version__}, triton {triton.__version__}, "
          f"pdl {launch_options(torch.device('cuda'))['USE_PDL']}", flush=True)  # fmt: skip
    plan = [(M, N, K, candidates(M)) for _, N, K in shapes for M in args.ms]
    precompile(compile_launches(plan), args.jobs)
    print("per call: us, then TB/s of FP8 bytes (bf16: us only); e = max |err| / max |ref|; best, 2nd", flush=True)
    records = run(shapes, args.ms, lambda calls: graph_ms(calls) * 1e3, "cuda", args.budget, start, ROTATE_BYTES)
    print(summary(records, args.ms), flush=True)
    if out:
        meta = {"device": device, "torch": torch.__version__, "triton": triton.__version__}
        Path(out).write_text(json.dumps({**meta, "records": records}, indent=1))
        print(f"wrote {out}", flush=True)
    print(f"total {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
