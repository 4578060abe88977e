"""CPU replay: 64 xgrammar matchers on the structured benchmark's schema, random allowed tokens."""
import json, random, sys, time, statistics
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
import torch, xgrammar as xgr
from nanoserve.models.registry import resolve_model
from nanoserve.tokenizer import _load_from
from structured import SCHEMA
tok = _load_from(resolve_model("smollm2-135m"))
V = 49152
info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V, stop_token_ids=[tok.eos_token_id])
comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
g = comp.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 64
rng = random.Random(0)
words = (V + 31) // 32
bm = torch.empty(N, words, dtype=torch.int32)
one = xgr.BatchGrammarMatcher(1)
eos = tok.eos_token_id
def allowed(row):
    b = bm[row].numpy().view("uint32")
    import numpy as np
    bits = np.unpackbits(b.view(np.uint8), bitorder="little")[:V]
    return np.nonzero(bits)[0]
# bias: strongly prefer non-eos / continue: pick uniformly over allowed like temp-1 random weights
ms = [xgr.GrammarMatcher(g) for _ in range(N)]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 256
fills, accepts, single = [], [], []
slow_states = []
for s in range(steps):
    live = [i for i, m in enumerate(ms) if not m.is_terminated()]
    if not live: break
    t = time.perf_counter()
    one.batch_fill_next_token_bitmask([ms[i] for i in live], bm, list(range(len(live))))
    fills.append((time.perf_counter() - t, len(live)))
    # per-matcher fill timing, to find slow states
    if s % 8 == 0:
        for j, i in enumerate(live):
            t = time.perf_counter(); ms[i].fill_next_token_bitmask(bm, j); d = time.perf_counter() - t
            single.append(d)
            if d > 200e-6: slow_states.append((d, tok.decode(hist[i][-6:]) if 'hist' in dir() else ''))
    t = time.perf_counter()
    for j, i in enumerate(live):
        a = allowed(j)
        # choose uniformly among allowed tokens (random weights, temperature 1)
        tkn = int(a[rng.randrange(len(a))])
        assert ms[i].accept_token(tkn)
    accepts.append(time.perf_counter() - t)
fs = [f for f, _ in fills]
print(f"steps {len(fills)}  fill median {statistics.median(fs)*1e6:.0f} us mean {statistics.mean(fs)*1e6:.0f} max {max(fs)*1e6:.0f}")
print(f"single fills median {statistics.median(single)*1e6:.1f} us mean {statistics.mean(single)*1e6:.1f} p99 {sorted(single)[int(len(single)*.99)]*1e6:.0f} max {max(single)*1e6:.0f}")
print("fill per step (every 16):", [round(f*1e6) for f, _ in fills[::16]])
