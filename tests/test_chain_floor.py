"""`benchmarks/probes/chain_floor.py` on the CPU: the step's kernel list and bytes it builds
from a bundled config, its variants (the same bytes in fewer kernels), the coordinate descent
over readers, and its two read kernels in Triton's interpreter (conftest sets TRITON_INTERPRET=1
without a GPU). Its timings need a GPU and are not tested here."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "probes"))

import chain_floor

from nanoserve.kernels.attention import MIN_SPLIT_TOKENS
from nanoserve.models.registry import BUNDLED_DIR

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
interp = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (set by conftest without a GPU)")


def config(name: str) -> dict:
    return json.loads((BUNDLED_DIR / f"{name}.json").read_text())


def test_qwen3_moe_chain_reads_the_active_weights_in_eleven_kernels_a_layer():
    cfg = config("qwen3-30b-a3b")
    chain = chain_floor.chain_for(cfg, context=192)
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    assert len(chain) == 11 * layers + 3
    assert [k.name for k in chain[:11]] == [
        "norm", "qkv", "rotary", "attention", "reduce", "o_proj", "norm", "router", "route", "gate_up", "down",
    ]  # fmt: skip
    # Issue 25's floor: 6.1 GB of active weights a token (attention, router, 8 of 128 experts, LM head).
    attention = hidden * (32 + 2 * 4) * 128 * 2 + 32 * 128 * hidden * 2
    experts = 8 * 3 * 768 * hidden * 2
    weights = layers * (attention + 128 * hidden * 2 + experts) + cfg["vocab_size"] * hidden * 2
    kv = layers * 192 * 4 * 128 * 2 * 2
    assert sum(k.bytes for k in chain) == weights + kv
    assert 6.0e9 < weights < 6.2e9


def test_dense_chains_follow_the_real_step():
    llama = chain_floor.chain_for(config("llama-3.1-8b"), context=192)
    assert "rotary" not in {k.name for k in llama}  # rotated in the qkv GEMV's epilogue
    short = chain_floor.chain_for(config("qwen3-0.6b"), context=MIN_SPLIT_TOKENS)
    assert "reduce" not in {k.name for k in short}  # one split writes its output directly
    assert {k.name for k in short} >= {"rotary", "gate_up", "down", "lm_head", "sampler"}


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "llama-3.1-8b"])
def test_variants_keep_the_bytes_in_fewer_kernels(name):
    cfg = config(name)
    chain = chain_floor.chain_for(cfg, context=192)
    layers = cfg["num_hidden_layers"]
    sizes = {v: chain_floor.variant(chain, v) for v in chain_floor.VARIANTS}
    assert len({sum(s) for s in sizes.values()}) == 1
    assert len(sizes["step"]) == len(chain)
    assert len(sizes["weights"]) == sum(k.bytes > 0 for k in chain)
    assert len(sizes["block"]) == 2 * layers + 1
    assert len(sizes["layer"]) == layers + 1
    assert len(sizes["flat"]) == 1


def test_per_size_readers_keeps_the_best_reader_per_size(monkeypatch):
    slow, fast = chain_floor.Reader(512, 1, 4, 0), chain_floor.Reader(4096, 1, 0, 2)

    def fake_time(sizes, readers, prefetch, device):  # the big size reads faster with `fast`, the small slower
        return sum(s * (0.5 if (r == fast) == (s > 10) else 1.0) for s, r in zip(sizes, readers))

    monkeypatch.setattr(chain_floor, "time_chain", fake_time)
    sizes = [100, 5, 100, 5]
    ms, chosen = chain_floor.per_size_readers(sizes, [slow, fast], slow, fake_time(sizes, [slow] * 4, 0, 0), 0, 0)
    assert chosen == {100: fast, 5: slow}
    assert ms == fake_time(sizes, [fast, slow, fast, slow], 0, 0)


@interp
@pytest.mark.parametrize("num_tiles, per_program", [(10, 3), (7, 7), (1, 4)])
def test_read_kernel_sums_every_tile_once(num_tiles, per_program):
    block = 64
    src = torch.randn(num_tiles * block).to(torch.bfloat16)
    programs = -(-num_tiles // per_program)
    out = torch.zeros(programs)
    chain_floor._read_kernel[(programs,)](
        src, out, num_tiles, per_program, BLOCK=block, STAGES=1, PREFETCH=False, USE_PDL=False
    )
    expected = src.float().view(num_tiles, block)
    for p in range(programs):
        torch.testing.assert_close(out[p], expected[p * per_program : (p + 1) * per_program].sum())


@interp
def test_persistent_kernel_reads_every_operation_and_crosses_every_barrier():
    # One program only: the interpreter runs programs one after another, so a second one
    # would never reach the barrier the first waits at.
    block, tiles = 64, [3, 1, 5]
    starts = torch.tensor([0, 3 * block, 4 * block])
    src = torch.randn(sum(tiles) * block).to(torch.bfloat16)
    out, counter = torch.zeros(1), torch.zeros(1, dtype=torch.int32)
    chain_floor._persistent_read_kernel[(1,)](
        src, starts, torch.tensor(tiles, dtype=torch.int32), counter, out, len(tiles), BLOCK=block, AHEAD=False
    )
    torch.testing.assert_close(out[0], src.float().sum())
    assert counter.item() == len(tiles)
