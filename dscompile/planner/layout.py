"""The one rank layout (``ParallelLayout``): how the world splits into pipeline stages, data-parallel replicas and
tensor-parallel slices, and which global rank sits where.

Pure arithmetic, no process groups: ``runtime/process_groups.py``, the pipeline engine and DeepSpeed's topology
classes (``dscompile/pipe.py``) read ranks from here only, so every part of dscompile agrees on one rank order.
"""

from __future__ import annotations

from dataclasses import dataclass

from dscompile.errors import DSCompileConfigError


@dataclass(frozen=True)
class ParallelLayout:
    """The one rank layout: sizes and each rank's coordinates; pure arithmetic, no process groups.

    Global rank ``r`` sits at ``(pp, dp, tp)`` with ``r = (pp * dp_size + dp) * tp_size + tp``, DeepSpeed's
    ``PipeModelDataParallelTopology`` order (axes pipe, data, model): the ranks of one tensor-parallel group are
    consecutive (on one node, where bandwidth is highest), a data-parallel group joins the ranks holding the same
    slices of the same stage, and pipeline stages are the outermost stride. Process groups
    (``runtime/process_groups.py``) and the pipeline engine read ranks from here only.
    """

    world_size: int
    tp_size: int = 1
    pp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1 or self.world_size % (self.tp_size * self.pp_size) != 0:
            raise DSCompileConfigError(
                "tensor_parallel.autotp_size",
                f"the world size {self.world_size} is not a multiple of tensor-parallel size {self.tp_size} × pipeline stages {self.pp_size}",
                "choose sizes whose product divides the number of ranks",
            )

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp_size * self.pp_size)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(pp, dp, tp)`` of global ``rank``."""
        tp = rank % self.tp_size
        dp = (rank // self.tp_size) % self.dp_size
        pp = rank // (self.tp_size * self.dp_size)
        return pp, dp, tp

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp_size + dp) * self.tp_size + tp

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(pp, dp, t) for t in range(self.tp_size)] for pp in range(self.pp_size) for dp in range(self.dp_size)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank_of(pp, d, tp) for d in range(self.dp_size)] for pp in range(self.pp_size) for tp in range(self.tp_size)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank_of(p, dp, tp) for p in range(self.pp_size)] for dp in range(self.dp_size) for tp in range(self.tp_size)]
