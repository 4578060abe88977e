"""Gated DeltaNet (Qwen3.5's linear-attention layers): the causal short convolution and the
gated delta rule, in torch. These are the references every faster kernel is tested against,
and the path on CPU.

The gated delta rule keeps a state S [Dk, Dv] per value head. For each token t, with key k_t
and query q_t (both L2-normalised, q scaled by Dk^-1/2), value v_t, decay g_t <= 0 (log
space) and write strength beta_t in (0, 1):

    S <- exp(g_t) S
    S <- S + k_t (beta_t (v_t - S^T k_t))^T      (the delta rule: write what S mispredicts)
    o_t = S^T q_t

`delta_rule_step` runs that for one token of many sequences at once (decode: shapes fixed, so
it records into CUDA graphs). `delta_rule_chunked` runs a whole sequence in chunks of C tokens
with matrix products: within a chunk starting from S0, with G_t the cumulative log decay and
u_t the vector written at t,

    u_t = beta_t (v_t - exp(G_t) S0^T k_t - sum_{r<t} exp(G_t - G_r) (k_t . k_r) u_r)
    o_t = exp(G_t) S0^T q_t + sum_{r<=t} exp(G_t - G_r) (q_t . k_r) u_r
    S_C = exp(G_C) S0 + sum_r exp(G_C - G_r) k_r u_r^T

so U solves a unit lower-triangular system, (I + A) U = beta (V - exp(G) K S0), with
A[t, r] = beta_t exp(G_t - G_r) (k_t . k_r) for r < t. Both compute in fp32.

The convolution is depthwise over time with kernel width W: each channel's output at t reads
its inputs t-W+1..t; the W-1 inputs before a sequence's new tokens come from its conv state
(zeros at the start), and the state afterwards holds the last W-1 inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (the eps as the reference library's)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's new inputs x [T, C] through the depthwise causal convolution `weight`
    [C, W] after the W-1 earlier inputs `state` [C, W-1], then SiLU: (output [T, C], the new
    state [C, W-1])."""
    width = weight.shape[1]
    full = torch.cat([state.to(x.dtype), x.t()], dim=1)  # [C, W-1+T]
    out = F.conv1d(full[None], weight[:, None, :].to(x.dtype), groups=weight.shape[0])[0]  # [C, T]
    return F.silu(out).t(), full[:, full.shape[1] - (width - 1) :]


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """One new input per sequence, x [B, C], with each sequence's state [B, C, W-1]; the states
    are updated in place; returns SiLU(conv) [B, C]."""
    window = torch.cat([states.to(x.dtype), x[:, :, None]], dim=2)  # [B, C, W]
    states.copy_(window[:, :, 1:])
    return F.silu((window * weight.to(x.dtype)).sum(dim=2))


def _heads(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys [..., Hk, Dk] normalised, q scaled, each key head repeated for the
    num_v_heads / Hk value heads it serves (fp32)."""
    q, k = l2norm(q.float()), l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    repeat = num_v_heads // k.shape[-2]
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=-2), k.repeat_interleave(repeat, dim=-2)
    return q, k


def delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor
) -> torch.Tensor:
    """One token of each of B sequences: q, k [B, Hk, Dk], v [B, Hv, Dv], g and beta [B, Hv],
    states [B, Hv, Dk, Dv] (fp32, updated in place). Returns o [B, Hv, Dv] in fp32."""
    q, k = _heads(q, k, v.shape[-2])
    s = states * g.float().exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", s, k)
    write = (v.float() - predicted) * beta.float()[..., None]
    s = s + k[..., :, None] * write[..., None, :]
    states.copy_(s)
    return torch.einsum("bhkv,bhk->bhv", s, q)


def delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence of T tokens: q, k [T, Hk, Dk], v [T, Hv, Dv], g and beta [T, Hv], the state
    before it [Hv, Dk, Dv]. Returns (o [T, Hv, Dv] fp32, the state after it, fp32)."""
    q, k = _heads(q, k, v.shape[-2])
    v, g, beta = v.float(), g.float(), beta.float()
    s = state.float()
    outs = []
    for start in range(0, q.shape[0], chunk):
        end = min(start + chunk, q.shape[0])
        # heads first: [H, C, D]
        qc, kc, vc = (x[start:end].transpose(0, 1) for x in (q, k, v))
        gc, bc = g[start:end].t(), beta[start:end].t()  # [H, C]
        cum = gc.cumsum(dim=1)
        n = end - start
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        # exp(G_t - G_r) for r <= t, 0 above the diagonal (masked before exp: no overflow)
        decay = torch.where(lower, cum[:, :, None] - cum[:, None, :], float("-inf")).exp()
        a = (bc[:, :, None] * decay * (kc @ kc.transpose(1, 2))).tril(-1)
        eye = torch.eye(n, dtype=a.dtype, device=a.device)
        rhs = bc[:, :, None] * (vc - cum.exp()[:, :, None] * (kc @ s))
        u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        outs.append((cum.exp()[:, :, None] * (qc @ s) + (decay * (qc @ kc.transpose(1, 2))) @ u).transpose(0, 1))
        tail = (cum[:, -1:] - cum).exp()  # exp(G_C - G_r)
        s = cum[:, -1].exp()[:, None, None] * s + (kc * tail[:, :, None]).transpose(1, 2) @ u
    return torch.cat(outs), s


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., D] scaled by `weight`, times SiLU(gate), in x's dtype (the norm in
    fp32, rounded before the weight: Qwen3.5's gated norm)."""
    dtype = x.dtype
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (weight * normed * F.silu(gate.float())).to(dtype)
