"""Whether pulling the next GEMV's weights into L2 while the small kernels before it run (norms,
rotary, attention: at batch 1 they leave HBM idle) shortens a one-row decoder layer.

A llama-3.1-8b layer at one row, as the engine chains it under PDL in a CUDA graph:
norm -> qkv GEMV -> rotary -> attention split -> reduce -> o_proj GEMV -> norm -> gate_up
(gated) GEMV -> down GEMV. The GEMVs are the engine's (`layers.linear` / `fp8_linear`, the
gated kernel); the five small kernels are stand-ins of one program each (an RMSNorm of the
vector), launched under PDL like the engine's. A variant gives some of the stand-ins extra
programs that only issue `cp.async.bulk.prefetch.L2` over a weight (up to a byte cap) and
exit: weights are never written, so they need no grid-dependency wait ("after X": they wait
for the kernel before them anyway, so the prefetch starts once X has completed; otherwise it
may start while X still runs, the stand-in having launched early under PDL). Variants name
"stand-in -> weight[:cap MB]". Layers rotate over weight copies together larger than 1 GB,
so no layer finds its weights in L2 from the replay before.

    PYTHONUNBUFFERED=1 python benchmarks/probes/l2_prefetch.py [--fp8 both]

Printed: µs per layer (median of 20 graph replays), per variant, and the change against none.
Finding (H100, benchmarks/results/2026-11-27.md): every prefetch variant was as slow or slower (up to
+19%); the engine does not prefetch beyond each GEMV's own first tile.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "probes")]

import argparse

import torch
import triton
import triton.language as tl

from nanoserve.kernels import launch
from nanoserve.kernels import linear as klinear
from nanoserve.kernels.launch import pdl_start
from nanoserve.models import layers
from nanoserve.models.quantization import quantize_per_channel

DT = torch.bfloat16
HIDDEN, QKV, INTER = 4096, 6144, 14336
WARPS = 4
PF_PROGRAMS = 32
ROTATE_BYTES = 1 << 30


@triton.jit
def _bulk_prefetch_l2(ptrs, sizes):
    """Ask L2 for sizes[i] bytes at ptrs[i] (16-byte aligned, multiples of 16); nothing waits."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r", [ptrs, sizes],
        dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _stand_in_kernel(x_ptr, y_ptr, N, pf_ptr, pf_bytes, pf_chunk, BLOCK: tl.constexpr, HAS_PF: tl.constexpr,
                     LANES: tl.constexpr, PF_WAIT: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    if pid > 0:  # a prefetch program (there are none without HAS_PF): one chunk per thread
        if HAS_PF:
            if PF_WAIT:  # start only once the previous kernel has completed
                pdl_start(USE_PDL)
            starts = ((pid - 1) * LANES + tl.arange(0, LANES)).to(tl.int64) * pf_chunk
            size = tl.minimum(pf_bytes - starts, pf_chunk)
            ok = size > 0
            _bulk_prefetch_l2(pf_ptr + tl.where(ok, starts, 0), tl.where(ok, size, 16).to(tl.int32))
    else:
        pdl_start(USE_PDL)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x) / N + 1e-6)
        tl.store(y_ptr + offs, (x * r).to(y_ptr.dtype.element_ty), mask=mask)


def stand_in(
    x: torch.Tensor, n: int, prefetch: torch.Tensor | None = None, cap: int = 0, wait: bool = False
) -> torch.Tensor:
    """An RMSNorm of x[0, :n] (one program), plus prefetch programs over prefetch[:cap bytes]."""
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    nbytes = 0 if prefetch is None else min(cap, prefetch.numel() * prefetch.element_size())
    lanes = 32 * WARPS
    chunk = 16 * triton.cdiv(triton.cdiv(nbytes, PF_PROGRAMS * lanes), 16)
    pf = prefetch.view(torch.uint8) if nbytes else x
    grid = (1 + (PF_PROGRAMS if nbytes else 0),)
    _stand_in_kernel[grid](x, y, n, pf, nbytes, chunk, BLOCK=triton.next_power_of_2(n), HAS_PF=nbytes > 0,
                           LANES=lanes, PF_WAIT=wait, num_warps=WARPS, **launch.launch_options(x.device))  # fmt: skip
    return y


def layer_weights(fp8: bool, gen: torch.Generator):
    found = {}
    for name, (n, k) in {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
                         "down": (HIDDEN, INTER)}.items():  # fmt: skip
        w = (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(DT)
        found[name] = quantize_per_channel(w) if fp8 else (w, None)
    return found


def product(x, w, s, gated=False):
    if gated:
        rule = (klinear.fp8_linear_config if s is not None else klinear.linear_config)(1, w.shape[0], w.shape[1], DT)
        return klinear.small_m_linear(x, w, None, klinear.gated_config(rule), w_scale=s, gated=True)
    if s is None:
        return layers.linear(x, w)
    return layers.fp8_linear(x, w, layers.Fp8Weight(s, False))


def run_layer(x, ws, plan: dict[str, tuple[str, int]]):
    """One layer; plan maps a stand-in (norm1, rope, split, reduce, norm2) to (weight, cap bytes, wait):
    with wait its prefetch programs start once the previous kernel has completed."""

    def small(name, v, n):
        target = plan.get(name)
        return stand_in(v, n, *((ws[target[0]][0], target[1], target[2]) if target else ()))

    h = small("norm1", x, HIDDEN)
    q = product(h, *ws["qkv"])
    a = small("reduce", small("split", small("rope", q, HIDDEN), HIDDEN), HIDDEN)
    o = product(a, *ws["o"])
    h = small("norm2", o, HIDDEN)
    return product(product(h, *ws["gate_up"], gated=True), *ws["down"])


MB = 1 << 20
VARIANTS = {
    "none": {},
    "rope -> o": {"rope": ("o", 1 << 40, False)},
    "split -> o": {"split": ("o", 1 << 40, False)},
    "reduce -> o": {"reduce": ("o", 1 << 40, False)},
    "norm1 -> qkv[:8]": {"norm1": ("qkv", 8 * MB, False)},
    "norm1 -> qkv": {"norm1": ("qkv", 1 << 40, False)},
    "norm2 -> gate_up[:8]": {"norm2": ("gate_up", 8 * MB, False)},
    "norm2 -> gate_up[:16]": {"norm2": ("gate_up", 16 * MB, False)},
    "rope -> o, norm1 -> qkv[:8], norm2 -> gate_up[:8]": {
        "rope": ("o", 1 << 40, False), "norm1": ("qkv", 8 * MB, False), "norm2": ("gate_up", 8 * MB, False)},
    "split -> o, norm1 -> qkv[:16], norm2 -> gate_up[:16]": {
        "split": ("o", 1 << 40, False), "norm1": ("qkv", 16 * MB, False), "norm2": ("gate_up", 16 * MB, False)},
    "rope -> o, after qkv": {"rope": ("o", 1 << 40, True)},
    "split -> o, after rope": {"split": ("o", 1 << 40, True)},
    "rope -> o[:8], after qkv": {"rope": ("o", 8 * MB, True)},
    "norm1 -> qkv[:8], after down": {"norm1": ("qkv", 8 * MB, True)},
    "norm2 -> gate_up[:8], after o": {"norm2": ("gate_up", 8 * MB, True)},
    "none (again: drift)": {},
}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fp8", choices=["off", "on", "both"], default="both")
    args = ap.parse_args()
    from attention import graph_ms

    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for fp8 in {"off": [False], "on": [True], "both": [False, True]}[args.fp8]:
        gen = torch.Generator(device="cuda").manual_seed(0)
        per_layer = (QKV + HIDDEN + 3 * INTER) * HIDDEN * (1 if fp8 else 2)
        ws = [layer_weights(fp8, gen) for _ in range(max(2, -(-ROTATE_BYTES // per_layer)))]
        x = torch.randn(1, HIDDEN, generator=gen, device="cuda").to(DT)
        ref = run_layer(x, ws[0], {})
        got = {}
        for name, plan in VARIANTS.items():
            assert torch.equal(run_layer(x, ws[0], plan), ref), name  # the stand-ins' prefetch changes nothing
            got[name] = graph_ms([lambda w=w, x=x, plan=plan: run_layer(x, w, plan) for w in ws]) * 1e3
        base = got["none"]
        print(f"llama-3.1-8b layer, {'fp8' if fp8 else 'bf16'} weights ({per_layer / 1e6:.0f} MB, {len(ws)} copies):")
        for name, us in got.items():
            print(f"  {name:55s} {us:7.2f} us  {100 * (us / base - 1):+5.1f}%", flush=True)
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
