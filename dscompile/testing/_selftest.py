"""Rank functions for the harness's own tests (spawned ranks import them from here)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist


def all_reduce_sum(rank: int, world_size: int, length: int) -> dict[str, Any]:
    t = torch.full((length,), float(rank + 1))
    dist.all_reduce(t)
    return {"rank": rank, "world": dist.get_world_size(), "sum": t, "pid": os.getpid()}


def report_env(rank: int, world_size: int, keys: list[str]) -> dict[str, str | None]:
    return {key: os.environ.get(key) for key in keys}


def report_start(rank: int, world_size: int, key: str) -> dict[str, Any]:
    """Who started this rank (the test process when spawned, the fork server when forked) and what it sees."""
    return {"parent": os.getppid(), "value": os.environ.get(key), "rank_env": os.environ.get("RANK")}


def _write_pid(pid_dir: str | None, rank: int) -> None:
    if pid_dir is not None:
        with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as handle:
            handle.write(str(os.getpid()))


def raise_on_rank(rank: int, world_size: int, bad_rank: int, pid_dir: str | None = None) -> int:
    _write_pid(pid_dir, rank)
    dist.barrier()
    if rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    dist.barrier()  # never completes: the bad rank is gone
    return rank


def exit_on_rank(rank: int, world_size: int, bad_rank: int, code: int) -> int:
    dist.barrier()
    if rank == bad_rank:
        os._exit(code)
    dist.barrier()
    return rank


def abort_on_rank(rank: int, world_size: int, bad_rank: int) -> int:
    """A native crash (glibc's abort on a corrupted heap looks the same to the harness)."""
    dist.barrier()
    if rank == bad_rank:
        os.abort()
    dist.barrier()
    return rank


def hang_on_rank(rank: int, world_size: int, bad_rank: int, pid_dir: str | None = None) -> int:
    _write_pid(pid_dir, rank)
    if rank == bad_rank:
        time.sleep(3600)
    dist.barrier()
    return rank


def unpicklable_result(rank: int, world_size: int) -> Any:
    return lambda: rank


def hang_under_parent(pid_dir: str) -> None:
    """Run in a throwaway parent process that the test kills while its ranks hang."""
    from dscompile.testing.distributed import run_distributed

    run_distributed(hang_on_rank, 2, 1, pid_dir, timeout=300)


if __name__ == "__main__":
    import sys

    hang_under_parent(sys.argv[1])
