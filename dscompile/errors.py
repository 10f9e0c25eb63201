"""The exceptions dscompile raises, so callers can tell user mistakes from bugs."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class DSCompileError(RuntimeError):
    """Base class of every error dscompile raises on purpose."""


class DSCompileConfigError(DSCompileError, ValueError):
    """A config key, value or combination that dscompile cannot honour.

    The message always names the offending key (as a dotted path) and says how to fix it.
    """

    def __init__(self, key: str, problem: str, fix: str | None = None) -> None:
        self.key = key
        self.problem = problem
        self.fix = fix
        message = f"config key '{key}': {problem}"
        if fix:
            message += f" ({fix})"
        super().__init__(message)


class DSCompileNotSupportedError(DSCompileConfigError):
    """A DeepSpeed key for a capability dscompile has not built yet: refused, never ignored."""

    def __init__(self, key: str, capability: str, fix: str = "remove the key or disable it; see the feature table in README.md") -> None:
        super().__init__(key, f"{capability} is not supported yet by dscompile", fix)


class DSCompilePassError(DSCompileError):
    """A pass produced an invalid graph; the message names the pass and the node."""


class DSCompilePipelineError(DSCompileError):
    """A textual pipeline or pass ordering that cannot run (unknown pass, missing requirement)."""


def suggest(word: str, candidates: Iterable[str]) -> str | None:
    """Return a 'did you mean' hint for a misspelt key, or None when nothing is close."""
    matches = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"did you mean '{matches[0]}'?" if matches else None


class DSCompileImportError(DSCompileError, ModuleNotFoundError):
    """A DeepSpeed import path (module or name) that dscompile refuses: the message says which and why.

    An ``ImportError`` (a ``ModuleNotFoundError``), so a script's ``try: from deepspeed.x import y / except ImportError``
    fallback still takes its other branch.
    """

    def __init__(self, path: str, reason: str, fix: str | None = None) -> None:
        self.path = path
        self.reason = reason
        message = f"DeepSpeed's '{path}' is not provided by dscompile: {reason}"
        if fix:
            message += f" ({fix})"
        ModuleNotFoundError.__init__(self, message, name=path)
