"""The decode graphs' first kernel: the embedding lookup fused with the first layer's input
norm, reading the input ids still being sampled from the token pool
(`kernels.norm.embed_rms_norm`), against its torch twin; and the embedding layer's torch path
with and without a pool.

CPU tests run the kernel in Triton's interpreter (conftest sets TRITON_INTERPRET=1 when no GPU
is present); GPU tests (`pytest -m gpu tests/test_embedding.py`) run llama-3.1-8b's table
width, also inside a CUDA graph, and compare with the unfused lookup + norm kernel.
"""

from __future__ import annotations

import os

import pytest
import torch

from nanoserve.kernels import norm

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
interp = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (set by conftest without a GPU)")
ON_CPU = pytest.param("cpu", marks=interp)
ON_GPU = pytest.param("cuda", marks=pytest.mark.gpu)
EPS = 1e-5


def case(rows: int, vocab: int, dim: int, dtype, device, seed: int = 0):
    """A table, a norm weight, ids with every other row pending (-1) and the rest plain, a pool
    holding other tokens and each row's entry in it."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(vocab, dim, generator=gen).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype).to(device)
    ids = torch.randint(0, vocab, (rows,), generator=gen)
    ids[::2] = -1
    pool = torch.randint(0, vocab, (rows + 3,), generator=gen)
    index = torch.randperm(rows + 3, generator=gen)[:rows]
    return table, weight, ids.to(device), pool.to(device), index.to(device)


@pytest.mark.parametrize("device", [ON_CPU, ON_GPU])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_embed_rms_norm_equals_the_lookup_and_the_norm(device, dtype):
    """The gathered rows are exact; the normed rows equal the norm kernel's on those rows (the
    same kernel body) and the torch reference within one rounding step; the pending ids are
    resolved in place and the others left alone."""
    shapes = [(1, 50, 96), (5, 50, 130)] if device == "cpu" else [(1, 128256, 4096), (256, 128256, 4096), (3, 997, 130)]
    for rows, vocab, dim in shapes:
        table, weight, ids, pool, index = case(rows, vocab, dim, dtype, device)
        resolved = torch.where(ids < 0, pool[index], ids)
        want, want_rows = norm.embed_rms_norm_reference(ids.clone(), pool, index, table, weight, EPS)
        got, got_rows = norm.embed_rms_norm(ids, pool, index, table, weight, EPS)
        assert torch.equal(ids, resolved), "the pending ids were not resolved in place"
        assert torch.equal(got_rows, table[resolved]) and torch.equal(got_rows, want_rows)
        assert torch.equal(got, norm.rms_norm(table[resolved], weight, EPS)), (rows, vocab, dim)
        tol = 2**-6 if dtype == torch.bfloat16 else 1e-5  # two bf16 steps: normalised value, then the weight
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_embedding_layer_reads_pending_ids_from_the_pool():
    """The layer with a pool (the torch path) equals a lookup of the resolved ids; without
    one, ids are looked up as they are."""
    from nanoserve.models.layers import VocabParallelEmbedding

    layer = VocabParallelEmbedding(50, 16)
    table, _, ids, pool, index = case(6, 50, 16, torch.float32, "cpu")
    resolved = torch.where(ids < 0, pool[index], ids)
    with torch.no_grad():
        layer.weight.copy_(table)
        got = layer(ids, (pool, index))
        assert torch.equal(ids, resolved)
        assert torch.equal(got, table[resolved])
        assert torch.equal(layer(resolved), got)


@pytest.mark.gpu
def test_gpu_embed_rms_norm_in_a_cuda_graph_reads_the_pool_at_replay():
    """Captured once, each replay reads the ids and the pool as they are at replay time."""
    table, weight, ids, pool, index = case(4, 128256, 4096, torch.bfloat16, "cuda")
    static_ids = ids.clone()
    norm.embed_rms_norm(static_ids, pool, index, table, weight, EPS)  # warm-up (compiles)
    static_ids.copy_(ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, rows = norm.embed_rms_norm(static_ids, pool, index, table, weight, EPS)
    for step in range(3):
        pool.random_(0, 128256)
        static_ids.copy_(ids)
        graph.replay()
        resolved = torch.where(ids < 0, pool[index], ids)
        torch.cuda.synchronize()
        assert torch.equal(static_ids, resolved), step
        assert torch.equal(rows, table[resolved]), step
        assert torch.equal(out, norm.rms_norm(table[resolved], weight, EPS)), step
