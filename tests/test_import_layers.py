"""Imports point down the layers (DESIGN.md), function-level imports included, and no modules import each other.

Layers, bottom first: 1 ``kernels/``; 2 the core of ``dscompile/`` (``CORE``); 3 ``dscompile/runtime/``;
4 ``passes/`` and ``backends/``; 5 the entry points (engines, frontend, CLI, the DeepSpeed-compatible modules,
everything else in ``dscompile/``). The registry (``dscompile.pipeline``) loads the pass and backend packages by
name, which is how the core reaches them without importing up. Imports under ``if TYPE_CHECKING:`` never run
and are not counted.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
TOP_FOLDERS = {"dscompile": "dscompile", "passes": "dscompile.passes", "backends": "dscompile.backends", "kernels": "dscompile.kernels"}
CORE = {"errors", "config", "graph", "cost", "planner", "pipeline", "sparsity", "deepspeed_config"}
# DeepSpeed's ``deepspeed.runtime.*`` import paths: thin re-exports that must sit under dscompile/runtime/ for
# ``import dscompile as deepspeed`` to find them. They are entry points (layer 5), whatever their folder.
DEEPSPEED_RUNTIME_PATHS = ("dscompile.runtime.utils", "dscompile.runtime.lr_schedules", "dscompile.runtime.zero")
LAYER_NAMES = {1: "kernels", 2: "core", 3: "runtime", 4: "passes/backends", 5: "entry points"}

# Import cycles that remain, each to be broken by splitting the modules along their jobs (issue 34). The list may
# only shrink: a cycle not listed fails, and so does a listed one that is gone (take it off the list). Empty now:
# the last one (the checkpoint formats) was broken by runtime/checkpoint_formats.py sitting above every format.
KNOWN_CYCLES: set[frozenset[str]] = set()


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    in_function: bool


@functools.cache
def module_files() -> dict[str, Path]:
    modules = {}
    for folder, package in TOP_FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [package, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _in_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return True
    return False


def import_edges(modules: dict[str, Path]) -> list[Edge]:
    """Every import of one of ``modules`` by another: ``from pkg import sub`` counts as importing ``pkg.sub``."""
    edges = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
                targets = submodules + ([base] if len(submodules) < len(node.names) else [])
            else:
                continue
            if _under_type_checking(node, parents):
                continue
            edges += [Edge(name, t, node.lineno, _in_function(node, parents)) for t in targets if t in modules and t != name]
    return edges


def layer(module: str) -> int:
    parts = module.split(".")
    if module == "dscompile" or any(module == p or module.startswith(p + ".") for p in DEEPSPEED_RUNTIME_PATHS):
        return 5
    if parts[1] == "kernels":
        return 1
    if parts[1] in CORE:  # a core module, or a module of a core package (dscompile/planner/)
        return 2
    if parts[1] == "runtime":
        return 3
    if parts[1] in ("passes", "backends"):
        return 4
    return 5


@functools.cache
def all_edges() -> tuple[Edge, ...]:
    return tuple(import_edges(module_files()))


def test_the_parser_sees_function_level_imports() -> None:
    """The edges this test rests on: function-level imports are counted (fusion imports its epilogue fold lazily)."""
    edges = all_edges()
    assert any(e.in_function for e in edges)
    assert any(e.source == "dscompile.passes.fusion" and e.target == "dscompile.passes.matmul_epilogue_fold" and e.in_function for e in edges)
    assert layer("dscompile.kernels.layout_cache") == 1 and layer("dscompile.config") == 2 and layer("dscompile.runtime.zero_ops") == 3
    assert layer("dscompile.passes.zero") == 4 and layer("dscompile.engines.training") == 5 and layer("dscompile.zero") == 5
    assert layer("dscompile.runtime.zero.partition_parameters") == 5 and layer("dscompile.runtime.zero_shard") == 3
    assert layer("dscompile.planner") == 2 and layer("dscompile.planner.zero_schedule") == 2


def test_imports_only_point_down_the_layers() -> None:
    upward = [e for e in all_edges() if layer(e.target) > layer(e.source)]
    lines = [
        f"{e.source} (line {e.line}{', in a function' if e.in_function else ''}, {LAYER_NAMES[layer(e.source)]}) imports "
        f"{e.target} ({LAYER_NAMES[layer(e.target)]})"
        for e in upward
    ]
    assert not lines, "imports reaching up the layers (DESIGN.md):\n" + "\n".join(lines)


def test_no_new_import_cycles() -> None:
    graph = nx.DiGraph((e.source, e.target) for e in all_edges())
    cycles = {frozenset(c) for c in nx.strongly_connected_components(graph) if len(c) > 1}
    new = [sorted(c) for c in cycles - KNOWN_CYCLES]
    gone = [sorted(c) for c in KNOWN_CYCLES - cycles]
    assert not new, f"modules that import each other: {new}"
    assert not gone, f"cycles broken: take them off KNOWN_CYCLES: {gone}"


def test_backends_never_import_passes() -> None:
    """A backend reads what passes left in node metadata (DESIGN.md); the passes it compiles the output of are named
    in its ``register_lowering(required_passes=...)`` and run by the frontend through the registry."""
    edges = [e for e in all_edges() if e.source.startswith("dscompile.backends.") and e.target.startswith("dscompile.passes")]
    reaching = [f"{e.source} (line {e.line}) imports {e.target}" for e in edges]
    assert not reaching, "backends importing passes:\n" + "\n".join(reaching)
