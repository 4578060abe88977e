"""Two-stream micro-batch experiment (run on a GPU machine):

    PYTHONUNBUFFERED=1 python benchmarks/probes/microbatch_overlap.py [--model qwen3-0.6b] [--steps 0 300 600 800]

Question: does a decode step run faster when its batch is cut in two halves whose forwards
run on two CUDA streams inside one graph? Decode attention is bandwidth-bound over all SMs
while the per-layer matmuls, norms and small kernels are latency-bound (an o_proj at 256
rows fills 16 of 132 SMs); two independent halves let one half's small kernels fill the SMs
the other half's attention leaves idle, and hide the launch gaps between dependent kernels.
The price: every matmul runs twice at half the rows.

For decode batches of the offline workload (benchmarks/offline_throughput.py; the context
lengths of the requests running at the given steps, longest first as the scheduler orders
them), on dummy weights with requests on shuffled pages, it times one decode step (model +
LM head, the engine's forward) captured in a CUDA graph, median of 20 replays:
- "one": the whole batch, as the engine runs it today;
- "halves, one stream": the two halves back to back (the cost of splitting alone);
- "halves, two streams": the halves forked onto two streams of equal priority and joined;
- "halves, two streams, A high": the same with the first half's stream at high priority;
- "halves, small kernels high": two streams per half, attention on a low-priority stream and
  everything else on a high-priority one (graph edges keep each half's order);
- "attention takes turns": the halves' attention calls alternate (A0, B0, A1, B1, ...), each
  waiting for the previous one, so one half's small kernels overlap the other's attention;
- "turns, small kernels high": the same with attention at low priority, the rest high.
The halves interleave the longest-first order (rows 0, 2, 4, ... and 1, 3, 5, ...), so both
carry about the same KV. Also checks that the halves' logits equal the whole batch's.

`--whole` times only the whole batch (a quick A/B of engine changes: run it once per
environment setting); `--profile` prints one layer's kernel timeline per step instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the repository, and benchmarks/ for shared helpers

import argparse
import random
from dataclasses import dataclass

import torch
from attention import workload_batches

from nanoserve.attention.base import AttentionMetadata, ForwardBatch
from nanoserve.attention.triton_backend import TritonAttentionBackend
from nanoserve.llm import LLM


@dataclass
class Half:
    ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    backend: TritonAttentionBackend


def make_half(lens: list[int], pages: list[list[int]], ids: torch.Tensor, page_size: int, max_len: int, dev) -> Half:
    n = len(lens)
    width = -(-max_len // page_size)
    table = torch.zeros(n, width, dtype=torch.int32)
    for i, p in enumerate(pages):
        table[i, : len(p)] = torch.tensor(p, dtype=torch.int32)
    prefix = torch.tensor([x - 1 for x in lens], dtype=torch.long)
    slot = table[torch.arange(n), prefix // page_size].long() * page_size + prefix % page_size
    meta = AttentionMetadata(
        is_decode=True,
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        prefix_lens=prefix.to(torch.int32).to(dev),
        cu_query_lens=torch.arange(n + 1, dtype=torch.int32, device=dev),
        page_table=table.to(dev),
        slot_mapping=slot.to(dev),
        seq_lens_host=lens,
        prefix_lens_host=(prefix).tolist(),
        max_query_len=1,
        max_seq_len=max_len,  # as the engine's graphs: the split count fixed by max_model_len
    )
    return Half(ids.to(dev), prefix.to(dev), meta, TritonAttentionBackend(max_num_reqs=n))


class Step:
    def __init__(self, runner, lens: list[int], max_len: int, rng: random.Random):
        self.runner = runner
        ps = runner.page_size
        need = [-(-n // ps) for n in lens]
        pool = list(range(1, runner.kv_cache.k[0].shape[0]))
        rng.shuffle(pool)
        pages, taken = [], 0
        for k in need:
            pages.append(pool[taken : taken + k])
            taken += k
        dev = runner.device
        ids = torch.randint(0, 10000, (len(lens),))
        self.whole = make_half(lens, pages, ids, ps, max_len, dev)
        self.a = make_half(lens[0::2], pages[0::2], ids[0::2], ps, max_len, dev)
        self.b = make_half(lens[1::2], pages[1::2], ids[1::2], ps, max_len, dev)

    def forward(self, h: Half, attn_stream=None, main_stream=None) -> torch.Tensor:
        model, kv = self.runner.model, self.runner.kv_cache
        h.backend.prepare(h.meta)
        batch = ForwardBatch(h.meta, h.backend, kv.k, kv.v)
        if attn_stream is None:
            return model.compute_logits(model(h.ids, h.positions, batch))
        # attention on `attn_stream`, the rest on `main_stream` (the caller's current stream)
        attn_out = residual = None
        for i in range(len(model.layers)):
            q, k, v, residual = model.piece(i, h.positions, h.ids, attn_out, residual)
            attn_stream.wait_stream(main_stream)
            with torch.cuda.stream(attn_stream):
                attn_out = batch.attend(i, q, k, v, model.attention_scale(i), **model.attention_kind(i))
            main_stream.wait_stream(attn_stream)
        hidden = model.piece(len(model.layers), h.positions, h.ids, attn_out, residual)
        return model.compute_logits(hidden)


def alternating(st: Step, mains: list[torch.cuda.Stream], attns: list[torch.cuda.Stream] | None) -> torch.Tensor:
    """The halves' forwards on `mains`, their attention calls taking turns (A0, B0, A1, B1,
    ...: each waits for the previous one), so one half's small kernels run during the other
    half's attention; attention on `attns` (e.g. at low priority) when given."""
    model, kv = st.runner.model, st.runner.kv_cache
    halves = (st.a, st.b)
    cur = torch.cuda.current_stream()
    batches = []
    for h, s in zip(halves, mains):
        s.wait_stream(cur)
        h.backend.prepare(h.meta)
        batches.append(ForwardBatch(h.meta, h.backend, kv.k, kv.v))
    attn_out, residual = [None, None], [None, None]
    last = None
    for i in range(len(model.layers)):
        for j, h in enumerate(halves):
            with torch.cuda.stream(mains[j]):
                q, k, v, residual[j] = model.piece(i, h.positions, h.ids, attn_out[j], residual[j])
            s = mains[j] if attns is None else attns[j]
            s.wait_stream(mains[j])
            if last is not None:
                s.wait_event(last)
            with torch.cuda.stream(s):
                attn_out[j] = batches[j].attend(i, q, k, v, model.attention_scale(i), **model.attention_kind(i))
                last = torch.cuda.Event()
                last.record()
            mains[j].wait_stream(s)
    outs = []
    for j, h in enumerate(halves):
        with torch.cuda.stream(mains[j]):
            hidden = model.piece(len(model.layers), h.positions, h.ids, attn_out[j], residual[j])
            outs.append(model.compute_logits(hidden))
        cur.wait_stream(mains[j])
    return torch.cat(outs)


def forked(fns: list, streams: list[torch.cuda.Stream]) -> list:
    cur = torch.cuda.current_stream()
    outs = []
    for fn, s in zip(fns, streams):
        s.wait_stream(cur)
        with torch.cuda.stream(s):
            outs.append(fn())
    for s in streams:
        cur.wait_stream(s)
    return outs


def graph_time(fn, reps: int = 20) -> tuple[float, object]:
    for _ in range(2):
        out = fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2], (graph, out)


def time_step(st: Step, streams: dict[str, list[torch.cuda.Stream]]) -> list[float]:
    """Graph ms of the seven variants (module docstring), checking the halves' logits."""
    halves = (st.a, st.b)

    def two(names: str):
        return torch.cat(forked([lambda h=h: st.forward(h) for h in halves], streams[names]))

    def small_high():
        fns = [
            lambda i=i, h=h: st.forward(h, streams["attn_low"][i], streams["main_high"][i])
            for i, h in enumerate(halves)
        ]
        return torch.cat(forked(fns, streams["main_high"]))

    variants = [
        lambda: st.forward(st.whole),
        lambda: torch.cat([st.forward(h) for h in halves]),
        lambda: two("plain"),
        lambda: two("a_high"),
        small_high,
        lambda: alternating(st, streams["plain"], None),
        lambda: alternating(st, streams["main_high"], streams["attn_low"]),
    ]
    times, outs = [], []
    for fn in variants:
        t, (graph, out) = graph_time(fn)
        times.append(t)
        outs.append(out)
        del graph
    n = st.whole.ids.shape[0]
    order = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)]).to(outs[0].device)
    ref = outs[0][order].float()
    for i, got in enumerate(outs[1:], 1):
        diff = (got.float() - ref).abs().max().item()
        if diff > 0.05 * ref.abs().max().item():
            print(f"  MISMATCH variant {i}: max diff {diff}")
    return times


def profile_step(st: Step, layer: int = 10, reps: int = 5) -> None:
    """One layer's kernels in the whole-batch graph, in order: duration, gap before each and
    the step's total kernel time by category (torch.profiler over `reps` replays)."""
    from torch.profiler import ProfilerActivity, profile

    from profile_offline import category, device_events  # isort: skip

    _, (graph, _) = graph_time(lambda st=st: st.forward(st.whole))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    events = sorted(device_events(prof, True), key=lambda e: e[1])
    splits = [i for i, e in enumerate(events) if "_decode_split" in e[0]]
    per_step = len(events) // reps
    first, nxt = splits[layer], splits[layer + 1]
    print(f"  layer {layer} (between two decode split kernels), {per_step} kernels per step:")
    for i in range(first, nxt + 1):
        name, start, end = events[i]
        gap = start - events[i - 1][2]
        print(f"    {end - start:7.2f} us  gap {gap:5.2f}  {name[:90]}")
    by_cat: dict[str, float] = {}
    for name, start, end in events[: per_step * reps]:
        by_cat[category(name)] = by_cat.get(category(name), 0.0) + (end - start) / reps
    span = (events[per_step - 1][2] - events[0][1]) / 1e3
    print(
        f"  per step: span {span:.3f} ms; kernel time by category (us): "
        + ", ".join(f"{k} {v:.0f}" for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1]))
    )
    del graph


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--steps", type=int, nargs="+", default=[0, 200, 400, 600, 800, 900])
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--profile", action="store_true", help="only one layer's kernel timeline per step")
    ap.add_argument("--whole", action="store_true", help="only the whole batch's step time (A/B runs)")
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy", enforce_eager=True, max_model_len=args.max_model_len)
    runner = llm.engine.runner
    print(f"device: {torch.cuda.get_device_name()}; model {args.model}; torch {torch.__version__}")
    batches = workload_batches(every=100)
    rng = random.Random(0)
    if args.whole:
        print("| step | rows | whole batch ms |\n|---|---|---|")
    elif not args.profile:
        lo, hi = 0, -8  # torch maps priorities outside the device's range to its ends (lower: higher)
        streams = {
            "plain": [torch.cuda.Stream(), torch.cuda.Stream()],
            "a_high": [torch.cuda.Stream(priority=hi), torch.cuda.Stream()],
            "attn_low": [torch.cuda.Stream(priority=lo) for _ in range(2)],
            "main_high": [torch.cuda.Stream(priority=hi) for _ in range(2)],
        }
        print(
            "| step | rows | mean ctx | one ms | halves, 1 stream | 2 streams | 2 streams, A high | small kernels high "
            "| attention takes turns | turns, small kernels high | best gain |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
    for step in args.steps:
        lens = sorted(batches[step // 100], reverse=True)
        st = Step(runner, lens, args.max_model_len, rng)
        if args.whole:
            print(f"| {step} | {len(lens)} | {graph_time(lambda st=st: st.forward(st.whole))[0]:.3f} |", flush=True)
        elif args.profile:
            print(f"step {step}: {len(lens)} rows")
            profile_step(st)
        else:
            times = time_step(st, streams)
            best = min(times[1:])
            cells = " | ".join(f"{t:.3f}" for t in times)
            print(
                f"| {step} | {len(lens)} | {sum(lens) // len(lens)} | {cells} | {1 - best / times[0]:+.1%} |",
                flush=True,
            )
        torch.cuda.empty_cache()
    llm.shutdown()


if __name__ == "__main__":
    main()
