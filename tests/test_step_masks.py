"""A step's grammar bitmasks (nanoserve/structured/step_masks.py): which rows, the reused host
buffer, and the device mask's words for constrained and free rows."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from nanoserve.structured.matcher import bitmask_words
from nanoserve.structured.step_masks import StepMasks


def req(constrained: bool, finished: bool = False, needs_mask: bool = True):
    matcher = SimpleNamespace(needs_mask=needs_mask) if constrained else None
    return SimpleNamespace(matcher=matcher, finish_reason="stop" if finished else None)


def test_rows_are_the_live_constrained_ones_and_the_buffer_is_reused():
    masks = StepMasks(torch.device("cpu"))
    reqs = [req(True), req(False), req(True, finished=True), req(True, needs_mask=False), req(True)]
    rows, host = masks.rows(reqs, grammar_vocab_size=70)
    assert rows == [0, 4]
    assert host.dtype == torch.int32 and host.shape[0] >= len(reqs) and host.shape[1] == bitmask_words(70)
    again, same = masks.rows(reqs[:3], grammar_vocab_size=70)
    assert again == [0] and same is host  # no new buffer while it is large enough
    _, bigger = masks.rows([req(True)] * (host.shape[0] + 1), grammar_vocab_size=70)
    assert bigger is not host and bigger.shape[0] > host.shape[0]


def test_device_mask_lets_free_rows_allow_every_id_and_constrained_rows_only_the_grammars():
    masks = StepMasks(torch.device("cpu"))
    grammar_words, vocab = bitmask_words(70), 200  # ids 70.. are past the tokenizer's
    host = torch.arange(4 * grammar_words, dtype=torch.int32).reshape(4, grammar_words) + 1
    assert masks.device_mask(3, [], host, vocab) is None  # nothing constrained: no mask
    every = masks.device_mask(3, [0, 1, 2], host, vocab)
    assert torch.equal(every[:, :grammar_words], host[:3]) and not every[:, grammar_words:].any()
    half = masks.device_mask(3, [1], host, vocab)
    assert half.shape == (3, bitmask_words(vocab))
    assert torch.equal(half[1, :grammar_words], host[1]) and not half[1, grammar_words:].any()
    assert (half[[0, 2]] == -1).all()  # free rows: every bit set
    assert torch.equal(masks.device_mask(3, [1], host, vocab), half)  # the cached per-row word
