"""Piecewise CUDA graphs for prefill and extend batches.

Owns: the schedule of token counts, the static buffers that the pieces of the forward read
and write, one CUDA graph per (token count, piece), and the choice of the padded token
count for a batch. The pieces are `DecoderLM.piece` (the forward cut at every attention
call); attention, and with it the store of the new K/V, runs eagerly between them with the
batch's own varlen metadata.

Invariants:
- sizes: 4..32 step 4, 48..256 step 16, 288..512 step 32, 576..1024 step 64,
  1280..4096 step 256, those <= the cap (`chunked_prefill_size`). A batch of T tokens runs
  at n = the smallest size >= T (binary search); T above the largest size runs eagerly;
- every piece of every size reads and writes slices [:n] of the same static buffers
  (token ids, positions, residual stream, q/k/v, attention output, final hidden states),
  allocated once for the largest size outside the graphs' memory pool; a graph keeps
  nothing alive in the pool, so all graphs share one pool and its memory is the largest
  piece's scratch, not a sum over sizes;
- rows T..n-1 are padding. They hold stale (finite or not) values and are never read into
  a real row: every op inside a piece is row-wise (see nanoserve.models.decoder), and
  attention runs on rows [:T] only, so padding never writes K/V and never reaches the
  sampler. Pad rows of the attention output keep whatever was there;
- graphs are captured largest first after one eager warm-up per size (torch.compile,
  cuBLAS heuristics, allocator), with the garbage collector frozen;
- then the sizes at which replaying is clearly slower than running the pieces eagerly are
  dropped (large batches of large models are bound by the GPU, where the copies into the
  static buffers can cost more than the launches the graphs save); near parity the graphs
  stay, because an eager step holds the host thread for its whole launch sequence, time the
  overlap loop needs to schedule the next step. Batches above the largest kept size run
  eagerly. Under tensor parallelism each rank times its own pieces (their
  collectives keep the ranks in step) and a size wins only where it wins on every rank
  (`agree`), so all ranks keep the same sizes and run the same search;
- `forward`'s result is a view of the static hidden-state buffer, valid until the next
  forward (the caller projects the rows it needs to logits right away, on the same stream).

Without `capture()` (CPU, tests) `forward` runs each piece's body directly on the same
static buffers with the same padding: the slow twin of the replay.
"""

from __future__ import annotations

import bisect
import gc
import logging
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from nanoserve.attention.base import ForwardBatch

if TYPE_CHECKING:
    from nanoserve.models.decoder import DecoderLM

log = logging.getLogger("nanoserve")

# (first, last, step) of each band of the schedule.
_BANDS = ((4, 32, 4), (48, 256, 16), (288, 512, 32), (576, 1024, 64), (1280, 4096, 256))


def piecewise_sizes(max_tokens: int) -> list[int]:
    """The captured token counts, ascending, none above `max_tokens`."""
    return [n for first, last, step in _BANDS for n in range(first, last + 1, step) if n <= max_tokens]


# A size keeps its graphs unless replaying takes longer than this factor times eager at start.
# Near parity the sign is run-to-run noise (1-3% on an H200; qwen3-0.6b at 4096 tokens measured
# 0.97-1.08x), and the two mistakes differ: graphs kept a little slower cost a few percent of
# GPU time, while steps left eager also cost the host their launch time. With 0.97 (graphs had
# to win by 3%), llama-3.1-8b servers kept graphs up to 416, 960 or 1536 tokens depending on
# the run, and the one at 416 ran the mixed policy's 512-768-token steps eagerly: at 24 req/s
# 4.5% of requests met (TTFT 500 ms, TPOT 25 ms) against 100% where they replayed
# (benchmarks/results/2026-11-27.md). With 1.05 each of the seven servers started since (two H200s)
# kept every size.
KEEP_WITHIN = 1.05


def largest_winning_size(sizes: list[int], graphs_win: Callable[[int], bool]) -> int | None:
    """The largest of the ascending `sizes` at which `graphs_win`, or None if they lose at
    the smallest. Assumes that graphs that win at a size win at every smaller one (the launch
    time they save is fixed, the copies they add grow with the size): the largest size is
    tried first (small models win everywhere), then a binary search."""
    if graphs_win(sizes[-1]):
        return sizes[-1]
    lo, hi = -1, len(sizes) - 2  # graphs win at sizes[lo] (lo = -1: none known), lose above hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if graphs_win(sizes[mid]):
            lo = mid
        else:
            hi = mid - 1
    return sizes[lo] if lo >= 0 else None


class PiecewiseGraphs:
    def __init__(
        self,
        model: DecoderLM,
        sizes: list[int],
        device: torch.device,
        dtype: torch.dtype,
        agree: Callable[[bool, torch.device], bool] | None = None,
    ):
        """`agree(value, device)`: whether `value` holds on every tensor-parallel rank (every
        rank calls it at the same point; `TPGroup.agree_all`); None: this process alone."""
        if not sizes:
            raise ValueError("piecewise graphs need at least one token count")
        self.model = model
        self.agree = agree
        self.sizes = sorted(sizes)
        self.max_tokens = self.sizes[-1]
        self.device = device
        attn = model.attention_module
        cfg = model.config
        n, d = self.max_tokens, attn.head_dim

        def buf(*shape, dtype=dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = buf(n, dtype=torch.long)
        self.positions = buf(n, dtype=torch.long)
        self.residual = buf(n, cfg.hidden_size)
        self.q = buf(n, attn.num_heads, d)
        self.k = buf(n, attn.num_kv_heads, d)
        self.v = buf(n, attn.num_kv_heads, d)
        self.attn_out = buf(n, attn.num_heads, d)
        self.hidden = buf(n, cfg.hidden_size)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # size -> one graph per piece
        self.replays: Counter[int] = Counter()  # forwards run per padded size (for tests and logs)
        self.capture_seconds = 0.0
        self.memory_bytes = 0  # static buffers + the graphs' pool and objects
        self.dropped: list[int] = []  # captured sizes measured slower than eager, dropped

    def padded_size(self, num_tokens: int) -> int | None:
        """The smallest captured size >= num_tokens, or None (run eagerly)."""
        at = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[at] if at < len(self.sizes) else None

    def _run_piece_body(self, i: int, n: int) -> None:
        """Piece i on rows [:n] of the static buffers; what a graph captures."""
        out = self.model.piece(i, self.positions[:n], self.input_ids[:n], self.attn_out[:n], self.residual[:n])
        if i == self.model.num_pieces - 1:
            self.hidden[:n].copy_(out)
            return
        # The residual is read before it is overwritten: piece i's last read of it precedes
        # these copies in stream order.
        for dst, src in zip((self.q, self.k, self.v, self.residual), out):
            dst[:n].copy_(src)

    def _run_piece(self, i: int, n: int) -> None:
        if self.graphs:
            self.graphs[n][i].replay()
        else:
            self._run_piece_body(i, n)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, as `DecoderLM.forward` gives them;
        T must be <= the largest size. A view of the static buffer (see the invariants)."""
        num_tokens = input_ids.shape[0]
        n = self.padded_size(num_tokens)
        if n is None:
            raise ValueError(f"{num_tokens} tokens is above the largest piecewise size {self.max_tokens}")
        self.replays[n] += 1
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        q, k, v, attn_out = (t[:num_tokens] for t in (self.q, self.k, self.v, self.attn_out))
        for i in range(self.model.num_pieces - 1):
            self._run_piece(i, n)
            attn_out.copy_(batch.attend(i, q, k, v, self.model.attention_scale(i), **self.model.attention_kind(i)))
        self._run_piece(self.model.num_pieces - 1, n)
        return self.hidden[:num_tokens]

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per (size, piece), largest size first, all in one memory pool."""
        dev = self.device
        static_bytes = sum(
            t.numel() * t.element_size()
            for t in (self.input_ids, self.positions, self.residual, self.q, self.k, self.v, self.attn_out, self.hidden)
        )
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        free_before, _ = torch.cuda.mem_get_info(dev)
        started = time.perf_counter()
        num_pieces = self.model.num_pieces
        pool = None
        graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        # Frozen objects are skipped by every collection, so nothing scans the whole heap
        # while graphs are captured; collection stays off until the capture ends.
        gc.collect()
        gc.freeze()
        gc.disable()
        try:
            bar = tqdm(list(reversed(self.sizes)), desc="capturing piecewise prefill graphs", leave=False)
            for n in bar:
                for i in range(num_pieces):  # warm-up at this size, eagerly
                    self._run_piece_body(i, n)
                torch.cuda.synchronize(dev)
                graphs[n] = []
                for i in range(num_pieces):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._run_piece_body(i, n)
                    if pool is None:
                        pool = graph.pool()
                    graphs[n].append(graph)
                free, _ = torch.cuda.mem_get_info(dev)
                bar.set_postfix(tokens=n, free_gib=f"{free / 2**30:.1f}")
            bar.close()
        finally:
            gc.enable()
            gc.unfreeze()
        self.graphs = graphs
        self._drop_slower_sizes()
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        free_after, _ = torch.cuda.mem_get_info(dev)
        self.capture_seconds = time.perf_counter() - started
        self.memory_bytes = free_before - free_after + static_bytes
        log.info(
            "captured piecewise prefill CUDA graphs for %d token counts (%d pieces each) in %.1f s, %.2f GiB; "
            "replayed for batches of up to %d tokens%s",
            len(self.sizes) + len(self.dropped),
            num_pieces,
            self.capture_seconds,
            self.memory_bytes / 2**30,
            self.max_tokens,
            f" (from {self.dropped[0]} up replaying took over {KEEP_WITHIN:.2f}x eager)" if self.dropped else "",
        )

    def _chain_seconds(self, n: int, replay: bool) -> float:
        """Wall time of all pieces at size n, without attention: replayed (with the copy of
        each attention output into the static buffer that `forward` adds) or eager."""
        last = self.model.num_pieces - 1
        torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        if replay:
            for i, graph in enumerate(self.graphs[n]):
                graph.replay()
                if i < last:
                    self.attn_out[:n].copy_(self.q[:n])
        else:
            residual = None
            for i in range(last + 1):
                out = self.model.piece(i, self.positions[:n], self.input_ids[:n], self.attn_out[:n], residual)
                residual = out[-1] if i < last else None
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def _graphs_win(self, n: int, repeats: int = 3) -> bool:
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(repeats + 1):  # the first round warms both up
            for replay, measured in times.items():
                measured.append(self._chain_seconds(n, replay))
        win = statistics.median(times[True][1:]) <= KEEP_WITHIN * statistics.median(times[False][1:])
        return win if self.agree is None else self.agree(win, self.device)

    def _drop_slower_sizes(self) -> None:
        # Time on random tokens at spread positions (uniform data can run faster than real).
        self.input_ids.random_(0, self.model.config.vocab_size)
        self.positions.random_(0, self.model.rotary.cos.shape[0])
        keep = largest_winning_size(self.sizes, self._graphs_win)
        self.dropped = [n for n in self.sizes if keep is None or n > keep]
        for n in self.dropped:
            del self.graphs[n]
        self.sizes = [n for n in self.sizes if n not in self.dropped]
        self.max_tokens = self.sizes[-1] if self.sizes else 0
