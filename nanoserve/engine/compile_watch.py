"""Kernels compiled while a process serves: Triton specializations first launched (compiled,
or loaded from the disk cache) and torch.compile graphs.

Each stalls the host for the whole compile (on a cold machine about a second), and every
request in flight waits that long for its next token. The engine's warm-up is meant to leave
none; a `CompileWatch` installed after it says which kernel a workload still reaches cold
(`log=True` logs each compile as it happens; benchmarks read the count around timed runs).
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("nanoserve")


class CompileWatch:
    def __init__(self, log_each: bool = False) -> None:
        self.triton: list[str] = []
        self.log_each = log_each
        self._graphs = self._torch_graphs()
        try:
            from triton import knobs
        except ImportError:  # no Triton (CPU): nothing to watch there
            return
        previous = knobs.runtime.jit_post_compile_hook

        def hook(**kwargs):
            name = kwargs["fn"].name
            self.triton.append(name)
            if self.log_each:
                log.warning(
                    "Triton kernel %s compiled while serving (%s UTC): steps stalled meanwhile",
                    name,
                    time.strftime("%H:%M:%S", time.gmtime()),
                )
            return previous(**kwargs) if previous else None

        knobs.runtime.jit_post_compile_hook = hook

    @staticmethod
    def _torch_graphs() -> int:
        from torch._dynamo.utils import counters

        return counters["stats"]["unique_graphs"]

    def read(self) -> str:
        """What compiled since the last read, as one line."""
        graphs = self._torch_graphs()
        names = ", ".join(sorted(set(self.triton)))
        text = f"{len(self.triton)} Triton ({names or '-'}), {graphs - self._graphs} torch.compile"
        self.triton, self._graphs = [], graphs
        return text
