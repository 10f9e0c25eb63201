"""Where measured partitions go: ``ctx.analysis["checkpointing"]``, ``checkpoint_reports()``, the dump's
``<graph>/checkpointing.json`` and the log; and the warnings said once per process."""

from __future__ import annotations

import collections
import json
import logging
from pathlib import Path
from typing import Any

from dscompile.passes.checkpointing.config import CheckpointOptions
from dscompile.pipeline import PassContext

log = logging.getLogger("dscompile.passes.checkpoint")

_REPORTS: collections.deque[dict[str, Any]] = collections.deque(maxlen=256)
_LOGGED_ONCE: set[str] = set()


def checkpoint_reports() -> list[dict[str, Any]]:
    """The measured report of every graph partitioned by this pass, oldest first (for tests, benchmarks, notebooks)."""
    return list(_REPORTS)


def clear_reports() -> None:
    _REPORTS.clear()


def _log_once(key: str, message: str, *args: Any) -> None:
    if key not in _LOGGED_ONCE:
        _LOGGED_ONCE.add(key)
        log.warning(message, *args)


def _record(ctx: PassContext, report: dict[str, Any], options: CheckpointOptions) -> None:
    ctx.analysis.setdefault("checkpointing", {})[ctx.graph_name] = report
    _REPORTS.append(report)
    dump = getattr(ctx.config, "dump", None)
    if dump:
        directory = Path(dump) / ctx.graph_name
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "checkpointing.json").write_text(json.dumps(report, indent=2, default=str))
    level = logging.INFO if options.profile else logging.DEBUG
    log.log(level, "%s: policy %s saves %d bytes (baseline %s), recomputes %d FLOPs", ctx.graph_name, report["policy"],
            report["saved_bytes"], report.get("baseline_saved_bytes", "-"), report["recompute_flops"])
