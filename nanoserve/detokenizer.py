"""Incremental detokenization and stop strings, for one sample.

Owns: `SampleDetokenizer`. Used by the offline `LLM` and by the API server alike.

Text is produced incrementally: only the tokens since the last stable point are decoded,
and text that ends in an incomplete UTF-8 sequence ("\ufffd") waits for the next token.
Stop strings are searched on the text, so they are found even when they straddle token
boundaries; the output is cut before the first stop string. Until the sample ends, the
last (longest stop string - 1) characters are held back, since they could be the start
of a stop string; `flush()` releases them.
Invariant: the concatenation of everything `append` and `flush` returned == `text`.
"""

from __future__ import annotations

from nanoserve.sampling_params import SamplingParams

# Prompt tokens decoded as context, so the first output token gets its leading space right.
_CONTEXT_TOKENS = 5


class SampleDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.stops = params.stop_strings
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self._shown = 0  # characters of text already returned
        self.stopped = False
        self.stop_reason: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def _new_text(self, token_ids: list[int]) -> str:
        out = []
        for token in token_ids:
            self._ids.append(token)
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._decode(self._ids[self._prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                out.append(full[len(prefix) :])
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._ids)
        return "".join(out)

    def append(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the text that became visible."""
        if self.stopped or not token_ids:
            return ""
        before = len(self.text)
        self.text += self._new_text(token_ids)
        if self.stops:
            search_from = max(0, before - self.hold)
            hits = [(i, s) for s in self.stops if (i := self.text.find(s, search_from)) != -1]
            if hits:
                cut, self.stop_reason = min(hits)
                self.text = self.text[:cut]
                self.stopped = True
                return self.flush()
        visible = max(self._shown, len(self.text) - self.hold)
        delta = self.text[self._shown : visible]
        self._shown = visible
        return delta

    def feed(self, token_ids: list[int]) -> tuple[str, int]:
        """`append` one token at a time, stopping at the token that completes a stop string:
        the visible text and how many of `token_ids` the sample keeps (a step that emitted
        several tokens, as a speculative one does, is cut exactly where one token at a time
        would have been)."""
        parts = []
        for kept, token in enumerate(token_ids, start=1):
            parts.append(self.append([token]))
            if self.stopped:
                return "".join(parts), kept
        return "".join(parts), len(token_ids)

    def flush(self) -> str:
        """The held-back text, when the sample has ended."""
        delta = self.text[self._shown :]
        self._shown = len(self.text)
        return delta
