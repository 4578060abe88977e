"""Compile a sweep's Triton launches before timing them, several at a time (the decode GEMM
probes gemm_decode.py and fp8_decode_sweep.py share it)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext


def precompile(launches: Iterable[tuple[str, Callable[[], object]]], jobs: int) -> None:
    """Run every (label, launch) of `launches`, `jobs` compiles at a time under Triton's
    AsyncCompileMode where it exists (its signature varies across versions), serially
    otherwise. A launch that fails prints its label; the sweep meets the error again when it
    runs that config."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        AsyncCompileMode = None
    start = time.perf_counter()
    parallel = jobs > 1 and AsyncCompileMode is not None
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        mode = nullcontext()
        if parallel:
            try:
                mode = AsyncCompileMode(pool, ignore_errors=True)
            except TypeError:  # older Triton: compile errors raise when the mode exits
                mode = AsyncCompileMode(pool)
        try:
            with mode:
                for label, launch in launches:
                    try:
                        launch()
                    except Exception as exc:  # noqa: BLE001 - a config the compiler rejects
                        print(f"  compile error {label}: {type(exc).__name__}: {str(exc).strip()[:120]}", flush=True)
        except Exception as exc:  # noqa: BLE001 - the rest compile at their first launch
            print(f"  precompile stopped: {type(exc).__name__}: {str(exc).strip()[:120]}", flush=True)
    how = f"{jobs} threads" if parallel else "serially"
    print(f"precompiled in {time.perf_counter() - start:.0f} s ({how})", flush=True)
