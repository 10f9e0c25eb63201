"""``deepspeed.ops.sparse_attention``: DeepSpeed's sparsity layouts (``dscompile.sparsity``, DeepSpeed's classes and
parameters). The attention modules themselves are refused with the reason: dscompile applies sparse attention as a
graph pass from the config's ``sparse_attention`` section."""

from dscompile.deepspeed_paths import refused_name
from dscompile.sparsity import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

__all__ = [
    "BSLongformerSparsityConfig",
    "BigBirdSparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "SparsityConfig",
    "VariableSparsityConfig",
]


def __getattr__(name: str) -> object:
    raise refused_name(__name__, name)
