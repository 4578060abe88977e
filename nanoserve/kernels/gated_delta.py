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
it records into CUDA graphs). `delta_rule_chunked` runs whole sequences in chunks of C tokens
with matrix products (several sequences at once as extra heads, right-padded with g = 0 and
beta = 0, which leave the state as it is): within a chunk starting from S0, with G_t the cumulative log decay and
u_t the vector written at t,

    u_t = beta_t (v_t - exp(G_t) S0^T k_t - sum_{r<t} exp(G_t - G_r) (k_t . k_r) u_r)
    o_t = exp(G_t) S0^T q_t + sum_{r<=t} exp(G_t - G_r) (q_t . k_r) u_r
    S_C = exp(G_C) S0 + sum_r exp(G_C - G_r) k_r u_r^T

so U solves a unit lower-triangular system, (I + A) U = beta (V - exp(G) K S0), with
A[t, r] = beta_t exp(G_t - G_r) (k_t . k_r) for r < t. Both compute in fp32.

The convolution is depthwise over time with kernel width W: each channel's output at t reads
its inputs t-W+1..t; the W-1 inputs before a sequence's new tokens come from its conv state
(zeros at the start), and the state afterwards holds the last W-1 inputs.

Several sequences of an extend batch come packed, one after another ([T, ...] with their
lengths): `causal_conv_varlen` convolves them so, and `delta_rule_varlen` runs them through
the chunked rule right-padded side by side as heads (the torch twin of
nanoserve.kernels.gated_delta_fla, which runs them packed through fla-core's kernels on CUDA).

Triton kernels beside the twins: the decode step in three launches (`decode_step`), and the
packed convolution of an extend in one (`causal_conv_packed`, the twin `causal_conv_varlen`,
which lays the sequences out with index copies around torch's depthwise convolution: on an
H200 those took ~2 ms a layer at 8k tokens).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanoserve.kernels.launch import INTERPRET

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (the eps as the reference library's)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """R sequences' new inputs x [R, T, C] (sequence r's first lengths[r] rows real, the rest
    padding) through the depthwise causal convolution `weight` [C, W] after the W-1 earlier
    inputs `states` [R, C, W-1], then SiLU: (output [R, T, C], each sequence's new state
    [R, C, W-1]: its last W-1 real inputs)."""
    width = weight.shape[1]
    full = torch.cat([states.to(x.dtype), x.transpose(1, 2)], dim=2)  # [R, C, W-1+T]
    out = F.conv1d(full, weight[:, None, :].to(x.dtype), groups=weight.shape[0])  # [R, C, T]
    # input i of the sequence sits at column i + W - 1: its last W - 1 are columns len .. len + W - 2
    cols = lengths[:, None] + torch.arange(width - 1, device=x.device)
    new_states = full.gather(2, cols[:, None, :].expand(-1, full.shape[1], -1))
    return F.silu(out).transpose(1, 2), new_states


def packed_to_padded(lengths: list[int], device: torch.device) -> tuple[torch.Tensor, int]:
    """(where [T], longest): sequences packed one after another (lengths[r] rows each) as rows
    of a [R * longest] layout right-padded to the longest: packed row i of sequence r, its
    j-th, sits at where[i] = r * longest + j."""
    longest = max(lengths)
    offsets = torch.arange(len(lengths)) * longest - torch.tensor([0, *lengths[:-1]]).cumsum(0)
    where = torch.arange(sum(lengths)) + offsets.repeat_interleave(torch.tensor(lengths))
    return where.to(device), longest


@functools.lru_cache(maxsize=8)
def _varlen_columns(lengths: tuple[int, ...], lead: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """`causal_conv_varlen`'s columns for these lengths (the same tensors for every layer of a
    forward; copied without a host sync): (each packed row's input column, each sequence's W-1
    state columns, its last W-1 columns, each packed row's output column)."""
    n = len(lengths)
    seq = torch.arange(n).repeat_interleave(torch.tensor(lengths))  # each packed row's sequence
    # sequence r's block of W-1 + lengths[r] columns starts at (its first packed row) + r (W-1)
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0) + torch.arange(n) * lead
    x_cols = torch.arange(sum(lengths)) + (seq + 1) * lead
    ends = starts + lead + torch.tensor(lengths)  # one past each block's last column
    state_cols = (starts[:, None] + torch.arange(lead)).flatten()
    last_cols = (ends[:, None] - lead + torch.arange(lead)).flatten()
    return tuple(t.to(device, non_blocking=True) for t in (x_cols, state_cols, last_cols, x_cols - lead))


def causal_conv_varlen(
    x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, lengths: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv` for R sequences packed one after another without padding: x [T, C] holds
    lengths[r] rows of sequence r after those of r - 1; `states` [R, C, W-1]. Returns (output
    [T, C], new states [R, C, W-1]). One convolution over all of them: each sequence's W-1
    earlier inputs are laid in front of its new ones, so no output window crosses from one
    sequence into the next."""
    channels, lead, n = x.shape[1], weight.shape[1] - 1, len(lengths)
    x_cols, state_cols, last_cols, out_cols = _varlen_columns(tuple(lengths), lead, x.device)
    full = x.new_empty(channels, x.shape[0] + n * lead)  # [C, T + R (W-1)]
    full[:, x_cols] = x.t()
    full[:, state_cols] = states.to(x.dtype).permute(1, 0, 2).reshape(channels, -1)
    out = F.conv1d(full[None], weight[:, None, :].to(x.dtype), groups=weight.shape[0])[0]  # [C, L - (W-1)]
    new_states = full[:, last_cols].view(channels, n, lead).permute(1, 0, 2)
    return F.silu(out[:, out_cols]).t().contiguous(), new_states


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


def delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    lengths: list[int],
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """R sequences packed one after another (lengths[r] tokens each): q, k [T, Hk, Dk], v [T, Hv,
    Dv], g and beta [T, Hv], the states before them [R, Hv, Dk, Dv]. Returns (o [T, Hv, Dv]
    fp32, the states after them [R, Hv, Dk, Dv] fp32). All in one chunked rule: each sequence
    right-padded to the longest with zeros (g = 0 and beta = 0 leave its state as it is, and
    its real tokens come before the padding), the sequences side by side as heads."""
    n, hv = len(lengths), v.shape[1]
    where, longest = packed_to_padded(lengths, q.device)

    def side_by_side(t: torch.Tensor) -> torch.Tensor:  # packed [T, H, ...] -> [longest, R * H, ...]
        out = t.new_zeros(n * longest, *t.shape[1:])
        out[where] = t
        return out.view(n, longest, *t.shape[1:]).transpose(0, 1).reshape(longest, n * t.shape[1], *t.shape[2:])

    o, s = delta_rule_chunked(*map(side_by_side, (q, k, v, g, beta)), states.flatten(0, 1), chunk=chunk)
    o = o.view(longest, n, hv, -1).transpose(0, 1).reshape(n * longest, hv, -1)
    return o[where], s.view(n, hv, *s.shape[1:])


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., D] scaled by `weight`, times SiLU(gate), in x's dtype (the norm in
    fp32, rounded before the weight: Qwen3.5's gated norm)."""
    dtype = x.dtype
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (weight * normed * F.silu(gate.float())).to(dtype)


# ---- Triton: the decode step in three launches --------------------------------------------
# The torch step above is some fifty small kernels per layer (a decode graph of qwen3.5-9b at
# batch 1 ran at 58% of its weights floor with it, 2026-11-28); the same step as three:
# the convolution (state shift included), the delta rule (decay, write strength, norms and the
# state update of one value head's block of columns per program), and the gated norm.


@triton.jit
def _conv_step_kernel(
    x_ptr, w_ptr, state_ptr, rows_ptr, prefix_ptr, out_ptr, C, stride_x, stride_row,
    W: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One input per sequence through the causal convolution and SiLU; the state row of the
    sequence shifts by one (zeros first where the sequence starts at position 0)."""
    b = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = ch < C
    row = tl.load(rows_ptr + b).to(tl.int64)
    keep = tl.load(prefix_ptr + b) != 0  # else the sequence starts here: its old row is garbage
    x = tl.load(x_ptr + b * stride_x + ch, mask=mask, other=0.0).to(tl.float32)
    base = state_ptr + row * stride_row + ch * (W - 1)
    acc = x * tl.load(w_ptr + ch * W + (W - 1), mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(W - 1):
        s = tl.where(keep, tl.load(base + j, mask=mask, other=0.0).to(tl.float32), 0.0)
        acc += s * tl.load(w_ptr + ch * W + j, mask=mask, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(base + j - 1, s.to(state_ptr.dtype.element_ty), mask=mask)
    tl.store(base + W - 2, x.to(state_ptr.dtype.element_ty), mask=mask)
    x_out = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded as the torch step's conv output
    tl.store(out_ptr + b * C + ch, (x_out / (1.0 + tl.exp(-x_out))).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _conv_packed_kernel(
    x_ptr, w_ptr, state_ptr, blocks_ptr, starts_ptr, out_ptr, new_state_ptr, C, stride_x,
    W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Tokens [j0, j0 + BLOCK_T) of sequence r (blocks [nb, 2] = (r, j0)) and channels of one
    column block through the causal convolution and SiLU; the program holding r's last token
    also writes its new state (its last W-1 inputs, from the old state where it is shorter)."""
    r = tl.load(blocks_ptr + 2 * tl.program_id(0))
    j0 = tl.load(blocks_ptr + 2 * tl.program_id(0) + 1)
    first = tl.load(starts_ptr + r)
    length = tl.load(starts_ptr + r + 1) - first
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = ch < C
    j = j0 + tl.arange(0, BLOCK_T)
    t_ok = j < length
    state = state_ptr + r * C * (W - 1) + ch * (W - 1)
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for w in tl.static_range(W):
        src = j - (W - 1) + w  # the input position this tap reads (negative: the old state's)
        rows = (first + src).to(tl.int64)
        from_x = tl.load(
            x_ptr + rows[:, None] * stride_x + ch[None, :], mask=(t_ok & (src >= 0))[:, None] & c_ok[None, :], other=0.0
        )
        from_state = tl.load(
            state[None, :] + (W - 1 + src)[:, None], mask=(t_ok & (src < 0))[:, None] & c_ok[None, :], other=0.0
        )
        tap = tl.load(w_ptr + ch * W + w, mask=c_ok, other=0.0).to(tl.float32)
        acc += (from_x.to(tl.float32) + from_state.to(tl.float32)) * tap[None, :]
    y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded as the convolution's output
    out_rows = (first + j).to(tl.int64)
    tl.store(
        out_ptr + out_rows[:, None] * C + ch[None, :],
        (y / (1.0 + tl.exp(-y))).to(out_ptr.dtype.element_ty),
        mask=t_ok[:, None] & c_ok[None, :],
    )
    if (j0 <= length - 1) & (length - 1 < j0 + BLOCK_T):
        for i in tl.static_range(W - 1):
            last = length - (W - 1) + i  # the new state's i-th input (negative: the old state's)
            if last >= 0:
                v = tl.load(x_ptr + (first + last).to(tl.int64) * stride_x + ch, mask=c_ok, other=0.0)
            else:
                v = tl.load(state + W - 1 + last, mask=c_ok, other=0.0)
            tl.store(
                new_state_ptr + r * C * (W - 1) + ch * (W - 1) + i, v.to(new_state_ptr.dtype.element_ty), mask=c_ok
            )


@functools.lru_cache(maxsize=8)
def _packed_blocks(lengths: tuple[int, ...], block_t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv_packed`'s token blocks (sequence, first position) and the sequences' first
    rows [R + 1], for these lengths (the same tensors for every layer of a forward)."""
    blocks = [(r, j) for r, n in enumerate(lengths) for j in range(0, n, block_t)]
    starts = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    table = torch.tensor(blocks, dtype=torch.int32)
    return table.to(device, non_blocking=True), starts.to(device, non_blocking=True)


def causal_conv_packed(
    x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, lengths: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv_varlen` in one Triton launch: x [T, C] packed (rows may be a view with a
    row stride), `states` [R, C, W-1]; returns (SiLU(conv) [T, C], new states [R, C, W-1]).
    Each output reads its W inputs straight from x or the old state, in fp32, rounded to x's
    dtype before the SiLU as the twin's convolution output is (its sum may be ordered
    differently)."""
    channels, width = x.shape[1], weight.shape[1]
    block_t, block_c = (4, 8) if INTERPRET else (32, 128)
    blocks, starts = _packed_blocks(tuple(lengths), block_t, x.device)
    out = torch.empty(x.shape[0], channels, dtype=x.dtype, device=x.device)
    new_states = torch.empty(len(lengths), channels, width - 1, dtype=states.dtype, device=x.device)
    _conv_packed_kernel[(blocks.shape[0], triton.cdiv(channels, block_c))](
        x, weight, states.contiguous(), blocks, starts, out, new_states, channels, x.stride(0),
        W=width, BLOCK_T=block_t, BLOCK_C=block_c,
    )  # fmt: skip
    return out, new_states


@triton.jit
def _delta_step_kernel(
    x_ptr, ba_ptr, a_log_ptr, dt_bias_ptr, state_ptr, rows_ptr, prefix_ptr, out_ptr,
    stride_ba, stride_row, HV, KEY_DIM, scale,
    DK: tl.constexpr, DV: tl.constexpr, REP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Value head h, columns [vb * BV, (vb + 1) * BV) of one sequence's state: decay, the delta
    write, and the output o = S^T q of those columns."""
    b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = tl.load(rows_ptr + b).to(tl.int64)
    keep = tl.load(prefix_ptr + b) != 0
    hk = h // REP
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    mk, mv = rk < DK, rv < DV
    xb = x_ptr + b * (2 * KEY_DIM + HV * DV)
    q = tl.load(xb + hk * DK + rk, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(xb + KEY_DIM + hk * DK + rk, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(xb + 2 * KEY_DIM + h * DV + rv, mask=mv, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    b_in = tl.load(ba_ptr + b * stride_ba + h).to(tl.float32)
    a_in = tl.load(ba_ptr + b * stride_ba + HV + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
    softplus = tl.where(a_in > 20.0, a_in, tl.log(1.0 + tl.exp(a_in)))
    decay = tl.exp(-tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * softplus)
    beta = 1.0 / (1.0 + tl.exp(-b_in))
    ptrs = state_ptr + row * stride_row + h * DK * DV + rk[:, None] * DV + rv[None, :]
    m2 = mk[:, None] & mv[None, :]
    s = tl.where(keep, tl.load(ptrs, mask=m2, other=0.0), 0.0) * decay
    write = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s += k[:, None] * write[None, :]
    tl.store(ptrs, s, mask=m2)
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(out_ptr + (b * HV + h) * DV + rv, o.to(out_ptr.dtype.element_ty), mask=mv)


@triton.jit
def _gated_norm_kernel(o_ptr, z_ptr, w_ptr, out_ptr, stride_z, HV, eps, DV: tl.constexpr, BV: tl.constexpr):
    """One row (a sequence's value head) of the gated RMSNorm, rounded as `gated_rms_norm`."""
    r = tl.program_id(0)
    b, h = r // HV, r % HV
    rv = tl.arange(0, BV)
    m = rv < DV
    o = tl.load(o_ptr + r * DV + rv, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + b * stride_z + h * DV + rv, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + rv, mask=m, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # products in fp32, rounded to dtype where the torch twin's 16-bit ops round
    normed = (o / tl.sqrt(tl.sum(o * o, axis=0) / DV + eps)).to(dtype).to(tl.float32)
    y = (w * normed).to(dtype).to(tl.float32) * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + r * DV + rv, y.to(dtype), mask=m)


# The delta step's tile: a value head's state columns per program and its warps, measured on an
# H200 (one layer's step, three launches, at Qwen3.5-35B-A3B's heads; benchmarks/probes/
# linear_decode.py): 64 x 4 at batch 256 317-319 us against 364-366 with 32 columns (3.36 TB/s
# on the fp32 state read and written), also ahead at 8, 32 and 64; a lone sequence gets more
# programs from 16 columns (8.2 us against 9.4 at 32 and 9.9 at 64).
DELTA_BLOCK_V = 64
DELTA_BLOCK_V_ONE_ROW = 16
DELTA_WARPS = 4


def decode_step(
    qkv: torch.Tensor,
    z: torch.Tensor,
    ba: torch.Tensor,
    conv_weight: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    conv_states: torch.Tensor,
    rec_states: torch.Tensor,
    rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
) -> torch.Tensor:
    """The whole decode step of a Gated DeltaNet layer after its input projection, in three
    launches: qkv [B, C] (before the convolution), z [B, Hv*Dv], ba [B, 2Hv] (rows may be views
    of one projection), the conv weight [C, W]; the state pools [rows, ...] updated in place at
    `rows` [B] (from zeros where `prefix_lens` is 0). Returns the gated norm's output
    [B, Hv*Dv]; the same as the torch step (`causal_conv_step`, `delta_rule_step`,
    `gated_rms_norm`) up to rounding."""
    batch, channels = qkv.shape
    hv, dk, dv = rec_states.shape[1], head_k_dim, rec_states.shape[3]
    width = conv_weight.shape[1]
    x = torch.empty(batch, channels, dtype=qkv.dtype, device=qkv.device)
    block = 256 if INTERPRET else 1024
    _conv_step_kernel[(batch, triton.cdiv(channels, block))](
        qkv, conv_weight, conv_states, rows, prefix_lens, x, channels, qkv.stride(0), conv_states.stride(0),
        W=width, BLOCK=block,
    )  # fmt: skip
    o = torch.empty(batch, hv, dv, dtype=qkv.dtype, device=qkv.device)
    block_v = DELTA_BLOCK_V_ONE_ROW if batch == 1 else DELTA_BLOCK_V
    bk, bv = triton.next_power_of_2(dk), min(block_v, triton.next_power_of_2(dv))
    _delta_step_kernel[(batch, hv, triton.cdiv(dv, bv))](
        x, ba, a_log, dt_bias, rec_states, rows, prefix_lens, o, ba.stride(0), rec_states.stride(0), hv,
        num_k_heads * dk, dk**-0.5, DK=dk, DV=dv, REP=hv // num_k_heads, BK=bk, BV=bv, num_warps=DELTA_WARPS,
    )  # fmt: skip
    out = torch.empty(batch, hv * dv, dtype=qkv.dtype, device=qkv.device)
    _gated_norm_kernel[(batch * hv,)](
        o, z, norm_weight, out, z.stride(0), hv, eps, DV=dv, BV=triton.next_power_of_2(dv), num_warps=1
    )
    return out
