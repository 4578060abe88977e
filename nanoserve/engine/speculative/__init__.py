"""Speculative decoding: several tokens per target forward, with the target's output unchanged.

Layout (the narrow interface to the engine is `Speculator`, in `step.py`):
- (`SpeculativeConfig`, the settings and their checks, lives in nanoserve/config.py);
- `proposer.py`: what every drafter offers (`Draft`, `DraftContext`, `Proposer`);
- `positions.py`: several positions of a request as rows of one decode batch;
- `ngram.py`: drafts looked up in the request's own tokens and in finished requests' tokens;
- `draft_model.py`: drafts from a small model of the same tokenizer, with its own KV cache
  on the target's pages;
- `eagle3.py`: drafts from an EAGLE-3 head over the target's hidden states;
- `acceptance.py`: the acceptance rule (greedy, and rejection sampling for sampled requests);
- `step.py`: the verify step (one target forward over each request's last token and its
  drafts), per-request back-off, the cost gate, the counters `/metrics` exports, and
  `make_proposer`.
"""
