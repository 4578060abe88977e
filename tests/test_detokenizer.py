"""Incremental detokenization and stop strings, on the embedded model's tokenizer."""

from __future__ import annotations

import random

import pytest

from nanoserve.detokenizer import SampleDetokenizer
from nanoserve.models.registry import resolve_model
from nanoserve.sampling_params import SamplingParams
from nanoserve.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model("smollm2-135m"))


TEXT = "Héllo wörld! 日本語のテキスト, emoji 🤖 and more: 1, 2, 3, 4."


def feed(detok: SampleDetokenizer, ids: list[int], step: int) -> list[str]:
    deltas = [detok.append(ids[i : i + step]) for i in range(0, len(ids), step)]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("step", [1, 3])
def test_deltas_add_up_to_the_full_decode(tok, step):
    prompt = tok.encode("Say something:")
    ids = tok.encode(TEXT)
    detok = SampleDetokenizer(tok, prompt, SamplingParams())
    deltas = feed(detok, ids, step)
    assert "".join(deltas) == detok.text == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)  # never half a UTF-8 character


def test_stop_string_across_tokens_is_cut(tok):
    ids = tok.encode(TEXT)
    for stop in ["wörld", "🤖 and", ", 3", "."]:
        detok = SampleDetokenizer(tok, [], SamplingParams(stop=[stop, "never there"]))
        deltas = feed(detok, ids, 1)
        assert detok.stopped and detok.stop_reason == stop
        assert detok.text == TEXT[: TEXT.index(stop)]
        assert "".join(deltas) == detok.text


def test_text_that_could_start_a_stop_string_is_held_back(tok):
    detok = SampleDetokenizer(tok, [], SamplingParams(stop=["STOP NOW"]))
    shown = detok.append(tok.encode("one two STOP"))
    assert not detok.stopped
    assert "STOP" not in shown and shown.startswith("one")
    assert shown + detok.flush() == "one two STOP"


# ---- the Rust window (tokenizers' DecodeStream) against the Python one -----------------


def run_both(tok, prompt: list[int], ids: list[int], params: SamplingParams, step: int = 1):
    fast, slow = SampleDetokenizer(tok, prompt, params), SampleDetokenizer(tok, prompt, params, fast=False)
    return (feed(fast, ids, step), fast), (feed(slow, ids, step), slow)


def test_smollm2_takes_the_rust_window(tok):
    detok = SampleDetokenizer(tok, tok.encode("Hi"), SamplingParams())
    assert detok._stream is not None
    assert SampleDetokenizer(tok, tok.encode("Hi"), SamplingParams(), fast=False)._stream is None


@pytest.fixture(scope="module")
def partial(tok) -> list[int]:
    """Ids that decode alone to half a character (byte-level pieces of multi-byte UTF-8)."""
    return [i for i in range(len(tok)) if tok.decode([i]) == "\ufffd"][:64]


@pytest.mark.parametrize("skip_special", [True, False])
@pytest.mark.parametrize("step", [1, 3])
def test_rust_and_python_windows_give_the_same_deltas(tok, partial, skip_special, step):
    rng = random.Random(7 + step)
    assert len(partial) >= 16  # the case where a window waits for the rest of a character
    specials = list(tok.all_special_ids)
    params = SamplingParams(skip_special_tokens=skip_special)
    for trial in range(40):
        # Random ids, with half characters and special tokens mixed in, after prompts that
        # sometimes end inside a character themselves.
        pool = [rng.randrange(len(tok)) for _ in range(64)] + partial + specials
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, 80))]
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 8))] + partial[: trial % 3]
        (fast_deltas, fast), (slow_deltas, slow) = run_both(tok, prompt, ids, params, step)
        assert fast_deltas == slow_deltas and fast.text == slow.text, (prompt, ids)
    (fast_deltas, _), (slow_deltas, _) = run_both(tok, tok.encode("Say:"), tok.encode(TEXT), params, step)
    assert fast_deltas == slow_deltas and "".join(fast_deltas) == TEXT


def test_rust_window_stops_where_the_python_one_does(tok):
    ids = tok.encode(TEXT)
    for stop in ["wörld", "🤖 and", ", 3"]:
        (fast_deltas, fast), (slow_deltas, slow) = run_both(tok, [], ids, SamplingParams(stop=[stop]))
        assert fast.stopped and fast.stop_reason == slow.stop_reason == stop and fast_deltas == slow_deltas


class RefusingStream:
    """A DecodeStream that raises from its `after`-th token on (as on a window it rejects)."""

    def __init__(self, inner, after: int):
        self.inner, self.left = inner, after

    def step(self, backend, token):
        self.left -= 1
        if self.left < 0:
            raise RuntimeError("refused")
        return self.inner.step(backend, token)


@pytest.mark.parametrize("after", [0, 1, 7, 30])
def test_a_refused_window_goes_on_in_python(tok, after):
    ids = tok.encode(TEXT)
    detok = SampleDetokenizer(tok, tok.encode("Say:"), SamplingParams())
    detok._stream = RefusingStream(detok._stream, after)
    deltas = feed(detok, ids, 1)
    assert detok._stream is None and "".join(deltas) == detok.text == TEXT
    assert not any("\ufffd" in d for d in deltas)
