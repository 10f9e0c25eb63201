"""What a training loop needs around its data: the engine's loader, an endless loader, one seed for every RNG.

``EpochLoader`` is the loader ``dscompile.initialize(training_data=...)`` returns, with DeepSpeed's
defaults: a ``DistributedSampler`` over the data-parallel ranks (shuffled, seed 0, as DeepSpeed's
``DeepSpeedDataLoader`` builds it), micro-batches of ``train_micro_batch_size_per_gpu``, the last
partial batch kept unless ``dataloader_drop_last`` is true, and each new pass a new epoch (a new
shuffle) unless the script set the epoch itself (``loader.data_sampler.set_epoch(n)``).
``RepeatingLoader`` restarts a finite loader when it runs out, so ``engine.train_batch(iter)``
can draw any number of batches; ``set_random_seed`` seeds Python's, NumPy's (when installed) and
torch's generators at once, as DeepSpeed's helper of the same name does.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler


class _EpochSampler(DistributedSampler):
    """A ``DistributedSampler`` that remembers whether the script chose the epoch."""

    epoch_set_by_caller = False

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.epoch_set_by_caller = True


class EpochLoader:
    """DeepSpeed's training loader (module docstring); ``data_sampler`` is the ``DistributedSampler``."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        num_replicas: int,
        rank: int,
        collate_fn: Any = None,
        drop_last: bool = False,
        shuffle: bool = True,
    ) -> None:
        self.batch_size = batch_size
        self.data_sampler = _EpochSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle)
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.data_sampler, collate_fn=collate_fn, drop_last=drop_last)
        self._passes = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if self._passes and not self.data_sampler.epoch_set_by_caller:
            self.data_sampler.set_epoch(self.data_sampler.epoch + 1)
        self.data_sampler.epoch_set_by_caller = False
        self._passes += 1
        return iter(self.loader)


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
