"""``deepspeed.compression.helper``: the module-tree helpers DeepSpeed's scripts import from there."""

from dscompile.runtime.compression.modules import convert_conv1d_to_linear, recursive_getattr, recursive_setattr

__all__ = ["convert_conv1d_to_linear", "recursive_getattr", "recursive_setattr"]
