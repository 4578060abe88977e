"""compile_watch: the engine's post-warm-up compile log and the benchmarks' compile count share
Triton's one post-compile hook (called here by hand: the interpreter compiles nothing)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

knobs = pytest.importorskip("triton").knobs

from nanoserve.engine import compile_watch


@pytest.fixture
def restore_hook():
    saved_hook, saved_state = knobs.runtime.jit_post_compile_hook, dict(compile_watch._logging)
    yield
    knobs.runtime.jit_post_compile_hook = saved_hook
    compile_watch._logging.update(saved_state)


def compile_kernel(name: str) -> None:
    knobs.runtime.jit_post_compile_hook(fn=SimpleNamespace(name=name))


def test_logged_only_while_on_and_counted_by_every_watch(restore_hook, caplog):
    knobs.runtime.jit_post_compile_hook = None
    compile_watch._logging.update(on=False, hooked=False)
    watch = compile_watch.CompileWatch()
    compile_watch.log_compiles(True)
    later = compile_watch.CompileWatch()  # chained after the log: both see every compile
    with caplog.at_level(logging.WARNING, logger="nanoserve"):
        compile_kernel("_first_kernel")
        compile_watch.log_compiles(False)  # a second engine building
        compile_kernel("_second_kernel")
        compile_watch.log_compiles(True)  # installs no second hook
        compile_kernel("_third_kernel")
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2 and "_first_kernel" in logged[0] and "_third_kernel" in logged[1]
    assert watch.read().startswith("3 Triton (_first_kernel, _second_kernel, _third_kernel)")
    assert later.read().startswith("3 Triton") and watch.read().startswith("0 Triton (-)")
