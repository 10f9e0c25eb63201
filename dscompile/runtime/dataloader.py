"""What a training loop needs around its data: an endless loader, and one seed for every RNG.

``RepeatingLoader`` restarts a finite loader when it runs out, so ``engine.train_batch(iter)``
can draw any number of batches; ``set_random_seed`` seeds Python's, NumPy's (when installed) and
torch's generators at once, as DeepSpeed's helper of the same name does.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import Any

import torch


class RepeatingLoader:
    """Iterate ``loader`` forever, starting it again (a new epoch) each time it is exhausted."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.data_iter: Iterator[Any] = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)  # an empty loader raises StopIteration again: nothing to repeat


def set_random_seed(seed: int) -> None:
    """Seed ``random``, ``numpy.random`` (if installed; it takes 32-bit seeds) and torch (every device)."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed % (2**32))
    torch.manual_seed(seed)  # also seeds every CUDA device
