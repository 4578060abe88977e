"""What a batch-1 decode step's chain of kernels costs when every kernel only reads its bytes:
the floor of the one-kernel-per-operation execution model, against the bandwidth floor.

A decode step at batch 1 is a chain: each kernel needs its predecessor's output. This probe
replays, in a CUDA graph with programmatic dependent launch (as the engine's kernels launch),
a chain of read-only kernels with the step's shape: per layer one kernel per operation of
the real step, each streaming the bytes that operation must read (weights, KV) from a buffer
of its own and doing nothing else. What the real kernels add on top (the products, the
reductions, the routing, the writes) is left out, so the chain estimates from below what any
step with this kernel structure can reach: a kernel cannot read its bytes faster than a plain
reader does (as far as this reader is as good as a read can be: the flat variant checks it
against the copy bandwidth).

Variants, each the same bytes in a different number of kernels:
- `step`: every kernel of the real step (`chain_for`), the small ones (norms, rotary, reduce,
  route, sampler) reading one tile;
- `weights`: only the kernels that read weights or KV (the small ones fused away for free);
- `block`: one kernel per block (attention, MLP) of each layer, and one for the head;
- `layer`: one kernel per layer reading the whole layer (what a kernel per layer could reach);
- `flat`: one kernel reading everything (the bandwidth floor as this reader reaches it).

The reader (`_read_kernel`): each program sums a contiguous run of BLOCK-element tiles in fp32
and stores one number; every program runs `pdl_start` first, and with `--prefetch` asks L2 for
its first tile before that, as the engine's GEMVs do. Each variant is timed for every `Reader`
the options give (tile, loads in flight, persistent or one-program-per-run grids) and the
fastest is printed: the floor is the best this reader does. `--per-size` then lets each kernel
size pick its own reader (`per_size_readers`).

    python benchmarks/probes/chain_floor.py [--models qwen3-30b-a3b qwen3-0.6b llama-3.1-8b]
        [--context 192] [--per-size] [--persistent] [--real]

`--persistent` also times the step's operations in one launch, a grid barrier between them
(`_persistent_read_kernel`), first with nothing read: what a persistent kernel's
synchronisation costs against kernel boundaries. Its reads keep one tile in flight per program
and fall far short of the bandwidth (benchmarks/results/2026-11-28.md): read the
barriers-only line, not the others, as a floor. `--real` also loads the model (dummy weights)
and replays its batch-1 decode graph in the same process (`latency.batch1_graph_ms`).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import argparse
import dataclasses
import gc
import itertools
import json
import math

import torch
import triton
import triton.language as tl
from attention import graph_ms

from nanoserve.kernels.attention import choose_num_splits
from nanoserve.kernels.launch import launch_options, pdl_start
from nanoserve.kernels.linear import _prefetch_l2
from nanoserve.models.registry import BUNDLED_DIR


@dataclasses.dataclass(frozen=True)
class ChainKernel:
    name: str
    bytes: int  # weights or KV it must read; 0: a small kernel (norm, rotary, reduce, route), one tile
    part: str  # "attention L", "mlp L" (layer L) or "head": what a kernel per block or per layer would merge


@triton.jit
def _read_kernel(
    src_ptr, out_ptr, num_tiles, tiles_per_program,
    BLOCK: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    first = pid * tiles_per_program
    last = tl.minimum(first + tiles_per_program, num_tiles)
    offs = tl.arange(0, BLOCK)
    ptrs = src_ptr + first.to(tl.int64) * BLOCK + offs
    if PREFETCH:
        lines = tl.arange(0, BLOCK // 64) * 64  # one pointer per 128-byte line of bf16
        _prefetch_l2(src_ptr + first.to(tl.int64) * BLOCK + lines)
    pdl_start(USE_PDL)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for _ in tl.range(first, last, num_stages=STAGES):
        acc += tl.load(ptrs).to(tl.float32)
        ptrs += BLOCK
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def _persistent_read_kernel(
    src_ptr, starts_ptr, tiles_ptr, counter_ptr, out_ptr, num_ops,
    BLOCK: tl.constexpr, AHEAD: tl.constexpr,
):  # fmt: skip
    # The whole chain in one launch: every program takes an equal run of each operation's tiles,
    # then waits at a grid barrier (a counter every program bumps once per operation) before the
    # next. All programs must be resident at once: `time_persistent` launches 1-2 a
    # multiprocessor and skips configurations whose registers would not fit them. AHEAD: before waiting, ask L2 for the program's first tile of the next
    # operation (weights do not depend on the barrier).
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for op in range(num_ops):
        num_tiles = tl.load(tiles_ptr + op)
        per_program = tl.cdiv(num_tiles, programs)
        first = pid * per_program
        ptrs = src_ptr + tl.load(starts_ptr + op) + first.to(tl.int64) * BLOCK + offs
        for _ in range(first, tl.minimum(first + per_program, num_tiles)):
            acc += tl.load(ptrs).to(tl.float32)
            ptrs += BLOCK
        if AHEAD:  # noqa: SIM102 - AHEAD is a constexpr, the inner test a runtime one
            if op + 1 < num_ops:
                ahead = pid * tl.cdiv(tl.load(tiles_ptr + op + 1), programs)
                if ahead < tl.load(tiles_ptr + op + 1):
                    lines = tl.arange(0, BLOCK // 64) * 64
                    _prefetch_l2(src_ptr + tl.load(starts_ptr + op + 1) + ahead.to(tl.int64) * BLOCK + lines)
        tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
        while tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu") < (op + 1) * programs:
            pass
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


@dataclasses.dataclass(frozen=True)
class Reader:
    """How the chain's kernels read: BLOCK-element tiles, STAGES loads in flight per program,
    and the grid: `per_sm` programs per multiprocessor (each an even share of the tiles), or
    with per_sm = 0 one program per `tiles` tiles."""

    block: int
    stages: int
    per_sm: int
    tiles: int

    def __str__(self) -> str:
        grid = f"{self.per_sm}/SM" if self.per_sm else f"{self.tiles} tiles/program"
        return f"block {self.block}, {self.stages} stages, {grid}"


def chain_for(cfg: dict, context: int, num_sms: int = 132) -> list[ChainKernel]:
    """The batch-1 decode step's kernels in order, from a bundled config (bf16): per layer the
    input norm, qkv, q/k norm + rotary + K/V store (Qwen3's q/k norms; otherwise the qkv GEMV
    does it), decode attention and its reduce (when the context is split), o_proj, the
    post-attention norm, then the MLP: gate_up and down, or for a sparse layer the router, the
    top-k route, gate_up and down of the k chosen experts; then the final norm, the LM head and
    the sampler. `num_sms` (an H100's or H200's 132 by default) feeds the decode split rule."""
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    qk_norm = cfg["model_type"] in ("qwen3", "qwen3_moe")
    chain: list[ChainKernel] = []
    for layer in range(layers):
        attention = [("norm", 0), ("qkv", hidden * (heads + 2 * kv_heads) * head_dim * 2)]
        if qk_norm:
            attention.append(("rotary", 0))
        attention.append(("attention", context * kv_heads * head_dim * 2 * 2))
        if choose_num_splits(1, kv_heads, context, num_sms, max_splits=32) > 1:  # the Triton backend's cap
            attention.append(("reduce", 0))
        attention.append(("o_proj", heads * head_dim * hidden * 2))
        sparse = (
            experts
            and layer not in cfg.get("mlp_only_layers", [])
            and (layer + 1) % cfg.get("decoder_sparse_step", 1) == 0
        )
        if sparse:
            inter, top_k = cfg.get("moe_intermediate_size") or cfg["intermediate_size"], cfg["num_experts_per_tok"]
            mlp = [("norm", 0), ("router", experts * hidden * 2), ("route", 0)]
            mlp += [("gate_up", top_k * 2 * inter * hidden * 2), ("down", top_k * inter * hidden * 2)]
        else:
            inter = cfg["intermediate_size"]
            mlp = [("norm", 0), ("gate_up", 2 * inter * hidden * 2), ("down", inter * hidden * 2)]
        chain += [ChainKernel(name, size, f"attention {layer}") for name, size in attention]
        chain += [ChainKernel(name, size, f"mlp {layer}") for name, size in mlp]
    head = [("norm", 0), ("lm_head", cfg["vocab_size"] * hidden * 2), ("sampler", 0)]
    return chain + [ChainKernel(name, size, "head") for name, size in head]


VARIANTS = ("step", "weights", "block", "layer", "flat")


def variant(chain: list[ChainKernel], name: str) -> list[int]:
    """Bytes per kernel of one of VARIANTS (0: a small kernel's one tile)."""
    if name == "step":
        return [k.bytes for k in chain]
    if name == "weights":
        return [k.bytes for k in chain if k.bytes]
    if name == "flat":
        return [sum(k.bytes for k in chain)]
    merged: dict[str, int] = {}  # insertion-ordered: the chain's order
    for k in chain:
        key = k.part if name == "block" else k.part.replace("attention ", "").replace("mlp ", "")
        merged[key] = merged.get(key, 0) + k.bytes
    return list(merged.values())


def time_chain(sizes: list[int], readers: list[Reader], prefetch: bool, device: torch.device) -> float:
    """ms per replay of a graph launching, in order, one reader per size (`readers[i]` reads
    `sizes[i]` bytes) on a buffer of its own."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiles = [max(1, math.ceil(s / 2 / r.block)) for s, r in zip(sizes, readers)]
    per_program = [math.ceil(n / (r.per_sm * sms)) if r.per_sm else r.tiles for n, r in zip(tiles, readers)]
    grids = [math.ceil(n / t) for n, t in zip(tiles, per_program)]
    lengths = [n * r.block for n, r in zip(tiles, readers)]
    src = torch.empty(sum(lengths), dtype=torch.bfloat16, device=device).normal_()
    out = torch.empty(max(grids), dtype=torch.float32, device=device)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    opts = launch_options(device)

    def launch_all() -> None:
        for start, n, t, g, r in zip(starts, tiles, per_program, grids, readers):
            _read_kernel[(g,)](
                src[start:], out, n, t, BLOCK=r.block, STAGES=r.stages, PREFETCH=prefetch, num_warps=4, **opts
            )

    return graph_ms([launch_all])


def time_persistent(sizes: list[int], block: int, per_sm: int, warps: int, ahead: bool, device: torch.device) -> float:
    """ms per replay of a graph running the whole chain in one `_persistent_read_kernel`
    launch (`per_sm` programs of `warps` warps per multiprocessor, all resident; a grid barrier
    between operations), the barrier's counter zeroed first."""
    programs = per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    tiles = [max(1, math.ceil(s / 2 / block)) for s in sizes]
    starts = [sum(tiles[:i]) * block for i in range(len(tiles))]
    src = torch.empty(sum(tiles) * block, dtype=torch.bfloat16, device=device).normal_()
    starts_t = torch.tensor(starts, dtype=torch.int64, device=device)
    tiles_t = torch.tensor(tiles, dtype=torch.int32, device=device)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    out = torch.empty(programs, dtype=torch.float32, device=device)

    args = (src, starts_t, tiles_t, counter, out, len(sizes))
    compiled = _persistent_read_kernel.warmup(*args, BLOCK=block, AHEAD=ahead, num_warps=warps, grid=(1,))
    compiled._init_handles()  # fills n_regs
    registers = getattr(torch.cuda.get_device_properties(device), "regs_per_multiprocessor", 65536)
    if per_sm * compiled.n_regs * 32 * warps > registers:  # not all resident: the barrier would never open
        return math.inf

    def launch() -> None:
        counter.zero_()
        _persistent_read_kernel[(programs,)](*args, BLOCK=block, AHEAD=ahead, num_warps=warps)

    return graph_ms([launch])


def per_size_readers(
    sizes: list[int], readers: list[Reader], start: Reader, start_ms: float, prefetch: bool, device: torch.device
) -> tuple[float, dict[int, Reader]]:
    """One pass of coordinate descent from the best uniform reader: for each distinct size
    (largest total bytes first), the reader that makes the whole chain fastest, the other
    sizes' readers held."""
    chosen = dict.fromkeys(set(sizes), start)
    best_ms = start_ms
    for size in sorted(chosen, key=lambda s: -s * sizes.count(s)):
        for r in readers:
            trial = {**chosen, size: r}
            ms = time_chain(sizes, [trial[s] for s in sizes], prefetch, device)
            if ms < best_ms:
                best_ms, chosen = ms, trial
    return best_ms, chosen


def real_graph_ms(name: str) -> float:
    from latency import batch1_graph_ms, fresh_prompt, one_run

    from nanoserve import LLM

    llm = LLM(name, load_format="dummy", max_model_len=1024, kv_cache_tokens=16384, max_num_seqs=8)
    one_run(llm.engine, fresh_prompt(0), "warm")
    ms = batch1_graph_ms(llm.engine)
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return ms


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "qwen3-0.6b", "llama-3.1-8b"])
    ap.add_argument("--context", type=int, default=192, help="tokens in the KV cache (latency.py: 128 + 64)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--blocks", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--stages", type=int, nargs="+", default=[1])
    ap.add_argument("--per-sm", type=int, nargs="+", default=[4, 8, 16], help="grids of this many programs per SM")
    ap.add_argument(
        "--tiles", type=int, nargs="+", default=[1, 2, 4, 16], help="grids of one program per this many tiles"
    )
    ap.add_argument("--prefetch", action="store_true", help="prefetch each program's first tile before the PDL wait")
    ap.add_argument("--per-size", action="store_true", help="then refine: a reader per kernel size (per_size_readers)")
    ap.add_argument("--persistent", action="store_true", help="also the step as one launch with grid barriers")
    ap.add_argument("--persistent-per-sm", type=int, nargs="+", default=[1, 2], help="its programs per SM")
    ap.add_argument("--real", action="store_true", help="also replay the model's own batch-1 graph")
    args = ap.parse_args()
    device = torch.device("cuda")
    for name in args.models:
        cfg = json.loads((BUNDLED_DIR / f"{name}.json").read_text())
        chain = chain_for(cfg, args.context, torch.cuda.get_device_properties(device).multi_processor_count)
        total = sum(variant(chain, "flat"))
        line = [f"{name}: {total / 1e9:.2f} GB read, {len(chain)} kernels"]
        readers = [Reader(b, st, p, 0) for b in args.blocks for st in args.stages for p in args.per_sm]
        readers += [Reader(b, st, 0, t) for b in args.blocks for st in args.stages for t in args.tiles]
        for v in args.variants:
            sizes = variant(chain, v)
            uniform = {r: time_chain(sizes, [r] * len(sizes), args.prefetch, device) for r in readers}
            best, ms = min(uniform.items(), key=lambda kv: kv[1])
            line.append(f"{v} ({len(sizes)} kernels) {ms:.3f} ms = {total / ms / 1e9:.2f} TB/s [{best}]")
            if args.per_size and len(set(sizes)) > 1:
                ms, chosen = per_size_readers(sizes, readers, best, ms, args.prefetch, device)
                picks = ", ".join(f"{size / 1e6:g} MB: {r}" for size, r in sorted(chosen.items()))
                line.append(f"{v}, a reader per size {ms:.3f} ms = {total / ms / 1e9:.2f} TB/s [{picks}]")
        if args.persistent:
            ms = time_persistent([0] * len(chain), 1024, 1, 4, False, device)
            print(f"{name}: one persistent launch, {len(chain)} barriers and nothing read {ms:.3f} ms", flush=True)
            step = variant(chain, "step")
            for ahead, b, p, w in itertools.product((False, True), args.blocks, args.persistent_per_sm, (4, 8)):
                ms = time_persistent(step, b, p, w, ahead, device)
                print(
                    f"{name}: one persistent launch, {len(chain)} operations"
                    f"{', next tile to L2 early' if ahead else ''} [block {b}, {p}/SM, {w} warps]: {ms:.3f} ms",
                    flush=True,
                )
        if args.real:
            line.append(f"real graph {real_graph_ms(name):.3f} ms")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
