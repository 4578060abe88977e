"""Kernels compiled while a process serves: Triton specializations first launched (compiled,
or loaded from the disk cache) and torch.compile graphs.

Each stalls the host for the whole compile (on a cold machine about a second), and every
request in flight waits that long for its next token. The engine's warm-up is meant to leave
none: it calls `log_compiles(False)` as it starts building and `log_compiles(True)` once warm,
so each Triton compile after that is logged with the kernel's name (the hook is process-wide,
so a second engine built in the same process silences it while it builds). Benchmarks count
compiles around their timed runs with a `CompileWatch`.
"""

from __future__ import annotations

import logging

log = logging.getLogger("nanoserve")


def _on_triton_compile(callback) -> bool:
    """Chain `callback(name)` into Triton's post-compile hook; False without Triton (CPU)."""
    try:
        from triton import knobs
    except ImportError:
        return False
    previous = knobs.runtime.jit_post_compile_hook

    def hook(**kwargs):
        callback(kwargs["fn"].name)
        return previous(**kwargs) if previous else None

    knobs.runtime.jit_post_compile_hook = hook
    return True


_logging = {"on": False, "hooked": False}


def log_compiles(on: bool) -> None:
    """Log every Triton compile from now on (True) or stop (False)."""
    if on and not _logging["hooked"]:
        _logging["hooked"] = _on_triton_compile(_log_one)
    _logging["on"] = on


def _log_one(name: str) -> None:
    if _logging["on"]:
        log.warning("Triton kernel %s compiled after the warm-up: steps stalled meanwhile", name)


class CompileWatch:
    """Counts what compiles from its creation on; `read` reports and restarts the count."""

    def __init__(self) -> None:
        self.triton: list[str] = []
        self._graphs = self._torch_graphs()
        _on_triton_compile(self.triton.append)

    @staticmethod
    def _torch_graphs() -> int:
        from torch._dynamo.utils import counters

        return counters["stats"]["unique_graphs"]

    def read(self) -> str:
        """What compiled since the last read, as one line."""
        graphs = self._torch_graphs()
        names = ", ".join(sorted(set(self.triton)))
        text = f"{len(self.triton)} Triton ({names or '-'}), {graphs - self._graphs} torch.compile"
        self.triton.clear()
        self._graphs = graphs
        return text
