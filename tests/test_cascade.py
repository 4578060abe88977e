"""Cascade decode attention: the host planner's invariants, and the cascade kernels against
plain decode and the torch reference.

CPU tests run the kernels in Triton's interpreter on tiny shapes (conftest sets
TRITON_INTERPRET=1 without a GPU); `pytest -m gpu tests/test_cascade.py` runs the real
shapes of qwen3-0.6b and llama-3.1-8b on CUDA, plainly and replayed from a CUDA graph.
Batches are drawn at random: groups that share a prefix of pages (of random length, not
page-aligned in tokens, some longer than a work item holds), members with their own suffix
pages, requests in no group, a request whose whole table equals another's but is shorter,
and padding rows of length 0. Unused cache slots hold large poison values and outputs start
as NaN, so a wrong slot read or an unwritten element fails.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import random

import numpy as np
import pytest
import torch

from nanoserve.attention.base import AttentionMetadata, CascadeInputs
from nanoserve.attention.cascade import (
    ITEM_FIELDS,
    MAX_CASCADE_PARTS,
    max_cascade_items,
    plan_cascade,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
POISON = 50.0
F = {name: i for i, name in enumerate(ITEM_FIELDS)}


def random_batch(rng: random.Random, page_size: int, max_pages: int, num_groups: int, group_size: tuple[int, int]):
    """Page tables [B, width] and seq_lens [B] of a decode batch whose groups share leading
    pages; returns (table, seq_lens, num_pages used + 1). Page ids are shuffled, 0 unused."""
    lens_pages: list[tuple[list[int], int]] = []  # (pages, seq_len)
    next_page = [1]

    def new_pages(k):
        out = list(range(next_page[0], next_page[0] + k))
        next_page[0] += k
        return out

    for _ in range(num_groups):
        shared = new_pages(rng.randint(1, max_pages - 1))
        for _ in range(rng.randint(*group_size)):
            own = rng.randint(0, max_pages - len(shared))
            seq = rng.randint(max(1, (len(shared) + own - 1) * page_size + 1), (len(shared) + own) * page_size)
            pages = shared + new_pages(own)
            seq = min(seq, len(pages) * page_size)
            lens_pages.append((pages[: -(-seq // page_size)], seq))
    for _ in range(rng.randint(0, 3)):  # requests in no group
        pages = new_pages(rng.randint(1, max_pages))
        lens_pages.append((pages, rng.randint((len(pages) - 1) * page_size + 1, len(pages) * page_size)))
    rng.shuffle(lens_pages)
    for _ in range(rng.randint(0, 2)):  # padding rows
        lens_pages.append(([], 0))
    # shuffle page ids so that sharing is by id, not by range
    perm = list(range(1, next_page[0]))
    rng.shuffle(perm)
    remap = {i + 1: p for i, p in enumerate(perm)}
    width = max_pages + 1
    table = np.zeros((len(lens_pages), width), dtype=np.int32)
    for i, (pages, _) in enumerate(lens_pages):
        table[i, : len(pages)] = [remap[p] for p in pages]
    seq_lens = np.array([s for _, s in lens_pages], dtype=np.int64)
    return table, seq_lens, next_page[0]


def check_plan(plan, table, seq_lens, page_size, max_members, max_items, min_tokens):
    """Every invariant of nanoserve.attention.cascade's docstring."""
    n = len(seq_lens)
    items = plan.items
    used = items[:, F["count"]] > 0
    assert not items[~used].any(), "unused items must be all zeros"
    assert used.sum() <= max_items
    listed = np.zeros(n, dtype=bool)
    covered: dict[int, list[tuple[int, int, int]]] = {}
    for it in items[used]:
        first, count = it[F["first_member"]], it[F["count"]]
        assert 2 <= count <= max_members
        rows = plan.members[first : first + count]
        assert it[F["table_row"]] in rows
        covered.setdefault(int(first), []).append((int(it[F["part"]]), int(it[F["lo"]]), int(it[F["hi"]])))
        listed[rows] = True
    for first, parts in covered.items():
        parts.sort()
        assert [p for p, _, _ in parts] == list(range(len(parts))) and len(parts) <= MAX_CASCADE_PARTS
        assert parts[0][1] == 0 and all(a[2] == b[1] for a, b in itertools.pairwise(parts)), parts
        tokens = parts[-1][2]
        count = int(items[items[:, F["first_member"]] == first][0, F["count"]])
        rows = plan.members[first : first + count]
        assert tokens >= min_tokens
        assert (plan.prefix_len[rows] == tokens).all() and (plan.num_parts[rows] == len(parts)).all()
        assert (seq_lens[rows] > tokens).all(), "the new token must stay in the suffix"
        cols = -(-tokens // page_size)
        assert (table[rows, :cols] == table[rows[0], :cols]).all(), "members disagree on a prefix page"
        assert (table[rows, 0] != 0).all()
    assert (plan.prefix_len[~listed] == 0).all() and (plan.num_parts[~listed] == 0).all()
    assert sorted(plan.members[: listed.sum()].tolist()) == sorted(np.flatnonzero(listed).tolist())


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_plan_invariants_random(page_size):
    rng = random.Random(page_size)
    found = 0
    for trial in range(200):
        table, seq_lens, _ = random_batch(rng, page_size, rng.randint(2, 12), rng.randint(0, 5), (1, 9))
        max_members = rng.choice([2, 3, 8, 32])
        max_items = max_cascade_items(len(seq_lens))
        min_tokens = rng.choice([1, 2 * page_size, 256])
        plan = plan_cascade(table, seq_lens, page_size, max_members, max_items, rng.randint(1, 64), min_tokens)
        if plan is not None:
            found += 1
            check_plan(plan, table, seq_lens, page_size, max_members, max_items, min_tokens)
    assert found > 50  # the draw does produce groups


def test_plan_finds_the_shared_prefix():
    # 3 requests share 5 pages (page_size 4: 20 tokens), a 4th shares only the first page.
    table = np.array([[7, 8, 9, 10, 11, 1, 0], [7, 8, 9, 10, 11, 2, 3], [7, 8, 9, 10, 11, 4, 0],
                      [12, 13, 0, 0, 0, 0, 0]], dtype=np.int32)  # fmt: skip
    seq = np.array([23, 26, 22, 6])
    plan = plan_cascade(table, seq, 4, max_members=8, max_items=16, target_items=1, min_tokens=16)
    assert plan is not None and plan.num_groups == 1
    assert plan.prefix_len.tolist() == [20, 20, 20, 0]
    assert plan.num_parts.tolist() == [1, 1, 1, 0]
    assert sorted(plan.members[:3].tolist()) == [0, 1, 2]
    # a member whose length ends inside the shared pages bounds the group's prefix
    seq2 = np.array([23, 26, 13, 6])
    plan2 = plan_cascade(table, seq2, 4, max_members=8, max_items=16, target_items=1, min_tokens=4)
    assert plan2.prefix_len.tolist() == [12, 12, 12, 0]
    # no sharing, or too short to be worth it: no plan
    assert plan_cascade(table[[0, 3]], seq[[0, 3]], 4, 8, 16, 1, 4) is None
    assert plan_cascade(table, seq, 4, max_members=8, max_items=16, target_items=1, min_tokens=21) is None


def test_plan_splits_long_prefixes_and_big_groups():
    page_size = 16
    shared = list(range(1, 129))  # 2048 tokens
    table = np.zeros((40, 140), dtype=np.int32)
    for i in range(40):
        table[i, :129] = shared + [200 + i]
    seq = np.full(40, 2048 + 10)
    plan = plan_cascade(table, seq, page_size, max_members=16, max_items=max_cascade_items(40), target_items=12)
    assert plan.num_groups == 3  # 40 members, at most 16 per item: 14 + 13 + 13
    counts = sorted({int(c) for c in plan.items[plan.items[:, F["count"]] > 0, F["count"]]})
    assert counts == [13, 14]
    assert (plan.num_parts == 4).all()  # 12 items over 3 equal groups
    check_plan(plan, table, seq, page_size, 16, max_cascade_items(40), 256)


# ------------------------------------------------------------------------------ kernels


def decode_case(rng, page_size, num_q_heads, num_kv_heads, head_dim, dtype, device, groups, group_size, max_pages):
    table, seq_lens, num_pages = random_batch(rng, page_size, max_pages, groups, group_size)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, POISON)
    v_cache = torch.full(shape, -POISON)
    for i, s in enumerate(seq_lens):  # fill each request's positions (shared pages agree)
        pos = np.arange(s)
        slots = torch.from_numpy(table[i, pos // page_size].astype(np.int64) * page_size + pos % page_size)
        fresh = k_cache.view(-1, num_kv_heads, head_dim)[slots, 0, 0] == POISON
        kv = torch.randn(2, int(fresh.sum()), num_kv_heads, head_dim, generator=gen)
        k_cache.view(-1, num_kv_heads, head_dim)[slots[fresh]] = kv[0]
        v_cache.view(-1, num_kv_heads, head_dim)[slots[fresh]] = kv[1]
    n = len(seq_lens)
    q = torch.randn(n, num_q_heads, head_dim, generator=gen)
    to = {"device": device, "dtype": torch.int32}
    meta = AttentionMetadata(
        is_decode=True,
        seq_lens=torch.tensor(seq_lens, **to),
        prefix_lens=torch.tensor(np.maximum(seq_lens - 1, 0), **to),
        cu_query_lens=torch.arange(n + 1, **to),
        page_table=torch.from_numpy(table).to(device),
        slot_mapping=torch.zeros(n, dtype=torch.int64, device=device),
        seq_lens_host=seq_lens.tolist(),
        prefix_lens_host=np.maximum(seq_lens - 1, 0).tolist(),
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
    )
    return q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype), meta, table, seq_lens


def to_device(plan, device) -> CascadeInputs:
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)
    return CascadeInputs(t(plan.prefix_len), t(plan.num_parts), t(plan.members), t(plan.items))


def reference(q, k_cache, v_cache, meta, scale):
    """Decode attention in float64, request by request, from the page table; zeros for
    padding rows (length 0)."""
    page_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    kc, vc = k_cache.double().view(-1, num_kv_heads, head_dim), v_cache.double().view(-1, num_kv_heads, head_dim)
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for b, seq in enumerate(meta.seq_lens_host):
        if seq == 0:
            continue
        pos = torch.arange(seq, device=q.device)
        slots = meta.page_table[b, pos // page_size].long() * page_size + pos % page_size
        keys = kc[slots].repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = vc[slots].repeat_interleave(group, dim=1)
        weights = (torch.einsum("hd,shd->hs", q[b].double(), keys) * scale).softmax(dim=-1)
        out[b] = torch.einsum("hs,shd->hd", weights, values)
    return out, torch.tensor(meta.seq_lens_host, device=q.device) > 0


def run_cascade_check(rng, device, dtype, num_q_heads, num_kv_heads, head_dim, page_size, tol, graph=False):
    from nanoserve.kernels import attention as tk

    group = num_q_heads // num_kv_heads
    plan = None
    while plan is None:  # a draw whose groups all end up too short has no plan: draw again
        q, kc, vc, meta, table, seq_lens = decode_case(
            rng, page_size, num_q_heads, num_kv_heads, head_dim, dtype, device,
            groups=rng.randint(1, 4), group_size=(2, 2 * tk.cascade_max_members(group) + 1),
            max_pages=rng.randint(3, 10),
        )  # fmt: skip
        n = len(seq_lens)
        plan = plan_cascade(table, seq_lens, page_size, tk.cascade_max_members(group), max_cascade_items(n),
                            rng.randint(1, 24), min_tokens=rng.choice([1, page_size]))  # fmt: skip
    cascade = to_device(plan, device)
    scale = head_dim**-0.5
    ref, valid = reference(q, kc, vc, meta, scale)
    splits = rng.choice([1, 2, 3])
    ws = torch.empty(tk.workspace_numel(n, num_q_heads, head_dim, splits + MAX_CASCADE_PARTS), device=device)
    outs = {}
    for name, c in (("cascade", cascade), ("plain", None)):
        out = torch.full_like(q, float("nan"))
        if graph and name == "cascade":
            tk.paged_decode(q, kc, vc, meta.page_table, meta.seq_lens, scale, splits, ws, out, c)  # compile
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                tk.paged_decode(q, kc, vc, meta.page_table, meta.seq_lens, scale, splits, ws, out, c)
            out.fill_(float("nan"))
            g.replay()
        else:
            tk.paged_decode(q, kc, vc, meta.page_table, meta.seq_lens, scale, splits, ws, out, c)
        assert not torch.isnan(out).any(), f"{name}: unwritten element"
        assert (out[~valid] == 0).all(), f"{name}: padding rows must be zeros"
        outs[name] = out.double()
    for name, out in outs.items():
        err = ((out[valid] - ref[valid]).norm() / ref[valid].norm()).item()
        assert err < tol, f"{name} vs reference: relative error {err:.2e} (splits {splits}, groups {plan.num_groups})"
    err = ((outs["cascade"] - outs["plain"]).norm() / outs["plain"].norm()).item()
    assert err < tol, f"cascade vs plain: {err:.2e}"


interp = pytest.mark.skipif(
    not (HAS_TRITON and INTERPRET), reason="needs triton and TRITON_INTERPRET=1 (set by conftest without a GPU)"
)


@interp
@pytest.mark.parametrize("page_size,heads", [(4, (4, 2)), (1, (6, 2)), (8, (4, 4))])
def test_interp_cascade_matches_plain_and_reference(page_size, heads):
    rng = random.Random(page_size * 10 + heads[0])
    for _ in range(2):
        run_cascade_check(rng, "cpu", torch.float32, heads[0], heads[1], 16, page_size, tol=2e-3)


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("heads,head_dim", [((16, 8), 128), ((32, 8), 128), ((8, 8), 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cascade_gpu(heads, head_dim, dtype):
    rng = random.Random(hash((heads, head_dim, str(dtype))) & 0xFFFF)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for trial in range(6):
        run_cascade_check(rng, "cuda", dtype, heads[0], heads[1], head_dim, 16, tol, graph=trial % 2 == 1)


# ------------------------------------------------------------------------------ engine


def shared_prefix_run(model_dir, backend: str, graphs_bs: int = 0, **engine_args):
    """Greedy tokens of 9 requests that share a 272-token prefix (the cache holds it first,
    so the 9 decode over the very same pages), and the engine's stats after the run. With
    `graphs_bs`, decode graphs up to that size are emulated on the CPU (eager forwards on
    the graphs' static inputs, tests/test_host_fastpath.py); the stats then count the
    replays of cascade graphs."""
    from nanoserve import LLM, SamplingParams
    from tests.test_host_fastpath import emulate_graphs
    from tests.tiny import random_prompts

    llm = LLM(str(model_dir), device="cpu", attention_backend=backend, **engine_args)
    cascade_replays = [0]
    if graphs_bs:
        graphs = emulate_graphs(llm, graphs_bs)
        for (bs, variant), graph in graphs.graphs.items():
            if variant == "cascade":
                graph.replay = lambda replay=graph.replay: (
                    cascade_replays.__setitem__(0, cascade_replays[0] + 1),
                    replay(),
                )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prefix = [t for p in random_prompts(8, seed=5, min_len=34, max_len=34) for t in p][:272]
    tails = random_prompts(9, seed=6, min_len=1, max_len=20)
    llm.generate([prefix + tails[0]], params, use_tqdm=False)  # puts the prefix in the cache
    outs = llm.generate([prefix + t for t in tails], params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"], "page leak"
    stats["cascade_graph_replays"] = cascade_replays[0]
    return [o.outputs[0].token_ids for o in outs], stats


@interp
@pytest.mark.slow
def test_interp_engine_cascade_matches_plain(tmp_path, monkeypatch):
    """End to end on the CPU (Triton interpreter): requests decoding over a shared cached
    prefix take the cascade path, eagerly and through (emulated) decode graphs padded from
    9 to 16 rows, and their greedy tokens equal the torch backend's (which the plain Triton
    decode equals, tests/test_triton_attention.py)."""
    from nanoserve import LLM
    from nanoserve.kernels import attention as tk
    from tests.tiny import make_tiny_model

    # the prefill's extend kernel in 64-token tiles: a 272-token prompt in 16-token ones was a
    # fifth of this test's time under the interpreter (tests/test_triton_attention.py crosses
    # tiles on small shapes)
    monkeypatch.setattr(tk, "INTERPRET_EXTEND_CONFIG", {**tk.INTERPRET_EXTEND_CONFIG, "BLOCK_M": 64, "BLOCK_N": 64})
    path = make_tiny_model(tmp_path / "qwen3", "qwen3")
    args = {"page_size": 16, "dtype": "float32"}
    want, _ = shared_prefix_run(path, "torch", **args)
    got, stats = shared_prefix_run(path, "triton", **args)
    assert stats["cascade_decode_steps"] == 3  # every decode step of the 9 (4 tokens: 3 decodes)
    assert stats["prefix_cache_hit_tokens"] >= 9 * 256
    assert got == want
    got_graphs, stats = shared_prefix_run(path, "triton", graphs_bs=16, **args)
    assert stats["cascade_decode_steps"] == 3 and stats["cascade_graph_replays"] == 3
    assert got_graphs == want
    off = LLM(str(path), device="cpu", attention_backend="triton", cascade_attention=False, **args)
    assert off.engine.runner.cascade_members == 0


@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_cascade_gpu(dtype):
    """Dummy qwen3-0.6b on CUDA: requests over a shared 600-token cached prefix, decoded by
    the cascade graphs (24 requests: graph of 32) and eagerly (40: above the largest graph),
    against the same engine with cascade off. fp32 must agree on every prompt; bf16 by the
    fast-path criterion (tests/test_gpu_fastpath.py)."""
    from nanoserve import LLM, SamplingParams
    from tests.test_gpu_fastpath import assert_as_close_to_fp32, compare

    rng = random.Random(7)
    prefix = [rng.randrange(20000) for _ in range(600)]
    prompts = [prefix + [rng.randrange(20000) for _ in range(rng.randint(1, 60))] for _ in range(64)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    runs = {}
    for cascade in (True, False):
        llm = LLM("qwen3-0.6b", load_format="dummy", dtype=dtype, max_model_len=1024, kv_cache_tokens=131072,
                  max_num_seqs=64, cuda_graph_max_bs=32, cascade_attention=cascade)  # fmt: skip
        llm.generate([prompts[0]], params, use_tqdm=False)  # the prefix into the cache
        result = []
        for wave in (prompts[1:25], prompts[25:65]):
            outs = llm.generate(wave, params, use_tqdm=False)
            result += [(o.outputs[0].token_ids, [lp.top for lp in o.outputs[0].logprobs]) for o in outs]
        stats = llm.stats()
        assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
        assert (stats["cascade_decode_steps"] > 0) == cascade, stats
        runs[cascade] = ([t for t, _ in result], [k for _, k in result])
        del llm
        torch.cuda.empty_cache()
    if dtype == "float32":
        compare(runs[True], runs[False], "cascade vs plain (float32)", 1.0)
        _fp32_runs["plain"] = runs[False]
    else:  # the bf16 bar (tests/test_gpu_fastpath.py): as close to fp32 as plain attention's bf16
        compare(runs[True], runs[False], "cascade vs plain (bfloat16)", 0.0)
        assert "plain" in _fp32_runs, "run with the float32 case first (parametrize order)"
        assert_as_close_to_fp32(runs[True], runs[False], _fp32_runs["plain"], "cascade vs plain (bfloat16)")


_fp32_runs: dict = {}  # the float32 case's plain run, the bf16 case's fp32 reference
