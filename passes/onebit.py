"""1-bit Adam, 0/1 Adam and 1-bit LAMB in the engines (``optimizer.type`` ``OneBitAdam``/``ZeroOneAdam``/``OneBitLamb``).

Their communication happens outside the compiled graphs, in the optimizer step (and, under ZeRO-1,
in the gradient reduce-scatter), so this module adds no graph pass: it registers the engine
extension (``dscompile.runtime.onebit.engine``) that hands the engine's gradient communication to
the optimizer. Order 20: after ZeRO (10) has moved the optimizer onto the shards, before mixed
precision (40).
"""

from __future__ import annotations

from dscompile.runtime.engine_core import register_engine_extension
from dscompile.runtime.onebit.engine import onebit_extension

register_engine_extension(20, "onebit")(onebit_extension)
