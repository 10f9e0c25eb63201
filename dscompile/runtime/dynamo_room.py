"""Room in Dynamo's per-code caches for every compile dscompile sets up on the user's behalf.

Dynamo keeps at most ``recompile_limit`` (8) compiled entries per code object, and every compiled
call of a model of the same class (one engine, or one model whose direct calls ``init_compression``
routes through dscompile) adds its own (its guards name its own module). Past the limit Dynamo runs
the forward uncompiled, with one log line: the ninth engine in a process (a notebook, a sweep, a
GAN's two engines built again) would then train without dscompile's passes, silently. The limits
only grow, from the values before the first such compile.
"""

from __future__ import annotations

import torch

_reserved = 0
_limits: tuple[int, int] | None = None  # Dynamo's limits before the first reservation (read then: importing torch._dynamo is slow)


def make_room(entries: int) -> None:
    """Raise Dynamo's per-code cache limits by ``entries`` more compiled entries."""
    global _reserved, _limits
    config = torch._dynamo.config
    if _limits is None:
        _limits = (config.recompile_limit, config.accumulated_recompile_limit)
    _reserved += entries
    per_code, accumulated = _limits
    config.recompile_limit = max(config.recompile_limit, per_code + _reserved)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, accumulated + _reserved)


def original_limits() -> tuple[int, int] | None:
    """Dynamo's ``(recompile_limit, accumulated_recompile_limit)`` before the first reservation."""
    return _limits
