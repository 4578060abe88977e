"""Compile the tensor-parallel kernels for Hopper (sm_90) at the given group sizes, without a
GPU: Triton's passes and ptxas run on the host. Prints each size once all its kernels have
compiled; a failure raises. Runtime ints are left unspecialised and every pointer and stride
16-divisible, as at the engine's larger ranks (ranks 0 and 1 are specialised, so TP=2 alone
never compiles these paths).

    python tests/hopper_compile.py 2 4 8

Used by tests/test_tp.py (CPU, in CI) and by benchmarks/tp_session.sh's `symm` stage (the GPU
image's Triton)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton
from triton.backends.compiler import GPUTarget

from nanoserve.kernels import all_reduce, linear

BF16, I64 = "*bf16", "*i64"


def compile_for_hopper(kernel, types: dict, constexprs: dict, num_warps: int) -> None:
    """`types`: the runtime arguments' Triton types; every other argument is a constexpr."""
    names = kernel.arg_names
    signature = {n: types.get(n, "constexpr") for n in names}
    divisible = [i for i, n in enumerate(names) if n in types and (types[n].startswith("*") or "stride" in n)]
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def compile_tp_kernels(world: int) -> None:
    norm_args = {"r_ptr": BF16, "w_ptr": BF16, "out_ptr": BF16, "sum_ptr": BF16, "epoch_ptr": I64, "eps": "fp32"}
    norm_args |= {n: "i32" for n in ("M", "rank", "stride_r", "stride_o", "stride_s")}
    norm = {"N": 4096, "BLOCK": 4096, "WORLD": world, "HAS_RESIDUAL": True, "USE_PDL": True}
    ll = {"part_ptr": BF16, "dst_addrs": I64, "recv_ptr": I64, "recv_stride": "i32", **norm_args}
    for sent in (False, True):
        compile_for_hopper(all_reduce._ll_all_reduce_rms_norm_kernel, ll, {**norm, "PACK": 2, "SENT": sent}, 16)
    pull = {"part_ptr": BF16, "slot_addrs": I64, "flag_addrs": I64, **norm_args}
    compile_for_hopper(all_reduce._all_reduce_rms_norm_kernel, pull, norm, 16)
    fma = {n: BF16 for n in ("x_ptr", "w_ptr", "b_ptr", "y_ptr")} | {"push_addrs": I64, "epoch_ptr": I64}
    fma |= {n: "i32" for n in ("N", "K", "stride_xm", "stride_wn", "stride_ym", "rank")}
    one_row = {"M": 1, "HAS_BIAS": False, "BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 1024, "EVEN_K": True, "LINE": 64}
    compile_for_hopper(linear._linear_fma_kernel, fma, {**one_row, "PUSH_WORLD": world, "USE_PDL": True}, 2)


if __name__ == "__main__":
    for size in map(int, sys.argv[1:]):
        compile_tp_kernels(size)
        print(size, flush=True)
