"""Incremental detokenization and stop strings, for one sample.

Owns: `SampleDetokenizer`. Used by the offline `LLM` and by the API server alike.

Text is produced incrementally: only the tokens since the last stable point are decoded,
and text that ends in an incomplete UTF-8 sequence ("\ufffd") waits for the next token.
Where the tokenizer's decode is its Rust backend's unchanged (no clean-up of spaces), the
`tokenizers` library's DecodeStream runs that window in Rust (~1.7 against ~12 us a token
on SmolLM2's vocabulary: a 64 x 256 batch detokenized in 28 ms instead of 170-250); the
Python window is its slow twin, and tests/test_detokenizer.py holds both to the same text.
Stop strings are searched on the text, so they are found even when they straddle token
boundaries; the output is cut before the first stop string. Until the sample ends, the
last (longest stop string - 1) characters are held back, since they could be the start
of a stop string; `flush()` releases them.
Invariant: the concatenation of everything `append` and `flush` returned == `text`.
"""

from __future__ import annotations

from nanoserve.sampling_params import SamplingParams

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers before 0.21
    DecodeStream = None

# Prompt tokens decoded as context, so the first output token gets its leading space right.
_CONTEXT_TOKENS = 5


def stream_backend(tokenizer):
    """The Rust tokenizer behind a transformers tokenizer whose decode returns that
    tokenizer's decode unchanged, else None. transformers cleans up spaces after decoding
    only where `clean_up_tokenization_spaces` is set, and never for BPE models unless forced."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if DecodeStream is None or backend is None:
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        if type(backend.model).__name__ != "BPE" or forced:
            return None
    return backend


class SampleDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams, fast: bool = True):
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
        self._backend = stream_backend(tokenizer) if fast else None
        self._stream = None
        # A context that ends inside a character would be re-emitted by the stream with the
        # first output token; the Python window starts after it (rare: the slow twin runs).
        if self._backend is not None and not (self._ids and self._decode(self._ids).endswith("\ufffd")):
            self._stream = DecodeStream(skip_special_tokens=self.skip_special)
            for token in self._ids:  # the context: its text is not output
                self._stream.step(self._backend, token)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def _new_text(self, token_ids: list[int]) -> str:
        out = []
        for token in token_ids:
            self._ids.append(token)
            if self._stream is not None:
                try:
                    piece = self._stream.step(self._backend, token)
                except Exception:  # noqa: BLE001 -- a window the stream refuses: the Python one goes on from the last text
                    self._stream = None
                    self._prefix_offset = max(0, self._read_offset - _CONTEXT_TOKENS)
                else:
                    if piece:
                        out.append(piece)
                        self._read_offset = len(self._ids)
                    continue
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
