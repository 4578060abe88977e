"""How many threads xgrammar's batch mask fill should use (CPU only; run it on the host that
serves, since the answer depends on its cores).

Walks --rows matchers token by token through random valid outputs of benchmarks/structured.py's
schemas (with and without `maxLength` strings) over SmolLM2-135M's tokenizer, and times per
step: the batch fill (`BatchGrammarMatcher(max_threads=T)`) for each T, the fill one matcher at
a time, and accepting the step's tokens one at a time and in a batch. Prints one line per
(schema, rows, method): median and mean ms per step.

    python benchmarks/probes/mask_fill_threads.py [--rows 16 64 128] [--steps 48] [--tokenizer DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the repository, and benchmarks/ for shared helpers

import argparse
import json
import os
import random
import statistics
import time

import numpy as np
import torch
import xgrammar as xgr
from structured import SCHEMAS

from nanoserve.models.registry import resolve_model
from nanoserve.tokenizer import load_tokenizer


def allowed_ids(row: torch.Tensor, vocab: int) -> np.ndarray:
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab])


def walks(compiled, rows: int, steps: int, vocab: int, words: int, seed: int) -> list[list[int]]:
    """`rows` random valid token sequences of `steps` tokens (the grammar never ends early:
    stop tokens are avoided while others are allowed)."""
    rng = random.Random(seed)
    mask = torch.empty(1, words, dtype=torch.int32)
    out = []
    for _ in range(rows):
        m, seq = xgr.GrammarMatcher(compiled), []
        for _ in range(steps):
            m.fill_next_token_bitmask(mask, 0)
            ids = allowed_ids(mask[0], vocab)
            if len(ids) == 0:
                break
            token = int(ids[rng.randrange(len(ids))])
            assert m.accept_token(token)
            seq.append(token)
        out.append(seq)
    return out


def measure(compiled, seqs: list[list[int]], length: int, words: int, threads: list[str]) -> dict[str, list[float]]:
    """Seconds per step of each method, walking fresh matchers along `seqs`."""
    rows = len(seqs)
    mask = torch.empty(rows, words, dtype=torch.int32)
    batches = {t: xgr.BatchGrammarMatcher(int(t) if t != "auto" else "auto") for t in threads}
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    times: dict[str, list[float]] = {}

    def timed(key, fn, *fn_args):
        started = time.perf_counter()
        fn(*fn_args)
        times.setdefault(key, []).append(time.perf_counter() - started)

    def fill_each():
        for r, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, r)

    def accept_each(tokens):
        for m, x in zip(matchers, tokens):
            m.accept_token(x)

    for i in range(length):
        for t, b in batches.items():
            timed(f"batch fill, {t} threads", b.batch_fill_next_token_bitmask, matchers, mask)
        timed("fill one at a time", fill_each)
        tokens = [s[i] for s in seqs]
        if i % 2:  # the two accepts alternate (each step's tokens are accepted once)
            timed("accept one at a time", accept_each, tokens)
        else:
            timed("accept batch", xgr.BatchGrammarMatcher.batch_accept_token, matchers, tokens)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--threads", nargs="+", default=["1", "2", "4", "8", "auto"])
    ap.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: the embedded SmolLM2's)")
    args = ap.parse_args()
    if args.tokenizer is None:
        tok = load_tokenizer(resolve_model("smollm2-135m"))
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = len(tok)
    words = (vocab + 31) // 32
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info)
    print(f"host: {os.cpu_count()} CPUs; vocabulary {vocab}")
    for label, schema in SCHEMAS.items():
        compiled = compiler.compile_json_schema(json.dumps(schema))
        for rows in args.rows:
            seqs = walks(compiled, rows, args.steps, vocab, words, seed=rows)
            length = min(len(s) for s in seqs)
            times = measure(compiled, seqs, length, words, args.threads)
            for key, v in times.items():
                print(
                    f"schema{label or ' plain'}, {rows:4d} rows, {length} steps: {key:26s} "
                    f"median {statistics.median(v) * 1e3:7.3f} ms, mean {statistics.mean(v) * 1e3:7.3f} ms"
                )


if __name__ == "__main__":
    main()
