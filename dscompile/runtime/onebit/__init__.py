"""1-bit Adam, 0/1 Adam and 1-bit LAMB: data-parallel optimizers whose communication is compressed
to one bit per value with error feedback, over any torch.distributed backend.

- ``comm``: the compressed all-reduce (``compressed_all_reduce``, ``CompressedLayout``), the
  counted collectives (``Collectives``) and byte counters (``CommStats``);
- ``base``: buckets, gradient averaging, the engine-facing protocol and the checkpoint share;
- ``adam``, ``zero_one_adam``, ``lamb``: the three optimizers;
- ``engine``, ``zero``: how a dscompile engine hands them its gradient communication (ZeRO-1/2 included);
- ``predict``: the bytes per step an engine would send, planned without running one (``dscompile dump``).
"""

from dscompile.runtime.onebit.adam import OneBitAdam
from dscompile.runtime.onebit.base import DEEPSPEED_TRANSPORTS, Bucket, CompressedCommOptimizer
from dscompile.runtime.onebit.comm import Collectives, CommStats, CompressedLayout, compressed_all_reduce, wire_bytes
from dscompile.runtime.onebit.lamb import OneBitLamb
from dscompile.runtime.onebit.zero_one_adam import ZeroOneAdam

OPTIMIZERS = {"onebitadam": OneBitAdam, "zerooneadam": ZeroOneAdam, "onebitlamb": OneBitLamb}
"""``optimizer.type`` (lower case, no underscores) -> class."""

__all__ = [
    "DEEPSPEED_TRANSPORTS",
    "OPTIMIZERS",
    "Bucket",
    "Collectives",
    "CommStats",
    "CompressedCommOptimizer",
    "CompressedLayout",
    "OneBitAdam",
    "OneBitLamb",
    "ZeroOneAdam",
    "compressed_all_reduce",
    "wire_bytes",
]
