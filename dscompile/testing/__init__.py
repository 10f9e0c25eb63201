"""Test helpers shipped with dscompile: the multi-process distributed harness.

`dscompile.testing.distributed` itself imports torch lazily; the `env=` of `run_distributed`
is in each rank's environment from exec onward, so it applies whatever `dscompile` imports.
"""

from dscompile.testing.distributed import (
    DistributedRunError,
    DistributedTestError,
    DistributedTimeoutError,
    RankFailure,
    free_port,
    requires_backend,
    run_distributed,
    run_distributed_or_fail,
)

__all__ = [
    "DistributedRunError",
    "DistributedTestError",
    "DistributedTimeoutError",
    "RankFailure",
    "free_port",
    "requires_backend",
    "run_distributed",
    "run_distributed_or_fail",
]
