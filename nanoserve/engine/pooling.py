"""Pooling for embedding models (`EngineConfig.task == "embed"`): a request's result is a vector.

Owns `LastTokenPooling`, the engine's one hook for embeddings. It replaces the model's output
head: the runner projects the final hidden state (after the final norm) of each request
whose prompt ends in this step, and for an embedding model that projection is the
L2-normalization of that state in fp32 (last-token pooling, as Qwen3-Embedding and other
decoder embedders are trained), instead of the LM head's logits. The engine hands those rows
to `finish`, which ends their requests at once.

Invariants:
- An embedding request runs its prompt (in chunks if it is long) and nothing else: it is
  finished ("stop") in the step its last prompt token is computed, with no output token,
  and its pages and slot go back then (the config turns the prefix cache off, so no KV is
  kept after it).
- Its one `StepUpdate` carries the vector (`embedding`, the model's hidden size, unit norm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.outputs import StepUpdate


class LastTokenPooling:
    def __init__(self, model: torch.nn.Module):
        # The runner calls `model.compute_logits(hidden[rows])` on the rows that end a prompt.
        model.compute_logits = self.head

    @staticmethod
    def head(hidden: torch.Tensor) -> torch.Tensor:
        return F.normalize(hidden.float(), p=2.0, dim=-1)

    @staticmethod
    def finish(engine, reqs: list, vectors: torch.Tensor) -> list[StepUpdate]:
        """End `reqs` (the requests whose prompt ended in this step, one row of `vectors`
        each) and report each with its vector."""
        rows = vectors.cpu().tolist()
        updates = []
        for req, vector in zip(reqs, rows, strict=True):
            engine._finish(req, "stop")
            update = engine._update(req)
            update.embedding = vector
            updates.append(update)
        return updates
