"""``deepspeed.ops``: the optimizers and sparsity layouts DeepSpeed scripts import from here.

Its kernel modules (``ops.transformer``, ``ops.op_builder``, ...) are refused by name with the reason
(``dscompile.deepspeed_paths``).
"""

from dscompile.ops import adam, lamb, sparse_attention

__all__ = ["adam", "lamb", "sparse_attention"]
