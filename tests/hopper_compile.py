"""Compile kernels for Hopper (sm_90) without a GPU: Triton's passes and ptxas run on the host.
Numbers are tensor-parallel group sizes: the TP kernels at that size. Runtime ints are left
unspecialised and every pointer and stride 16-divisible, as at the engine's larger ranks
(ranks 0 and 1 are specialised, so TP=2 alone never compiles these paths). `decode`: the
decode kernels that read before their PDL wait (rotary with and without its norm, K/V store
and fp8 cache; decode split, over requests and over a verify step's runs, and reduce), in
their PDL variants, which Triton's interpreter never builds. `rows16`: the 2..16-row fused kernels (the split-K qkv sum with the rotation
and K/V store, `qkv_rope._split_rope_kernel`; the gated dot kernel, `linear._gated_dot_kernel`)
at llama-3.1-8b's shapes, in their PDL variants. Prints each argument once all its kernels
have compiled; a failure raises. `mxfp4`: gpt-oss's MXFP4 expert kernels, checked to load
whole 16-byte groups of codes. `linear`: Qwen3.5's Gated DeltaNet kernels;
`align`: the MoE alignment kernel.

    python tests/hopper_compile.py 2 4 8 decode rows16 mxfp4 linear align

Used by tests/test_tp.py and tests/test_decode_kernels.py (CPU, in CI, through
`check_in_own_process`) and by benchmarks/tp_session.sh's `symm` stage (the GPU image's Triton)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton
from triton.backends.compiler import GPUTarget

from nanoserve.kernels import all_reduce, attention, gated_delta, linear, moe, qkv_rope, rotary

BF16, I64, I32, F32 = "*bf16", "*i64", "*i32", "*fp32"


def compile_for_hopper(
    kernel, types: dict, constexprs: dict, num_warps: int, num_stages: int = 3, undivided: tuple[str, ...] = ()
) -> str:
    """`types`: the runtime arguments' Triton types; every other argument is a constexpr.
    `undivided`: strides a launch would not specialise (not multiples of 16). Returns the PTX."""
    names = kernel.arg_names
    signature = {n: types.get(n, "constexpr") for n in names}
    divisible = [
        i
        for i, n in enumerate(names)
        if n in types and (types[n].startswith("*") or "stride" in n) and n not in undivided
    ]
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


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


def compile_decode_kernels() -> None:
    rope = {n: BF16 for n in ("q_ptr", "k_ptr", "v_ptr", "q_out_ptr", "k_out_ptr", "qw_ptr", "kw_ptr")}
    rope |= {"pos_ptr": I64, "cos_ptr": F32, "sin_ptr": F32, "slot_ptr": I64, "eps": "fp32"}
    rope |= {n: "i32" for n in rotary._qk_norm_rope_kernel.arg_names if n.startswith("stride")}
    heads = {"NUM_Q_HEADS": 16, "NUM_K_HEADS": 8, "HEAD_DIM": 128, "HALF": 64, "BLOCK_HALF": 64, "BLOCK_H": 4}
    heads |= {"Q_BLOCKS": 4, "K_BLOCKS": 2, "USE_PDL": True}
    for norm, store, fp8 in ((False, False, False), (True, False, False), (False, True, False), (True, True, True)):
        cache = "*fp8e4nv" if fp8 else BF16
        types = rope | {"k_cache_ptr": cache, "v_cache_ptr": cache}
        compile_for_hopper(
            rotary._qk_norm_rope_kernel, types, {**heads, "HAS_NORM": norm, "STORE_KV": store, "TO_FP8": fp8}, 1
        )
    split = {n: BF16 for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")} | {"scale_log2": "fp32"}
    split |= {n: I32 for n in ("page_table_ptr", "seq_lens_ptr", "kv_start_ptr", "run_rows_ptr")}
    split |= {"part_ptr": F32, "lse_ptr": F32}
    split |= {n: "i32" for n in attention._decode_split_kernel.arg_names if n.startswith(("stride", "num_"))}
    shape = {"NUM_Q_HEADS": 32, "GROUP": 4, "PAGE_SIZE": 16, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_N": 64}
    shape |= {"MIN_SPLIT": 64, "USE_PDL": True}
    for direct, start, runs in (
        (False, False, False),
        (True, False, False),
        (False, True, False),
        (False, False, True),
        (True, False, True),
    ):
        consts = {**shape, "BLOCK_H": 32 if runs else 16, "DIRECT": direct, "HAS_START": start, "RUNS": runs}
        consts["SKIP_EMPTY"] = runs and not direct  # as paged_decode launches it
        compile_for_hopper(attention._decode_split_kernel, split, {**consts, "DOT_F32": False, "HEADS_FIRST": True}, 4)
    reduce = {"part_ptr": F32, "lse_ptr": F32, "out_ptr": BF16} | {n: I32 for n in ("seq_lens_ptr", "kv_start_ptr")}
    reduce |= {"num_parts_ptr": I32} | {n: "i32" for n in ("stride_ot", "stride_oh", "num_splits", "num_cols")}
    for cascade in (False, True):
        consts = {k: shape[k] for k in ("NUM_Q_HEADS", "HEAD_DIM", "BLOCK_D", "BLOCK_N", "MIN_SPLIT", "USE_PDL")}
        compile_for_hopper(
            attention._decode_reduce_kernel, reduce, {**consts, "BLOCK_S": 32, "HAS_CASCADE": cascade}, 4
        )


def compile_rows16_kernels() -> None:
    rope = {"ws_ptr": F32, "b_ptr": BF16, "y_ptr": BF16, "pos_ptr": I64, "cos_ptr": F32, "sin_ptr": F32}
    rope |= {"slot_ptr": I64} | {n: "i32" for n in qkv_rope._split_rope_kernel.arg_names if n.startswith("stride")}
    heads = {"SPLIT_K": 2, "NUM_Q_HEADS": 32, "NUM_K_HEADS": 8, "HEAD_DIM": 128, "BLOCK_HALF": 64, "BLOCK_H": 8}
    for bias, store, fp8 in ((False, False, False), (False, True, False), (True, True, True)):
        cache = "*fp8e4nv" if fp8 else BF16
        consts = {**heads, "HAS_BIAS": bias, "STORE_KV": store, "TO_FP8": fp8, "USE_PDL": True}
        compile_for_hopper(qkv_rope._split_rope_kernel, rope | {"k_cache_ptr": cache, "v_cache_ptr": cache}, consts, 4)
    gated = {n: BF16 for n in ("x_ptr", "w_ptr", "b_ptr", "y_ptr")}
    gated |= {n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_wn", "stride_ym")}
    tile = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "UPCAST": False, "PRECISE": True, "USE_PDL": True}
    for bias, even in ((False, True), (True, False)):
        compile_for_hopper(linear._gated_dot_kernel, gated, {**tile, "HAS_BIAS": bias, "EVEN_K": even}, 4)


def compile_mxfp4_kernels() -> None:
    """gpt-oss-20b's MXFP4 expert kernels as its shapes specialise them: weight rows H/8 = 360
    words apart and scale rows 90 bytes, neither a multiple of 16, so Triton cannot tell that a
    group's four words are 16-byte aligned unless the kernels say so. Without it the decode
    kernels loaded them one word at a time (137 us a layer at T=1 on an H200; 80 with the same
    tiles in 16-byte loads).
    Asserts that both decode kernels and the grouped gate_up kernel load whole groups."""
    words = {"w_ptr": I32, "s_ptr": "*u8", "ids_ptr": I32, "b_ptr": BF16, "H": "i32", "I": "i32"}
    strides = ("stride_we", "stride_wn", "stride_se", "stride_sn", "stride_be")
    gate_up = words | {"x_ptr": BF16, "out_ptr": BF16} | {n: "i32" for n in (*strides, "stride_x", "stride_o")}
    down = words | {"a_ptr": BF16, "planes_ptr": F32, "topk_w_ptr": F32, "k_split": "i32"}
    down |= {n: "i32" for n in (*strides, "stride_a", "stride_plane")}
    act = {"ACT": 1, "ALPHA": 1.702, "LIMIT": 7.0}
    loop = {"K": 4, "BLOCK_N": 8, "BLOCK_K": 512, "LOOP_STAGES": 1, "USE_PDL": False}
    odd = ("stride_wn", "stride_sn")
    for half2 in (False, True):  # fp32 activations; bf16 ones, multiplied in f16x2 by PTX
        h2 = {"HALF2": half2, "ASM": half2}
        ptx = compile_for_hopper(moe._decode_gate_up_mx_kernel, gate_up, loop | act | h2, 4, 1, odd)
        assert "ld.global.v4.b32" in ptx, "the decode gate_up kernel reads its weights in pieces"
        assert ("fma.rn.f16x2" in ptx) == half2, "the decode gate_up kernel's products are not as asked"
        consts = loop | h2 | {"split_k": 1, "ROUND": True, "HAS_BIAS": True, "ACT_F16": half2}
        types = down | {"split_k": "i32", "a_ptr": "*fp16" if half2 else BF16}
        ptx = compile_for_hopper(moe._decode_down_mx_kernel, types, consts, 4, 1, odd)
        assert "ld.global.v4.b32" in ptx, "the decode down kernel reads its weights in pieces"
    grouped = gate_up | {n: I32 for n in ("pairs_ptr", "block_expert_ptr", "num_padded_ptr")}
    grouped |= {"num_pairs": "i32", "num_m": "i32"}
    tiles = {"K": 4, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 0, "F32": False, "ASM": True} | act
    ptx = compile_for_hopper(moe._grouped_gate_up_mx_kernel, grouped, tiles, 4, 3, odd)
    whole = re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx)
    assert whole, "the grouped gate_up kernel reads its weights in pieces"


def compile_linear_kernels() -> None:
    """Qwen3.5's Gated DeltaNet kernels (the decode step's three, the packed convolution of an
    extend) at Qwen3.5-35B-A3B's head sizes: Triton's interpreter runs code that the compiler
    refuses (a name rebound to another type in a branch compiled under the interpreter)."""
    compile_for_hopper(
        gated_delta._conv_packed_kernel,
        {n: BF16 for n in ("x_ptr", "w_ptr", "state_ptr", "out_ptr", "new_state_ptr")}
        | {"blocks_ptr": I32, "starts_ptr": I32, "C": "i32", "stride_x": "i32"},
        {"W": 4, "BLOCK_T": 32, "BLOCK_C": 128},
        4,
    )
    compile_for_hopper(
        gated_delta._conv_step_kernel,
        {n: BF16 for n in ("x_ptr", "w_ptr", "state_ptr", "out_ptr")}
        | {"rows_ptr": I64, "prefix_ptr": I32, "C": "i32", "stride_x": "i32", "stride_row": "i32"},
        {"W": 4, "BLOCK": 1024},
        4,
    )
    delta = {"x_ptr": BF16, "ba_ptr": BF16, "a_log_ptr": F32, "dt_bias_ptr": F32, "state_ptr": F32}
    delta |= {"rows_ptr": I64, "prefix_ptr": I32, "out_ptr": BF16, "scale": "fp32"}
    delta |= {n: "i32" for n in ("stride_ba", "stride_row", "HV", "KEY_DIM")}
    for bv in (gated_delta.DELTA_BLOCK_V, gated_delta.DELTA_BLOCK_V_ONE_ROW):
        consts = {"DK": 128, "DV": 128, "REP": 2, "BK": 128, "BV": bv}
        compile_for_hopper(gated_delta._delta_step_kernel, delta, consts, gated_delta.DELTA_WARPS)
    norm = {"o_ptr": BF16, "z_ptr": BF16, "w_ptr": BF16, "out_ptr": BF16, "stride_z": "i32", "HV": "i32", "eps": "fp32"}
    compile_for_hopper(gated_delta._gated_norm_kernel, norm, {"DV": 128, "BV": 128}, 1)


def compile_align_kernel() -> None:
    """The MoE alignment (a program per expert, and one for the rows past every group) at
    Qwen3.5-35B-A3B's 256 experts, for 2048 pairs (a batch of 256 tokens at top-8)."""
    args = {"ids_ptr": I32, "sorted_ptr": I32, "block_expert_ptr": I32, "num_padded_ptr": I32}
    consts = {"E": 256, "BLOCK_M": 16, "BLOCK_P": 2048, "BLOCK_E": 512, "BLOCK_C": 1024, "BLOCK_B": 64}
    compile_for_hopper(moe._align_kernel, args | {"pairs": "i32", "capacity": "i32"}, consts, 8)


def check_in_own_process(*args: str) -> None:
    """Run this script on `args` in a process of its own, without Triton's interpreter (the
    caller's process may run it), and assert that every argument compiled."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__, *args], check=False, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == list(args), done.stdout


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        if arg == "decode":
            compile_decode_kernels()
        elif arg == "rows16":
            compile_rows16_kernels()
        elif arg == "mxfp4":
            compile_mxfp4_kernels()
        elif arg == "linear":
            compile_linear_kernels()
        elif arg == "align":
            compile_align_kernel()
        else:
            compile_tp_kernels(int(arg))
        print(arg, flush=True)
