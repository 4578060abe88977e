"""A Triton kernel that samples one token per row of logits in one read of the logits.

Owns `fused_sample(logits, temperature, seed, step)`: for each row, the argmax over the
vocabulary of logit / T + Gumbel noise (T > 0: a draw from softmax(logits / T), the
Gumbel-max trick) or of the logit itself (T == 0: greedy). The slow twin is the torch
path of sampler.py (fp32 copy of the logits, a noise tensor of the same size, a fused
argmax), which reads and writes about 1 GB per step at batch 256 x 151,936 words; this
kernel reads the logits once in their own dtype (78 MB) and writes two small partials.

How: a 2-D grid, rows x vocabulary chunks. Each program walks its chunk in tiles of BLOCK
words and keeps, per lane, the best score and its index; it writes the chunk's best
(score, index) to a partial buffer, and a second kernel (one program per row) picks the
best chunk. The chunk count grows as the batch shrinks, so a batch of one row still
spreads over many SMs.

Noise: Philox (tl.philox) keyed by the sampler's seed, with counter (word // 4, row, step):
one Philox call gives the uniforms of four neighbouring words. `step` is a host int the
caller increments per call, so draws differ between calls, repeat for the same (seed,
step), and need no device state. A uniform u in (0, 1) becomes E = -ln(1 - u) ~
Exp(1) (a short series for small u, where 1 - u would lose the digits that decide the
winner), and the score is logit / T - ln E, whose argmax is a draw from softmax(logit / T). Both logs
run on the GPU's approximate lg2 (`_ln`).

Invariants:
- greedy rows: exactly torch.argmax of the logits (ties: the lowest index, as torch);
  T > 0 rows: statistically a draw from softmax(logits / T); NaN logits are never chosen
  (torch.argmax would return a NaN's index);
- no host sync: grids and the partial buffers depend only on the logits' shape; the
  temperatures are read on the device;
- the noise of a word depends on (seed, step, row, word) only, not on the tile size or on
  how the vocabulary is split into chunks (a chunk starts at a multiple of the tile).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Words per tile and the most chunks a row is split into. The interpreter runs numpy per
# program: small tiles keep CPU tests fast and make tiny vocabularies cross several tiles
# and chunks.
BLOCK = 16 if INTERPRET else 1024
NUM_WARPS = 4
MAX_CHUNKS = 8 if INTERPRET else 256
# Programs the chunk split aims for, per SM (a batch of 256 rows gets 5 chunks per row on
# 132 SMs; a single row gets 149 chunks of one tile each).
PROGRAMS_PER_SM = 8
# The noise's logs through the GPU's approximate lg2 (see _ln); NANOSERVE_SAMPLER_FAST_LOG=0:
# libdevice's logf, for A/B.
FAST_LOG = not INTERPRET and os.environ.get("NANOSERVE_SAMPLER_FAST_LOG", "1") != "0"
_num_sms: dict[int, int] = {}


@triton.jit
def _tile(BLOCK: tl.constexpr):
    """Word offsets of a tile as [BLOCK // 4, 4]: row g holds words 4g .. 4g + 3, the four
    that share one Philox call, along the last axis so that one thread holds all four
    (a layout that split them would make each thread repeat the call)."""
    return tl.arange(0, BLOCK // 4)[:, None] * 4 + tl.arange(0, 4)[None, :]


@triton.jit
def _ln(x, FAST: tl.constexpr):
    """Natural log. FAST: the GPU's lg2.approx (one special-function instruction, relative
    error ~2^-22) times ln 2, where tl.log compiles to libdevice's accurate logf, about twenty
    instructions and a branch: with two logs per word the kernel was compute-bound on them
    (H200, 256 rows x 151,936 words at T = 0.6: 0.137 -> 0.074 ms per call). Noise needs no
    last-ulp accuracy. The interpreter cannot run PTX: FAST is off there."""
    if FAST:
        y = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
        return y * 0.6931471805599453
    else:
        return tl.log(x)


@triton.jit
def _gumbel_scores(logit, inv_t, seed, step_lo, step_hi, row, tile_start, BLOCK: tl.constexpr, FAST_LOG: tl.constexpr):
    """logit * inv_t + Gumbel(0, 1) noise for the tile of words tile_start + _tile(BLOCK)
    (tile_start a multiple of 4): word w gets output w % 4 of Philox counter
    (w // 4, row, step_lo, step_hi)."""
    c0 = (tile_start // 4 + tl.arange(0, BLOCK // 4)).to(tl.uint32)
    zero = c0 * 0
    c1 = zero + row.to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, zero + step_lo.to(tl.uint32), zero + step_hi.to(tl.uint32))
    j = tl.arange(0, 4)[None, :]
    r = tl.where(j == 0, r0[:, None], tl.where(j == 1, r1[:, None], tl.where(j == 2, r2[:, None], r3[:, None])))
    # u in (0, 1]: a uint32 at its midpoint, scaled by 2^-32 (rounds to 1 only at the top).
    u = r.to(tl.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10
    # E = -ln(1 - u) ~ Exp(1). For small u, 1 - u in fp32 drops the digits of u that make E
    # small (the likely winners): there, the series u + u^2/2 + u^3/3 + u^4/4.
    series = u * (1.0 + u * (0.5 + u * (0.3333333333333333 + u * 0.25)))
    e = tl.where(u < 0.015625, series, -_ln(1.0 - u, FAST_LOG))
    return logit * inv_t - _ln(e, FAST_LOG)


@triton.jit
def _chunk_best(
    row_ptr,
    vocab,
    chunk_start,
    chunk,
    inv_t,
    seed,
    step_lo,
    step_hi,
    row,
    BLOCK: tl.constexpr,
    NOISE: tl.constexpr,
    FAST_LOG: tl.constexpr,
):
    """(best score, its lowest index) over words [chunk_start, chunk_start + chunk)."""
    offs = _tile(BLOCK)
    best = tl.full([BLOCK // 4, 4], float("-inf"), tl.float32)
    best_idx = chunk_start + offs
    for tile in range(0, chunk, BLOCK):
        cols = chunk_start + tile + offs
        logit = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        if NOISE:
            score = _gumbel_scores(logit, inv_t, seed, step_lo, step_hi, row, chunk_start + tile, BLOCK, FAST_LOG)
        else:
            score = logit
        # Strictly greater: a lane keeps its earliest index among equal scores.
        better = score > best
        best = tl.where(better, score, best)
        best_idx = tl.where(better, cols, best_idx)
    top = tl.max(tl.max(best, axis=1), axis=0)
    first = tl.min(tl.min(tl.where(best == top, best_idx, 2147483647), axis=1), axis=0)
    return top, first


# Ints that vary from call to call are not specialized (Triton would compile a variant for a
# value of 1 or a multiple of 16).
@triton.jit(do_not_specialize=["num_chunks", "seed", "step_lo", "step_hi"])
def _sample_chunk_kernel(
    logits_ptr,
    temp_ptr,
    part_val_ptr,
    part_idx_ptr,
    vocab,
    stride_row,
    chunk,
    num_chunks,
    seed,
    step_lo,
    step_hi,
    BLOCK: tl.constexpr,
    FAST_LOG: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    t = tl.load(temp_ptr + row)
    inv_t = 1.0 / tl.where(t > 0, t, 1.0)
    if t > 0:
        top, first = _chunk_best(
            row_ptr, vocab, c * chunk, chunk, inv_t, seed, step_lo, step_hi, row, BLOCK, True, FAST_LOG
        )
    else:  # greedy: no noise drawn
        top, first = _chunk_best(
            row_ptr, vocab, c * chunk, chunk, inv_t, seed, step_lo, step_hi, row, BLOCK, False, FAST_LOG
        )
    tl.store(part_val_ptr + row * num_chunks + c, top)
    tl.store(part_idx_ptr + row * num_chunks + c, first)


@triton.jit(do_not_specialize=["num_chunks"])
def _sample_reduce_kernel(part_val_ptr, part_idx_ptr, out_ptr, num_chunks, MAX_CHUNKS: tl.constexpr):
    """The best chunk of each row; chunks are in word order, so the lowest index wins ties."""
    row = tl.program_id(0)
    k = tl.arange(0, MAX_CHUNKS)
    valid = k < num_chunks
    vals = tl.load(part_val_ptr + row * num_chunks + k, mask=valid, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * num_chunks + k, mask=valid, other=2147483647)
    top = tl.max(vals, axis=0)
    token = tl.min(tl.where(valid & (vals == top), idx, 2147483647), axis=0)
    tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit(do_not_specialize=["seed", "step_lo", "step_hi"])
def _scores_kernel(
    logits_ptr,
    temp_ptr,
    out_ptr,
    vocab,
    stride_row,
    seed,
    step_lo,
    step_hi,
    BLOCK: tl.constexpr,
    FAST_LOG: tl.constexpr,
):
    """Test twin: the scores `_sample_chunk_kernel` maximizes, one tile per program."""
    row = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    cols = start + _tile(BLOCK)
    logit = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < vocab).to(tl.float32)
    t = tl.load(temp_ptr + row)
    score = _gumbel_scores(logit, 1.0 / t, seed, step_lo, step_hi, row, start, BLOCK, FAST_LOG)
    tl.store(out_ptr + row.to(tl.int64) * vocab + cols, score, mask=cols < vocab)


def _programs_target(device: torch.device) -> int:
    if device.type != "cuda":
        return 16
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _num_sms:
        _num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return PROGRAMS_PER_SM * _num_sms[index]


def split_vocab(rows: int, vocab: int, programs: int) -> tuple[int, int]:
    """(words per chunk, a multiple of BLOCK; number of chunks) so that rows x chunks is about `programs`, with at most MAX_CHUNKS
    chunks and at least one tile per chunk."""
    block = BLOCK
    wanted = min(MAX_CHUNKS, triton.cdiv(vocab, block), max(1, triton.cdiv(programs, max(rows, 1))))
    chunk = triton.cdiv(triton.cdiv(vocab, wanted), block) * block
    return chunk, triton.cdiv(vocab, chunk)


def _noise_key(seed: int, step: int) -> tuple[int, int, int]:
    """(seed, step low, step high) as 31-bit ints: Triton types a Python int by its value,
    and a change of type would compile the kernel again."""
    return seed & 0x7FFFFFFF, step & 0x7FFFFFFF, (step >> 31) & 0x7FFFFFFF


def gumbel_scores(logits: torch.Tensor, temperature: torch.Tensor, seed: int, step: int) -> torch.Tensor:
    """Test twin of `fused_sample` for rows with T > 0: the fp32 scores [N, vocab]
    (logit / T + the same Gumbel noise) whose argmax it returns."""
    rows, vocab = logits.shape
    out = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)
    if rows and logits.stride(1) != 1:
        logits = logits.contiguous()
    grid = (rows, triton.cdiv(vocab, BLOCK))
    if rows:
        _scores_kernel[grid](
            logits,
            temperature,
            out,
            vocab,
            logits.stride(0),
            *_noise_key(seed, step),
            BLOCK=BLOCK,
            FAST_LOG=FAST_LOG,
            num_warps=NUM_WARPS,
        )
    return out


def fused_sample(
    logits: torch.Tensor, temperature: torch.Tensor, seed: int, step: int, programs: int | None = None
) -> torch.Tensor:
    """One token per row of `logits` [N, vocab] (any float dtype, words dense): argmax of
    logit / T + Gumbel noise, or of the logit where T == 0. `temperature`: fp32 [N] on the
    logits' device. `seed`, `step`: host ints keying the noise. Returns long [N]."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    programs = programs if programs is not None else _programs_target(logits.device)
    chunk, num_chunks = split_vocab(rows, vocab, programs)
    part_val = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    _sample_chunk_kernel[(rows, num_chunks)](
        logits,
        temperature,
        part_val,
        part_idx,
        vocab,
        logits.stride(0),
        chunk,
        num_chunks,
        *_noise_key(seed, step),
        BLOCK=BLOCK,
        FAST_LOG=FAST_LOG,
        num_warps=NUM_WARPS,
    )
    _sample_reduce_kernel[(rows,)](part_val, part_idx, out, num_chunks, MAX_CHUNKS=MAX_CHUNKS, num_warps=NUM_WARPS)
    return out
