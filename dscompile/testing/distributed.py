"""Run a function on N real torch.distributed ranks (separate processes) and collect results.

    from dscompile.testing.distributed import run_distributed
    results = run_distributed(my_check, 2, some_arg, timeout=60)   # [rank0_value, rank1_value]

`fn(rank, world_size, *args)` runs in each spawned process after the process group is
initialised (gloo by default) and before it is destroyed. `fn` and `args` travel by pickle,
so `fn` must be defined at module level in an importable module (not a lambda, closure or a
function defined inside a test); the test suite keeps its targets in
`dscompile.testing._selftest`.

Fault tests name the ranks they kill (``may_die=[1]``): such a rank dying from a signal does not
fail the run; its result is a ``RankDied`` and the other ranks run to their own end.

Why it looks like this: a distributed test must never hang and must say which rank failed and
why. The parent hosts the rendezvous TCPStore (bound to a free port by the OS, so no port
races, and it outlives any rank), watches every rank's result pipe and process sentinel, stops
all ranks as soon as one fails, and kills everything at the deadline, reporting where the
stuck ranks were (a faulthandler stack dump) before killing them. Ranks are forked from a server that
imported torch, Inductor and dscompile once (a fresh interpreter per rank cost about 5 CPU-seconds of
imports, and the suite starts hundreds of ranks); the server restarts when the environment changed, and a run
with its own `env` still spawns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

MASTER_ADDR = "127.0.0.1"
_log = logging.getLogger("dscompile.testing.distributed")
FAILURE_GRACE_S = 0.75
"""After the first failure, how long to keep listening so the root cause can be told apart
from its echoes (peers failing with 'connection closed' because the first rank died)."""
STACK_DUMP_WAIT_S = 1.0
_WATCH_FN = "_dscompile_parent_watch"
_PEER_ECHO_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote worker")


def free_port(host: str = MASTER_ADDR) -> int:
    """A TCP port that was free a moment ago (the OS picked it for a bind to port 0).

    Another process may take it before you bind it; `run_distributed` itself does not rely on
    this (its store binds port 0 directly)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class RankDied:
    """The result of a rank listed in ``may_die`` that was killed by a signal (a fault test's victim)."""

    rank: int
    exitcode: int

    @property
    def signal(self) -> str:
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"


@dataclass
class RankFailure:
    """How one rank failed: an exception (type, message, remote traceback) or a bare exit code."""

    rank: int
    exitcode: int | None
    exc_type: str | None = None
    message: str | None = None
    traceback: str | None = None
    echo: bool = False
    """True when the error looks like a consequence of another rank dying (gloo 'connection closed')."""

    def describe(self) -> str:
        if self.exc_type is not None:
            return f"rank {self.rank} raised {self.exc_type}: {self.message}"
        if self.exitcode is not None and self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = f"signal {-self.exitcode}"
            return f"rank {self.rank} was killed by {name} (exit code {self.exitcode}) without raising an exception"
        return f"rank {self.rank} exited with code {self.exitcode} without raising an exception or returning a result"


class DistributedRunError(RuntimeError):
    """Base of the harness's errors."""


class DistributedTestError(DistributedRunError):
    """A rank raised or died. `rank`, `exitcode` and `remote_traceback` describe the root cause;
    `failures` lists every rank failure seen before the others were stopped."""

    def __init__(self, failures: list[RankFailure]) -> None:
        self.failures = failures
        primary = failures[0]
        self.rank = primary.rank
        self.exitcode = primary.exitcode
        self.exc_type = primary.exc_type
        self.remote_traceback = primary.traceback
        lines = [primary.describe()]
        if primary.traceback:
            lines += [f"--- remote traceback (rank {primary.rank}) ---", primary.traceback.rstrip()]
        for other in failures[1:]:
            lines.append(f"also: {other.describe()}" + (" (probably caused by the failure above)" if other.echo else ""))
            if other.traceback and not other.echo:
                lines += [f"--- remote traceback (rank {other.rank}) ---", other.traceback.rstrip()]
        super().__init__("\n".join(lines))


class DistributedTimeoutError(DistributedRunError):
    """The run passed its deadline; `ranks` were still running and were killed. `stacks` maps a
    rank to the Python stacks of its threads at the deadline (empty when it had not started up)."""

    def __init__(self, ranks: list[int], timeout: float, stacks: dict[int, str], results: dict[int, Any]) -> None:
        self.ranks = ranks
        self.timeout = timeout
        self.stacks = stacks
        self.results = results
        lines = [
            f"distributed run timed out after {timeout:.1f} s; rank(s) {ranks} still running were killed "
            f"(ranks finished: {sorted(results)})"
        ]
        for rank in ranks:
            dump = stacks.get(rank, "").strip()
            lines += [f"--- rank {rank} stacks at the deadline ---", dump or "(no stack dump: the rank was still starting)"]
        super().__init__("\n".join(lines))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
    collective_timeout: float | None = None,
    may_die: Collection[int] = (),
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned ranks; return their results in rank order.

    - `timeout` bounds the whole run, process start-up included; past it every rank is killed
      and DistributedTimeoutError names the ranks still running.
    - `collective_timeout` (default `timeout + 30`) is the process group's own timeout, so a
      rank stuck in a collective also errors on its own if the parent ever goes away.
    - `env` is added to each rank's environment from interpreter start (so it applies to
      variables read at import time such as TRITON_INTERPRET). RANK, WORLD_SIZE, LOCAL_RANK,
      LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set; OMP_NUM_THREADS defaults to 1.
    - Return values must be picklable; tensors in lists/tuples/dicts come back detached on CPU.
    - A rank that raises or dies fails the run with DistributedTestError at once (the others
      are terminated); no processes outlive the call.
    - `may_die` lists ranks a fault test kills on purpose: such a rank killed by a signal gives
      `RankDied` as its result, and the run waits for the others to finish (or the deadline).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    try:
        payload = pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(
            f"run_distributed could not pickle {getattr(fn, '__qualname__', fn)!r} and its args ({exc}); "
            "fn must be a module-level function in an importable module and args must be picklable"
        ) from exc

    import torch.distributed as dist

    store = dist.TCPStore(
        MASTER_ADDR, 0, world_size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout + 30)
    )
    coll_timeout = collective_timeout if collective_timeout is not None else timeout + 30.0
    ctx = _rank_context(env)
    procs: list[Any] = []
    conns: list[Connection] = []
    with tempfile.TemporaryDirectory(prefix="dscompile-dist-") as tmp:
        stack_files = [os.path.join(tmp, f"rank{rank}.stacks") for rank in range(world_size)]
        try:
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                rank_env = {
                    "OMP_NUM_THREADS": "1",
                    **dict(env or {}),
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(world_size),
                    "LOCAL_WORLD_SIZE": str(world_size),
                    "MASTER_ADDR": MASTER_ADDR,
                    "MASTER_PORT": str(store.port),
                }
                proc = ctx.Process(
                    target=_rank_main,
                    args=(
                        rank, world_size, payload, store.port, backend, coll_timeout, writer, stack_files[rank], os.getpid(),
                        list(sys.path), {**os.environ, **rank_env},
                    ),
                    name=f"dscompile-rank{rank}",
                    daemon=True,
                )
                with _patched_environ(rank_env):
                    proc.start()
                writer.close()
                procs.append(proc)
                conns.append(reader)
            return _supervise(procs, conns, stack_files, time.monotonic() + timeout, timeout, frozenset(may_die))
        finally:
            _stop(procs)
            for conn in conns:
                conn.close()
            del store


def run_distributed_or_fail(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """`run_distributed` for pytest: a rank failure or timeout becomes `pytest.fail` with the remote
    traceback as the whole report, instead of a local traceback through the harness."""
    import pytest

    try:
        return run_distributed(fn, world_size, *args, **kwargs)
    except DistributedRunError as exc:
        pytest.fail(f"{type(exc).__name__}: {exc}", pytrace=False)


def requires_backend(backend: str = "gloo") -> Any:
    """A pytest skip marker for tests that need torch.distributed with `backend` (gloo, nccl)."""
    import pytest
    import torch
    import torch.distributed as dist

    available = dist.is_available() and {
        "gloo": dist.is_gloo_available,
        "nccl": lambda: dist.is_nccl_available() and torch.cuda.device_count() > 0,
        "mpi": dist.is_mpi_available,
    }.get(backend, lambda: False)()
    return pytest.mark.skipif(not available, reason=f"torch.distributed backend '{backend}' is not available here")


# ----------------------------------------------------------------------------- parent side

FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch._inductor.compile_fx", "dscompile", "transformers")
"""What the fork server imports once, so a rank starts as a fork instead of a fresh interpreter that
imports torch, Inductor, dscompile and transformers again (about 5 CPU-seconds a rank; a missing
package is skipped)."""
_RANK_KEYS = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
_forkserver_environ: dict[str, str] | None = None


def _import_time_environ() -> dict[str, str]:
    """The environment the ranks' imports could read; pytest rewrites PYTEST_CURRENT_TEST for every test."""
    return {key: value for key, value in os.environ.items() if key not in _RANK_KEYS and key != "PYTEST_CURRENT_TEST"}


def _rank_context(env: Mapping[str, str] | None) -> Any:
    """Fork ranks from a server that has imported the heavy modules with this process's environment.

    Modules read some variables when they are imported (TRITON_INTERPRET, Inductor's config), so the server
    is restarted when the environment changed since it started (a test or a library set a variable), and a
    run with its own `env` spawns fresh interpreters. DSCOMPILE_RANK_START=spawn forces spawning."""
    import multiprocessing as mp
    from multiprocessing import forkserver

    global _forkserver_environ
    if env or os.environ.get("DSCOMPILE_RANK_START") == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    current = _import_time_environ()
    if _forkserver_environ is not None and current != _forkserver_environ:
        stop = getattr(forkserver._forkserver, "_stop", None)  # CPython's own restart path (3.8+)
        if stop is None:
            return mp.get_context("spawn")
        changed = sorted(k for k in current.keys() | _forkserver_environ.keys() if current.get(k) != _forkserver_environ.get(k))
        _log.debug("environment changed (%s): restarting the rank fork server", ", ".join(changed))
        stop()
        _forkserver_environ = None
    ctx = mp.get_context("forkserver")
    if _forkserver_environ is None:
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        forkserver.ensure_running()
        _forkserver_environ = current
    return ctx


@contextlib.contextmanager
def _patched_environ(updates: Mapping[str, str]) -> Iterator[None]:
    """Set variables for the duration of a spawn so the child inherits them from exec onward."""
    saved = {key: os.environ.get(key) for key in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _supervise(
    procs: list[Any], conns: list[Connection], stack_files: list[str], deadline: float, timeout: float, may_die: frozenset[int] = frozenset()
) -> list[Any]:
    """Wait for every rank to report and exit; raise on the first failure or at the deadline."""
    world_size = len(procs)
    results: dict[int, Any] = {}
    failures: list[RankFailure] = []
    reported: set[int] = set()
    exited: set[int] = set()
    open_conns = dict(enumerate(conns))
    failure_deadline: float | None = None

    def receive(rank: int) -> None:
        conn = open_conns.pop(rank)
        try:
            kind, body = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # closed without a message: judged by the exit code
        except Exception as exc:  # the result could not be unpickled here
            failures.append(RankFailure(rank, None, type(exc).__name__, f"its return value could not be unpickled: {exc}"))
            reported.add(rank)
            return
        reported.add(rank)
        if kind == "ok":
            results[rank] = body
        else:
            failures.append(RankFailure(rank, None, **body))

    while len(exited) < world_size:
        now = time.monotonic()
        if failures and failure_deadline is None:
            failure_deadline = now + FAILURE_GRACE_S
        if failure_deadline is not None and now >= failure_deadline:
            break
        if now >= deadline:
            running = [r for r in range(world_size) if r not in exited]
            stacks = _dump_stacks(procs, running, stack_files)
            raise DistributedTimeoutError(running, timeout, stacks, results)
        limit = min(deadline, failure_deadline or deadline) - now
        waitables: dict[Any, tuple[str, int]] = {conn: ("msg", rank) for rank, conn in open_conns.items()}
        waitables.update({procs[r].sentinel: ("exit", r) for r in range(world_size) if r not in exited})
        for obj in wait(list(waitables), timeout=limit):
            what, rank = waitables[obj]
            if what == "msg" and rank in open_conns:
                receive(rank)
            elif what == "exit":
                procs[rank].join()
                exited.add(rank)
                if rank in open_conns and open_conns[rank].poll(0):
                    receive(rank)  # the result arrived together with the exit
                code = procs[rank].exitcode
                if rank in may_die and rank not in reported and code is not None and code < 0:
                    results[rank] = RankDied(rank, code)  # the fault test's victim: not a failure
                    reported.add(rank)
                elif rank not in reported or (rank in results and code != 0):
                    stacks = _read_stacks(stack_files[rank]) if code is not None and code < 0 else ""
                    failures.append(RankFailure(rank, code, traceback=f"its threads when it died (faulthandler):\n{stacks}" if stacks else None))
                    reported.add(rank)
    if failures:
        for failure in failures:
            if failure.exitcode is None and procs[failure.rank].exitcode is not None:
                failure.exitcode = procs[failure.rank].exitcode
        # Root causes first, echoes (gloo 'connection closed by peer') after; stable by arrival.
        raise DistributedTestError(sorted(failures, key=lambda f: f.echo))
    return [results[rank] for rank in range(world_size)]


def _dump_stacks(procs: list[Any], ranks: list[int], stack_files: list[str]) -> dict[int, str]:
    """Ask still-running ranks for a faulthandler dump of all their threads and read it back."""
    if not hasattr(signal, "SIGUSR1"):
        return {}
    sizes = {}
    for rank in ranks:
        sizes[rank] = _file_size(stack_files[rank])
        with contextlib.suppress(OSError, ValueError):
            if procs[rank].pid is not None and procs[rank].is_alive():
                os.kill(procs[rank].pid, signal.SIGUSR1)
    end = time.monotonic() + STACK_DUMP_WAIT_S
    while time.monotonic() < end:
        time.sleep(0.05)
        if all(_file_size(stack_files[r]) > sizes[r] for r in ranks):
            time.sleep(0.1)  # let the dump finish writing
            break
    stacks = {}
    for rank in ranks:
        stacks[rank] = _read_stacks(stack_files[rank])
    return stacks


def _read_stacks(path: str) -> str:
    """A rank's faulthandler dump, less the harness's own parent-watch thread."""
    try:
        with open(path, errors="replace") as handle:
            text = handle.read()
    except OSError:
        return ""
    blocks = [b for b in text.split("\n\n") if f" in {_WATCH_FN}\n" not in b + "\n"]
    return "\n\n".join(blocks).strip()


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def _stop(procs: list[Any]) -> None:
    """Terminate, then kill, every rank that is still alive, and reap them all."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    end = time.monotonic() + 2.0
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)


# ----------------------------------------------------------------------------- rank side


def _rank_main(
    rank: int,
    world_size: int,
    payload: bytes,
    port: int,
    backend: str,
    collective_timeout: float,
    conn: Connection,
    stack_file: str,
    parent_pid: int,
    parent_path: list[str],
    environ: dict[str, str],
) -> None:
    """Entry point of one rank: rendezvous, run fn, tear down, send the result.

    A forked rank starts with the fork server's sys.path and environment, so both are set to the
    parent's here before `fn` is unpickled (its module may only be importable from the parent's path)."""
    import faulthandler

    sys.path[:] = parent_path
    os.environ.clear()
    os.environ.update(environ)
    _watch_parent(parent_pid)
    stack_handle = open(stack_file, "w")  # stays open: faulthandler writes to it
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_handle, all_threads=True)
    faulthandler.enable(file=stack_handle, all_threads=True)  # a rank killed by SIGSEGV/SIGABRT leaves its stacks there too
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1") or 1)))
        fn, args = pickle.loads(payload)
        if backend == "nccl":
            torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
        store = dist.TCPStore(MASTER_ADDR, port, world_size, is_master=False, timeout=timedelta(seconds=collective_timeout))
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=collective_timeout)
        )
        # Every rank's connections are up before any rank may finish: a rank whose fn returns at once would
        # otherwise close its side while a slower peer is still connecting ("connectFullMesh failed").
        dist.barrier()
        result = fn(rank, world_size, *args)
        if dist.is_initialized():
            dist.destroy_process_group()
        message = pickle.dumps(("ok", _to_cpu(result)))
    except BaseException as exc:  # everything is reported to the parent
        _send(conn, pickle.dumps(("err", _describe(exc))))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip atexit: a broken process group can hang interpreter shutdown
    _send(conn, message)
    conn.close()
    # The result is delivered and the process group destroyed: skip interpreter finalization.
    # Tearing down torch's C++ state there (gloo and c10d threads holding tensors) can abort with
    # 'terminate called without an active exception' long after the rank's work succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _send(conn: Connection, data: bytes) -> None:
    with contextlib.suppress(OSError):
        conn.send_bytes(data)


def _describe(exc: BaseException) -> dict[str, Any]:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    message = str(exc)
    if isinstance(exc, (ModuleNotFoundError, AttributeError)) and "pickle" in text:
        message += " (run_distributed's fn must be defined at module level in a module the ranks can import)"
    lowered = message.lower()
    echo = type(exc).__name__ == "DistBackendError" or any(marker in lowered for marker in _PEER_ECHO_MARKERS)
    return {"exc_type": type(exc).__qualname__, "message": message, "traceback": text, "echo": echo}


def _to_cpu(value: Any) -> Any:
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, value)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, owned by another user
    return True


def _watch_parent(parent_pid: int) -> None:
    """Exit if the parent disappears (killed test runner), so no rank is ever orphaned."""

    first_parent = os.getppid()  # the test process when spawned, the fork server when forked

    def _dscompile_parent_watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != first_parent or not _alive(parent_pid):
                os._exit(70)

    threading.Thread(target=_dscompile_parent_watch, name="dscompile-parent-watch", daemon=True).start()
