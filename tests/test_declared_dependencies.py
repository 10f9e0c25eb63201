"""Every module of the installed package imports with only its declared dependencies (a bare install).

``pip install -e . && dscompile demo`` once failed with ``No module named 'numpy'``: the test
environment has numpy (through the test extras), so no test saw it. Building a fresh virtual
environment per test run costs minutes (``.ci/run`` does it for both README commands); here a
subprocess hides every package outside the standard library and the closure of the declared
runtime requirements (``dscompile/testing/declared_imports.py``, run as a file so that the guard is
in place before torch imports numpy) and imports every module.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import dscompile.testing.declared_imports as declared_imports
from dscompile.testing.declared_imports import PACKAGES, allowed_top_level, dependency_closure

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = declared_imports.__file__


def _run(*extra: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, SCRIPT, *extra], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


def test_packages_list_matches_pyproject() -> None:
    tomllib = pytest.importorskip("tomllib")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert sorted(declared) == sorted(PACKAGES)


def test_every_package_folder_is_declared() -> None:
    """A folder with an ``__init__.py`` missing from pyproject's list would be left out of a wheel."""
    folders = {"dscompile": ROOT / "dscompile"} | {f"dscompile.{name}": ROOT / name for name in ("passes", "backends", "kernels")}
    found = set()
    for name, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            relative = init.parent.relative_to(folder).parts
            found.add(".".join((name, *relative)))
    assert sorted(found) == sorted(PACKAGES)


def test_runtime_closure_is_the_declared_one() -> None:
    closure = dependency_closure()
    assert {"torch", "triton", "networkx", "sympy", "numpy"} <= closure
    allowed = allowed_top_level()
    for test_only in ("transformers", "pytest", "hypothesis", "matplotlib", "nbclient"):
        assert test_only not in allowed, test_only


@pytest.mark.slow
def test_every_module_imports_with_declared_dependencies_only() -> None:
    result = _run()
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "imported" in result.stdout and "FAILED" not in result.stdout
    assert "needs the [hf] extra, as declared: dscompile.integrations.huggingface" in result.stdout  # refused by name, not by accident


def test_the_guard_fails_on_an_undeclared_module_level_import(tmp_path: Path) -> None:
    """The check can fail: a module importing a test-only package at module level is refused though it is installed here."""
    pytest.importorskip("hypothesis")
    (tmp_path / "uses_hypothesis.py").write_text("import hypothesis\n")
    (tmp_path / "uses_hypothesis_lazily.py").write_text("def f():\n    import hypothesis\n    return hypothesis\n")
    lazily = _run("uses_hypothesis_lazily", pythonpath=tmp_path)
    assert lazily.returncode == 0, lazily.stdout + lazily.stderr[-3000:]
    eager = _run("uses_hypothesis", pythonpath=tmp_path)
    assert eager.returncode == 1
    assert "FAILED uses_hypothesis: ModuleNotFoundError: No module named 'hypothesis' (not a declared dependency of dscompile)" in eager.stdout
