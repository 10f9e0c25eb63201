"""``dscompile.compression``: DeepSpeed Compression's public functions (``deepspeed.compression``).

A DeepSpeed compression script ports by changing its imports (``deepspeed.compression.compress``,
``deepspeed.compression.helper`` and ``deepspeed.compression.scheduler`` exist under the same names)::

    from dscompile.compression.compress import init_compression, redundancy_clean
    model = init_compression(model, "ds_config.json", teacher_model=teacher)
    engine, *_ = dscompile.initialize(model=model, config="ds_config.json")
    ...train: engine(x) or model(x), engine.backward(loss), engine.step()...
    model = redundancy_clean(model, "ds_config.json")

``init_compression`` applies layer reduction, prepares the matched layers and routes the model's own
calls through dscompile, so ``model(x)`` is compressed wherever it is called, as DeepSpeed's swapped
layers are; the ``quantize`` and ``prune`` passes do the compressing in every graph compiled from the
model. The schedule advances as DeepSpeed's: by itself under ``dscompile.initialize`` (whose engine
also calls ``init_compression`` when the script did not), through ``get_compression_scheduler(model)
.step(global_step)`` (or DeepSpeed's ``compression_scheduler``) in a plain training loop.
``redundancy_clean`` returns a model that is really smaller (packed int8/int4 weights, pruned rows,
heads and channels removed). The work is done in ``dscompile.passes.compression``,
``layer_reduction``, ``redundancy_clean`` and ``dscompile.runtime.compression``.
"""

from dscompile.compression.compress import init_compression, redundancy_clean
from dscompile.compression.helper import convert_conv1d_to_linear, recursive_getattr, recursive_setattr
from dscompile.compression.scheduler import CompressionScheduler, compression_scheduler, get_compression_scheduler

__all__ = [
    "CompressionScheduler",
    "compression_scheduler",
    "convert_conv1d_to_linear",
    "get_compression_scheduler",
    "init_compression",
    "recursive_getattr",
    "recursive_setattr",
    "redundancy_clean",
]
