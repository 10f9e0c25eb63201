"""``pytest -m gpu``: the tests that need CUDA (skipped elsewhere), with the time the check has left."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from gpucheck.common import Ctx

SECTION = "tests"
ROOT = Path(__file__).resolve().parents[2]


def run(ctx: Ctx) -> None:
    try:
        import pytest  # noqa: F401
    except ImportError:
        ctx.table.add(SECTION, "pytest -m gpu", "not run", "pytest missing: pip install -e '.[test]'")
        return
    timeout = ctx.left()
    if timeout < 60:
        ctx.table.add(SECTION, "pytest -m gpu", "not run", f"{timeout:.0f} s left: run --only tests")
        return
    start = time.perf_counter()
    # only the modules holding gpu-marked tests: collecting the whole suite costs a minute
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())
    command = [sys.executable, "-m", "pytest", "-q", "--tb=short", "--show-capture=no", "-p", "no:cacheprovider", "-m", "gpu", *files]
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        ctx.table.add(SECTION, "pytest -m gpu", "timed out", f"after {timeout:.0f} s: run --only tests")
        return
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-200:]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", summary)}
    value = ", ".join(f"{counts.get(k, 0)} {k}" for k in ("passed", "failed", "skipped"))
    ok = proc.returncode in (0, 5) and not counts.get("failed") and not counts.get("error") and not counts.get("errors")
    ctx.table.add(SECTION, "pytest -m gpu", value, f"{time.perf_counter() - start:.0f} s" + ("" if ok else f"; FAILED (exit {proc.returncode})"))
    if not ok:
        print(proc.stdout[-12000:], proc.stderr[-2000:], sep="\n")
