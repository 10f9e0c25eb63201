"""Import modules as a bare install would: only the standard library and declared dependencies.

``python path/to/declared_imports.py [extra_module ...]`` (run as a file, not with ``-m``: importing
the ``dscompile`` package would import torch, and torch numpy where it is installed, before the
guard is in place) installs an import guard that
refuses every top-level module outside the standard library, dscompile itself and the installed
closure of dscompile's declared runtime requirements (their own requirements included, extras
excluded), then imports every module of every package in ``PACKAGES`` (pyproject's
``[tool.setuptools] packages``; a test keeps the two equal) plus the extra modules named on the
command line. It prints one line per module that failed and exits 1 if any
did. A test-extras environment has transformers, hypothesis and pytest installed; the guard makes
them invisible, so a module-level ``import transformers`` fails here exactly as it would after a
bare ``pip install dscompile``. Optional imports inside ``try: ... except ImportError`` (torch has
several) see what a bare install would see.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata as metadata
import pkgutil
import re
import sys
from collections.abc import Iterable, Sequence

PACKAGES = (
    "dscompile",
    "dscompile.engines",
    "dscompile.planner",
    "dscompile.runtime",
    "dscompile.runtime.onebit",
    "dscompile.runtime.compression",
    "dscompile.compression",
    "dscompile.runtime.offload",
    "dscompile.runtime.zero",
    "dscompile.runtime.inference",
    "dscompile.moe",
    "dscompile.ops",
    "dscompile.sequence",
    "dscompile.module_inject",
    "dscompile.utils",
    "dscompile.testing",
    "dscompile.zoo",
    "dscompile.integrations",
    "dscompile.passes",
    "dscompile.passes.tensor_parallel",
    "dscompile.passes.checkpointing",
    "dscompile.passes.mixed_precision",
    "dscompile.passes.pipeline_split",
    "dscompile.backends",
    "dscompile.backends.triton",
    "dscompile.kernels",
)

NEEDS_EXTRA = {"dscompile.integrations.huggingface": "hf"}
"""Modules that bring another library's integration: a bare install must refuse them with an ImportError that
names the extra to install (``pip install 'dscompile[hf]'``), not with a bare ``No module named``."""


def _requirement_names(dist: metadata.Distribution) -> list[str]:
    """Names of a distribution's unconditional requirements (``; extra == ...`` ones left out)."""
    names = []
    for line in dist.requires or []:
        requirement, _, marker = line.partition(";")
        if "extra" in marker:
            continue
        if marker.strip() and not _marker_holds(marker):
            continue
        match = re.match(r"\s*([A-Za-z0-9_.\-]+)", requirement)
        if match:
            names.append(match.group(1))
    return names


def _marker_holds(marker: str) -> bool:
    """Evaluate a simple environment marker (python_version, sys_platform, platform_system...)."""
    try:
        from packaging.markers import Marker  # present wherever pip is; absent: assume it holds
    except ImportError:
        return True
    return Marker(marker.strip()).evaluate({"extra": ""})


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dependency_closure(root: str = "dscompile") -> set[str]:
    """Normalised names of ``root``'s installed runtime requirements, transitively."""
    seen: set[str] = set()
    todo = list(_requirement_names(metadata.distribution(root)))
    while todo:
        name = _normal(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            todo.extend(_requirement_names(metadata.distribution(name)))
        except metadata.PackageNotFoundError:
            continue  # a declared requirement that is not installed fails at import, as it should
    return seen


def allowed_top_level(root: str = "dscompile") -> set[str]:
    """Top-level import names a bare install of ``root`` provides."""
    closure = dependency_closure(root)
    allowed = set(sys.stdlib_module_names) | set(sys.builtin_module_names) | {root, "__main__"}
    for module, dists in metadata.packages_distributions().items():
        if any(_normal(d) in closure for d in dists):
            allowed.add(module)
    return allowed


def _in_stdlib_dirs(name: str) -> bool:
    """Private stdlib modules missing from ``sys.stdlib_module_names`` (``_sysconfigdata_*``)."""
    import importlib.machinery
    import os
    import sysconfig

    dirs = {sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")}
    dirs |= {os.path.join(d, "lib-dynload") for d in list(dirs)}
    return importlib.machinery.PathFinder.find_spec(name, sorted(d for d in dirs if d)) is not None


class DeclaredOnly(importlib.abc.MetaPathFinder):
    """Refuse top-level modules outside ``allowed``; remember what was refused."""

    def __init__(self, allowed: Iterable[str]) -> None:
        self.allowed = set(allowed)
        self.refused: set[str] = set()

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        top = fullname.partition(".")[0]
        if top not in self.allowed and not _in_stdlib_dirs(top):
            self.refused.add(top)
            raise ModuleNotFoundError(f"No module named {fullname!r} (not a declared dependency of dscompile)", name=fullname)
        return None


def package_modules(packages: Sequence[str] = PACKAGES) -> list[str]:
    """Every module of the given packages (imports each package to find its files)."""
    modules = []
    for package in packages:
        modules.append(package)
        imported = importlib.import_module(package)
        modules.extend(f"{package}.{info.name}" for info in pkgutil.iter_modules(imported.__path__) if not info.ispkg)
    return modules


def install_guard() -> DeclaredOnly:
    """Put the guard first on ``sys.meta_path``; modules already imported stay importable, so call it first."""
    leaked = sorted(m for m in ("transformers", "hypothesis", "pytest") if m in sys.modules)
    if leaked:
        raise RuntimeError(f"install the guard before anything imports {leaked}: run this file as a script")
    guard = DeclaredOnly(allowed_top_level())
    sys.meta_path.insert(0, guard)
    return guard


def main(argv: Sequence[str] | None = None) -> int:
    extra = list(sys.argv[1:] if argv is None else argv)
    guard = install_guard()
    guard.allowed |= {name.partition(".")[0] for name in extra}  # the modules under test themselves
    failures = []
    try:
        modules = package_modules()
    except Exception as exc:  # a package __init__ itself failing
        print(f"FAILED package import: {type(exc).__name__}: {exc}")
        return 1
    for name in [*modules, *extra]:
        try:
            importlib.import_module(name)
        except Exception as exc:
            extra = NEEDS_EXTRA.get(name)
            if extra is not None and isinstance(exc, ImportError) and f"dscompile[{extra}]" in str(exc):
                print(f"needs the [{extra}] extra, as declared: {name}: {exc}")
                continue
            failures.append(name)
            print(f"FAILED {name}: {type(exc).__name__}: {exc}")
    total = len(modules) + len(extra)
    print(f"imported {total - len(failures)} of {total} modules; refused (possibly inside try/except): {sorted(guard.refused)}")
    return 1 if failures else 0


if __name__ == "__main__":
    if sys.path and sys.path[0] and __file__.startswith(sys.path[0]):
        sys.path.pop(0)  # this file's folder is no place to import the package's modules from
    sys.exit(main())
