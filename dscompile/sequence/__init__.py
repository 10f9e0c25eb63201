"""``deepspeed.sequence``: the module scripts doing Ulysses by hand import (``sequence.layer.DistributedAttention``)."""

from dscompile.sequence import layer
from dscompile.sequence.layer import DistributedAttention

__all__ = ["DistributedAttention", "layer"]
