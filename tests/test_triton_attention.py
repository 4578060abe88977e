"""Triton attention backend against the torch reference backend.

GPU tests (`pytest -m gpu tests/test_triton_attention.py`) sweep shapes on CUDA. CPU tests
run tiny shapes in Triton's interpreter (conftest sets TRITON_INTERPRET=1 when no GPU is
present, before triton is imported); they are skipped when triton is missing or the
interpreter is off.

Every check draws fresh random inputs, gives requests shuffled non-contiguous pages, fills
unused cache pages and the new tokens' slots with large poison values (so reading a wrong
slot or skipping a store changes the result), and poisons the output with NaN (so an
unwritten element fails).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import random
from dataclasses import dataclass

import pytest
import torch

from nanoserve.attention.base import AttentionMetadata
from nanoserve.attention.torch_backend import TorchAttentionBackend

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
POISON = 50.0


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float


def make_case(
    reqs: list[tuple[int, int]],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
    decode: bool = False,
    cache_dtype: torch.dtype | None = None,
) -> Case:
    """reqs: (prefix_len, new_len) per request; the caches in `cache_dtype` (default: dtype)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rng = random.Random(seed)
    pages_per_req = [-(-(p + n) // page_size) for p, n in reqs]
    spare = 3
    num_pages = 1 + sum(pages_per_req) + spare
    order = list(range(1, num_pages))
    rng.shuffle(order)  # non-contiguous, shuffled page assignment; page 0 stays reserved
    max_pages = max(pages_per_req) + 2  # columns past a request's pages stay 0 (the dummy page)
    page_table = torch.zeros(len(reqs), max_pages, dtype=torch.int32)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, POISON)
    v_cache = torch.full(shape, -POISON)
    slots, cu = [], [0]
    taken = 0
    for i, ((prefix, new), npages) in enumerate(zip(reqs, pages_per_req)):
        pages = order[taken : taken + npages]
        taken += npages
        page_table[i, :npages] = torch.tensor(pages, dtype=torch.int32)
        pos = torch.arange(prefix + new)
        req_slots = torch.tensor(pages)[pos // page_size] * page_size + pos % page_size
        flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
        flat_k[req_slots[:prefix]] = torch.randn(prefix, num_kv_heads, head_dim, generator=gen)
        flat_v[req_slots[:prefix]] = torch.randn(prefix, num_kv_heads, head_dim, generator=gen)
        slots.append(req_slots[prefix:])
        cu.append(cu[-1] + new)
    total = cu[-1]
    # q/k/v as column slices of one fused qkv projection, as a model produces them
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(total, width, generator=gen)
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    q = q.view(total, num_q_heads, head_dim)
    k = k.view(total, num_kv_heads, head_dim)
    v = v.view(total, num_kv_heads, head_dim)
    to = {"device": device}
    meta = AttentionMetadata(
        is_decode=decode,
        seq_lens=torch.tensor([p + n for p, n in reqs], dtype=torch.int32, **to),
        prefix_lens=torch.tensor([p for p, _ in reqs], dtype=torch.int32, **to),
        cu_query_lens=torch.tensor(cu, dtype=torch.int32, **to),
        page_table=page_table.to(device),
        slot_mapping=torch.cat(slots).to(torch.int64).to(device),
        seq_lens_host=[p + n for p, n in reqs],
        prefix_lens_host=[p for p, _ in reqs],
        max_query_len=max(n for _, n in reqs),
        max_seq_len=max(p + n for p, n in reqs),
    )
    qkv = qkv.to(device=device, dtype=dtype)
    q, k, v = (
        t.view(total, -1, head_dim)
        for t in qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    )
    cache_dtype = cache_dtype or dtype
    return Case(q, k, v, k_cache.to(device, cache_dtype), v_cache.to(device, cache_dtype), meta, head_dim**-0.5)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def check(case: Case, tol: float, backend=None, window: int = 0, sinks: torch.Tensor | None = None) -> None:
    """The Triton backend against the torch backend and `attention_reference`; `window` and
    `sinks`: the layer's kind (a sliding window, attention sinks). With a window, the Triton
    side's cached positions that no window reaches hold NaN (reading one fails the check)."""
    from nanoserve.attention.triton_backend import TritonAttentionBackend

    backend = backend or TritonAttentionBackend()
    ref_backend = TorchAttentionBackend()
    kc_ref, vc_ref = case.k_cache.clone(), case.v_cache.clone()
    kind = {"window": window, "sinks": sinks}
    ref_backend.prepare(case.meta)
    ref = ref_backend.forward(case.q, case.k, case.v, kc_ref, vc_ref, case.meta, case.scale, **kind)

    if window:
        poison_outside_windows(case.meta, case.k_cache, case.v_cache, window)
    out = torch.full_like(case.q, float("nan"), memory_format=torch.contiguous_format)
    backend.prepare(case.meta)
    got = backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale, out=out, **kind)
    assert got.data_ptr() == out.data_ptr()
    assert not torch.isnan(out).any(), "NaN (unwritten element or bad softmax) in output"
    err = rel_err(out, ref)
    assert err < tol, f"relative error {err:.2e}"
    # the store wrote exactly the new tokens' slots, and nothing else
    for cache, ref_cache in ((case.k_cache, kc_ref), (case.v_cache, vc_ref)):
        assert torch.equal(torch.where(cache.isnan(), ref_cache, cache), ref_cache)  # NaN: the poison
    num_kv_heads, head_dim = case.k_cache.shape[2], case.k_cache.shape[3]
    flat = case.k_cache.view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat[case.meta.slot_mapping], case.k.to(flat.dtype))
    # and the kernels' own torch reference (kernels/attention.py), request by request
    from nanoserve.kernels.attention import attention_reference, gather_kv

    cu, meta = case.meta.cu_query_lens.tolist(), case.meta
    for i, (seq, prefix) in enumerate(zip(meta.seq_lens_host, meta.prefix_lens_host)):
        table = meta.page_table[i : i + 1]
        keys, values = (gather_kv(c, table, seq)[0].to(case.q.dtype) for c in (kc_ref, vc_ref))
        if not meta.is_decode:  # an extend's new tokens attend to each other as computed, not as cached
            keys[prefix:], values[prefix:] = case.k[cu[i] : cu[i + 1]], case.v[cu[i] : cu[i + 1]]
        want = attention_reference(case.q[cu[i] : cu[i + 1]], keys, values, case.scale, prefix, **kind)
        if cu[i + 1] > cu[i]:
            err = rel_err(out[cu[i] : cu[i + 1]], want)
            assert err < tol, f"request {i}: relative error {err:.2e} to attention_reference"


def ragged(rng: random.Random, batch: int, lo: int, hi: int) -> list[int]:
    lens = [rng.randint(lo, hi) for _ in range(batch)]
    lens[rng.randrange(batch)] = hi  # the longest length is always present
    return lens


# ------------------------------------------------------------------------------ CPU tests

interp = pytest.mark.skipif(
    not (HAS_TRITON and INTERPRET), reason="needs triton and TRITON_INTERPRET=1 (set by conftest without a GPU)"
)


@interp
@pytest.mark.parametrize("page_size", [1, 4])
def test_interp_decode_gqa3_splits(page_size):
    from nanoserve.kernels import attention as tk

    assert tk.INTERPRET  # the kernels run in the interpreter, on the CPU tensors below
    lens = [1, 37, 70, 5]
    case = make_case([(n - 1, 1) for n in lens], 6, 2, 32, page_size, torch.float32, "cpu", seed=1, decode=True)
    assert case.q.device.type == "cpu"
    check(case, tol=2e-3)  # fp32 products on CPU: far under bf16's bar


def runs_case(runs: list[tuple[int, int]], num_q_heads, num_kv_heads, head_dim, page_size, dtype, device, seed):
    """A verify step's decode batch: per request (context, positions), `positions` rows that
    are its next positions, each a decode row of its own over the request's pages (the K/V of
    the earlier rows stored as the step stores them), and the runs those rows form."""
    from nanoserve.kernels.attention import RunInputs

    case = make_case(runs, num_q_heads, num_kv_heads, head_dim, page_size, dtype, device, seed)
    m = case.meta
    owner = [i for i, (_, n) in enumerate(runs) for _ in range(n)]
    seq = [p + j + 1 for p, n in runs for j in range(n)]
    first_rows = [sum(n for _, n in runs[:i]) for i in range(len(runs))]
    run_rows = torch.zeros(len(seq), dtype=torch.int32)
    run_rows[first_rows] = torch.tensor([n for _, n in runs], dtype=torch.int32)
    to = {"device": device}
    meta = AttentionMetadata(
        is_decode=True,
        seq_lens=torch.tensor(seq, dtype=torch.int32, **to),
        prefix_lens=torch.tensor([s - 1 for s in seq], dtype=torch.int32, **to),
        cu_query_lens=torch.arange(len(seq) + 1, dtype=torch.int32, **to),
        page_table=m.page_table[torch.tensor(owner, device=m.page_table.device)].contiguous(),
        slot_mapping=m.slot_mapping,
        seq_lens_host=seq,
        prefix_lens_host=[s - 1 for s in seq],
        max_query_len=1,
        max_seq_len=max(seq),
        runs=RunInputs(run_rows.to(device), max(n for _, n in runs), len(runs)),
    )
    return dataclasses.replace(case, meta=meta)


@interp
@pytest.mark.parametrize("max_splits", [1, 4])
def test_interp_decode_runs(max_splits):
    """A verify batch's runs (one program reads a request's K/V for all its positions) give
    each row its own causal attention: against the torch backend, which attends row by row."""
    from nanoserve.attention.triton_backend import TritonAttentionBackend

    runs = [(36, 5), (3, 1), (70, 3), (0, 2)]  # a run of one row and one from position 0 among them
    case = runs_case(runs, 6, 2, 32, 4, torch.float32, "cpu", seed=11)
    check(case, tol=2e-3, backend=TritonAttentionBackend(max_splits=max_splits))


@interp
def test_interp_decode_runs_fp8_cache():
    case = runs_case([(30, 5), (9, 3)], 4, 2, 32, 4, torch.bfloat16, "cpu", seed=15)
    fp8 = torch.float8_e4m3fn
    case = dataclasses.replace(case, k_cache=case.k_cache.to(fp8), v_cache=case.v_cache.to(fp8))
    for t in (case.k, case.v):  # fp8-representable new K/V (see test_interp_fp8_cache)
        t.copy_(t.to(fp8))
    check(case, tol=1e-2)


@interp
def test_interp_decode_runs_bf16_sinks():
    from nanoserve.attention.triton_backend import TritonAttentionBackend

    case = runs_case([(20, 4), (41, 4)], 8, 2, 16, 4, torch.bfloat16, "cpu", seed=12)
    sinks = torch.randn(8)
    for splits in (1, 3):
        check(case, tol=1e-2, backend=TritonAttentionBackend(max_splits=splits), sinks=sinks)


@interp
def test_interp_decode_bf16_one_split():
    from nanoserve.attention.triton_backend import TritonAttentionBackend

    case = make_case([(n - 1, 1) for n in (3, 20)], 4, 4, 16, 4, torch.bfloat16, "cpu", seed=2, decode=True)
    check(case, tol=1e-2, backend=TritonAttentionBackend(max_splits=1))


@interp
@pytest.mark.parametrize("decode", [True, False])
def test_interp_fp8_cache(decode):
    # An fp8 KV cache: both backends attend over the same fp8 values, upcast. The new K/V are
    # made fp8-representable first because Triton's interpreter rounds ties away from zero
    # where torch (and the GPU's cvt.rn) round to even; the GPU test below stores raw values.
    reqs = [(n - 1, 1) for n in (9, 40, 3)] if decode else [(21, 35), (0, 5), (16, 1)]
    case = make_case(reqs, 4, 2, 32, 4, torch.bfloat16, "cpu", seed=5, decode=decode, cache_dtype=torch.float8_e4m3fn)
    for t in (case.k, case.v):
        t.copy_(t.to(torch.float8_e4m3fn))
    check(case, tol=1e-2)


@interp
def test_interp_extend_with_prefix():
    # prefixes under ragged new-token counts; new lengths cross several 16-row tiles
    case = make_case([(21, 35), (0, 5), (16, 1), (3, 17)], 4, 2, 32, 4, torch.float32, "cpu", seed=3)
    check(case, tol=2e-3)


@interp
def test_interp_extend_head_dim_not_pow2():
    case = make_case([(9, 20), (0, 7)], 2, 1, 24, 1, torch.float32, "cpu", seed=4)
    check(case, tol=2e-3)


@interp
def test_interp_store_skips_negative_slots():
    from nanoserve.kernels import attention as tk

    k_cache = torch.zeros(3, 4, 2, 16)
    v_cache = torch.zeros(3, 4, 2, 16)
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    tk.store_kv(k_cache, v_cache, k, v, torch.tensor([5, -1, 11]))
    flat_k, flat_v = k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_v[11], v[2])
    assert flat_k.abs().sum(dim=(1, 2)).nonzero().flatten().tolist() == [5, 11]


def poison_outside_windows(meta: AttentionMetadata, k_cache, v_cache, window: int) -> None:
    """Overwrite every cached K/V position that no new token's window reaches with NaN: a
    kernel that reads one then fails (even masked, 0 * NaN is NaN in its PV product)."""
    page_size = k_cache.shape[1]
    for i, prefix in enumerate(meta.prefix_lens_host):
        pos = torch.arange(max(0, prefix - window + 1))  # before the first new token's window
        pages = meta.page_table[i].long().cpu()[pos // page_size]
        for cache in (k_cache, v_cache):
            cache.view(-1, *cache.shape[2:])[pages * page_size + pos % page_size] = float("nan")


@interp
@pytest.mark.parametrize("window", [1, 5, 24])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_interp_decode_window_and_sinks(window, with_sinks):
    # GQA 3, several splits over contexts longer and shorter than the window; positions before
    # every window are NaN, so a kernel that reads them fails.
    lens = [1, 37, 70, 9]
    case = make_case([(n - 1, 1) for n in lens], 6, 2, 32, 4, torch.float32, "cpu", seed=11, decode=True)
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(3)) * 2 if with_sinks else None
    check(case, tol=2e-3, window=window, sinks=sinks)


@interp
def test_interp_decode_sinks_one_split_bf16():
    from nanoserve.attention.triton_backend import TritonAttentionBackend

    case = make_case([(n - 1, 1) for n in (3, 20)], 4, 2, 16, 4, torch.bfloat16, "cpu", seed=12, decode=True)
    sinks = torch.tensor([0.5, -1.0, 3.0, 0.0])
    check(case, tol=1e-2, backend=TritonAttentionBackend(max_splits=1), sinks=sinks)


@interp
@pytest.mark.parametrize("window", [3, 16, 40])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_interp_extend_window_and_sinks(window, with_sinks):
    # prefixes and new tokens longer than the window, crossing several 16-row tiles; one
    # request's prefix is wholly before every window, one has none
    reqs = [(21, 35), (0, 5), (50, 3), (3, 17)]
    case = make_case(reqs, 4, 2, 32, 4, torch.float32, "cpu", seed=13)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(4)) if with_sinks else None
    check(case, tol=2e-3, window=window, sinks=sinks)


@interp
def test_interp_mixed_batch_window_and_sinks():
    # decode rows then prompt rows in one batch: each part gets the layer's kind
    reqs = [(40, 1), (9, 1), (21, 35), (0, 5)]
    case = make_case(reqs, 4, 2, 32, 4, torch.float32, "cpu", seed=14)
    case.meta.num_decode_rows = 2
    check(case, tol=2e-3, window=12, sinks=torch.tensor([1.0, -2.0, 0.5, 4.0]))


def test_reference_window_and_sinks_by_hand():
    # One query over 3 keys: window 2 drops the first key; the sink adds exp(sink) to the
    # denominator (the backends are checked against this reference above).
    from nanoserve.kernels.attention import attention_reference

    q = torch.tensor([[[1.0, 0.0]]])
    k = torch.tensor([[[5.0, 0.0]], [[1.0, 0.0]], [[2.0, 0.0]]])
    v = torch.tensor([[[100.0, 0.0]], [[1.0, 0.0]], [[3.0, 1.0]]])
    sink = torch.tensor([0.5])
    got = attention_reference(q, k, v, 1.0, causal_offset=2, window=2, sinks=sink)
    e1, e2, es = torch.exp(torch.tensor([1.0, 2.0, 0.5]))
    want = torch.stack([(e1 * 1 + e2 * 3) / (e1 + e2 + es), e2 / (e1 + e2 + es)])
    assert torch.allclose(got[0, 0], want)


def engine_tokens(model_dir, backend: str, device: str, **engine_args) -> list[list[int]]:
    from nanoserve import LLM, SamplingParams
    from tests.tiny import random_prompts

    llm = LLM(str(model_dir), device=device, attention_backend=backend, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(random_prompts(3, seed=3, max_len=40), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@interp
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_interp_engine_matches_torch_backend(tmp_path, arch):
    """The engine end to end (chunked prefill => extends over prefixes, then decodes) gives
    the same greedy tokens with the Triton backend as with the torch one (gemma3: sliding
    windows shorter than the prompts)."""
    from tests.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / arch, arch)
    args = {"chunked_prefill_size": 16, "page_size": 4}
    assert engine_tokens(path, "triton", "cpu", **args) == engine_tokens(path, "torch", "cpu", **args)


def test_get_backend_names():
    from nanoserve.attention import get_backend

    assert get_backend("auto", "cpu").name == "torch"
    assert get_backend("torch").name == "torch"
    if HAS_TRITON:
        assert get_backend("triton", max_splits=4).name == "triton"
    with pytest.raises(ValueError):
        get_backend("nope")


# ------------------------------------------------------------------------------ GPU tests

gpu = pytest.mark.gpu

DECODE_SHAPES = [
    # (batch, max_ctx, q_heads, kv_heads, head_dim, page_size)
    (1, 1, 8, 8, 128, 16),
    (1, 8192, 32, 8, 128, 16),
    (3, 4000, 9, 3, 64, 16),  # SmolLM2: group 3
    (7, 2048, 16, 8, 64, 1),
    (16, 1024, 32, 4, 128, 1),
    (64, 512, 32, 8, 128, 16),
    (128, 300, 16, 2, 64, 16),
    (256, 128, 32, 8, 128, 16),
    (256, 64, 16, 16, 128, 1),
    (5, 3000, 32, 32, 128, 16),  # MHA
]


@gpu
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: "b{}-ctx{}-h{}/{}-d{}-p{}".format(*s))
def test_decode(shape):
    batch, max_ctx, hq, hkv, d, page = shape
    rng = random.Random(hash(shape) & 0xFFFF)
    lens = ragged(rng, batch, 1, max_ctx)
    seed = rng.randrange(1 << 30)
    case = make_case([(n - 1, 1) for n in lens], hq, hkv, d, page, torch.bfloat16, "cuda", seed=seed, decode=True)
    check(case, tol=1e-2)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("max_splits", [1, 32])
def test_decode_runs(dtype, max_splits):
    """Verify batches through the decode kernel over runs (llama's head shape): runs of 1..5 positions over
    ragged contexts, one program per run and split against the torch backend's rows."""
    from nanoserve.attention.triton_backend import TritonAttentionBackend

    rng = random.Random(13)
    runs = [(rng.randint(0, 3000), rng.randint(1, 5)) for _ in range(12)] + [(4090, 5)]
    case = runs_case(runs, 32, 8, 128, 16, dtype, "cuda", seed=14)
    check(case, tol=1e-2 if dtype == torch.bfloat16 else 1e-4, backend=TritonAttentionBackend(max_splits=max_splits))


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_dtypes(dtype, head_dim):
    lens = [1, 700, 2100, 33]
    case = make_case([(n - 1, 1) for n in lens], 16, 4, head_dim, 16, dtype, "cuda", seed=11, decode=True)
    check(case, tol=1e-2)


@gpu
@pytest.mark.parametrize("decode", [True, False])
def test_fp8_cache(decode):
    # Raw bf16 K/V: check() asserts the kernel's fp8 bytes equal torch's cast; an extend's new
    # tokens attend to each other unrounded in both backends.
    rng = random.Random(21)
    if decode:
        reqs = [(n - 1, 1) for n in ragged(rng, 64, 1, 3000)]
    else:
        reqs = list(zip(ragged(rng, 8, 0, 2000), ragged(rng, 8, 1, 300)))
    case = make_case(
        reqs, 16, 8, 128, 16, torch.bfloat16, "cuda", seed=22, decode=decode, cache_dtype=torch.float8_e4m3fn
    )
    check(case, tol=1e-2)


EXTEND_SHAPES = [
    # (batch, max_prefix, max_new, q_heads, kv_heads, head_dim, page_size)
    (1, 0, 1, 8, 8, 128, 16),
    (1, 4096, 512, 32, 8, 128, 16),
    (4, 2048, 300, 9, 3, 64, 16),
    (3, 1000, 129, 16, 2, 64, 1),
    (8, 512, 64, 32, 4, 128, 16),
    (16, 300, 1, 32, 8, 128, 16),  # prefix under single new tokens (decode-shaped extend)
    (2, 0, 777, 8, 1, 128, 1),  # no prefix, but forced through the Triton kernel below
    (32, 128, 40, 16, 16, 64, 16),
]


@gpu
@pytest.mark.parametrize("shape", EXTEND_SHAPES, ids=lambda s: "b{}-pre{}-new{}-h{}/{}-d{}-p{}".format(*s))
def test_extend(shape):
    from nanoserve.attention.triton_backend import TritonAttentionBackend

    batch, max_prefix, max_new, hq, hkv, d, page = shape
    rng = random.Random(hash(shape) & 0xFFFF)
    prefixes = ragged(rng, batch, 0, max_prefix)
    news = ragged(rng, batch, 1, max_new)
    case = make_case(list(zip(prefixes, news)), hq, hkv, d, page, torch.bfloat16, "cuda", seed=rng.randrange(1 << 30))
    check(case, tol=1e-2, backend=TritonAttentionBackend(use_fa2=False))


@gpu
def test_prefill_fa2_path():
    rng = random.Random(5)
    news = ragged(rng, 4, 1, 1500)
    case = make_case([(0, n) for n in news], 32, 8, 128, 16, torch.bfloat16, "cuda", seed=6)
    check(case, tol=1e-2)


# Layer kinds at the real models' shapes: gpt-oss (64 q / 8 kv heads, head_dim 64, window 128,
# sinks), gemma-3-12b (16 / 8, head_dim 256, window 1024), gemma-3-27b (32 / 16, head_dim 128).
KIND_SHAPES = [
    # (q_heads, kv_heads, head_dim, window, sinks)
    (64, 8, 64, 128, True),
    (64, 8, 64, 0, True),
    (16, 8, 256, 1024, False),
    (32, 16, 128, 1024, False),
]


@gpu
@pytest.mark.parametrize("kind", KIND_SHAPES, ids=lambda s: "h{}/{}-d{}-w{}-sinks{}".format(*s))
@pytest.mark.parametrize("decode", [True, False])
def test_window_and_sinks(kind, decode):
    from nanoserve.attention.triton_backend import TritonAttentionBackend

    hq, hkv, d, window, with_sinks = kind
    rng = random.Random(hash(kind) & 0xFFFF)
    if decode:
        reqs = [(n - 1, 1) for n in ragged(rng, 16, 1, 5000)]
    else:
        reqs = list(zip(ragged(rng, 6, 0, 3000), ragged(rng, 6, 1, 1500)))
    case = make_case(reqs, hq, hkv, d, 16, torch.bfloat16, "cuda", seed=rng.randrange(1 << 30), decode=decode)
    sinks = torch.randn(hq, device="cuda").to(torch.bfloat16) if with_sinks else None
    check(case, tol=1e-2, backend=TritonAttentionBackend(use_fa2=False), window=window, sinks=sinks)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_extend_fp16_fp32(dtype, head_dim):
    from nanoserve.attention.triton_backend import TritonAttentionBackend

    case = make_case([(100, 50), (0, 90), (1500, 3)], 8, 2, head_dim, 16, dtype, "cuda", seed=7)
    check(case, tol=1e-2, backend=TritonAttentionBackend(use_fa2=False))


@gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt-oss"])
def test_engine_matches_torch_backend_on_gpu(tmp_path, page_size, arch):
    from tests.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / arch, arch)
    args = {
        "chunked_prefill_size": 16,
        "page_size": page_size,
        "dtype": "float32",
        "kv_cache_tokens": 4096,
        "enforce_eager": True,
    }
    assert engine_tokens(path, "triton", "cuda", **args) == engine_tokens(path, "torch", "cuda", **args)


@gpu
def test_decode_cuda_graph_replay():
    """Decode is capturable: capture once with the largest context, replay on new lengths."""
    from nanoserve.attention.triton_backend import TritonAttentionBackend

    hq, hkv, d, page, batch = 32, 8, 128, 16, 8
    backend = TritonAttentionBackend()
    backend.reserve_decode_workspace(batch, hq, d, hkv, 4096, "cuda")
    case = make_case([(4095, 1)] * batch, hq, hkv, d, page, torch.bfloat16, "cuda", seed=8, decode=True)
    out = torch.empty_like(case.q)
    backend.prepare(case.meta)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale, out=out)
    # new lengths (shorter, ragged) written into the captured device buffers
    lens = [1, 17, 4096, 300, 2000, 1024, 5, 999]
    new = make_case([(n - 1, 1) for n in lens], hq, hkv, d, page, torch.bfloat16, "cuda", seed=9, decode=True)
    assert new.k_cache.shape[0] <= case.k_cache.shape[0]
    for dst, src in ((case.k_cache, new.k_cache), (case.v_cache, new.v_cache)):
        dst.zero_()
        dst[: src.shape[0]].copy_(src)
    m, nm = case.meta, new.meta
    m.seq_lens.copy_(nm.seq_lens)
    m.page_table.zero_()
    m.page_table[:, : nm.page_table.shape[1]].copy_(nm.page_table)
    m.slot_mapping.copy_(nm.slot_mapping)
    for dst, src in ((case.q, new.q), (case.k, new.k), (case.v, new.v)):
        dst.copy_(src)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref_backend = TorchAttentionBackend()
    ref_backend.prepare(nm)
    ref = ref_backend.forward(new.q, new.k, new.v, new.k_cache, new.v_cache, nm, new.scale)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < 1e-2
