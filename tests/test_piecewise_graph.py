"""Piecewise CUDA graphs for prefill/extend batches (nanoserve.engine.piecewise_graph).

CPU: the piece-chained forward equals a reference forward written out plainly (residual
stream, per-prompt causal attention); the size schedule and the rounding up; the replay
path's padding and slicing, run without graphs (each piece's body on the padded static
buffers) against the eager forward, with poisoned pad rows, K/V written to real slots only,
and through the whole engine.
GPU (`pytest -m gpu tests/test_piecewise_graph.py`): dummy qwen3-0.6b in bf16, greedy tokens
with piecewise graphs vs without for prompts of 1 to 4096 tokens, in batches that hit
captured sizes exactly, just above them and above the largest, first from scratch and then
again as extends of cached prefixes; nothing leaks.
"""

from __future__ import annotations

import argparse
import random

import pytest
import torch
import torch.nn.functional as F

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig, add_engine_args, engine_config_from_args
from nanoserve.engine.piecewise_graph import KEEP_WITHIN, PiecewiseGraphs, largest_winning_size, piecewise_sizes
from nanoserve.kernels.norm import rms_norm_reference
from nanoserve.kernels.rotary import rope_reference
from nanoserve.kvcache.pool import PageTable
from nanoserve.scheduler.request import Request
from nanoserve.scheduler.scheduler import ScheduledBatch
from tests.tiny import LINEAR, TINY_CONFIGS, VOCAB, make_tiny_model, random_prompts

# ---------------------------------------------------------------------------- schedule

FULL_SCHEDULE = (
    [4, 8, 12, 16, 20, 24, 28, 32]
    + [48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256]
    + [288, 320, 352, 384, 416, 448, 480, 512]
    + [576, 640, 704, 768, 832, 896, 960, 1024]
    + [1280, 1536, 1792, 2048, 2304, 2560, 2816, 3072, 3328, 3584, 3840, 4096]
)


def test_schedule_exact_and_capped():
    assert piecewise_sizes(8192) == FULL_SCHEDULE
    assert piecewise_sizes(4096) == FULL_SCHEDULE
    assert piecewise_sizes(1000) == FULL_SCHEDULE[: FULL_SCHEDULE.index(960) + 1]
    assert piecewise_sizes(288) == FULL_SCHEDULE[: FULL_SCHEDULE.index(288) + 1]
    assert piecewise_sizes(4) == [4]
    assert piecewise_sizes(3) == []


def test_largest_winning_size():
    """Sizes at which graphs are slower than eager are dropped: for every crossover (graphs
    win up to some size, lose above), the search finds it within a few probes."""
    sizes = FULL_SCHEDULE
    for last_win in [None, *sizes]:
        probes = []

        def wins(n, last_win=last_win, probes=probes):
            probes.append(n)
            return last_win is not None and n <= last_win

        assert largest_winning_size(sizes, wins) == last_win
        assert len(probes) <= 8, probes
    assert largest_winning_size([4], lambda n: True) == 4
    assert largest_winning_size([4], lambda n: False) is None


# ------------------------------------------------------------------------ tiny models


@pytest.fixture(scope="module", params=sorted(set(TINY_CONFIGS) - set(LINEAR)))  # LINEAR: no piecewise graphs
def tiny_llm(request, tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny") / request.param, request.param)
    return LLM(str(model_dir), device="cpu", dtype="float32", kv_cache_tokens=4096, enable_prefix_caching=False)


def test_off_on_cpu_and_flag(tiny_llm):
    assert tiny_llm.engine.runner.piecewise is None  # never captured on CPU
    assert EngineConfig().piecewise_cuda_graphs
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    add_engine_args(parser)
    assert not engine_config_from_args(parser.parse_args(["m", "--no-piecewise-graphs"])).piecewise_cuda_graphs
    assert engine_config_from_args(parser.parse_args(["m"])).piecewise_cuda_graphs


def make_batch(lengths: list[int], prefixes: list[int], page_size: int, seed: int) -> ScheduledBatch:
    """Requests with `prefixes[r]` tokens already in the cache and `lengths[r]` new ones,
    on distinct pages starting at page 1 (page 0 is the reserved one)."""
    rng = random.Random(seed)
    requests, next_page = [], 1
    table = PageTable(len(lengths), max(-(-(pre + n) // page_size) for n, pre in zip(lengths, prefixes)))
    for r, (n, pre) in enumerate(zip(lengths, prefixes)):
        total = pre + n
        pages = list(range(next_page, next_page + -(-total // page_size)))
        next_page += len(pages)
        ids = [rng.randrange(VOCAB) for _ in range(total)]
        requests.append(Request(str(r), SamplingParams(), total, ids, arrival=r, num_computed=pre, pages=pages, slot=r))
        table.assign(r, pages)
    return ScheduledBatch(requests, list(lengths), is_decode=False, page_table=table)


def reference_hidden(model, input_ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Final hidden states of prompts computed from scratch, written out plainly: the
    residual stream as a running sum, causal attention per prompt with SDPA."""
    out, start = [], 0
    for n in lengths:
        x = model.embed_tokens.weight[input_ids[start : start + n]]
        positions = torch.arange(n)
        for layer in model.layers:
            a = layer.self_attn
            h = rms_norm_reference(x, layer.input_layernorm.weight, layer.input_layernorm.eps)
            qkv = F.linear(h, a.qkv_proj.weight, a.qkv_proj.bias)
            q, k, v = qkv.split(
                [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim], -1
            )
            q, k, v = (t.reshape(n, -1, a.head_dim) for t in (q, k, v))
            if a.q_norm is not None:
                q = rms_norm_reference(q, a.q_norm.weight, a.q_norm.eps)
                k = rms_norm_reference(k, a.k_norm.weight, a.k_norm.eps)
            q, k = rope_reference(positions, q, k, model.rotary.cos, model.rotary.sin)
            group = a.num_heads // a.num_kv_heads
            k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
            o = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=a.scale)
            x = x + F.linear(o.transpose(0, 1).reshape(n, -1), a.o_proj.weight)
            h = rms_norm_reference(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
            gate, up = F.linear(h, layer.mlp.gate_up_proj.weight).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.mlp.down_proj.weight)
        out.append(rms_norm_reference(x, model.norm.weight, model.norm.eps))
        start += n
    return torch.cat(out)


@torch.inference_mode()
def test_piece_chained_forward_equals_reference(tiny_llm):
    runner = tiny_llm.engine.runner
    if runner.model.config.model_type in ("gemma3_text", "gpt_oss"):
        pytest.skip("reference_hidden writes out the Llama/Qwen block; Gemma 3 and gpt-oss meet transformers instead")
    lengths = [1, 7, 30]
    inputs = runner.prepare(make_batch(lengths, [0, 0, 0], runner.page_size, seed=1), [0, 1, 2])
    runner.backend.prepare(inputs.meta)
    from nanoserve.attention.base import ForwardBatch

    batch = ForwardBatch(inputs.meta, runner.backend, runner.kv_cache.k, runner.kv_cache.v)
    got = runner.model(inputs.input_ids, inputs.positions, batch)
    want = reference_hidden(runner.model, inputs.input_ids, lengths)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# (new tokens per request, cached prefix per request): totals at captured sizes exactly,
# just above, one token, and above the largest size (eager); some extend a prefix.
SMALL_CAP = 64  # schedule 4..32 step 4, 48, 64
CASES = {
    "1 token": ([1], [0]),
    "exactly 8": ([5, 3], [0, 0]),
    "9 -> 12": ([4, 5], [0, 0]),
    "exactly 48, extends": ([20, 20, 8], [0, 17, 40]),
    "49 -> 64, extends": ([30, 19], [33, 5]),
    "exactly 64": ([64], [0]),
    "65: above the largest, eager": ([40, 25], [0, 9]),
}


@torch.inference_mode()
@pytest.mark.parametrize("case", list(CASES))
def test_padded_pieces_equal_eager(tiny_llm, case):
    """The replay path without graphs: the same static buffers, padding and slicing. Pad
    rows start poisoned (NaN, out-of-prompt ids and positions): real rows must not notice,
    and K/V may change only in the batch's own slots."""
    runner = tiny_llm.engine.runner
    lengths, prefixes = CASES[case]
    num_tokens = sum(lengths)
    pw = PiecewiseGraphs(runner.model, piecewise_sizes(SMALL_CAP), runner.device, torch.float32)
    padded = pw.padded_size(num_tokens)
    assert (padded is None) == (num_tokens > SMALL_CAP)
    assert padded is None or padded == min(s for s in FULL_SCHEDULE if s >= num_tokens)
    for cache in (*runner.kv_cache.k, *runner.kv_cache.v):
        cache.normal_()  # the cached prefixes: anything, as long as both runs read the same
    batch = make_batch(lengths, prefixes, runner.page_size, seed=len(case))
    sample_rows = list(range(len(lengths)))
    inputs = runner.prepare(batch, sample_rows)
    runner.piecewise = None
    want = runner.execute(inputs)
    before = [c.clone() for c in (*runner.kv_cache.k, *runner.kv_cache.v)]
    for buf in (pw.residual, pw.q, pw.k, pw.v, pw.attn_out, pw.hidden):
        buf.fill_(float("nan"))
    pw.input_ids.fill_(VOCAB - 1)
    pw.positions.fill_(runner.model.rotary.cos.shape[0] - 1)
    runner.piecewise = pw
    try:
        got = runner.execute(inputs)
    finally:
        runner.piecewise = None
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert dict(pw.replays) == ({} if padded is None else {padded: 1})
    # The batch's own slots: with window groups (Gemma 3, gpt-oss) the sliding layers write
    # their group's slots in the same pool, which the group's page map gives (pages it never
    # assigned, as this hand-made batch's, map to the reserved page 0).
    slots = [inputs.meta.slot_mapping]
    if runner.window_map is not None:
        slots += [s for _, s in runner.window_map.group_tables(inputs.meta.page_table, inputs.meta.slot_mapping)]
    touched = torch.zeros(runner.kv_cache.num_pages * runner.page_size, dtype=torch.bool)
    touched[torch.cat(slots)] = True
    for old, new in zip(before, (*runner.kv_cache.k, *runner.kv_cache.v)):
        flat_old, flat_new = old.flatten(0, 1), new.flatten(0, 1)
        assert torch.equal(flat_old[~touched], flat_new[~touched])  # nothing outside the batch's slots
        torch.testing.assert_close(flat_new[touched], flat_old[touched])  # the same K/V as eager wrote


@torch.inference_mode()
def test_rank0_decides_and_sizes_win_on_every_rank(tiny_llm):
    """Tensor parallelism's two agreements, without processes: a step's `piecewise` flag
    (rank 0's decision) overrides the runner's own, and a rank without the graphs refuses it;
    a size at which graphs win here is kept only if `agree` (every rank) says so."""
    runner = tiny_llm.engine.runner
    pw = PiecewiseGraphs(runner.model, piecewise_sizes(SMALL_CAP), runner.device, torch.float32)
    batch = make_batch([5, 3], [0, 0], runner.page_size, seed=3)
    inputs = runner.prepare(batch, [0, 1])
    runner.piecewise = pw
    try:
        assert runner.uses_piecewise(inputs)
        inputs.piecewise = False  # rank 0 runs this step eagerly: so does this rank
        runner.execute(inputs)
        assert not pw.replays
        inputs.piecewise = True
        runner.execute(inputs)
        assert dict(pw.replays) == {8: 1}
        runner.piecewise = None
        with pytest.raises(RuntimeError, match="has not captured"):
            runner.execute(inputs)
    finally:
        runner.piecewise = None
    pw._chain_seconds = lambda n, replay: 1.0 if replay else 2.0  # graphs win on this rank
    for other_rank_wins in (True, False):
        verdicts = []

        def agree(value, device, other=other_rank_wins, verdicts=verdicts):
            verdicts.append(value)
            return value and other

        pw.agree = agree
        assert pw._graphs_win(8) == other_rank_wins
        assert verdicts == [True]


@pytest.mark.parametrize("tiny_llm", ["llama"], indirect=True)  # the rule reads timings only
@torch.inference_mode()
def test_graphs_stay_near_parity(tiny_llm):
    """A size keeps its graphs unless replaying takes over KEEP_WITHIN times eager: near
    parity the timing's sign is noise, and an eager step also holds the host thread."""
    runner = tiny_llm.engine.runner
    pw = PiecewiseGraphs(runner.model, piecewise_sizes(SMALL_CAP), runner.device, torch.float32)
    for replay_over_eager, kept in ((0.5, True), (1.0, True), (0.99 * KEEP_WITHIN, True), (1.01 * KEEP_WITHIN, False)):
        pw._chain_seconds = lambda n, replay, r=replay_over_eager: r if replay else 1.0
        assert pw._graphs_win(8) == kept, replay_over_eager


def test_engine_with_piecewise_path_equals_eager(tmp_path):
    """Whole engine on CPU with the uncaptured piecewise path routed in: same greedy tokens
    as the eager engine, prefill batches ran through it, nothing leaked."""
    model_dir = make_tiny_model(tmp_path / "llama", "llama")
    prompts = random_prompts(6, seed=5, min_len=1, max_len=30)  # 93 tokens: batches of <= 64 and above
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kw = {"device": "cpu", "dtype": "float32", "kv_cache_tokens": 4096, "chunked_prefill_size": 64}
    want = [o.outputs[0].token_ids for o in LLM(str(model_dir), **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(model_dir), **kw)
    runner = llm.engine.runner
    runner.piecewise = PiecewiseGraphs(runner.model, piecewise_sizes(SMALL_CAP), runner.device, torch.float32)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert sum(runner.piecewise.replays.values()) >= 2  # the prompts needed two chunks of <= 64
    stats = llm.stats()
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"], stats


# ------------------------------------------------------------------------------- GPU

GPU_MODEL = "qwen3-0.6b"
NEW = 8
# One generate call per batch: its prompts are prefilled in one step (8192-token budget).
GPU_BATCHES = {
    "1 token": [1],
    "exactly 4": [4],
    "5 -> 8": [5],
    "exactly 32 in 4": [8, 8, 8, 8],
    "33 -> 48": [17, 16],
    "exactly 48 in 3": [16, 16, 16],
    "exactly 256 in 3": [100, 100, 56],
    "257 -> 288": [100, 100, 57],
    "mixed 619 -> 640": [1, 2, 3, 100, 513],
    "exactly 1024": [1024],
    "1025 -> 1280": [1025],
    "4095 -> 4096": [4095],
    "exactly 4096": [4096],
    "exactly 4096 in 3": [1000, 1000, 2096],
    "4097: above the largest": [4097],
    "5000 in 2: above the largest": [3000, 2000],
}


def gpu_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(20000) for _ in range(n)] for n in lengths]


def gpu_llm(**kw) -> LLM:
    return LLM(
        GPU_MODEL,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=8192,
        kv_cache_tokens=131072,
        max_num_seqs=16,
        cuda_graph_max_bs=16,
        **kw,
    )


def gpu_runs(llm: LLM):
    """Every batch twice: from scratch, then again (extends of the cached prefixes)."""
    from tests.test_gpu_fastpath import assert_idle

    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=5)
    tokens, top5 = [], []
    for again in (False, True):
        for seed, lengths in enumerate(GPU_BATCHES.values()):
            outs = llm.generate(gpu_prompts(lengths, seed), params, use_tqdm=False)
            assert_idle(llm)
            tokens += [o.outputs[0].token_ids for o in outs]
            top5 += [[lp.top for lp in o.outputs[0].logprobs] for o in outs]
            if again:
                assert all(o.num_cached_tokens > 0 for o, n in zip(outs, lengths) if n > 16)
    return tokens, top5


@pytest.mark.gpu
def test_gpu_piecewise_vs_eager_prefill():
    from tests.test_gpu_fastpath import compare

    eager_llm = gpu_llm(piecewise_cuda_graphs=False)
    assert eager_llm.engine.runner.piecewise is None
    eager = gpu_runs(eager_llm)
    del eager_llm
    torch.cuda.empty_cache()
    llm = gpu_llm()
    pw = llm.engine.runner.piecewise
    assert pw is not None and pw.sizes + pw.dropped == FULL_SCHEDULE
    print(
        f"piecewise graphs: capture {pw.capture_seconds:.1f} s, {pw.memory_bytes / 2**30:.2f} GiB, "
        f"replayed up to {pw.max_tokens} tokens (dropped as slower: {pw.dropped})"
    )
    fast = gpu_runs(llm)
    print(f"piecewise replays per padded size: {dict(sorted(pw.replays.items()))}")
    for size in (4, 8, 32, 48, 256, 288, 640, 1024, 1280, 4096):
        assert (pw.replays[size] > 0) == (size <= pw.max_tokens), size
    assert pw.padded_size(4097) is None
    compare(fast, eager, "piecewise vs eager prefill")
