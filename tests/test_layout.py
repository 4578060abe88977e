"""The codebase's shape: the kernels floor imports nothing above it, no import circles between
modules or subpackages, and every NANOSERVE_* variable is read in nanoserve/switches.py only."""

from __future__ import annotations

import ast
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from nanoserve.switches import KernelSwitches, declared_names, log_nondefault, warn_unknown

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nanoserve"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """nanoserve modules `path` imports anywhere in its body (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import mod` imports pkg and, where it is a module, pkg.mod
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in known}
    return found


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    known = set(modules)
    # a package's __init__ is what `import nanoserve.x` runs; leave the root package out: it
    # is imported with everything and imports only leaf modules (outputs, sampling_params)
    return {m: imported_modules(p, known) - {m, "nanoserve"} for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def subpackage(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_import_circles_between_modules():
    assert cycles(import_graph()) == []


def test_no_import_circles_between_subpackages():
    graph: dict[str, set[str]] = {}
    for m, deps in import_graph().items():
        graph.setdefault(subpackage(m), set()).update(subpackage(d) for d in deps if subpackage(d) != subpackage(m))
    assert cycles(graph) == []


def test_cycle_finder_finds_a_planted_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_kernels_import_nothing_above_them():
    graph = import_graph()
    for module, deps in graph.items():
        if module.startswith("nanoserve.kernels"):
            above = sorted(d for d in deps if not d.startswith("nanoserve.kernels"))
            assert above == [], f"{module} imports {above}"


def test_importing_the_kernels_loads_no_other_subpackage():
    code = (
        "import sys, nanoserve.kernels, nanoserve.kernels.attention, nanoserve.kernels.linear, "
        "nanoserve.kernels.sampling, nanoserve.kernels.all_reduce, nanoserve.kernels.rotary\n"
        "print(sorted(m for m in sys.modules if m.startswith('nanoserve')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    loaded = eval(out.stdout.strip().splitlines()[-1])  # a list literal printed by the child
    # nanoserve/__init__ brings its two leaf modules (the offline API's types); nothing else
    allowed = {"nanoserve", "nanoserve.outputs", "nanoserve.sampling_params"}
    assert [m for m in loaded if m not in allowed and not m.startswith("nanoserve.kernels")] == []


def environment_reads(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every string constant naming a NANOSERVE_* variable outside docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.startswith("NANOSERVE_")
        and id(node) not in docstrings
    ]


def test_switches_are_read_in_one_module_only():
    offenders = {
        str(p.relative_to(ROOT)): reads
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.name != "switches.py" and (reads := environment_reads(p))
    }
    assert offenders == {}


def test_environment_read_finder_sees_a_read(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""NANOSERVE_IN_A_DOCSTRING is fine."""\nimport os\nX = os.environ.get("NANOSERVE_PDL")\n')
    assert environment_reads(planted) == [(3, "NANOSERVE_PDL")]


def test_switches_from_environment():
    assert KernelSwitches.from_env({}) == KernelSwitches()
    s = KernelSwitches.from_env(
        {"NANOSERVE_PDL": "0", "NANOSERVE_SYMM_PROTOCOL": "LL", "NANOSERVE_SYMM_MEM_MAX_BYTES": "1024", "PATH": "/x"}
    )
    assert (s.pdl, s.symm_protocol, s.symm_mem_max_bytes) == (False, "ll", 1024)
    assert s.nondefault() == {
        "NANOSERVE_PDL": False,
        "NANOSERVE_SYMM_PROTOCOL": "ll",
        "NANOSERVE_SYMM_MEM_MAX_BYTES": 1024,
    }
    for bad in ({"NANOSERVE_PDL": "maybe"}, {"NANOSERVE_SYMM_PROTOCOL": "push"}, {"NANOSERVE_TP_TEARDOWN": "x"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            KernelSwitches.from_env(bad)


def test_unknown_variable_warned_and_nondefault_logged_once(caplog):
    with caplog.at_level(logging.INFO, logger="nanoserve.switches"):
        assert warn_unknown({"NANOSERVE_TRITON_OPZ": "0", "NANOSERVE_PDL": "0"}) == ["NANOSERVE_TRITON_OPZ"]
        switches = KernelSwitches(triton_silu=False, tp_teardown="destroy")
        log_nondefault(switches)
        log_nondefault(switches)
    assert "NANOSERVE_TRITON_OPZ" in caplog.text
    assert caplog.text.count("NANOSERVE_TRITON_SILU=False") == 1 and "NANOSERVE_TP_TEARDOWN=destroy" in caplog.text
    assert "NANOSERVE_PDL" in declared_names()


def test_engine_config_carries_the_switches(monkeypatch):
    from nanoserve.config import EngineConfig

    monkeypatch.setenv("NANOSERVE_TRITON_OPS", "0")
    assert EngineConfig().switches.triton_ops is False
    assert EngineConfig(switches=KernelSwitches()).switches.triton_ops is True
