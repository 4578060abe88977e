"""Incremental detokenization and stop strings, on the embedded model's tokenizer."""

from __future__ import annotations

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
