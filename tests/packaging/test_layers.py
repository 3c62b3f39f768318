"""The package's shape (docs/architecture.md): its layers import in one direction only, no module
imports itself back through others, the product never imports its lab, and the stream loop
reaches the routing decision in a few hops. `lint-imports` reads the contracts from
pyproject.toml; grimp is the import graph it builds on."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp

from tests.support.configs import ROOT

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root, capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )


def test_the_layer_contracts_hold():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    """The check can fail: a copy of the tree where a leaf imports the top."""
    for name in ("extproc", "irislab"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    metrics = tmp_path / "extproc" / "metrics.py"
    metrics.write_text(metrics.read_text() + "\nfrom extproc import cli  # noqa: E402, F401\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "extproc.metrics -> extproc.cli" in result.stdout


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the import cycles of `edges` (components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in edges[module]:
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return cycles


def test_no_module_imports_itself_back():
    graph = grimp.build_graph("extproc", cache_dir=None)
    edges = {module: set(graph.find_modules_directly_imported_by(module)) & graph.modules for module in graph.modules}
    assert strongly_connected(edges) == []
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]  # the check finds one


def test_the_stream_loop_reaches_the_decision_in_at_most_four_hops():
    graph = grimp.build_graph("extproc", cache_dir=None)
    chain = graph.find_shortest_chain(importer="extproc.protocol.stream", imported="extproc.routing.router")
    assert chain is not None and len(chain) - 1 <= 4, chain
