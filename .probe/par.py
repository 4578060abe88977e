import json, random, sys, time, statistics, threading
from concurrent.futures import ThreadPoolExecutor
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
import numpy as np, torch, xgrammar as xgr
from nanoserve.models.registry import resolve_model
from nanoserve.tokenizer import _load_from
from structured import SCHEMA
tok = _load_from(resolve_model("smollm2-135m"))
V = 49152
info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V, stop_token_ids=[tok.eos_token_id])
g = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
N = 64
rng = random.Random(0)
bm = torch.empty(N, (V+31)//32, dtype=torch.int32)
ms = [xgr.GrammarMatcher(g) for _ in range(N)]
# walk into varied states
for s in range(40):
    xgr.BatchGrammarMatcher(1).batch_fill_next_token_bitmask(ms, bm, list(range(N)))
    for j, m in enumerate(ms):
        a = np.nonzero(np.unpackbits(bm[j].numpy().view(np.uint8), bitorder="little")[:V])[0]
        m.accept_token(int(a[rng.randrange(len(a))]))
rows = list(range(N))
ones = [xgr.BatchGrammarMatcher(1) for _ in range(5)]
pool = ThreadPoolExecutor(4)
def fill(k):
    if k == 1:
        ones[0].batch_fill_next_token_bitmask(ms, bm, rows); return
    size = (N + k - 1) // k
    chunks = [(ms[i:i+size], rows[i:i+size]) for i in range(0, N, size)]
    futs = [pool.submit(ones[c+1].batch_fill_next_token_bitmask, chunks[c][0], bm, chunks[c][1]) for c in range(1, len(chunks))]
    ones[0].batch_fill_next_token_bitmask(chunks[0][0], bm, chunks[0][1])
    for f in futs: f.result()
ref = bm.clone(); fill(1); ref = bm.clone()
for k in (1, 2, 4):
    bm.zero_(); fill(k); assert torch.equal(bm, ref)
    ts = []
    for _ in range(300):
        t = time.perf_counter(); fill(k); ts.append(time.perf_counter() - t)
    print(k, f"median {statistics.median(ts)*1e6:.0f} us p90 {sorted(ts)[270]*1e6:.0f}")
t = time.perf_counter()
for _ in range(300): [m._debug_print_internal_state() for m in ms]
if torch.cuda.is_available():
    bm = torch.empty(N, (V+31)//32, dtype=torch.int32, pin_memory=True)
    for k in (1, 4):
        ts = []
        for _ in range(300):
            t = time.perf_counter(); fill(k); ts.append(time.perf_counter() - t)
        print("pinned", k, f"median {statistics.median(ts)*1e6:.0f} us")
import threading; print("threads", threading.enumerate())
