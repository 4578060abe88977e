"""The MoE kernels of nanoserve/kernels/moe.py (route, align, fused_moe) against their torch twins.

CPU tests run small shapes in Triton's interpreter (conftest sets TRITON_INTERPRET=1 without a
GPU): both fused_moe paths, H and I not multiples of the blocks, experts no token chose, top-k
1 to 8, fp32 with a tight bound (an indexing slip moves whole rows) and bf16. GPU tests
(`pytest -m gpu tests/test_moe_kernel.py`) sweep token counts 1..8192, 8..128 experts and
top-k 1..8 in bf16, judge the kernel by its error to an fp64 truth against the bf16 twin's own
error (printed, asserted with a margin), and replay both paths in a CUDA graph bit-equal to eager.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

import pytest
import torch

from nanoserve.kernels import moe

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
interp = pytest.mark.skipif(
    not (HAS_TRITON and INTERPRET), reason="needs triton and TRITON_INTERPRET=1 (set by conftest without a GPU)"
)
gpu = pytest.mark.gpu


def make_inputs(T, H, inter, E, k, dtype, device, seed=0, renormalize=True, skew=0.0):
    """Random hidden, weights scaled to keep outputs O(1), and a routing from route_reference.
    `skew` > 0 biases the router towards the low experts, so some experts get no token."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen, device=device).to(dtype)
    w13 = (torch.randn(E, 2 * inter, H, generator=gen, device=device) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=gen, device=device) / inter**0.5).to(dtype)
    logits = torch.randn(T, E, generator=gen, device=device)
    logits -= skew * torch.arange(E, device=device)
    weights, ids = moe.route_reference(logits, k, renormalize)
    return hidden, w13, w2, weights, ids


def truth(hidden, w13, w2, weights, ids):
    """The fp64 sum (the yardstick both the kernel and the bf16 twin are measured against)."""
    return moe.fused_moe_reference(hidden.double(), w13.double(), w2.double(), weights.double(), ids)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------- CPU


def test_reference_is_the_definition():
    """fused_moe_reference against a per-token loop written from the formula."""
    hidden, w13, w2, weights, ids = make_inputs(5, 12, 6, 4, 2, torch.float64, "cpu")
    want = torch.zeros_like(hidden)
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            gate, up = w13[e, :6] @ hidden[t], w13[e, 6:] @ hidden[t]
            want[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(moe.fused_moe_reference(hidden, w13, w2, weights, ids), want)


@interp
@pytest.mark.parametrize(("E", "k"), [(8, 1), (8, 2), (12, 3), (16, 8), (60, 4), (128, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_interp_route(E, k, renormalize):
    logits = torch.randn(9, E)  # fp32: no ties, whose order torch.topk leaves open
    w, ids = moe.route(logits, k, renormalize)
    w_ref, ids_ref = moe.route_reference(logits, k, renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == ids.shape == (9, k)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)


@interp
def test_interp_route_is_gpt_oss_routing():
    """gpt-oss routes by a softmax over its k largest logits (Hugging Face's
    GptOssTopKRouter); route's k largest of the softmax over all E, divided by their sum, is
    the same function, which lets gpt-oss's fused path route in one launch."""
    logits = 3 * torch.randn(37, 32)
    top, ids = torch.topk(logits, 4, dim=-1)
    w, got = moe.route(logits, 4, True)
    assert torch.equal(got.long(), ids)
    torch.testing.assert_close(w, torch.softmax(top, dim=-1), atol=1e-7, rtol=1e-6)


def stable_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The top-k expert ids, largest first, the lower index first among equal logits."""
    return torch.sort(logits.float(), dim=1, descending=True, stable=True).indices[:, :k].int()


@interp
@pytest.mark.parametrize(("E", "k"), [(8, 2), (16, 8), (64, 8)])
def test_interp_route_ties_go_to_the_lower_index(E, k):
    logits = torch.randint(-2, 3, (9, E)).float()  # five values: every row ties inside its top-k
    w, ids = moe.route(logits, k, True)
    assert torch.equal(ids, stable_top_k(logits, k))
    torch.testing.assert_close(w, moe.route_reference(logits, k, True)[0], atol=1e-6, rtol=1e-5)


def test_route_rejects_bad_top_k():
    with pytest.raises(ValueError, match="top_k"):
        moe.route(torch.randn(2, 4), 5, True)
    with pytest.raises(ValueError, match="top_k"):
        moe.route(torch.randn(2, 4), 0, True)


ALIGN_CASES = [(1, 2, 8, 16), (7, 3, 5, 4), (40, 8, 16, 16), (3, 1, 64, 32), (256, 8, 128, 16), (512, 2, 8, 128)]


@pytest.mark.parametrize(("T", "k", "E", "block_m"), ALIGN_CASES)
def test_align_groups_every_pair_once(T, k, E, block_m):
    """The torch twin (runs on CPU as on the GPU): every pair once, blocks of one expert in
    expert order, padding only at each group's end, num_padded = the padded group sizes."""
    ids = torch.randint(0, E, (T, k), dtype=torch.int32)
    al = moe.align_reference(ids, E, block_m)
    pairs = T * k
    assert al.sorted_pairs.numel() == moe.align_capacity(T, k, E, block_m)
    used = int(al.num_padded)
    counts = torch.bincount(ids.flatten().long(), minlength=E)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    real = al.sorted_pairs[:used]
    assert sorted(real[real < pairs].tolist()) == list(range(pairs))
    assert (al.sorted_pairs[used:] == pairs).all()
    flat = ids.flatten()
    for b in range(used // block_m):
        rows = real[b * block_m : (b + 1) * block_m]
        e = int(al.block_expert[b])
        members = rows[rows < pairs].long()
        assert len(members) and (flat[members] == e).all()
        assert (rows[len(members) :] == pairs).all()  # padding after the group's pairs
        assert b == 0 or int(al.block_expert[b - 1]) <= e
    assert (al.block_expert[used // block_m :] == E).all()


@interp
@pytest.mark.parametrize("skew", [0.0, 2.0])
@pytest.mark.parametrize(("T", "k", "E", "block_m"), ALIGN_CASES)
def test_interp_align_kernel_equals_twin(T, k, E, block_m, skew):
    """The align kernel (a program per expert) returns the twin's alignment exactly (also with most
    experts empty)."""
    logits = torch.randn(T, E) - skew * torch.arange(E)
    ids = moe.route_reference(logits, k, True)[1]
    al, twin = moe.align(ids, E, block_m, interpreted=True), moe.align_reference(ids, E, block_m)
    assert T * k <= moe.ALIGN_KERNEL_MAX_PAIRS
    assert torch.equal(al.sorted_pairs, twin.sorted_pairs)
    assert torch.equal(al.block_expert, twin.block_expert)
    assert torch.equal(al.num_padded, twin.num_padded)


# (T, H, I, E, k, skew): ragged H and I, empty experts (T*k < E, skew), every top-k up to 8
INTERP_SHAPES = [
    (1, 40, 24, 8, 2, 0.0),
    (3, 64, 48, 16, 8, 0.0),
    (6, 48, 40, 16, 1, 1.0),
    (33, 72, 56, 8, 4, 0.0),
    (20, 32, 16, 32, 2, 0.5),
]


@interp
@pytest.mark.parametrize("path", ["decode", "grouped"])
@pytest.mark.parametrize(("T", "H", "inter", "E", "k", "skew"), INTERP_SHAPES)
def test_interp_fused_moe_fp32_tight(path, T, H, inter, E, k, skew):
    """fp32 in and out: the kernel must match the twin to summation-order noise."""
    args = make_inputs(T, H, inter, E, k, torch.float32, "cpu", skew=skew, renormalize=k % 2 == 0)
    if skew:
        assert len(torch.unique(args[4])) < E  # some experts are empty
    out = moe.fused_moe(*args, path=path)
    ref = moe.fused_moe_reference(*args)
    assert out.dtype == torch.float32 and not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


@interp
@pytest.mark.parametrize("path", ["decode", "grouped"])
@pytest.mark.parametrize(("T", "H", "inter", "E", "k", "skew"), INTERP_SHAPES[:3])
def test_interp_fused_moe_bf16(path, T, H, inter, E, k, skew):
    """bf16: near the bf16 twin's distance from the fp64 truth. Triton 3.9's interpreter
    converts fp32 to bf16 by truncation (measured: twice the mean error of round-to-nearest),
    and the kernels round five times (four products, then the sum of the slots' planes), so
    here the bound is 5x the twin's (measured up to 4.5x: 1.69e-2 against 3.72e-3; 3.2x while
    the sum was rounded by torch); on the GPU it is 1.5x."""
    args = make_inputs(T, H, inter, E, k, torch.bfloat16, "cpu", skew=skew)
    out = moe.fused_moe(*args, path=path)
    assert out.dtype == torch.bfloat16
    want = truth(*args)
    err, twin = rel_err(out, want), rel_err(moe.fused_moe_reference(*args), want)
    print(f"{path} T={T} E={E} k={k}: kernel {err:.2e}, twin {twin:.2e} (relative to fp64)")
    assert err < 5 * twin + 1e-3, f"kernel {err:.2e} vs twin {twin:.2e}"


@interp
def test_interp_grouped_blocks_wider_than_groups():
    """A BLOCK_M larger than any expert's group (every block mostly padding), and different
    BLOCK_M for the two GEMMs (two alignments)."""
    args = make_inputs(5, 32, 32, 8, 2, torch.float32, "cpu")
    cfgs = (moe.MoEConfig(32, 16, 16, 1, 1), moe.MoEConfig(16, 32, 32, 1, 1))
    out = moe.fused_moe(*args, configs=cfgs, path="grouped")
    torch.testing.assert_close(out, moe.fused_moe_reference(*args), atol=2e-6, rtol=1e-5)


@interp
@pytest.mark.parametrize("group_m", [1, 3, 64])
def test_interp_grouped_block_order(group_m):
    """Sorted blocks taken in groups (1, one that does not divide the block count, more than
    there are): every (block, column block) program still runs once, so fp32 stays tight."""
    args = make_inputs(33, 72, 56, 8, 4, torch.float32, "cpu")
    cfg = moe.MoEConfig(16, 16, 16, 1, 1, group_m=group_m)
    out = moe.fused_moe(*args, configs=(cfg, cfg), path="grouped")
    torch.testing.assert_close(out, moe.fused_moe_reference(*args), atol=2e-6, rtol=1e-5)


def test_fp32_reads_tiles_of_the_bf16_bytes():
    """The table is measured in bf16; fp32 runs take half as deep tiles, so a config that fits
    shared memory in bf16 fits in fp32 (a 512-deep fp32 decode tile did not, on an H200)."""
    cfg = moe.MoEConfig(1, 8, 512, 2, 3)
    assert moe._for_dtype(cfg, torch.bfloat16) == cfg
    assert moe._for_dtype(cfg, torch.float32) == moe.MoEConfig(1, 8, 256, 2, 3)
    assert moe._for_dtype(moe.MoEConfig(16, 16, 16, 1, 1), torch.float32).block_k == 16  # tl.dot's least


def test_fused_moe_rejects_bad_shapes():
    hidden, w13, w2, weights, ids = make_inputs(2, 8, 4, 4, 2, torch.float32, "cpu")
    with pytest.raises(ValueError, match="do not fit"):
        moe.fused_moe(hidden, w13, w2[:, :, :3], weights, ids)
    with pytest.raises(ValueError, match="must be"):
        moe.fused_moe(hidden, w13, w2, weights[:1], ids[:1])
    with pytest.raises(ValueError, match="path"):
        moe.fused_moe(hidden, w13, w2, weights, ids, path="dense")
    assert moe.fused_moe(hidden[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 8)


def test_configs_table_then_fallback(monkeypatch):
    """A bucket in TUNED gets its measured entry and the path it was measured on; a bucket
    without one the nearest measured bucket of the path the T*k rule picks; a shape without
    any entry on that path the fallback, without warnings."""
    monkeypatch.setattr(moe, "TUNED", {})
    grouped = (moe.MoEConfig(64, 128, 64, 4, 3), moe.MoEConfig(64, 64, 128, 8, 4))
    grouped_big = (moe.MoEConfig(128, 128, 64, 8, 3), moe.MoEConfig(128, 64, 64, 8, 3))
    decode = (moe.MoEConfig(1, 32, 128, 4, 3), moe.MoEConfig(1, 64, 256, 4, 3, split_k=2))
    moe.TUNED[(4096, 14336, 8, 256)] = grouped
    moe.TUNED[(4096, 14336, 8, 4096)] = grouped_big
    moe.TUNED[(4096, 14336, 8, 1)] = decode
    moe.TUNED[(4096, 14336, 8, 16)] = grouped  # measured faster than the decode path at 9..16 tokens
    assert moe.get_configs(4096, 14336, 8, 200, 2) == grouped  # 200 tokens fall in the 256 bucket
    assert moe.get_configs(4096, 14336, 8, 1000, 2) == grouped  # bucket 1024: 256 is nearer than 4096
    assert moe.get_configs(4096, 14336, 8, 3000, 2) == grouped_big
    assert moe.get_configs(4096, 14336, 8, 12, 2) == grouped  # the entry picks its bucket's path
    assert moe.get_configs(4096, 14336, 8, 12, 2, path="decode") == decode
    assert moe.get_configs(4096, 14336, 8, 3, 2) == decode  # bucket 4, untuned: the rule says decode
    assert moe.get_configs(4096, 14336, 8, 1, 2, path="grouped") == grouped  # nearest grouped bucket
    fallback = moe.get_configs(4096, 7168, 8, 1000, 2)  # no entry for this shape
    assert fallback == (moe._fallback_config(1000, 2, 8, 7168, False), moe._fallback_config(1000, 2, 8, 4096, False))
    assert moe.get_configs(512, 256, 64, 10, 6)[0].block_m == 1  # 60 pairs: decode
    assert moe.get_configs(512, 256, 64, 11, 6)[0].block_m > 1  # 66 pairs: grouped


@interp
@pytest.mark.parametrize("split", [2, 3, 5])
@pytest.mark.parametrize(("T", "H", "inter", "E", "k", "skew"), INTERP_SHAPES[:3])
def test_interp_decode_split_k(split, T, H, inter, E, k, skew):
    """The decode path's down product split over its depth (splits that do not divide I, and
    more splits than depth blocks: empty planes): k * split planes, fp32 as tight as unsplit,
    and their ordered sum is fused_moe's output bit for bit."""
    args = make_inputs(T, H, inter, E, k, torch.float32, "cpu", skew=skew)
    cfgs = (moe.MoEConfig(1, 16, 16, 1, 1), moe.MoEConfig(1, 16, 16, 1, 1, split_k=split))
    planes = moe.fused_moe_partials(*args, configs=cfgs, path="decode")
    assert planes.shape == (k * split, T, H) and planes.dtype == torch.float32
    out = moe.fused_moe(*args, configs=cfgs, path="decode")
    torch.testing.assert_close(out, moe.fused_moe_reference(*args), atol=2e-6, rtol=1e-5)
    ordered = planes[0].clone()
    for plane in planes[1:]:
        ordered += plane
    assert torch.equal(out, ordered)


@interp
@pytest.mark.parametrize("path", ["decode", "grouped"])
def test_interp_partials_are_the_slots_terms(path):
    """Plane j holds slot j's weighted expert output for every token (the layout the next
    RMSNorm reads), so each plane equals the reference run on that slot alone."""
    T, H, inter, E, k = 5, 32, 24, 8, 3
    hidden, w13, w2, weights, ids = make_inputs(T, H, inter, E, k, torch.float32, "cpu")
    planes = moe.fused_moe_partials(hidden, w13, w2, weights, ids, path=path)
    assert planes.shape == (k, T, H)
    for j in range(k):
        alone = moe.fused_moe_reference(hidden, w13, w2, weights[:, j : j + 1], ids[:, j : j + 1])
        torch.testing.assert_close(planes[j], alone, atol=2e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- GPU

# token counts 1..8192 (some leaving experts empty at 128 experts), experts 8..128, top-k 1..8
GPU_CASES = [
    (T, E, k)
    for T in (1, 2, 3, 8, 17, 64, 100, 256, 1000, 4096, 8192)
    for E, k in ((8, 2), (8, 1), (64, 6), (128, 8), (128, 1))
]


@gpu
@pytest.mark.parametrize(("T", "E", "k"), GPU_CASES)
def test_gpu_fused_moe_bf16_vs_twin(T, E, k):
    H, inter = 512, 384
    args = make_inputs(T, H, inter, E, k, torch.bfloat16, "cuda", seed=T * 1000 + E + k)
    want = truth(*args)
    twin = rel_err(moe.fused_moe_reference(*args), want)
    for path in ("decode", "grouped") if T * k <= 4 * moe.DECODE_MAX_PAIRS else ("grouped",):
        out = moe.fused_moe(*args, path=path)
        err = rel_err(out, want)
        print(f"T={T} E={E} k={k} {path}: kernel {err:.2e}, twin {twin:.2e} (relative to fp64)")
        assert not out.isnan().any()
        assert err < 1.5 * twin + 1e-3, f"{path}: kernel {err:.2e} vs twin {twin:.2e}"
    out = moe.fused_moe(*args)  # the table's / fallback's choice
    assert rel_err(out, want) < 1.5 * twin + 1e-3


@gpu
@pytest.mark.parametrize(("T", "H", "inter", "E", "k"), [(1, 2048, 768, 128, 8), (64, 2048, 768, 128, 8),
                                                        (2048, 2048, 768, 128, 8), (4, 4096, 1792, 8, 2),
                                                        (1024, 4096, 1792, 8, 2), (1, 4096, 14336, 8, 2)])  # fmt: skip
def test_gpu_fused_moe_model_shapes_fp32_tight(T, H, inter, E, k):
    """fp32 (no TF32): both paths equal the fp32 twin to summation-order noise."""
    args = make_inputs(T, H, inter, E, k, torch.float32, "cuda", seed=T)
    ref = moe.fused_moe_reference(*args)
    for path in ("decode", "grouped"):
        torch.testing.assert_close(moe.fused_moe(*args, path=path), ref, atol=2e-5, rtol=1e-4)


@gpu
@pytest.mark.parametrize(("E", "k"), [(8, 2), (60, 4), (64, 8), (128, 8), (128, 1)])
@pytest.mark.parametrize("T", [1, 77, 8192])
def test_gpu_route(T, E, k):
    """bf16 logits tie often (on an H200, 2026-11-25, 18% of 77 rows at E=64, k=8 had a tie in
    their top-k that torch.topk ordered otherwise): the kernel must choose exactly as the stable
    sort does (lower index first among ties), and torch.topk's choice must be the same logits."""
    logits = torch.randn(T, E, device="cuda", dtype=torch.bfloat16)
    want = stable_top_k(logits, k)
    for renormalize in (True, False):
        w, ids = moe.route(logits, k, renormalize)
        w_ref, ids_ref = moe.route_reference(logits, k, renormalize)
        assert torch.equal(ids, want)
        assert torch.equal(logits.gather(1, ids_ref.long()), logits.gather(1, ids.long()))
        torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)


@gpu
@pytest.mark.parametrize("block_m", [16, 64, 128])
@pytest.mark.parametrize(
    ("T", "E", "k"), [(1, 8, 2), (9, 8, 2), (256, 8, 2), (2048, 8, 2), (5, 128, 8), (256, 128, 8), (512, 128, 8)]
)
def test_gpu_align_kernel_equals_twin(T, E, k, block_m):
    """Every decode batch size's alignment (up to ALIGN_KERNEL_MAX_PAIRS pairs) from the one
    kernel equals the torch twin's exactly."""
    ids = moe.route_reference(torch.randn(T, E, device="cuda"), k, True)[1]
    al, twin = moe.align(ids, E, block_m), moe.align_reference(ids, E, block_m)
    for name in ("sorted_pairs", "block_expert", "num_padded"):
        assert torch.equal(getattr(al, name), getattr(twin, name)), name


def assert_graph_replays_bit_equal(layer, hidden: torch.Tensor, logits: torch.Tensor) -> None:
    """`layer()` (route + fused_moe on `hidden` and `logits`) captured in a CUDA graph and
    replayed on new inputs, written into those tensors: bit-equal to an eager call each time."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer()
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed + 1)
        hidden.copy_(torch.randn(hidden.shape, generator=gen, device="cuda"))
        logits.copy_(torch.randn(logits.shape, generator=gen, device="cuda") * 3)
        graph.replay()
        eager = layer()
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager)


@gpu
@pytest.mark.parametrize(("T", "E", "k"), [(2, 128, 8), (8, 8, 2), (512, 128, 8), (300, 8, 2)])
def test_gpu_graph_replay_bit_equal(T, E, k):
    """route + fused_moe captured in a CUDA graph (fails on any host synchronisation), replayed
    on new inputs copied into the captured buffers: bit-equal to eager on the same inputs."""
    H, inter = 1024, 512
    hidden, w13, w2, _, _ = make_inputs(T, H, inter, E, k, torch.bfloat16, "cuda")
    logits = torch.randn(T, E, device="cuda")

    def layer():
        w, ids = moe.route(logits, k, True)
        return moe.fused_moe(hidden, w13, w2, w, ids)

    assert_graph_replays_bit_equal(layer, hidden, logits)


# The ragged shapes of INTERP_SHAPES at few tokens (the interpreter runs the decode path a
# program per (pair, column block): 33 tokens took 15-21 s a case).
FEW_TOKEN_SHAPES = [INTERP_SHAPES[0], (5, 72, 56, 8, 4, 0.0), INTERP_SHAPES[4]]


def fp8_inputs(T, H, inter, E, k, blocks, dtype=torch.float32, skew=0.0, device="cpu"):
    """make_inputs with both weights in e4m3: `blocks` (bn, bk) scale blocks, or None per channel."""
    hidden, w13, w2, weights, ids = make_inputs(T, H, inter, E, k, torch.float32, device, skew=skew)
    bn, bk13, bk2 = (1, H, inter) if blocks is None else (blocks[0], blocks[1], blocks[1])
    q13, s13 = moe.quantize_experts(w13, bn, bk13)
    q2, s2 = moe.quantize_experts(w2, bn, bk2)
    return hidden.to(dtype), q13, q2, weights, ids, moe.ExpertScales(s13, s2, bn, bk13, bk2)


@interp
@pytest.mark.parametrize("path", ["decode", "grouped"])
@pytest.mark.parametrize("blocks", [None, (8, 16), (8, 32)])
@pytest.mark.parametrize(("T", "H", "inter", "E", "k", "skew"), FEW_TOKEN_SHAPES)
def test_interp_fused_moe_fp8_experts(path, blocks, T, H, inter, E, k, skew):
    """e4m3 experts with per-channel or block scales (blocks narrower than the kernels' tiles,
    whose K steps are cut to fit, and not dividing H): fp32 activations match the twin on the
    dequantized weights to summation-order noise."""
    hidden, q13, q2, weights, ids, scales = fp8_inputs(T, H, inter, E, k, blocks, skew=skew)
    out = moe.fused_moe(hidden, q13, q2, weights, ids, path=path, scales=scales)
    d13, d2 = scales.dequantized(q13, q2, torch.float32)
    ref = moe.fused_moe_reference(hidden, d13, d2, weights, ids)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


@interp
def test_interp_fused_moe_fp8_bf16_activations():
    """bf16 activations: the kernels multiply by the exact dequantized weights (fp32), the bf16
    twin by them rounded to bf16; both against the fp64 truth on the exact ones. Bound as
    test_interp_fused_moe_bf16's (the interpreter truncates to bf16)."""
    hidden, q13, q2, weights, ids, scales = fp8_inputs(3, 64, 48, 16, 8, (16, 32), dtype=torch.bfloat16)
    want = truth(hidden, *scales.dequantized(q13, q2, torch.float32), weights, ids)
    twin = rel_err(moe.fused_moe_reference(hidden, *scales.dequantized(q13, q2, torch.bfloat16), weights, ids), want)
    for path in ("decode", "grouped"):
        out = moe.fused_moe(hidden, q13, q2, weights, ids, path=path, scales=scales)
        err = rel_err(out, want)
        print(f"fp8 experts, bf16 {path}: kernel {err:.2e}, twin {twin:.2e}")
        assert out.dtype == torch.bfloat16 and err < 5 * twin + 1e-3, (path, err, twin)


@interp
def test_fused_moe_refuses_fp8_without_scales():
    hidden, q13, q2, weights, ids, scales = fp8_inputs(2, 32, 16, 8, 2, None)
    with pytest.raises(ValueError, match="FP8 experts need"):
        moe.fused_moe_partials(hidden, q13, q2, weights, ids)
    bad = moe.ExpertScales(scales.w13[:, :1], scales.w2, 1, 32, 16)
    with pytest.raises(ValueError, match="w13 scales must be"):
        moe.fused_moe_partials(hidden, q13, q2, weights, ids, scales=bad)
    hidden, q13, q2, weights, ids, scales = fp8_inputs(2, 32, 24, 8, 2, (16, 16))
    with pytest.raises(ValueError, match="whole 16-row blocks"):
        moe.fused_moe_partials(hidden, q13, q2, weights, ids, scales=scales)


@gpu
@pytest.mark.parametrize("blocks", [None, (128, 128)])
@pytest.mark.parametrize("T", [1, 4, 64, 2048])
def test_gpu_fused_moe_fp8_experts(T, blocks):
    """qwen3-30b-a3b's expert shapes in e4m3 (per channel, and the 128x128 blocks of its FP8
    checkpoint): fp32 activations tight against the twin on the dequantized weights, bf16 within
    1.5x of the bf16 twin's error to the fp64 truth on the exact dequantized weights, both paths."""
    H, inter, E, k = 2048, 768, 128, 8
    hidden, q13, q2, weights, ids, scales = fp8_inputs(T, H, inter, E, k, blocks, device="cuda")
    d13, d2 = scales.dequantized(q13, q2, torch.float32)
    ref = moe.fused_moe_reference(hidden, d13, d2, weights, ids)
    for path in ("decode", "grouped"):
        out = moe.fused_moe(hidden, q13, q2, weights, ids, path=path, scales=scales)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    x = hidden.bfloat16()
    want = truth(x, d13, d2, weights, ids)
    twin = rel_err(moe.fused_moe_reference(x, *scales.dequantized(q13, q2, torch.bfloat16), weights, ids), want)
    for path in ("decode", "grouped"):
        err = rel_err(moe.fused_moe(x, q13, q2, weights, ids, path=path, scales=scales), want)
        print(f"fp8 experts T={T} blocks={blocks} {path}: kernel {err:.2e}, twin {twin:.2e}")
        assert err < 1.5 * twin + 1e-3, (path, err, twin)


def gpt_oss_act(E, inter, H, b2=True, seed=3, device="cpu", dtype=torch.float32):
    """gpt-oss's biases (b2 None: a TP rank other than 0) with its alpha, and a limit small
    enough that the clamps bite on these inputs."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b13 = torch.randn(E, 2 * inter, generator=gen, device=device).to(dtype)
    bias2 = torch.randn(E, H, generator=gen, device=device).to(dtype) if b2 else None
    return moe.ClampedSwiGLU(b13, bias2, alpha=1.702, limit=1.0)


def test_clamped_swiglu_reference_is_the_definition():
    """expert_mlp with gpt-oss's activation against the formula, written out per token."""
    hidden, w13, w2, weights, ids = make_inputs(3, 8, 4, 2, 1, torch.float64, "cpu")
    act = gpt_oss_act(2, 4, 8, dtype=torch.float64)
    got = moe.fused_moe_reference(hidden, w13, w2, weights, ids, act)
    for t in range(3):
        e = int(ids[t, 0])
        z = w13[e] @ hidden[t] + act.b13[e]
        g, u = z[:4].clamp(max=1.0), z[4:].clamp(-1.0, 1.0)
        want = weights[t, 0] * (w2[e] @ ((u + 1) * g * torch.sigmoid(1.702 * g)) + act.b2[e])
        torch.testing.assert_close(got[t], want)
    every = moe.fused_moe_every_expert(hidden, w13, w2, weights, ids, act)
    torch.testing.assert_close(every, got)


@interp
@pytest.mark.parametrize("path", ["decode", "grouped"])
@pytest.mark.parametrize("b2", [True, False])
@pytest.mark.parametrize(("T", "H", "inter", "E", "k", "skew"), FEW_TOKEN_SHAPES[:2])
def test_interp_fused_moe_gpt_oss_experts(path, b2, T, H, inter, E, k, skew):
    """gpt-oss's experts (biases, clamped SwiGLU; without b2 as on a TP rank > 0) in fp32."""
    args = make_inputs(T, H, inter, E, k, torch.float32, "cpu", skew=skew)
    act = gpt_oss_act(E, inter, H, b2)
    out = moe.fused_moe(*args, path=path, act=act)
    torch.testing.assert_close(out, moe.fused_moe_reference(*args, act), atol=2e-6, rtol=1e-5)


@interp
def test_interp_gpt_oss_down_bias_once_over_depth_splits():
    """The decode path's down product split over its depth adds b2 in one split only."""
    args = make_inputs(4, 32, 64, 8, 2, torch.float32, "cpu")
    act = gpt_oss_act(8, 64, 32)
    cfgs = (moe.MoEConfig(1, 16, 16, 1, 1), moe.MoEConfig(1, 16, 16, 1, 1, split_k=3))
    out = moe.fused_moe(*args, configs=cfgs, path="decode", act=act)
    torch.testing.assert_close(out, moe.fused_moe_reference(*args, act), atol=2e-6, rtol=1e-5)


@gpu
@pytest.mark.parametrize("T", [1, 8, 256])
def test_gpu_fused_moe_gpt_oss_shapes(T):
    """gpt-oss-20b's expert shapes (H = I = 2880, 32 experts, k 4): fp32 tight against the
    twin, bf16 within 1.5x of the bf16 twin's error to the fp64 truth, both paths."""
    H, inter, E, k = 2880, 2880, 32, 4
    args = make_inputs(T, H, inter, E, k, torch.float32, "cuda", seed=T)
    act = gpt_oss_act(E, inter, H, device="cuda")
    act = dataclasses.replace(act, limit=7.0)
    ref = moe.fused_moe_reference(*args, act)
    for path in ("decode", "grouped"):
        torch.testing.assert_close(moe.fused_moe(*args, path=path, act=act), ref, atol=2e-5, rtol=1e-4)
    hidden, w13, w2, weights, ids = args
    b = [t.bfloat16() for t in (hidden, w13, w2)]
    act16 = moe.ClampedSwiGLU(act.b13.bfloat16(), act.b2.bfloat16(), act.alpha, act.limit)
    act64 = moe.ClampedSwiGLU(act.b13.double(), act.b2.double(), act.alpha, act.limit)
    want = moe.fused_moe_reference(*(t.double() for t in b), weights.double(), ids, act64)
    twin = rel_err(moe.fused_moe_reference(*b, weights, ids, act16), want)
    for path in ("decode", "grouped"):
        err = rel_err(moe.fused_moe(*b, weights, ids, path=path, act=act16), want)
        print(f"gpt-oss experts T={T} {path}: kernel {err:.2e}, twin {twin:.2e}")
        assert err < 1.5 * twin + 1e-3, (path, err, twin)


# ---------------------------------------------------------------------------------------------- MXFP4


def mxfp4_inputs(T, H, inter, E, k, dtype=torch.float32, device="cpu", seed=0):
    """Random hidden and routing, and MXFP4 experts: uniform random codes (every value, both
    nibbles) and scales 2^-6..2^-3 varied per group (a wrong scale or nibble order shows)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen, device=device).to(dtype)
    u8 = {"generator": gen, "device": device, "dtype": torch.uint8}
    w13, w2 = torch.randint(0, 256, (E, 2 * inter, H // 2), **u8), torch.randint(0, 256, (E, H, inter // 2), **u8)
    # variance 8.6 * 2^(2(s-127)): O(1) products at these widths
    lo13, lo2 = (127 - round(0.5 * math.log2(8.6 * n)) - 1 for n in (H, inter))
    s13 = torch.randint(lo13, lo13 + 3, (E, 2 * inter, H // 32), **u8)
    s2 = torch.randint(lo2, lo2 + 3, (E, H, inter // 32), **u8)
    weights, ids = moe.route_reference(torch.randn(T, E, generator=gen, device=device), k, True)
    return hidden, w13, w2, weights, ids, moe.Mxfp4Scales(s13, s2)


def test_mxfp4_packing_is_the_checkpoint_format():
    """The kernels' nibble order (`pack_mxfp4`) dequantizes to the checkpoint format's values
    (nanoserve.models.mxfp4, checked there against the format by hand), bit for bit."""
    from nanoserve.models import mxfp4

    blocks = torch.randint(0, 256, (3, 5, 4, 16), dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 5, 4), dtype=torch.uint8)
    want = mxfp4.dequantize(blocks, scales, torch.float32)
    assert torch.equal(moe.dequantize_mxfp4(moe.pack_mxfp4(blocks), scales, torch.float32), want)
    hidden, w13, w2, weights, ids, scales = mxfp4_inputs(3, 64, 32, 4, 2)
    d13, d2 = scales.dequantized(w13, w2, torch.float32)
    act = gpt_oss_act(4, 32, 64)
    torch.testing.assert_close(  # the twin's on-the-fly dequantization is the dequantized weights'
        moe.fused_moe_reference(hidden, w13, w2, weights, ids, act, scales),
        moe.fused_moe_reference(hidden, d13, d2, weights, ids, act),
        atol=0,
        rtol=0,
    )


# (T, H, I, configs): gpt-oss's tiny widths at 1, 3 and 17 tokens (the fallback's tiles; at 17,
# 32-row tiles: 16-row ones took 10.6 s in the interpreter), and H of five groups in K steps
# that end in a part step (decode: two groups, its down product split over its depth; grouped:
# 128 deep, two groups in fp32), experts no token chose among them.
MXFP4_CASES = [
    (1, 64, 64, None),
    (3, 64, 64, None),
    (17, 64, 64, ((1, 32, 64, 1, 1), (1, 32, 64, 1, 1))),
    (2, 160, 64, ((1, 16, 64, 1, 1), (1, 16, 64, 1, 1, 3))),
]


@interp
@pytest.mark.parametrize("path", ["decode", "grouped"])
@pytest.mark.parametrize(("T", "H", "inter", "cfgs"), MXFP4_CASES)
def test_interp_fused_moe_mxfp4_fp32(path, T, H, inter, cfgs):
    """MXFP4 experts (4 experts, top-2, gpt-oss's biases and clamped SwiGLU): the codes decoded in
    the kernels' registers match the twin on the dequantized weights to summation-order noise."""
    hidden, w13, w2, weights, ids, scales = mxfp4_inputs(T, H, inter, 4, 2)
    act = gpt_oss_act(4, inter, H)
    configs = None
    if cfgs is not None:
        configs = tuple(moe.MoEConfig(*c) if path == "decode" else moe.MoEConfig(16, c[1], 128, c[3], 1) for c in cfgs)
    out = moe.fused_moe(hidden, w13, w2, weights, ids, configs=configs, path=path, scales=scales, act=act)
    ref = moe.fused_moe_reference(hidden, w13, w2, weights, ids, act, scales)
    assert out.dtype == torch.float32 and ref.abs().max() > 0.5
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


@interp
def test_interp_fused_moe_mxfp4_bf16():
    """bf16 activations on MXFP4 experts: both paths near the bf16 twin's distance from the fp64
    truth (bound as test_interp_fused_moe_bf16's: the interpreter truncates to bf16)."""
    hidden, w13, w2, weights, ids, scales = mxfp4_inputs(3, 64, 64, 4, 2, torch.bfloat16)
    act = gpt_oss_act(4, 64, 64, dtype=torch.bfloat16)
    act64 = moe.ClampedSwiGLU(act.b13.double(), act.b2.double(), act.alpha, act.limit)
    d13, d2 = scales.dequantized(w13, w2, torch.float64)
    want = moe.fused_moe_reference(hidden.double(), d13, d2, weights.double(), ids, act64)
    twin = rel_err(moe.fused_moe_reference(hidden, w13, w2, weights, ids, act, scales), want)
    for path in ("decode", "grouped"):
        out = moe.fused_moe(hidden, w13, w2, weights, ids, path=path, scales=scales, act=act)
        err = rel_err(out, want)
        print(f"mxfp4 experts, bf16 {path}: kernel {err:.2e}, twin {twin:.2e}")
        assert out.dtype == torch.bfloat16 and err < 5 * twin + 1e-3, (path, err, twin)


def test_fused_moe_refuses_bad_mxfp4():
    hidden, w13, w2, weights, ids, scales = mxfp4_inputs(2, 64, 64, 4, 2)
    with pytest.raises(ValueError, match="need their Mxfp4Scales"):  # uint8 weights of unpacked shapes
        moe.fused_moe_partials(hidden, w13.repeat(1, 1, 2), w2.repeat(1, 1, 2), weights, ids)
    with pytest.raises(ValueError, match="MXFP4: w13"):
        moe.fused_moe_partials(hidden, w13[:, :, :16], w2, weights, ids, scales=scales)
    with pytest.raises(ValueError, match="w2 scales must be"):
        moe.fused_moe_partials(hidden, w13, w2, weights, ids, scales=moe.Mxfp4Scales(scales.w13, scales.w2.float()))
    with pytest.raises(ValueError, match="powers? of two"):
        cfg = moe.MoEConfig(1, 16, 48, 1, 1)
        moe.fused_moe_partials(hidden, w13, w2, weights, ids, configs=(cfg, cfg), path="decode", scales=scales)


def test_align_kernel_compiles_for_hopper():
    """The align kernel built for sm_90 on the host (tests/hopper_compile.py, in a process of
    its own): the interpreter runs branches the compiler may refuse."""
    pytest.importorskip("triton.backends.nvidia")
    from hopper_compile import check_in_own_process

    check_in_own_process("align")


def test_mxfp4_kernels_load_whole_groups_for_hopper():
    """gpt-oss's MXFP4 kernels, built for sm_90 on the host as its shapes specialise them
    (tests/hopper_compile.py, in a process of its own: this one may run the interpreter), load
    a group's four words of codes in one 16-byte access (one word at a time, the same tiles
    took 137 us a layer at T=1 on an H200 against 80)."""
    pytest.importorskip("triton.backends.nvidia")
    from hopper_compile import check_in_own_process

    check_in_own_process("mxfp4")


@gpu
@pytest.mark.parametrize("T", [1, 8, 256])
def test_gpu_fused_moe_mxfp4_gpt_oss_shapes(T):
    """gpt-oss-20b's experts as MXFP4 (H = I = 2880, 32 experts, top-4): fp32 tight against the
    twin (the weights dequantized), bf16 within 1.5x of the bf16 twin's error to the fp64 truth,
    both paths and the table's choice."""
    H, inter, E, k = 2880, 2880, 32, 4
    hidden, w13, w2, weights, ids, scales = mxfp4_inputs(T, H, inter, E, k, device="cuda", seed=T)
    act = dataclasses.replace(gpt_oss_act(E, inter, H, device="cuda"), limit=7.0)
    ref = moe.fused_moe_reference(hidden, w13, w2, weights, ids, act, scales)
    for path in ("decode", "grouped", None):
        out = moe.fused_moe(hidden, w13, w2, weights, ids, path=path, scales=scales, act=act)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    x = hidden.bfloat16()
    act16 = moe.ClampedSwiGLU(act.b13.bfloat16(), act.b2.bfloat16(), act.alpha, act.limit)
    act64 = moe.ClampedSwiGLU(act.b13.double(), act.b2.double(), act.alpha, act.limit)
    d13, d2 = scales.dequantized(w13, w2, torch.float64)
    want = moe.fused_moe_reference(x.double(), d13, d2, weights.double(), ids, act64)
    twin = rel_err(moe.fused_moe_reference(x, w13, w2, weights, ids, act16, scales), want)
    for path in ("decode", "grouped", None):
        err = rel_err(moe.fused_moe(x, w13, w2, weights, ids, path=path, scales=scales, act=act16), want)
        print(f"mxfp4 gpt-oss experts T={T} {path}: kernel {err:.2e}, twin {twin:.2e}")
        assert err < 1.5 * twin + 1e-3, (path, err, twin)


@gpu
@pytest.mark.parametrize("T", [1, 8, 300])
def test_gpu_mxfp4_graph_replay_bit_equal(T):
    """route + fused_moe on MXFP4 experts captured in a CUDA graph (no host synchronisation) and
    replayed on new inputs: bit-equal to eager."""
    H, inter, E, k = 1024, 512, 32, 4
    hidden, w13, w2, _, _, scales = mxfp4_inputs(T, H, inter, E, k, torch.bfloat16, "cuda")
    act = gpt_oss_act(E, inter, H, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(T, E, device="cuda")

    def layer():
        w, ids = moe.route(logits, k, True)
        return moe.fused_moe(hidden, w13, w2, w, ids, scales=scales, act=act)

    assert_graph_replays_bit_equal(layer, hidden, logits)
