"""ZeRO-Offload and ZeRO-Infinity: optimizer states on the host or in NVMe swap files.

``swap.py`` is the asynchronous file I/O (aligned buffers, O_DIRECT where the file system allows,
a thread pool, errors that name the path); ``optimizer.py`` is ``OffloadedOptimizer``, which wraps
ZeRO's sharded optimizer and steps the offloaded part on the host, tile by tile for NVMe.
``params.py`` is ``ParamStore``, ZeRO-3's parameter shards on the host or NVMe (``offload_param``).
Both sections are parsed in ``passes/offload.py``.
"""

from dscompile.runtime.offload.optimizer import OffloadedOptimizer, OffloadSettings
from dscompile.runtime.offload.swap import SwapDirectory, SwapError

__all__ = ["OffloadSettings", "OffloadedOptimizer", "SwapDirectory", "SwapError"]
