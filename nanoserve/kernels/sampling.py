"""Triton kernels that sample one token per row of logits in one read of the logits.

Owns `fused_sample(logits, temperature, seed, step)`: for each row, a draw from
softmax(logits / T) by inverse transform sampling (T > 0), or the argmax of the logits
(T == 0: greedy). The slow twin is the torch path of sampler.py (fp32 copy of the logits, a
noise tensor of the same size, a fused argmax), which reads and writes about 1 GB per step
at batch 256 x 151,936 words; these kernels read the logits once in their own dtype (78 MB)
plus one tile per row.

How, in one launch (`_sample_kernel`, a 2-D grid of rows x vocabulary chunks):
1. each program walks its chunk in tiles of BLOCK words and writes, per tile, the largest
   logit m, the first word holding it and (rows with T > 0) the tile's softmax mass s = sum
   of 2^((logit - m) * log2(e) / T). The chunk count grows as the batch shrinks, so a batch
   of one row still spreads over many SMs.
2. the row's last program to finish (an atomic ticket per row) draws the row's token: with M
   the row's largest logit, tile j weighs W_j = s_j * 2^((m_j - M) * log2(e) / T). A uniform u
   in (0, 1) picks the first tile whose running sum of W passes u * sum(W), then, in that
   tile, the first word whose running sum of the same per-word terms passes what is left:
   word w is chosen with probability softmax(logits / T)[w]. Greedy rows (and rows with no
   finite positive mass, e.g. all -inf or a +inf logit) take the first tile holding M and the
   first word equal to M that its stats name. The running sums and u are fp64 (u from 52
   random bits), so no word's probability is lost to the resolution of fp32.
   Optionally the token is also stored into a token pool at the row's index there (the
   engine's next step reads it from the pool), so no copy kernel follows.
One launch instead of a stats kernel and a draw kernel: a batch-1 decode step waited for
each launch and gap between the LM head and the next step (H200, benchmarks/results/2026-11-27.md).
The tickets are a per-device int32 buffer of zeros that each row's last program resets, so
calls on one device must not run concurrently (the engine samples on one stream).

Token bitmask (structured outputs): an optional int32 [N, ceil(vocab / 32)] input whose bit j
of word i says whether word 32 * i + j is allowed in that row; both kernels read a disallowed
word as -inf (in `_load_row_tile`, so the tile stats and the draw see the same masked row).
`apply_token_bitmask` is its torch reference (and the torch sampler's way to apply it).

`sample_reference` is the torch reference the tests compare with (sampler.py's torch path is
the engine's slow twin).

One uniform per row instead of noise per word: the Gumbel-max kernel this replaces drew a
Philox number and two logs for each of the 39M words of a 256-row step and was compute-bound
at about half the copy bandwidth (H200: 74 us per 256-row call).

Uniforms: Philox (tl.philox) keyed by the sampler's seed, with counter (row, 0, step low,
step high). `step` is a host int the caller increments per call, so draws differ between
calls, repeat for the same (seed, step), and need no device state.

Invariants:
- greedy rows: exactly torch.argmax of the logits (ties: the lowest index, as torch; a row
  of -inf gives 0, as torch); NaN logits are never chosen (they count as -inf);
- T > 0 rows: a word of probability 0 (logit -inf or NaN) is never drawn; the others with
  their softmax(logits / T) probability, up to fp32 rounding of the per-word terms;
- no host sync: grids and the partial buffers depend only on the logits' shape; the
  temperatures are read on the device;
- the draw depends on (seed, step, row) and the row's logits only, not on how the
  vocabulary is split into chunks (chunks are whole tiles; the per-tile terms and the order
  of every sum are fixed by the tile size alone).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.launch import INTERPRET

# Words per tile and the most chunks a row is split into. The interpreter runs numpy per
# program: small tiles keep CPU tests fast and make tiny vocabularies cross several tiles
# and chunks.
BLOCK = 16 if INTERPRET else 2048
NUM_WARPS = 4
MAX_CHUNKS = 8 if INTERPRET else 256
# Programs the chunk split aims for, per SM (a batch of 256 rows gets 5 chunks per row on
# 132 SMs; a single row gets one chunk per tile).
PROGRAMS_PER_SM = 8
_num_sms: dict[int, int] = {}
_ticket_buffers: dict[str, torch.Tensor] = {}


@triton.jit
def _load_row_tile(row_ptr, vocab, tile, mask_row_ptr, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr):
    """Logits of words tile * BLOCK + [0, BLOCK) in fp32: -inf past the vocabulary, for NaN
    and (HAS_MASK) for words whose bit in the row's bitmask is 0."""
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    x = tl.where(x == x, x, float("-inf"))  # noqa: PLR0124 - x != x only for NaN
    if HAS_MASK:
        words = tl.load(mask_row_ptr + cols // 32, mask=cols < vocab, other=0)
        x = tl.where(((words >> (cols % 32)) & 1) != 0, x, float("-inf"))
    return x


@triton.jit
def _terms(x, m, c):
    """Per-word softmax terms of a tile relative to its max m: 2^((x - m) * c), c = log2(e) / T.
    Both kernels compute them with this one expression, so the draw re-creates exactly the
    terms that the tile's mass summed. A tile of -inf has terms 0 (not NaN)."""
    return tl.exp2((x - tl.where(m == float("-inf"), 0.0, m)) * c)


@triton.jit
def _inv_temperature(temp_ptr, row):
    """(T, log2(e) / T) of a row; the second is only used where T > 0."""
    t = tl.load(temp_ptr + row)
    return t, 1.4426950408889634 / tl.where(t > 0, t, 1.0)


@triton.jit
def _row_uniform(seed, row, step_lo, step_hi):
    """The row's uniform, fp64 from 52 Philox bits: (r0 * 2^20 + (r1 >> 12) + 0.5) * 2^-52, in
    [2^-53, 1 - 2^-53] (the half is exact below 2^52, so u is never 0 or 1)."""
    zero = (row * 0).to(tl.uint32)
    r0, r1, _, _ = tl.philox(seed, row.to(tl.uint32), zero, zero + step_lo.to(tl.uint32), zero + step_hi.to(tl.uint32))
    u = ((r0.to(tl.uint64) << 20) + (r1 >> 12).to(tl.uint64)).to(tl.float64)
    return (u + 0.5) * 2.220446049250313e-16


@triton.jit
def _chunk_stats(row_ptr, mask_row_ptr, max_ptr, arg_ptr, mass_ptr, stats, t, c, vocab, first, last,
                 BLOCK: tl.constexpr, HAS_MASK: tl.constexpr):  # fmt: skip
    """Per tile of [first, last): its largest logit, the first word holding it and (T > 0) its
    softmax mass."""
    for tile in range(first, last):
        x = _load_row_tile(row_ptr, vocab, tile, mask_row_ptr, BLOCK, HAS_MASK)
        m = tl.max(x, axis=0)
        tl.store(max_ptr + stats + tile, m)
        tl.store(arg_ptr + stats + tile, tile * BLOCK + tl.argmax(x, axis=0, tie_break_left=True))
        if t > 0:  # greedy rows need no mass
            tl.store(mass_ptr + stats + tile, tl.sum(_terms(x, m, c), axis=0))


@triton.jit
def _draw_row(row_ptr, mask_row_ptr, max_ptr, arg_ptr, mass_ptr, stats, t, c, row, vocab, num_tiles, seed, step_lo,
              step_hi, BLOCK: tl.constexpr, TILES: tl.constexpr, HAS_MASK: tl.constexpr):  # fmt: skip
    """The row's token from its tile stats (see the module docstring). The stats were written
    by other programs: read past L1 (.cg)."""
    j = tl.arange(0, TILES)
    j_ok = j < num_tiles
    m = tl.load(max_ptr + stats + j, mask=j_ok, other=float("-inf"), cache_modifier=".cg")
    top = tl.max(m, axis=0)

    # Greedy (and the fallback of a row without finite mass): the first word equal to the
    # largest logit, in the first tile that holds it (whose stats name that word).
    top_tile = tl.min(tl.where(j_ok & (m == top), j, TILES), axis=0)
    token = tl.load(arg_ptr + stats + top_tile, cache_modifier=".cg")
    k = tl.arange(0, BLOCK)

    if t > 0:
        # Tile weights relative to the row's max, their running sum (fp64), and the target.
        mass = tl.load(mass_ptr + stats + j, mask=j_ok, other=0.0, cache_modifier=".cg")
        weight = mass.to(tl.float64) * _terms(m, top, c).to(tl.float64)
        total = tl.sum(weight, axis=0)
        cum = tl.cumsum(weight, axis=0)
        target = _row_uniform(seed, row, step_lo, step_hi) * total
        # The first tile whose running sum passes the target; the last tile with mass if
        # rounding left the target at the very end.
        last_tile = tl.max(tl.where(weight > 0, j, -1), axis=0)
        tile = tl.maximum(tl.minimum(tl.min(tl.where(j_ok & (cum > target), j, TILES), axis=0), last_tile), 0)
        before = tl.max(tl.where(j < tile, cum, 0.0), axis=0)
        # What is left of the target, in the tile's own terms (relative to its max).
        m_tile = tl.max(tl.where(j == tile, m, float("-inf")), axis=0)
        scale = _terms(m_tile, top, c).to(tl.float64)
        left = (target - before) / scale
        y = _load_row_tile(row_ptr, vocab, tile, mask_row_ptr, BLOCK, HAS_MASK)
        terms = _terms(y, m_tile, c)
        run = tl.cumsum(terms.to(tl.float64), axis=0)
        last_word = tl.max(tl.where(terms > 0, k, -1), axis=0)
        word = tl.minimum(tl.min(tl.where(run > left, k, BLOCK), axis=0), last_word)
        finite = (total > 0) & (total < float("inf"))  # NaN fails both: the greedy fallback
        token = tl.where(finite, tile * BLOCK + word, token)
    return token.to(tl.int64)


# Ints that vary from call to call are not specialized (Triton would compile a variant for a
# value of 1 or a multiple of 16).
@triton.jit(do_not_specialize=["tiles_per_chunk", "num_tiles", "num_chunks", "seed", "step_lo", "step_hi"])
def _sample_kernel(
    logits_ptr, temp_ptr, max_ptr, arg_ptr, mass_ptr, mask_ptr, ticket_ptr, out_ptr, pool_ptr, pool_index_ptr,
    vocab, stride_row, mask_words, tiles_per_chunk, num_tiles, num_chunks, seed, step_lo, step_hi,
    BLOCK: tl.constexpr, TILES: tl.constexpr, HAS_MASK: tl.constexpr, HAS_POOL: tl.constexpr,
):  # fmt: skip
    """Program (row, chunk): the stats of the chunk's tiles; the row's last program to finish
    (a ticket per row, reset to 0 by that program for the next call) draws the row's token."""
    row = tl.program_id(0)
    first = tl.program_id(1) * tiles_per_chunk
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    mask_row_ptr = mask_ptr + row.to(tl.int64) * mask_words
    t, c = _inv_temperature(temp_ptr, row)
    stats = row.to(tl.int64) * num_tiles
    last = tl.minimum(first + tiles_per_chunk, num_tiles)
    _chunk_stats(row_ptr, mask_row_ptr, max_ptr, arg_ptr, mass_ptr, stats, t, c, vocab, first, last, BLOCK, HAS_MASK)
    # Every thread's stores come before the ticket (the barrier), and the ticket's release /
    # acquire orders them before the last program's reads.
    tl.debug_barrier()
    if tl.atomic_add(ticket_ptr + row, 1, sem="acq_rel", scope="gpu") == num_chunks - 1:
        tl.store(ticket_ptr + row, 0)
        token = _draw_row(row_ptr, mask_row_ptr, max_ptr, arg_ptr, mass_ptr, stats, t, c, row, vocab, num_tiles,
                          seed, step_lo, step_hi, BLOCK, TILES, HAS_MASK)  # fmt: skip
        tl.store(out_ptr + row, token)
        if HAS_POOL:
            tl.store(pool_ptr + tl.load(pool_index_ptr + row), token)


@triton.jit(do_not_specialize=["seed", "step_lo", "step_hi"])
def _uniforms_kernel(out_ptr, seed, step_lo, step_hi):
    """Test twin: the uniform the draw uses for row program_id(0)."""
    row = tl.program_id(0)
    tl.store(out_ptr + row, _row_uniform(seed, row, step_lo, step_hi))


def _programs_target(device: torch.device) -> int:
    if device.type != "cuda":
        return 16
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _num_sms:
        _num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return PROGRAMS_PER_SM * _num_sms[index]


def _tickets(device: torch.device, rows: int) -> torch.Tensor:
    """The per-row tickets of `_sample_kernel` on `device`: zeros between calls (each row's
    last program resets its own), grown as batches grow."""
    key = str(device)
    buf = _ticket_buffers.get(key)
    if buf is None or buf.numel() < rows:
        buf = _ticket_buffers[key] = torch.zeros(max(rows, 256), dtype=torch.int32, device=device)
    return buf


def split_vocab(rows: int, num_tiles: int, programs: int) -> tuple[int, int]:
    """(tiles per chunk, number of chunks) so that rows x chunks is about `programs`, with at
    most MAX_CHUNKS chunks and at least one tile per chunk."""
    wanted = min(MAX_CHUNKS, num_tiles, max(1, triton.cdiv(programs, max(rows, 1))))
    per_chunk = triton.cdiv(num_tiles, wanted)
    return per_chunk, triton.cdiv(num_tiles, per_chunk)


def _noise_key(seed: int, step: int) -> tuple[int, int, int]:
    """(seed, step low, step high) as 31-bit ints: Triton types a Python int by its value,
    and a change of type would compile the kernel again."""
    return seed & 0x7FFFFFFF, step & 0x7FFFFFFF, (step >> 31) & 0x7FFFFFFF


def row_uniforms(rows: int, seed: int, step: int, device: torch.device) -> torch.Tensor:
    """Test twin of `fused_sample`: the fp64 uniform each row's draw uses."""
    out = torch.empty(rows, dtype=torch.float64, device=device)
    if rows:
        _uniforms_kernel[(rows,)](out, *_noise_key(seed, step), num_warps=1)
    return out


def unpack_token_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [N, vocab] from an int32 bitmask [N, ceil(vocab / 32)]: True where allowed."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The torch reference of the kernels' mask: disallowed words set to -inf, in place."""
    return logits.masked_fill_(~unpack_token_bitmask(bitmask, logits.shape[1]), float("-inf"))


def sample_reference(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The torch reference of `fused_sample` given its uniforms (`row_uniforms`): per row,
    the argmax (T == 0) or the first word where the fp64 CDF of softmax(logits / T) passes
    u * total (NaN counts as -inf). Agrees with the kernel except where fp32 rounding of the
    per-word terms moves the CDF across u (rare: the tests bound it)."""
    x = torch.nan_to_num(logits.double(), nan=float("-inf"))
    greedy = temperature <= 0
    scaled = x / torch.where(greedy, 1.0, temperature.double())[:, None]
    p = scaled.softmax(dim=-1)
    cdf = p.cumsum(dim=-1)
    target = (uniforms.double() * cdf[:, -1])[:, None]
    drawn = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=logits.shape[1] - 1)
    return torch.where(greedy, x.argmax(dim=-1), drawn)


def fused_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seed: int,
    step: int,
    programs: int | None = None,
    bitmask: torch.Tensor | None = None,
    pool: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One token per row of `logits` [N, vocab] (any float dtype, words dense): a draw from
    softmax(logits / T), or the argmax where T == 0. `temperature`: fp32 [N] on the logits'
    device. `seed`, `step`: host ints keying the uniforms. `bitmask`: optional int32
    [N, ceil(vocab / 32)] of allowed words (see the module docstring). `pool`: optional
    (long [P], long [N]): row i's token is also stored at pool[0][pool[1][i]]. Returns long [N]."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    num_tiles = triton.cdiv(vocab, BLOCK)
    programs = programs if programs is not None else _programs_target(logits.device)
    per_chunk, num_chunks = split_vocab(rows, num_tiles, programs)
    tile_max = torch.empty(rows, num_tiles, dtype=torch.float32, device=logits.device)
    tile_arg = torch.empty(rows, num_tiles, dtype=torch.int32, device=logits.device)
    tile_mass = torch.empty(rows, num_tiles, dtype=torch.float32, device=logits.device)
    has_mask = bitmask is not None
    if has_mask:
        bitmask = bitmask.contiguous()
        assert bitmask.dtype == torch.int32 and bitmask.shape == (rows, triton.cdiv(vocab, 32)), "bad bitmask shape"
    mask_arg = bitmask if has_mask else out  # never read without HAS_MASK
    words = triton.cdiv(vocab, 32)
    pool_arg, index_arg = pool if pool is not None else (out, out)  # never read without HAS_POOL
    _sample_kernel[(rows, num_chunks)](
        logits, temperature, tile_max, tile_arg, tile_mass, mask_arg, _tickets(logits.device, rows), out,
        pool_arg, index_arg, vocab, logits.stride(0), words, per_chunk, num_tiles, num_chunks, *_noise_key(seed, step),
        BLOCK=BLOCK, TILES=triton.next_power_of_2(num_tiles), HAS_MASK=has_mask, HAS_POOL=pool is not None,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
