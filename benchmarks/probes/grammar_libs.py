"""Compare the grammar libraries nanoserve could build constrained decoding on (CPU).

Measures, with the embedded SmolLM2-135M tokenizer (49,152 words), for xgrammar and
llguidance: compile time of a few grammars cold (a fresh compiler) and cached (the same spec
again), and the per-token time to fill the next-token bitmask while walking a valid output
token by token. Prints one table; the choice and the numbers are in benchmarks/results/2026-11-25.md.

    python benchmarks/probes/grammar_libs.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the repository, and benchmarks/ for shared helpers

import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "level": {"type": "string", "enum": ["low", "mid", "high"]},
        "email": {"type": "string"},
        "notes": {"type": ["string", "null"]},
    },
    "required": ["name", "age", "role", "active", "score", "tags", "address", "level", "email", "notes"],
    "additionalProperties": False,
}
SCHEMA_TEXT = json.dumps(
    {
        "name": "Ada",
        "age": 36,
        "role": "admin",
        "active": True,
        "score": 9.5,
        "tags": ["math", "code"],
        "address": {"city": "London", "zip": "12345"},
        "level": "high",
        "email": "ada@example.com",
        "notes": None,
    }
)
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral"]
EBNF = 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9]+ | "(" expr ")"'
LARK = 'start: expr\nexpr: term ("+" term)*\nterm: /[0-9]+/ | "(" expr ")"'
CASES = {  # name -> (walk text)
    "schema10": SCHEMA_TEXT,
    "json_object": '{"a": [1, 2, {"b": "c"}]}',
    "regex": "555-123-4567",
    "choice": "neutral",
    "ebnf": "(1+2)+34",
}


def _tokenizer():
    from nanoserve.models.registry import resolve_model
    from nanoserve.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model("smollm2-135m"))


def _ms(f, repeat=1):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = f()
        times.append((time.perf_counter() - t) * 1e3)
    return out, min(times)


def bench_xgrammar(tok, vocab):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[tok.eos_token_id])
    specs = {
        "schema10": lambda c: c.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False),
        "json_object": lambda c: c.compile_builtin_json_grammar(),
        "regex": lambda c: c.compile_regex(REGEX),
        "choice": lambda c: c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in CHOICES)),
        "ebnf": lambda c: c.compile_grammar(EBNF),
    }
    rows = {}
    for name, make in specs.items():
        _, cold = _ms(lambda: make(xgr.GrammarCompiler(info, max_threads=1)))  # noqa: B023
        comp = xgr.GrammarCompiler(info, max_threads=1)
        compiled = make(comp)
        _, cached = _ms(lambda: make(comp), repeat=5)  # noqa: B023
        matcher = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, vocab)
        fills = []
        for t in tok.encode(CASES[name], add_special_tokens=False) + [tok.eos_token_id]:
            s = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            fills.append((time.perf_counter() - s) * 1e6)
            assert matcher.accept_token(t), (name, t)
        assert matcher.is_terminated()
        rows[name] = (cold, cached, statistics.median(fills), max(fills))
    return rows


def bench_llguidance(tok, vocab):
    import llguidance as llg
    import llguidance.hf
    import llguidance.torch as llt

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    specs = {
        "schema10": lambda: llg.LLMatcher.grammar_from_json_schema(SCHEMA),
        "json_object": lambda: llg.LLMatcher.grammar_from_json_schema({"type": "object"}),
        "regex": lambda: llg.LLMatcher.grammar_from_regex(REGEX),
        "choice": lambda: llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(x) for x in CHOICES)),
        "ebnf": lambda: llg.LLMatcher.grammar_from_lark(LARK),
    }
    rows = {}
    for name, make in specs.items():
        grammar = make()
        # llguidance has no separate compile step: the matcher builds its parser lazily; we
        # time construction plus the first mask (what a request pays before its first token).
        mask = llt.allocate_token_bitmask(1, vocab)

        def first():
            m = llg.LLMatcher(lltok, grammar)  # noqa: B023
            llt.fill_next_token_bitmask(m, mask, 0)  # noqa: B023
            return m

        _, cold = _ms(first)
        _, cached = _ms(first, repeat=5)
        matcher = llg.LLMatcher(lltok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        fills = []
        for t in tok.encode(CASES[name], add_special_tokens=False) + [tok.eos_token_id]:
            s = time.perf_counter()
            llt.fill_next_token_bitmask(matcher, mask, 0)
            fills.append((time.perf_counter() - s) * 1e6)
            assert matcher.consume_token(t), (name, t, matcher.get_error())
        rows[name] = (cold, cached, statistics.median(fills), max(fills))
    return rows


def main() -> None:
    tok = _tokenizer()
    vocab = 49152
    for lib, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        print(f"{lib}: grammar | compile cold ms | compile cached ms | mask fill median us | max us")
        for name, (cold, cached, med, worst) in fn(tok, vocab).items():
            print(f"  {name:11s} | {cold:9.2f} | {cached:8.3f} | {med:8.1f} | {worst:8.1f}")


if __name__ == "__main__":
    main()
