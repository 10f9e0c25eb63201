"""The distributed test harness: real gloo ranks, results in rank order, failures and hangs
reported promptly with the remote cause, and no process left behind."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch

from dscompile.testing import _selftest
from dscompile.testing.distributed import (
    DistributedTestError,
    DistributedTimeoutError,
    free_port,
    requires_backend,
    run_distributed,
)

pytestmark = [pytest.mark.distributed, requires_backend("gloo")]


def _assert_dead(pid_dir: Path) -> None:
    pids = [int(p.read_text()) for p in pid_dir.glob("rank*.pid")]
    assert pids, "the ranks should have recorded their pids"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert multiprocessing.active_children() == []


def test_all_reduce_two_ranks_in_rank_order() -> None:
    results = run_distributed(_selftest.all_reduce_sum, 2, 3, timeout=60)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 for r in results)
    for r in results:
        torch.testing.assert_close(r["sum"], torch.full((3,), 3.0))
    assert results[0]["pid"] != results[1]["pid"] != os.getpid()
    assert multiprocessing.active_children() == []


def test_world_size_four_and_environment() -> None:
    results = run_distributed(_selftest.all_reduce_sum, 4, 2, timeout=90)
    for rank, r in enumerate(results):
        assert r["rank"] == rank
        torch.testing.assert_close(r["sum"], torch.full((2,), 10.0))


def test_rank_environment_and_user_env() -> None:
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DSCOMPILE_SELFTEST", "OMP_NUM_THREADS"]
    before = dict(os.environ)
    results = run_distributed(_selftest.report_env, 2, keys, timeout=60, env={"DSCOMPILE_SELFTEST": "yes"})
    assert dict(os.environ) == before, "the parent's environment must be restored"
    for rank, r in enumerate(results):
        assert (r["RANK"], r["LOCAL_RANK"], r["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert r["MASTER_ADDR"] == "127.0.0.1" and int(r["MASTER_PORT"]) > 0
        assert r["DSCOMPILE_SELFTEST"] == "yes" and r["OMP_NUM_THREADS"] == "1"


def test_ranks_fork_from_a_server_started_with_the_current_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forked ranks skip the per-rank imports. A variable set after the server started must reach the ranks'
    imports too, so the server restarts; a run with its own env spawns; the parent's sys.path reaches forked ranks."""
    key = "DSCOMPILE_SELFTEST_LATE"
    monkeypatch.delenv(key, raising=False)
    first = run_distributed(_selftest.report_start, 2, key, timeout=120)
    again = run_distributed(_selftest.report_start, 2, key, timeout=120)
    assert all(r["parent"] != os.getpid() and r["value"] is None for r in first + again), first + again
    assert [r["rank_env"] for r in first] == ["0", "1"]
    assert {r["parent"] for r in first} == {r["parent"] for r in again}, "the same server forks both runs"
    monkeypatch.setenv(key, "late")
    restarted = run_distributed(_selftest.report_start, 2, key, timeout=120)
    assert all(r["value"] == "late" and r["parent"] not in (os.getpid(), first[0]["parent"]) for r in restarted), restarted
    spawned = run_distributed(_selftest.report_start, 2, key, timeout=120, env={key: "own"})
    assert all(r["parent"] == os.getpid() and r["value"] == "own" for r in spawned), spawned


def test_exception_on_rank_one_is_reported_with_traceback(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_selftest.raise_on_rank, 2, 1, str(tmp_path), timeout=60)
    err = info.value
    assert time.monotonic() - start < 40, "the healthy rank must be stopped, not left to time out"
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert "deliberate failure on rank 1" in str(err)
    assert err.remote_traceback is not None
    assert "_selftest.py" in err.remote_traceback and "raise_on_rank" in err.remote_traceback
    assert "rank 1 raised ValueError" in str(err)
    _assert_dead(tmp_path)


def test_rank_killed_by_a_native_abort_is_reported_with_its_stacks() -> None:
    """faulthandler writes the dying rank's Python stacks; the report carries them (where a heap corruption struck)."""
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_selftest.abort_on_rank, 2, 1, timeout=60)
    err = info.value
    assert err.rank == 1 and "killed by SIGABRT" in str(err)
    assert "its threads when it died" in str(err) and "abort_on_rank" in str(err), str(err)


def test_rank_exit_without_exception_reports_exit_code() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_selftest.exit_on_rank, 2, 1, 3, timeout=60)
    err = info.value
    assert err.rank == 1 and err.exitcode == 3 and err.remote_traceback is None
    assert "rank 1 exited with code 3" in str(err)
    assert multiprocessing.active_children() == []


def test_hung_rank_times_out_and_is_killed(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTimeoutError) as info:
        run_distributed(_selftest.hang_on_rank, 2, 1, str(tmp_path), timeout=20)
    elapsed = time.monotonic() - start
    assert 20 <= elapsed < 30
    err = info.value
    assert err.ranks == [0, 1]  # rank 0 waits in the barrier, rank 1 sleeps
    # Ranks that reached fn (they wrote their pid first) show where they were stuck.
    if (tmp_path / "rank1.pid").exists():
        assert "in hang_on_rank" in err.stacks[1]
    if (tmp_path / "rank0.pid").exists():
        assert "in barrier" in err.stacks[0] and "in hang_on_rank" in err.stacks[0]
    assert "_dscompile_parent_watch" not in str(err)
    _assert_dead(tmp_path)


def test_unpicklable_inputs_and_results_are_explained() -> None:
    with pytest.raises(TypeError, match="module-level function"):
        run_distributed(lambda rank, world: rank, 2, timeout=30)
    with pytest.raises(DistributedTestError, match="rank 0 raised"):
        run_distributed(_selftest.unpicklable_result, 1, timeout=60)


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_selftest.all_reduce_sum, 0, 1)


def test_ranks_die_with_a_killed_parent(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    parent = subprocess.Popen([sys.executable, "-m", "dscompile.testing._selftest", str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("rank*.pid"))) < 2:
            assert time.monotonic() < deadline and parent.poll() is None, "the ranks never started"
            time.sleep(0.2)
        time.sleep(0.5)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
        end = time.monotonic() + 10
        while time.monotonic() < end and any(_alive(pid) for pid in pids):
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in pids), "ranks outlived their killed parent"
    finally:
        parent.kill()
        parent.wait(10)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as dead.
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_pytest_helper_fails_with_the_remote_report() -> None:
    from dscompile.testing.distributed import run_distributed_or_fail

    with pytest.raises(pytest.fail.Exception, match="rank 0 raised ValueError: deliberate failure on rank 0"):
        run_distributed_or_fail(_selftest.raise_on_rank, 1, 0, timeout=60)
