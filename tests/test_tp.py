"""Tensor parallelism on CPU (gloo): TP=2 against TP=1 on tiny models of every
architecture, chunked prefill and the prefix cache on, simple and overlap loops; TP=4 (kv
heads replicated on two ranks each) against TP=1; a dead or
hung worker rank makes rank 0 fail with a clear error within the collective timeout; the
server with --tp 2. Without processes: the step message packs and unpacks to the same
inputs, row-parallel partial sums kept in fp32 round like TP=1's matmul, partial sums summed
by the norm after them, which sums may take the symmetric-memory path, and its fused
all-reduce + RMSNorm kernel in Triton's interpreter with a simulated peer. On 2 GPUs
(`-m gpu`): that kernel against NCCL's all-reduce + rms_norm; decode graphs and piecewise
prefill graphs against their eager twins.

Spawned ranks re-import torch, so each architecture starts one TP=2 LLM for the module.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from tiny import LINEAR, TINY_CONFIGS, first_layer_draft, make_tiny_model, random_prompts

from nanoserve.attention.base import AttentionMetadata
from nanoserve.distributed.tp_runner import (
    HEADER_LEN,
    StepHeader,
    TensorParallelError,
    control_len,
    control_message,
    pack_step,
    unpack_step,
)
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams
from nanoserve.step import ForwardInputs

REPO = Path(__file__).resolve().parent.parent
ENGINE = {
    "device": "cpu",
    "dtype": "float32",
    "chunked_prefill_size": 16,
    "kv_cache_tokens": 4096,
    "enable_prefix_caching": True,
}
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
TIMEOUT_S = 8.0


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_tp")
    return {arch: make_tiny_model(root / arch, arch) for arch in TINY_CONFIGS}


def test_linear_attention_models_refuse_tp_before_spawning(model_dirs):
    """Qwen3.5 under TP is refused by name before a worker starts: the next TP engine runs."""
    with pytest.raises(ValueError, match="tensor parallelism is not supported .*linear-attention"):
        LLM(str(model_dirs["qwen3.5"]), tensor_parallel_size=2, dist_timeout_s=60, **ENGINE)
    llm = LLM(str(model_dirs["qwen3"]), tensor_parallel_size=2, dist_timeout_s=60, **ENGINE)
    try:
        assert len(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) > 0
    finally:
        llm.shutdown()


def _tokens(outputs):
    return [[s.token_ids for s in o.outputs] for o in outputs]


def _assert_idle_and_no_leak(llm):
    stats = llm.engine.stats()
    assert stats["requests_running"] == 0 and stats["requests_waiting"] == 0
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    llm.engine.check_invariants()


@pytest.mark.parametrize("arch", [a for a in TINY_CONFIGS if a not in LINEAR])  # LINEAR: refused below
def test_tp2_greedy_matches_tp1(model_dirs, arch):
    # Prompts longer than a 16-token chunk, some sharing a prefix (prefix-cache hits on
    # the second round), and an n=2 request (its fork copies a KV page on every rank).
    prompts = random_prompts(6, seed=3, min_len=5, max_len=60)
    prompts += [prompts[0][:40] + [1, 2, 3], prompts[1] + [7]]
    params = [GREEDY] * len(prompts)
    params[-1] = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2)
    tp1 = LLM(str(model_dirs[arch]), **ENGINE)
    want = [_tokens(tp1.generate(prompts, params, use_tqdm=False)) for _ in range(2)]
    del tp1
    tp2 = LLM(str(model_dirs[arch]), tensor_parallel_size=2, dist_timeout_s=60, **ENGINE)
    try:
        got = [_tokens(tp2.generate(prompts, params, use_tqdm=False))]
        tp2.engine.overlap = True  # the overlap loop (CUDA's default): rank 0 launches step N+1 first
        got.append(_tokens(tp2.generate(prompts, params, use_tqdm=False)))
        assert got == want
        assert tp2.engine.stats()["prefix_cache_hit_tokens"] > 0
        _assert_idle_and_no_leak(tp2)
        pids = tp2.engine.runner.worker_pids
    finally:
        tp2.shutdown()
    assert len(pids) == 1
    assert not _alive(pids[0])


@pytest.mark.parametrize("algo", ["ngram", "draft"])
def test_tp2_speculative_greedy_matches_tp1_without(model_dirs, tmp_path, algo):
    """Speculation under TP=2: verify steps are decode batches that rank 0 broadcasts (a draft
    model runs unsharded on rank 0). Greedy output equals TP=1's without speculation, in the
    overlap loop, with the prefix cache's second pass; no page is left behind."""
    prompts = [p * 3 + p[:2] for p in random_prompts(4, seed=7, min_len=4, max_len=12)]  # repeats: n-grams match
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    spec = {"speculative_algorithm": algo, "speculative_num_draft_tokens": 4, "speculative_cost_gate": False}
    if algo == "draft":
        spec["speculative_draft_model"] = str(first_layer_draft(model_dirs["llama"], tmp_path / "draft"))
    tp1 = LLM(str(model_dirs["llama"]), **ENGINE)
    want = _tokens(tp1.generate(prompts, params, use_tqdm=False))
    del tp1
    tp2 = LLM(str(model_dirs["llama"]), tensor_parallel_size=2, dist_timeout_s=60, **ENGINE, **spec)
    try:
        tp2.engine.overlap = True
        got = [_tokens(tp2.generate(prompts, params, use_tqdm=False)) for _ in range(2)]
        assert got == [want, want]
        stats = tp2.engine.stats()
        assert stats["vllm:spec_decode_num_drafts"] > 0 and stats["vllm:spec_decode_num_accepted_tokens"] > 0
        _assert_idle_and_no_leak(tp2)
    finally:
        tp2.shutdown()


def test_tp4_greedy_matches_tp1(model_dirs):
    # Four ranks over 2 kv heads: each kv head is replicated on two ranks, the vocabulary is
    # split four ways. Simple and overlap loops.
    prompts = random_prompts(6, seed=5, min_len=5, max_len=60)
    tp1 = LLM(str(model_dirs["llama"]), **ENGINE)
    want = _tokens(tp1.generate(prompts, GREEDY, use_tqdm=False))
    del tp1
    tp4 = LLM(str(model_dirs["llama"]), tensor_parallel_size=4, dist_timeout_s=60, **ENGINE)
    try:
        got = [_tokens(tp4.generate(prompts, GREEDY, use_tqdm=False))]
        tp4.engine.overlap = True
        got.append(_tokens(tp4.generate(prompts, GREEDY, use_tqdm=False)))
        assert got == [want, want]
        _assert_idle_and_no_leak(tp4)
        pids = tp4.engine.runner.worker_pids
    finally:
        tp4.shutdown()
    assert len(pids) == 3
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return _state(pid) not in ("Z", None)  # a reaped zombie is gone


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return None


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_dead_or_hung_worker_raises_within_timeout(model_dirs, how):
    llm = LLM(str(model_dirs["llama"]), tensor_parallel_size=2, dist_timeout_s=TIMEOUT_S, **ENGINE)
    try:
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
        (pid,) = llm.engine.runner.worker_pids
        os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        time.sleep(0.2)
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match="tensor parallelism failed"):
            llm.generate([[4, 5, 6, 7]], GREEDY, use_tqdm=False)
        assert time.monotonic() - started < TIMEOUT_S + 5
        with pytest.raises(TensorParallelError):  # the group stays failed
            llm.generate([[4, 5, 6, 7]], GREEDY, use_tqdm=False)
        assert not _alive(pid)  # a hung worker is killed by rank 0
    finally:
        llm.shutdown()


# ---- the server with --tp 2 ------------------------------------------------------------------


class _Server:
    def __init__(self, cmd: list[str]):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if m := re.search(pattern, self.log):
                return m
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log}")
            time.sleep(0.1)
        raise TimeoutError(f"{pattern!r} not seen in {timeout_s} s:\n{self.log}")


def test_server_tp2_serves_and_exits_when_a_rank_dies(model_dirs):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("zmq")
    cmd = [sys.executable, "-m", "nanoserve.cli", "serve", str(model_dirs["qwen2"]), "--tp", "2", "--device", "cpu",
           "--port", "0", "--kv-cache-tokens", "4096", "--dist-timeout", str(TIMEOUT_S)]  # fmt: skip
    srv = _Server(cmd)
    try:
        url = srv.wait_for(r"nanoserve is ready: .* at (http://\S+) ", 120).group(1)
        worker = int(srv.wait_for(r"worker pids \[(\d+)\]", 5).group(1))
        body = {
            "model": str(model_dirs["qwen2"]),
            "prompt": [5, 6, 7, 8],
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5

        os.kill(worker, signal.SIGKILL)
        try:
            httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT_S + 20)
        except httpx.HTTPError:
            pass  # the server may go away mid-request
        code = srv.proc.wait(TIMEOUT_S + 30)
        assert code != 0
        assert "tensor parallelism failed" in srv.log
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait(10)


@pytest.mark.parametrize("teardown", ["abort", "destroy"])
def test_shutdown_ends_workers_and_groups(model_dirs, teardown):
    """Either teardown (KernelSwitches.tp_teardown, which the spawned worker receives in the
    config) stops the worker within the grace period and leaves no process group, so the
    process can start another tensor-parallel engine."""
    from nanoserve.distributed.tp_runner import SHUTDOWN_GRACE_S
    from nanoserve.switches import KernelSwitches

    switches = KernelSwitches(tp_teardown=teardown)
    llm = LLM(str(model_dirs["llama"]), tensor_parallel_size=2, dist_timeout_s=TIMEOUT_S, switches=switches, **ENGINE)
    (pid,) = llm.engine.runner.worker_pids
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    started = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - started < SHUTDOWN_GRACE_S
    assert not _alive(pid)
    assert not torch.distributed.is_initialized()


def test_garbage_collected_llm_stops_its_workers(model_dirs):
    import gc

    llm = LLM(str(model_dirs["llama"]), tensor_parallel_size=2, dist_timeout_s=TIMEOUT_S, **ENGINE)
    (pid,) = llm.engine.runner.worker_pids
    del llm
    gc.collect()
    assert not _alive(pid)


def test_two_nodes_on_one_host(model_dirs):
    """--nnodes 2: node 1 runs the same command with --node-rank 1 and hosts rank 1."""
    from nanoserve.distributed.process_group import free_port

    addr = f"127.0.0.1:{free_port()}"
    prompts = random_prompts(3, seed=5, min_len=5, max_len=40)
    want = _tokens(LLM(str(model_dirs["mistral"]), **ENGINE).generate(prompts, GREEDY, use_tqdm=False))
    node1 = subprocess.Popen(
        [sys.executable, "-m", "nanoserve.cli", "generate", "--model", str(model_dirs["mistral"]), "--device", "cpu",
         "--tp", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr, "--kv-cache-tokens", "4096",
         "--chunked-prefill-size", "16", "--dist-timeout", "60"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        llm = LLM(
            str(model_dirs["mistral"]),
            tensor_parallel_size=2,
            nnodes=2,
            node_rank=0,
            dist_init_addr=addr,
            dist_timeout_s=60,
            **ENGINE,
        )
        assert llm.engine.runner.worker_pids == []  # rank 1 is node 1's
        assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
        llm.shutdown()
        assert node1.wait(30) == 0, node1.stdout.read()
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait(10)


# ---- the step message and the row-parallel reduction (no processes) -------------------------


def _inputs(
    rng: torch.Generator, tokens: int, reqs: int, width: int, rows: int | None, graph_bs: int | None, piecewise=None
):
    def ints(n, dtype, high=1000):
        return torch.randint(0, high, (n,), generator=rng).to(dtype)

    meta = AttentionMetadata(
        is_decode=tokens == reqs,
        seq_lens=ints(reqs, torch.int32),
        prefix_lens=ints(reqs, torch.int32),
        cu_query_lens=ints(reqs + 1, torch.int32),
        page_table=ints(reqs * width, torch.int32).view(reqs, width),
        slot_mapping=ints(tokens, torch.long, 2**40),  # above 2**32: both int32 halves matter
        seq_lens_host=ints(reqs - 1, torch.long).tolist(),  # unpadded: one fewer than the rows
        prefix_lens_host=ints(reqs - 1, torch.long).tolist(),
        max_query_len=7,
        max_seq_len=99,
    )
    logit_rows = None if rows is None else ints(rows, torch.long)
    return ForwardInputs(
        ints(tokens, torch.long, 2**40), ints(tokens, torch.long), meta, logit_rows, graph_bs, reqs - 1,
        piecewise=piecewise,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("tokens", "reqs", "width", "rows", "graph_bs", "piecewise"),
    [
        (8, 8, 3, None, 8, None),
        (30, 4, 5, 3, None, True),
        (30, 4, 5, 0, None, False),
        (5, 2, 0, None, None, None),
    ],
)
def test_step_message_round_trip(tokens, reqs, width, rows, graph_bs, piecewise):
    sent = _inputs(torch.Generator().manual_seed(tokens + reqs), tokens, reqs, width, rows, graph_bs, piecewise)
    header, host, payload = pack_step(sent)
    assert payload.dtype == torch.int32 and payload.dim() == 1
    msg = control_message(header, host, control_len(max_num_seqs=8))
    h = StepHeader(*msg[:HEADER_LEN].tolist())
    got = unpack_step(h, msg[HEADER_LEN : HEADER_LEN + 2 * h.host_reqs].tolist(), payload.clone())
    for name in ("input_ids", "positions", "logit_rows"):
        a, b = getattr(sent, name), getattr(got, name)
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), name
    assert (got.graph_bs, got.num_reqs, got.piecewise) == (sent.graph_bs, sent.num_reqs, sent.piecewise)
    for name in ("seq_lens", "prefix_lens", "cu_query_lens", "page_table", "slot_mapping"):
        a, b = getattr(sent.meta, name), getattr(got.meta, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("is_decode", "seq_lens_host", "prefix_lens_host", "max_query_len", "max_seq_len"):
        assert getattr(sent.meta, name) == getattr(got.meta, name), name


def test_control_message_too_long_is_an_error():
    with pytest.raises(ValueError, match="exceeds"):
        control_message(StepHeader(1), list(range(20)), control_len(max_num_seqs=4))


def test_fp32_partial_sums_round_like_tp1():
    """Two ranks' row-parallel partials of a bf16 matmul: kept in fp32 and rounded once
    after the sum (what RowParallelLinear does at TP > 1), they equal TP=1's single bf16
    matmul far more often than bf16 partials summed in bf16."""
    from nanoserve.models.layers import linear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=g).bfloat16()
    w = (torch.randn(256, 512, generator=g) / 16).bfloat16()
    tp1 = torch.nn.functional.linear(x, w)
    halves = [(x[:, :256], w[:, :256]), (x[:, 256:], w[:, 256:])]
    partials = [linear(xp, wp, fp32_out=True) for xp, wp in halves]
    assert all(p.dtype == torch.float32 for p in partials)
    fp32_path = (partials[0] + partials[1]).bfloat16()
    bf16_path = sum(torch.nn.functional.linear(xp, wp) for xp, wp in halves)
    exact = (fp32_path.double() - (x.double() @ w.double().T)).abs().max()
    assert exact <= tp1.double().abs().max() * 2**-8  # within one bf16 rounding of the exact product
    fp32_off = (fp32_path != tp1).float().mean().item()
    bf16_off = (bf16_path != tp1).float().mean().item()
    assert fp32_off < 0.01 and bf16_off > 5 * max(fp32_off, 0.01), (fp32_off, bf16_off)


def _fp32_out_error(m: int, n: int, k: int, device: str, run) -> float:
    """Relative error of run(x, w) -> fp32 [m, n] against the exact product of bf16 x and w."""
    g = torch.Generator(device=device).manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g, device=device).bfloat16()
    w = (torch.randn(n, k, generator=g, device=device) / k**0.5).bfloat16()
    out = run(x, w)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    ref = x.double() @ w.double().T
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter (CPU runs)")
@pytest.mark.parametrize("m", [1, 4])
def test_small_m_linear_writes_fp32_partials(m):
    """The Triton small-M kernel that RowParallelLinear uses at TP > 1 for decode batches,
    given an fp32 output: fp32 sums of bf16 products, not rounded to bf16 (interpreter)."""
    from nanoserve.kernels import linear as klinear

    def run(x, w):
        out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
        config = klinear.LinearConfig("fma", 1, 8, 64) if m == 1 else klinear.LinearConfig("dot", 16, 32, 64)
        return klinear.small_m_linear(x, w, None, config, out=out)

    assert _fp32_out_error(m, 48, 256, "cpu", run) < 1e-6  # bf16 outputs would be ~2e-3 off


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 64, 300])
@pytest.mark.parametrize(("n", "k"), [(4096, 2048), (4096, 7168)])  # llama-3.1-8b o_proj, down_proj at TP=2
def test_linear_fp32_out_on_gpu(m, n, k):
    """linear(..., fp32_out=True) on CUDA (Triton small-M kernel for decode sizes, cuBLAS
    with an fp32 output above) against the exact product: fp32 accuracy, no bf16 rounding."""
    from nanoserve.models.layers import linear

    assert _fp32_out_error(m, n, k, "cuda", lambda x, w: linear(x, w, fp32_out=True)) < 1e-5


# ---- GPUs: decode CUDA graphs under TP (run with `pytest -m gpu tests/test_tp.py`) -------------


@pytest.mark.gpu
def test_tp2_decode_graphs_match_eager_on_gpus():
    """TP=2 over NCCL with decode graphs captured on both ranks and the overlap loop, against
    the same engine's eager twin (rank 0's graphs dropped: every rank then runs eagerly),
    at batch sizes around the captured ones (one row: every linear a GEMV, the gate_up one
    gated; padding; the largest graph; one past it)."""
    from test_gpu_fastpath import SAME_KERNELS_TOL, compare, make_prompts, run

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    llm = LLM(
        "qwen3-0.6b", load_format="dummy", dtype="bfloat16", tensor_parallel_size=2, max_model_len=1024,
        kv_cache_tokens=65536, max_num_seqs=64, cuda_graph_max_bs=32, piecewise_cuda_graphs=False,
        enable_prefix_caching=False,  # the eager run repeats the prompts: no cache hits, same prefill
    )  # fmt: skip
    try:
        engine = llm.engine
        graphs = engine.runner.graphs
        assert graphs is not None and graphs.max_bs == 32 and engine.overlap
        batches = [make_prompts(n, seed=n) for n in (1, 3, 9, 32, 33)]
        fast = [run(llm, prompts, new=24) for prompts in batches]
        engine.runner.local.graphs, engine.overlap = None, False
        eager = [run(llm, prompts, new=24) for prompts in batches]
        engine.runner.local.graphs, engine.overlap = graphs, True
        # One verdict over all 78 prompts (each batch's own would allow no divergence at all).
        what = "TP=2 graphs + overlap vs eager, batches of 1, 3, 9, 32, 33"
        compare(_joined(fast), _joined(eager), what, logprob_tol=SAME_KERNELS_TOL)  # bit-equal on 2 x H200
    finally:
        llm.shutdown()


@pytest.mark.gpu
def test_tp2_piecewise_graphs_match_eager_on_gpus():
    """TP=2 with piecewise prefill graphs captured on both ranks (their all-reduces inside:
    NCCL, or the fused sum + norm over symmetric memory where the partials fit), against the
    same engine with rank 0's piecewise graphs dropped: its steps then say "eager" and the
    workers follow. Prefill batches at captured sizes, padded, and above the largest
    (chunked, eager); decode graphs on in both runs. A padded batch runs its linears at the
    padded row count, other kernels than eager's at the real one, so the bar is
    test_piecewise_graph's (near-tie flips allowed; 2 x H100: 35 of 36 identical, one flip at a
    0.125 logprob gap)."""
    from test_gpu_fastpath import compare, run

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    llm = LLM(
        "qwen3-0.6b", load_format="dummy", dtype="bfloat16", tensor_parallel_size=2, max_model_len=2048,
        kv_cache_tokens=65536, max_num_seqs=16, cuda_graph_max_bs=16, chunked_prefill_size=512,
        enable_prefix_caching=False,  # the eager run repeats the prompts: no cache hits, same prefill
    )  # fmt: skip
    try:
        runner = llm.engine.runner
        pw = runner.piecewise
        assert pw is not None and pw.sizes, "no piecewise size kept at TP=2"
        rng = torch.Generator().manual_seed(7)
        lengths = [[1], [4], [5], [3, 1], [30, 2, 7, 9], [100, 100, 56], [300, 200, 12], [60] * 8, [700], [1500, 9]]
        lengths += [[17] * 10]
        batches = [[torch.randint(0, 20000, (n,), generator=rng).tolist() for n in b] for b in lengths]
        fast = [run(llm, prompts, new=12) for prompts in batches]
        replays = sum(pw.replays.values())
        assert replays >= 8, dict(pw.replays)
        runner.local.piecewise = None
        eager = [run(llm, prompts, new=12) for prompts in batches]
        runner.local.piecewise = pw
        assert sum(pw.replays.values()) == replays
        compare(_joined(fast), _joined(eager), "TP=2 piecewise graphs vs eager prefill")
    finally:
        llm.shutdown()


def _joined(runs):
    tokens, top5 = [], []
    for t, k in runs:
        tokens += t
        top5 += k
    return tokens, top5


# ---- the fused all-reduce + RMSNorm over symmetric memory (distributed/symm_all_reduce.py) -----


def test_symm_all_reduce_size_rule():
    from nanoserve.distributed.symm_all_reduce import DEFAULT_MAX_BYTES, fits

    row = 4096 * 4  # one fp32 row of a 4096-wide partial sum
    assert fits(row, torch.float32, DEFAULT_MAX_BYTES) and fits(256 * row, torch.float32, DEFAULT_MAX_BYTES)
    assert not fits(257 * row, torch.float32, DEFAULT_MAX_BYTES)  # prefill-sized: NCCL
    assert fits(8192 * 2, torch.bfloat16, DEFAULT_MAX_BYTES) and fits(8192 * 2, torch.float16, DEFAULT_MAX_BYTES)
    assert not fits(0, torch.float32, DEFAULT_MAX_BYTES)
    assert not fits(row, torch.int64, DEFAULT_MAX_BYTES)


def test_symm_protocol_rule():
    """LL for small sums under "auto" (twice the bytes on the wire, fewer round trips), pull
    above LL_MAX_BYTES; partials that are not whole 32-bit words never take LL."""
    from nanoserve.distributed.symm_all_reduce import LL_MAX_BYTES, SymmAllReduce

    max_bytes = 2**20
    buf = torch.zeros(SymmAllReduce.buffer_bytes(max_bytes, 2), dtype=torch.uint8)
    base = buf.data_ptr()
    rows_at_limit = LL_MAX_BYTES // (4096 * 2)

    def uses_ll(protocol, rows, width=4096, dtype=torch.bfloat16):
        symm = SymmAllReduce(buf, [base, base], 0, max_bytes, protocol)
        assert symm.ll_recv[1].shape == (2, max_bytes // 4)  # a word per 4 bytes of partials, per source
        return symm.uses_ll(torch.zeros(rows, width, dtype=dtype))

    assert uses_ll("auto", 1) and uses_ll("auto", rows_at_limit) and not uses_ll("auto", rows_at_limit + 1)
    assert uses_ll("auto", 1, dtype=torch.float32) and not uses_ll("auto", rows_at_limit, dtype=torch.float32)
    assert uses_ll("ll", 256) and not uses_ll("pull", 1)
    assert not uses_ll("ll", 1, width=4095)  # an odd bf16 row: not whole words


def test_symm_push_offer_rule(monkeypatch):
    """The matmul is offered the LL send only for one-row LL sums of 2-byte partials, and a
    slot's new partials void any earlier offer (else a later sum would skip its send: a hang)."""
    from nanoserve.distributed.symm_all_reduce import SymmAllReduce

    max_bytes = 2**20
    buf = torch.zeros(SymmAllReduce.buffer_bytes(max_bytes, 2), dtype=torch.uint8)
    monkeypatch.setattr(SymmAllReduce, "_slot_of", lambda self, x: 0)  # as if x were slot 0's view
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU build has none

    def offer(protocol="auto", rows=1, dtype=torch.bfloat16):
        symm = SymmAllReduce(buf, [buf.data_ptr()] * 2, 1, max_bytes, protocol)
        return symm, symm.ll_push(torch.zeros(rows, 4096, dtype=dtype))

    symm, push = offer()
    assert push is not None and push.rank == 1 and push.dst_addrs is symm.ll_dst_addrs[0] and not push.sent
    assert symm.partial_out(1, 4096, torch.bfloat16, 0) is None and not symm._pushes  # voided
    assert offer(rows=2)[1] is None and offer(dtype=torch.float32)[1] is None and offer("pull")[1] is None
    assert offer()[0].ll_push(None) is None
    symm = SymmAllReduce(buf, [buf.data_ptr()] * 2, 1, max_bytes, "auto", push_in_matmul=False)
    assert symm.ll_push(torch.zeros(1, 4096, dtype=torch.bfloat16)) is None


def _interpreted_rank_call(rank, parts, flags, epochs, residual, weight, eps):
    """One fused call as rank `rank` of len(parts), its peers simulated by plain tensors:
    parts[q] is rank q's slot holding its partials."""
    from nanoserve.kernels.all_reduce import all_reduce_rms_norm

    addrs = torch.tensor([p.data_ptr() for p in parts], dtype=torch.int64)
    flag_addrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    return all_reduce_rms_norm(parts[rank], addrs, flag_addrs, epochs, rank, residual, weight, eps)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter (conftest sets it without a GPU)"
)
@pytest.mark.parametrize("rank", [0, 1])
def test_all_reduce_rms_norm_kernel_interpreted(rank):
    """The fused kernel in Triton's interpreter, as rank `rank` of 2 whose peer has already
    signalled: the sum over ranks + residual and its RMSNorm match the plain torch ops (fp32,
    where the interpreter rounds as torch), rows beyond the programs are covered (6 rows, 4
    programs), it signals the peer with its call count, and the counts go on across calls."""
    from nanoserve.kernels.all_reduce import all_reduce_rms_norm_reference
    from nanoserve.kernels.norm import add_rms_norm_reference

    gen = torch.Generator().manual_seed(rank)
    rows, width, programs, eps = 6, 48, 4, 1e-6
    epochs = torch.zeros(programs, dtype=torch.int64)
    flags = [torch.zeros(programs, 2, dtype=torch.int64) for _ in range(2)]
    peer = 1 - rank
    for call in (1, 2):
        parts = [torch.randn(rows, width, generator=gen) for _ in range(2)]
        residual = torch.randn(rows, width, generator=gen)
        weight = 1 + 0.1 * torch.randn(width, generator=gen)
        flags[rank][:, peer] = call  # the peer's programs have published their partials
        out, total = _interpreted_rank_call(rank, parts, flags, epochs, residual, weight, eps)
        want_out, want_total = add_rms_norm_reference(parts[0] + parts[1], residual, weight, eps)
        torch.testing.assert_close(total, want_total, rtol=0, atol=0)
        torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
        ref_out, ref_total = all_reduce_rms_norm_reference(parts, residual, weight, eps)
        torch.testing.assert_close(total, ref_total, rtol=0, atol=0)
        torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
        assert (epochs == call).all() and (flags[peer][:, rank] == call).all() and (flags[rank][:, rank] == call).all()
    # one row: only program 0 runs, the other programs' counts stay
    parts = [torch.randn(1, width, generator=gen) for _ in range(2)]
    flags[rank][0, peer] = 3
    _interpreted_rank_call(rank, parts, flags, epochs, torch.zeros(1, width), torch.ones(width), eps)
    assert epochs.tolist() == [3, 2, 2, 2] and flags[peer][:, rank].tolist() == [3, 2, 2, 2]


def _words(part: torch.Tensor, call: int) -> torch.Tensor:
    """`part`'s rows as the LL protocol's 64-bit words: 32 bits of partials under the call count."""
    bits = part.contiguous().view(torch.int32).reshape(-1).to(torch.int64) & 0xFFFFFFFF
    return bits | (call << 32)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter (conftest sets it without a GPU)"
)
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ll_all_reduce_rms_norm_kernel_interpreted(rank, dtype):
    """The LL kernel in Triton's interpreter, as rank `rank` of 2 whose peer's words for this
    call are already in the receive buffer (over the previous call's): it sends
    its own partials to the peer's buffer tagged with the call count, and the sum + residual
    and its RMSNorm match the plain torch ops; rows beyond the programs are covered (6 rows,
    4 programs), bf16 partials travel two to a word, and a call without a residual (the
    embedding's sum) gives the plain sum and its norm. Integer-valued inputs keep every sum
    exact, so the sums compare bit for bit in both dtypes."""
    from nanoserve.kernels.all_reduce import ll_all_reduce_rms_norm
    from nanoserve.kernels.norm import add_rms_norm_reference, rms_norm_reference

    gen = torch.Generator().manual_seed(rank)
    rows, width, programs, eps = 6, 48, 4, 1e-6
    per_row = width * dtype.itemsize // 4
    epochs = torch.zeros(programs, dtype=torch.int64)
    recv = torch.zeros(2, rows * per_row + 8, dtype=torch.int64)  # this rank's receive buffer
    peer_recv = torch.zeros_like(recv)  # the peer's
    peer = 1 - rank
    dst = torch.zeros(2, dtype=torch.int64)
    dst[peer] = peer_recv[rank].data_ptr()  # where this rank's words land in the peer's buffer
    for call in (1, 2):
        parts = [torch.randint(-20, 20, (rows, width), generator=gen).to(dtype) for _ in range(2)]
        residual = torch.randint(-20, 20, (rows, width), generator=gen).to(dtype)
        weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
        recv[peer, : rows * per_row] = _words(parts[peer], call)  # the peer's words have arrived
        out, total = ll_all_reduce_rms_norm(parts[rank], dst, recv, epochs, rank, residual, weight, eps)
        want_out, want_total = add_rms_norm_reference(
            parts[0].float() + parts[1].float(), residual.float(), weight.float(), eps
        )
        assert torch.equal(total.float(), want_total), call
        torch.testing.assert_close(out.float(), want_out, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-2)
        assert (epochs == call).all()
        assert torch.equal(peer_recv[rank, : rows * per_row], _words(parts[rank], call)), call
    # the stream's first sum (the embedding's partials): no residual, outputs in the weight's dtype
    recv[peer, : rows * per_row] = _words(parts[peer], 3)
    out, total = ll_all_reduce_rms_norm(parts[rank], dst, recv, epochs, rank, None, weight, eps)
    assert total.dtype == weight.dtype and torch.equal(total.float(), parts[0].float() + parts[1].float())
    torch.testing.assert_close(
        out.float(), rms_norm_reference(total.float(), weight.float(), eps), rtol=1e-2, atol=1e-2
    )


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter (conftest sets it without a GPU)"
)
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("block_n", [2, 4])
def test_one_row_matmul_pushes_its_words_interpreted(rank, block_n):
    """The one-row fma matmul with a push, in Triton's interpreter as rank `rank` of 2: it
    stores its result locally and, as LL words under the next call's count, into the peer's
    receive buffer, leaving the counts alone; the LL sum told `sent` then stores nothing
    itself and sums as usual. Integer-valued bf16 operands: exact products."""
    from nanoserve.kernels.all_reduce import ll_all_reduce_rms_norm
    from nanoserve.kernels.linear import LinearConfig, can_push, small_m_linear
    from nanoserve.kernels.norm import add_rms_norm_reference

    gen = torch.Generator().manual_seed(10 + rank)
    n, k, eps, peer = 48, 64, 1e-6, 1 - rank
    config = LinearConfig("fma", 1, block_n, 32, num_warps=2)
    assert can_push(config, 1, torch.bfloat16) and not can_push(config, 2, torch.bfloat16)
    assert not can_push(config, 1, torch.float32)
    epochs = torch.zeros(4, dtype=torch.int64)
    epochs[0] = 6  # five earlier fused calls, as in a running engine
    recv = torch.zeros(2, n, dtype=torch.int64)
    peer_recv = torch.zeros_like(recv)
    dst = torch.zeros(2, dtype=torch.int64)
    dst[peer] = peer_recv[rank].data_ptr()
    x = torch.randint(-1, 2, (1, k), generator=gen).bfloat16()  # |products summed| <= 64: exact
    w = torch.randint(-1, 2, (n, k), generator=gen).bfloat16()
    part = torch.empty(1, n, dtype=torch.bfloat16)
    small_m_linear(x, w, None, config, out=part, push=(dst, epochs, rank))
    assert torch.equal(part, (x.float() @ w.float().T).bfloat16())
    assert torch.equal(peer_recv[rank, : n // 2], _words(part, 7)) and epochs[0] == 6
    assert not peer_recv[peer].any()

    peer_recv.zero_()
    recv.zero_()
    peer_part = torch.randint(-20, 20, (1, n), generator=gen).bfloat16()
    recv[peer, : n // 2] = _words(peer_part, 7)
    residual = torch.randint(-20, 20, (1, n), generator=gen).bfloat16()
    weight = torch.ones(n, dtype=torch.bfloat16)
    out, total = ll_all_reduce_rms_norm(part, dst, recv, epochs, rank, residual, weight, eps, sent=True)
    parts = (part, peer_part) if rank == 0 else (peer_part, part)
    want_out, want_total = add_rms_norm_reference(
        parts[0].float() + parts[1].float(), residual.float(), weight.float(), eps
    )
    assert torch.equal(total.float(), want_total) and epochs[0] == 7
    torch.testing.assert_close(out.float(), want_out, rtol=1e-2, atol=1e-2)
    assert not peer_recv.any() and not recv[rank].any()  # sent by the matmul: the sum stored nothing


def test_tp_kernels_compile_for_every_group_size():
    """The fused all-reduce kernels (LL and pull, sending or not) and the one-row matmul's push
    compile for Hopper at 2, 4 and 8 ranks (tests/hopper_compile.py, in a process of its own:
    this one may run Triton's interpreter). At 4 ranks the LL send once failed to compile in
    Triton 3.6 (a branch on the runtime rank), and only TP=4 on GPUs had shown it."""
    pytest.importorskip("triton.backends.nvidia")
    from hopper_compile import check_in_own_process

    check_in_own_process("2", "4", "8")


def test_row_parallel_partials_sum_in_the_norm():
    """Without a process group: a row-parallel layer returns partial sums (rank 0's with the
    bias) and RMSNorm(reduce_over=...) sums them before the residual add; with the two
    ranks' partials added by hand (what the all-reduce does) the result is TP=1's."""
    from nanoserve.distributed import TPGroup
    from nanoserve.models.layers import RMSNorm, RowParallelLinear

    gen = torch.Generator().manual_seed(0)
    full = RowParallelLinear(8, 6, bias=True)
    full.weight.data.copy_(torch.randn(6, 8, generator=gen))
    full.bias.data.copy_(torch.randn(6, generator=gen))
    x = torch.randn(3, 8, generator=gen)
    halves = []
    for r in range(2):
        layer = RowParallelLinear(8, 6, bias=True, tp=TPGroup(r, 2))
        layer.weight.weight_loader(layer.weight, full.weight.data, None)
        layer.bias.data.copy_(full.bias.data)
        halves.append(layer(x[:, 4 * r : 4 * r + 4]))
    torch.testing.assert_close(halves[0] + halves[1], full(x), rtol=1e-5, atol=1e-5)

    class SummedByHand(TPGroup):
        def all_reduce(self, t):
            return halves[0] + halves[1]

    norm = RMSNorm(6, 1e-6)
    norm.weight.data.copy_(1 + torch.randn(6, generator=gen))
    residual = torch.randn(3, 6, generator=gen)
    got = norm(halves[0], residual, reduce_over=SummedByHand(0, 2))
    want = norm(full(x), residual)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def _symm_rank(rank: int, world: int, addr: str, protocol: str) -> None:
    """One rank of test_fused_all_reduce_rms_norm_matches_nccl_on_gpus (spawned)."""
    import torch.distributed as dist

    from nanoserve.distributed import TPGroup
    from nanoserve.distributed.process_group import destroy_distributed, init_distributed
    from nanoserve.distributed.symm_all_reduce import setup_symm_all_reduce
    from nanoserve.kernels.norm import rms_norm
    from nanoserve.switches import KernelSwitches

    device = torch.device(f"cuda:{rank}")
    ctx = init_distributed(rank, world, rank, addr, device, timeout_s=60)
    try:
        symm = setup_symm_all_reduce(ctx, single_host=True, switches=KernelSwitches(symm_protocol=protocol))
        assert symm is not None, "the symmetric-memory all-reduce did not set up (see the log)"
        assert symm.protocol == protocol
        tp = TPGroup(rank, world, symm)
        g = torch.Generator(device=device).manual_seed(1234 + rank)  # different partials on each rank
        shared = torch.Generator(device=device).manual_seed(99)  # the same residual and weight everywhere
        hidden, eps = 4096, 1e-5
        weight = (1 + 0.1 * torch.randn(hidden, generator=shared, device=device)).bfloat16()

        def same_on_every_rank(t: torch.Tensor) -> bool:
            parts = torch.empty((world, *t.shape), dtype=t.dtype, device=device)
            dist.all_gather_into_tensor(parts, t.contiguous())
            return all(torch.equal(parts[0], parts[r]) for r in range(1, world))

        def nccl_twin(part, residual):
            summed = part.clone()
            dist.all_reduce(summed)
            return rms_norm(summed.bfloat16(), weight, eps, residual)

        def check(got, want, what):
            for name, a, b in zip(("normed", "sum"), got, want, strict=True):
                assert a.dtype == torch.bfloat16 and torch.equal(a, b), (
                    what,
                    name,
                    (a.float() - b.float()).abs().max(),
                )
                assert same_on_every_rank(a), (what, name)

        for dtype in (torch.bfloat16, torch.float32):
            # eager, alternating slots; 130 and 256 rows take more rows than programs
            for i, rows in enumerate((1, 3, 64, 130, 256)):
                part = symm._own_region(i % 2, rows, hidden, dtype)
                part.copy_(torch.randn(rows, hidden, generator=g, device=device) * 4)
                residual = torch.randn(rows, hidden, generator=shared, device=device).bfloat16()
                want = nccl_twin(part, residual)
                check(tp.reduce_rms_norm(part, residual, weight, eps), want, (dtype, rows, "eager"))
            # the stream's first sum (the embedding's partials): no residual
            part = symm._own_region(1, 5, hidden, dtype)
            part.copy_(torch.randn(5, hidden, generator=g, device=device) * 4)
            summed = part.clone()
            dist.all_reduce(summed)
            summed = summed.bfloat16()
            want = (rms_norm(summed, weight, eps), summed)
            check(tp.reduce_rms_norm(part, None, weight, eps), want, (dtype, "no residual"))
            # captured as the decode graphs use it: partials written into partial_out's views
            # (slot 0, then 1, four layers' worth), then replayed on fresh inputs; rank 1
            # sleeps at a different point than rank 0, so the ranks arrive skewed.
            rows = 8
            inputs = [torch.zeros(rows, hidden, dtype=dtype, device=device) for _ in range(8)]
            residual = torch.zeros(rows, hidden, dtype=torch.bfloat16, device=device)
            torch.cuda.synchronize(device)
            graph, outs = torch.cuda.CUDAGraph(), []
            with torch.cuda.graph(graph):
                assert tp.partial_out(257, hidden, torch.float32, 0) is None  # above the slot: NCCL
                res = residual
                for j, src in enumerate(inputs):
                    if j % 3 == rank:
                        torch.cuda._sleep(20000)
                    part = tp.partial_out(rows, hidden, dtype, j % 2)
                    assert part is not None and symm.holds(part)
                    part.copy_(src)
                    outs.append(tp.reduce_rms_norm(part, res, weight, eps))
                    res = outs[-1][1]
            for _ in range(20):
                for src in inputs:
                    src.copy_(torch.randn(rows, hidden, generator=g, device=device) * 4)
                residual.copy_(torch.randn(rows, hidden, generator=shared, device=device))
                graph.replay()
                res = residual
                for src, got in zip(inputs, outs, strict=True):
                    want = nccl_twin(src, res)
                    check(got, want, (dtype, "graph"))
                    res = want[1]
        # one row, as batch-1 decode: the matmul writing the partials sends them itself (o_proj-
        # and down-like shapes, both slots), the sum only waits; ranks skewed as above
        from nanoserve.models.layers import linear

        weights = [(torch.randn(hidden, k, generator=shared, device=device) / 32).bfloat16() for k in (2048, 1024)]
        xs = [torch.zeros(1, w.shape[1], dtype=torch.bfloat16, device=device) for w in weights * 2]
        residual = torch.zeros(1, hidden, dtype=torch.bfloat16, device=device)
        torch.cuda.synchronize(device)
        graph, outs, snaps = torch.cuda.CUDAGraph(), [], []
        with torch.cuda.graph(graph):
            res = residual
            for j, x in enumerate(xs):
                if j % 3 == rank:
                    torch.cuda._sleep(20000)
                part = tp.partial_out(1, hidden, torch.bfloat16, j % 2)
                push = tp.ll_push(part)
                assert (push is not None) == symm.uses_ll(part)  # pull: nothing to push
                linear(x, weights[j % 2], out=part, push=push)
                assert push is None or push.sent, "the one-row matmul did not take the push"
                snaps.append(part.clone())
                outs.append(tp.reduce_rms_norm(part, res, weight, eps))
                res = outs[-1][1]
        for _ in range(20):
            for x in xs:
                x.copy_(torch.randn(x.shape, generator=g, device=device))
            residual.copy_(torch.randn(1, hidden, generator=shared, device=device))
            graph.replay()
            res = residual
            for snap, got in zip(snaps, outs, strict=True):
                want = nccl_twin(snap, res)
                check(got, want, "one row, pushed by the matmul")
                res = want[1]
        assert tp.partial_out(8, hidden, torch.bfloat16, 0) is None  # eager: NCCL
        dist.barrier()
    finally:
        destroy_distributed()


@pytest.mark.gpu
@pytest.mark.parametrize("protocol", ["auto", "ll", "pull"])
def test_fused_all_reduce_rms_norm_matches_nccl_on_gpus(protocol):
    """The fused all-reduce + residual add + RMSNorm over symmetric memory against NCCL's
    all-reduce followed by rms_norm, on random bf16 and fp32 partials (1..256 x 4096): the
    same bits, the same on every rank, eagerly and replayed 20 times from a CUDA graph of 8
    chained calls over both slots with the ranks skewed; and one-row sums whose partials the
    matmul sends to the peers itself (LL), replayed the same way."""
    import torch.multiprocessing as mp

    from nanoserve.distributed.process_group import free_port

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # never multicast (shared hosts)
    mp.spawn(_symm_rank, args=(2, f"127.0.0.1:{free_port()}", protocol), nprocs=2, join=True)
