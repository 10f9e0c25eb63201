"""``deepspeed.sequence.layer``: ``DistributedAttention``, Ulysses around a local attention for models that
take their own chunk of the sequence. It lives with the rest of Ulysses' runtime
(``dscompile/runtime/sequence_parallel.py``), where the sequence-parallel pass also finds it to refuse
sharding such a model a second time."""

from dscompile.runtime.sequence_parallel import DistributedAttention

__all__ = ["DistributedAttention"]
