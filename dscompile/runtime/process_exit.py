"""A process group dscompile creates is destroyed at exit, before the interpreter tears down.

A script that ends without ``destroy_process_group()`` (DeepSpeed's examples do) leaves gloo's worker
threads holding work objects whose tensors still reference Python objects; the interpreter's
finalization then destroys them without the GIL and the rank can abort with "terminate called
without an active exception" after its training finished (pytorch#190489). An ``atexit`` handler
destroys the group while the interpreter is whole. It is skipped after an uncaught exception: peers
may still be inside a collective with this rank, and destroying the group then can hang instead of exit.

Destroying is not enough while anything still references the group (an engine in a script's globals does):
its worker threads live on into finalization. A worker that has just finished the script's last
asynchronous collective then drops the work's tensors, whose Python objects need the GIL, and a thread
taking the GIL during finalization is killed by a forced unwind: "terminate called without an active
exception", SIGABRT (seen in a core dump: ``ProcessGroupGloo::runLoop`` → ``~AsyncAllreduceWork`` →
``THPVariable_clear`` → ``take_gil`` → ``pthread_exit``). So the handler first releases the GIL for a moment
(``SETTLE_S``), letting such a worker finish while the interpreter is whole.
"""

from __future__ import annotations

import atexit
import sys
import time
from types import TracebackType
from typing import Any

import torch.distributed as dist

_state = {"registered": False, "failed": False}
SETTLE_S = 0.3  # seconds the exit handler sleeps (GIL released) before destroying the groups


def init_process_group(**kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` plus the clean exit above."""
    dist.init_process_group(**kwargs)
    if _state["registered"]:
        return
    _state["registered"] = True
    previous = sys.excepthook

    def note_failure(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        _state["failed"] = True
        previous(kind, value, tb)

    sys.excepthook = note_failure
    atexit.register(destroy_at_exit)


def destroy_at_exit() -> None:
    if not _state["failed"] and dist.is_available() and dist.is_initialized():
        time.sleep(SETTLE_S)  # the group's workers drop their last works' tensors while the GIL can still be taken
        dist.destroy_process_group()
