"""Mixed precision as graph passes: bf16 or fp16 compute with fp32 master weights (``amp``), and gradient reductions in
``communication_data_type`` (``comm_dtype``).

One module per job (README.md has the layout, what the passes do and the rules). Importing the package registers the
``fp16``, ``bf16`` and ``communication_data_type`` config sections, the config rule, the ``amp`` and ``comm_dtype``
passes and the engine extensions. The names other code imports are re-exported here.
"""

from __future__ import annotations

from dscompile.passes.mixed_precision import extension  # noqa: F401  (registers the engine extensions)
from dscompile.passes.mixed_precision.amp_pass import AmpOptions, amp_pass
from dscompile.passes.mixed_precision.comm_dtype import CommDtypeOptions, comm_dtype_pass
from dscompile.passes.mixed_precision.config import (
    COMM_DTYPES,
    LOW_DTYPES,
    BF16Config,
    FP16Config,
    communication_dtype,
    precision_of,
)
from dscompile.passes.mixed_precision.folding import cast_source, count_casts, fold_casts
from dscompile.passes.mixed_precision.policy import POLICIES, CastPolicy, Rule, classify, is_zero_gather, op_key

__all__ = [
    "COMM_DTYPES",
    "LOW_DTYPES",
    "POLICIES",
    "AmpOptions",
    "BF16Config",
    "CastPolicy",
    "CommDtypeOptions",
    "FP16Config",
    "Rule",
    "amp_pass",
    "cast_source",
    "classify",
    "comm_dtype_pass",
    "communication_dtype",
    "count_casts",
    "fold_casts",
    "is_zero_gather",
    "op_key",
    "precision_of",
]
