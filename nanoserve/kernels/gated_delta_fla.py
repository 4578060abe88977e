"""Gated DeltaNet's chunked delta rule for an extend batch through fla-core (the Triton kernels
of flash-linear-attention, an optional dependency: the `gpu` extra), with the torch twin
`gated_delta.delta_rule_varlen` as the fallback and the reference.

`delta_rule_varlen` takes the requests packed one after another, as the twin does, and hands
them to fla's `chunk_gated_delta_rule` as one varlen batch (cu_seqlens: no padding). How our
conventions map onto fla's:
- layout: ours [T, H, D] packed; fla's [B, T, H, D] with B = 1 and `cu_seqlens` [N + 1] (int64)
  for the sequence boundaries (plus the same on the host, `cu_seqlens_cpu`: no device sync);
- grouped heads: fla takes q and k with Hk heads and v with Hv (a multiple of Hk) and serves
  value head h with key head h // (Hv / Hk), as our `repeat_interleave`: nothing is expanded;
- normalisation: q and k are normalised here (our `l2norm`, x / sqrt(sum x^2 + 1e-6), in fp32,
  rounded to their dtype) and go in with `use_qk_l2norm_in_kernel` off; `scale` Dk^-1/2 is
  applied to q inside as ours is;
- g: the log-space decay in natural log, as ours (fla turns it into base 2 itself); beta: the
  write strength after the sigmoid; both fp32;
- state: fla's [N, Hv, Dk, Dv] (the default `state_v_first=False`), S^T q as ours: our pool's
  rows as they are, fp32; the final state comes back fp32.
Outputs come in q's dtype (the twin's are fp32; the caller rounds them to the model's dtype
before the gated norm either way). In bf16 fla also keeps some intermediates in bf16 (the
normalised q and k, the per-chunk states it reads outputs from, the inverted triangular
blocks), so it matches the twin to bf16 rounding, not bit for bit (tests/test_gpu_fla.py).

When fla runs (`unusable_reason`): tensors on CUDA in bf16 or fp16, and fla importable. fp32
stays on the twin: fla's fp32 products are TF32 (tl.dot's default, and its triangular solve
asks for TF32 outright), and fp32 serving is the exactness path (GPU tokens equal to CPU's).
fla is imported on first use on CUDA only, so CPU and CI never need it; an import that fails
(not installed, or a Triton whose autotuner refuses fla's kernels: fla-core 0.5.2's import
raises ValueError under Triton 3.9, 2026-11-28; the GPU image's Triton 3.6 does not check)
leaves the twin in place, the reason kept for the start-up log.

Imports nothing of nanoserve outside nanoserve.kernels.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import torch

from nanoserve.kernels import gated_delta

# Activation dtypes that take fla's kernels (see the module docstring for fp32).
FLA_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _load() -> tuple[Callable | None, str]:
    """(fla's chunk_gated_delta_rule, its version), or (None, why it cannot be imported)."""
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as exc:  # noqa: BLE001 - not installed, or its kernels do not build with this Triton
        return None, f"{type(exc).__name__}: {exc}"
    return chunk_gated_delta_rule, getattr(fla, "__version__", "?")


def version() -> str | None:
    """fla-core's version where it imports (importing it), else None."""
    fn, info = _load()
    return info if fn is not None else None


def unusable_reason(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why fla cannot run the chunked rule for tensors of `dtype` on `device`; None: it can.
    Cheap after the first call on CUDA (the import is tried once per process)."""
    if torch.device(device).type != "cuda":
        return "not on CUDA"
    if dtype not in FLA_DTYPES:
        return f"{str(dtype).removeprefix('torch.')} stays exact on the torch twin (fla's fp32 products are TF32)"
    fn, info = _load()
    return None if fn is not None else f"fla-core is not importable ({info})"


def usable(x: torch.Tensor) -> bool:
    return unusable_reason(x.device, x.dtype) is None


def delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    lengths: list[int],
    use_fla: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta.delta_rule_varlen`'s contract (R sequences packed one after another,
    lengths[r] tokens each: q, k [T, Hk, Dk] raw, v [T, Hv, Dv], g and beta [T, Hv], the
    states before them [R, Hv, Dk, Dv]; returns (o [T, Hv, Dv], the states after them fp32))
    through fla (`fla_varlen`) where `use_fla` and `usable(q)`, o then in q's dtype; otherwise
    through the torch twin, o fp32."""
    if use_fla and usable(q):
        return fla_varlen(q, k, v, g, beta, states, lengths)
    return gated_delta.delta_rule_varlen(q, k, v, g, beta, states, lengths)


def fla_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    lengths: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`delta_rule_varlen` through fla's `chunk_gated_delta_rule`, whatever the dtype (fp32 in
    TF32 products: tests compare it with the twin so); CUDA tensors, fla importable."""
    chunk_gated_delta_rule, info = _load()
    if chunk_gated_delta_rule is None:
        raise RuntimeError(f"fla-core is not importable ({info})")
    cu, cu_cpu = _cu_seqlens(tuple(lengths), q.device)
    # q and k normalised here, not by fla (`use_qk_l2norm_in_kernel`): its l2norm kernel
    # compiled anew for each new token count (25 compiles after the warm-up in one offline
    # run on an H200, 2026-11-28). One compiled kernel for both (eager torch, six launches
    # a layer, cost 3% of that run's throughput: the extend steps are launch-bound).
    q, k = _normalised(q, k)
    o, final = chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None].float(), beta[None].float(),
        scale=q.shape[-1] ** -0.5,
        initial_state=states.float().contiguous(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
        cu_seqlens=cu,
        cu_seqlens_cpu=cu_cpu,
    )  # fmt: skip
    return o[0], final


def _l2norm_pair(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta.l2norm` of q and k in fp32, rounded back to their dtype (as fla's in-kernel
    norm stores them)."""
    return gated_delta.l2norm(q.float()).to(q.dtype), gated_delta.l2norm(k.float()).to(k.dtype)


@functools.cache
def _compiled_l2norm_pair() -> Callable:
    return torch.compile(_l2norm_pair, dynamic=True, fullgraph=True)


def _normalised(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _compiled_l2norm_pair()(q, k) if q.is_cuda else _l2norm_pair(q, k)


@functools.lru_cache(maxsize=8)
def _cu_seqlens(lengths: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens on `device`, the same on the host), int64: the same tensors for every layer
    of a forward. fla memoises what it derives from them by identity (its chunk indices, built
    on the host and copied over with a sync): once per forward, not once per layer."""
    cu_cpu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.long)
    return cu_cpu.to(device, non_blocking=True), cu_cpu
