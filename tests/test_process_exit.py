"""A process group made by ``dscompile.init_distributed()`` is destroyed at exit, before interpreter teardown.

DeepSpeed's example scripts end without ``destroy_process_group()``; with gloo a rank could then abort in
the interpreter's finalization after training finished ("terminate called without an active exception").
Each case runs a one-rank script in a fresh interpreter: an ``atexit`` handler registered *before* the
group was made runs *after* dscompile's (atexit is last-in first-out) and reports whether a group is left.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    import torch.distributed as dist
    import dscompile

    atexit.register(lambda: print("left initialized:", dist.is_initialized(), flush=True))
    dscompile.init_distributed(dist_backend="gloo", distributed_port={port})
    dist.all_reduce(__import__("torch").ones(2))
    if "{mode}" == "raise":
        raise RuntimeError("the script failed")
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode,left", [("finish", False), ("raise", True)])
def test_group_made_by_init_distributed_is_destroyed_at_exit_unless_the_script_failed(mode: str, left: bool) -> None:
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(port=_free_port(), mode=mode)], capture_output=True, text=True, timeout=120, env=env)
    assert f"left initialized: {left}" in proc.stdout, proc.stdout + proc.stderr
    assert (proc.returncode != 0) == (mode == "raise"), proc.stderr
