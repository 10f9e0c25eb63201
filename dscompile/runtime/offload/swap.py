"""Asynchronous swap files for NVMe offload: one directory per rank, whole files read and written by a thread pool.

Why a thread pool and not libaio: ``os.preadv`` / ``os.pwritev`` release the GIL, so a few Python
threads keep the disk busy while the optimizer steps another tile, with nothing to build or install.
Files are opened with ``O_DIRECT`` where the file system accepts it (the page cache would otherwise
keep a second copy of everything swapped out, which is the memory offload is meant to free); where it
does not (tmpfs, some network file systems), plain buffered I/O is used and logged once. O_DIRECT needs
4 KiB-aligned addresses, sizes and offsets: ``aligned_buffer`` gives such memory and every segment is
padded to ``ALIGN`` bytes.

Every failure names the file: a missing or unwritable directory at start, a full disk (ENOSPC) on a
write, a file that vanished or shrank on a read. In debug mode (``"debug": true`` in the config or
``DSCOMPILE_DEBUG=1``) every file's CRC-32 is kept when it is written and checked when it is read back,
so bytes changed on disk (another process, a bad device) fail loudly instead of training on them.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
import warnings
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from dscompile.errors import DSCompileError

log = logging.getLogger("dscompile.offload")

ALIGN = 4096
"""Alignment of buffers, segment sizes and file offsets (what O_DIRECT asks on common file systems)."""


class SwapError(DSCompileError):
    """A swap file could not be created, written or read back."""


def align_up(nbytes: int, alignment: int = ALIGN) -> int:
    return -(-nbytes // alignment) * alignment


def aligned_buffer(nbytes: int, pin_memory: bool = False) -> torch.Tensor:
    """``nbytes`` of uint8 host memory starting at an ``ALIGN``-byte boundary (pinned when asked and CUDA exists).

    Unpinned buffers are anonymous memory maps: page-aligned, and handed back to the system as soon as
    the last view of them dies (the C allocator would keep freed swap buffers resident, and keeping
    swapped-out states out of RAM is the point).
    """
    if pin_memory and torch.cuda.is_available():
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=True)
        start = (-raw.data_ptr()) % ALIGN
        return raw[start : start + nbytes]
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": an anonymous map is writable
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def _explain(exc: OSError, path: Path, doing: str, key: str = "zero_optimization.offload_optimizer", contents: str = "optimizer states") -> SwapError:
    if exc.errno == errno.ENOSPC:
        why = f"the disk under nvme_path is full; free space there or point {key}.nvme_path at a larger disk"
    elif exc.errno == errno.ENOENT:
        why = f"the file is gone (deleted or its directory removed while training); the offloaded {contents} in it are lost"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = "no permission to write there; choose a writable nvme_path"
    else:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
    return SwapError(f"NVMe offload: {doing} {path} failed: {why} ({type(exc).__name__}: {exc})")


class SwapDirectory:
    """``root/rank_N``: named swap files, read and written whole, asynchronously.

    ``block_size`` bytes go per system call (``aio.block_size``), ``threads`` calls run at once
    (``aio.intra_op_parallelism`` / ``thread_count``). ``read``/``write`` return futures; the
    counters say how many bytes moved and how long callers waited for them. ``verify`` keeps a CRC-32
    of each file as written and checks it on every read (debug mode: it costs a pass over the bytes).
    """

    def __init__(
        self,
        nvme_path: str | os.PathLike,
        rank: int,
        block_size: int = 1 << 20,
        threads: int = 1,
        direct: bool = True,
        verify: bool = False,
        key: str = "zero_optimization.offload_optimizer",
        contents: str = "optimizer states",
        write_pool: bool = False,
    ) -> None:
        self.key, self.contents = key, contents  # named in error messages: the config section and what the files hold
        base = Path(nvme_path)
        if not base.is_dir():
            raise SwapError(
                f"NVMe offload: nvme_path {base} does not exist or is not a directory; create it (on the fast disk) or point "
                f"{key}.nvme_path at an existing directory"
            )
        self.root = base / f"rank_{rank}"
        try:
            self.root.mkdir(exist_ok=True)
            probe = self.root / ".probe"
            probe.write_bytes(b"\0" * ALIGN)
            probe.unlink()
        except OSError as exc:
            raise _explain(exc, self.root, "creating swap files in", key, contents) from exc
        self.block_size = max(ALIGN, align_up(int(block_size)))
        self.direct = direct and hasattr(os, "O_DIRECT") and self._direct_works()
        if direct and not self.direct:
            log.info("NVMe offload: %s does not take O_DIRECT; using buffered I/O (the page cache may hold swapped bytes)", self.root)
        self.pool = ThreadPoolExecutor(max_workers=max(1, int(threads)), thread_name_prefix="dscompile-swap")
        # ``write_pool``: writes get threads of their own, so a read never queues behind writes of other files (a
        # read of the same file is ordered after its write with ``read(after=)``); without, one pool in submission order.
        self.writer = ThreadPoolExecutor(max_workers=max(1, int(threads)), thread_name_prefix="dscompile-swap-w") if write_pool else self.pool
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.bytes_written = 0
        self.wait_seconds = 0.0
        self.verify = verify
        self._checksums: dict[str, list[tuple[int, int]]] = {}

    def _direct_works(self) -> bool:
        probe = self.root / ".direct_probe"
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        except OSError:
            return False
        try:
            buf = aligned_buffer(ALIGN)
            os.pwritev(fd, [buf.numpy()], 0)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)

    def path(self, name: str) -> Path:
        return self.root / name

    def _open(self, path: Path, flags: int) -> int:
        if self.direct:
            flags |= os.O_DIRECT
        return os.open(path, flags, 0o600)

    def _write(self, name: str, buffer: torch.Tensor) -> None:
        path = self.path(name)
        view = buffer.numpy()
        try:
            fd = self._open(path, os.O_WRONLY | os.O_CREAT)
            try:
                for start in range(0, view.nbytes, self.block_size):
                    chunk = view[start : start + self.block_size]
                    done = os.pwritev(fd, [chunk], start)
                    if done != chunk.nbytes:
                        raise OSError(errno.ENOSPC, f"short write ({done} of {chunk.nbytes} bytes)")
            finally:
                os.close(fd)
        except OSError as exc:
            raise _explain(exc, path, "writing", self.key, self.contents) from exc
        with self._lock:
            self.bytes_written += view.nbytes
            if self.verify:
                self._checksums[name] = self._block_checksums(view)

    def _read(self, name: str, buffer: torch.Tensor) -> None:
        path = self.path(name)
        view = buffer.numpy()
        try:
            size = path.stat().st_size
            if size < view.nbytes:
                raise SwapError(
                    f"NVMe offload: {path} holds {size} bytes, {view.nbytes} expected: it was truncated or overwritten by "
                    f"something else; the offloaded {self.contents} in it are lost (resume from a checkpoint)"
                )
            fd = self._open(path, os.O_RDONLY)
            try:
                for start in range(0, view.nbytes, self.block_size):
                    chunk = view[start : start + self.block_size]
                    done = os.preadv(fd, [chunk], start)
                    if done != chunk.nbytes:
                        raise SwapError(f"NVMe offload: reading {path}: short read ({done} of {chunk.nbytes} bytes at offset {start})")
            finally:
                os.close(fd)
        except OSError as exc:
            raise _explain(exc, path, "reading", self.key, self.contents) from exc
        if self.verify:
            with self._lock:
                written = self._checksums.get(name)
            # A read may take a prefix of the file (masters only before the states exist): compare the blocks it covers whole.
            got = self._block_checksums(view)
            if written is not None and any(g != w for (g, w) in zip(got, written, strict=False) if g[0] == w[0]):
                raise SwapError(
                    f"NVMe offload: {path} changed on disk since it was written (CRC-32 mismatch on read-back): something else wrote "
                    f"to it or the device returned bad data; the offloaded {self.contents} in it are lost (resume from a checkpoint)"
                )
        with self._lock:
            self.bytes_read += view.nbytes

    def _block_checksums(self, view: object) -> list[tuple[int, int]]:
        """(length, CRC-32) of each ``block_size`` block, as the file is written and read: block by block from offset 0."""
        data = memoryview(view).cast("B")  # type: ignore[arg-type]
        return [(len(data[i : i + self.block_size]), zlib.crc32(data[i : i + self.block_size])) for i in range(0, len(data), self.block_size)]

    def write(self, name: str, buffer: torch.Tensor) -> Future[None]:
        """Write ``buffer`` (aligned uint8, a multiple of ``ALIGN`` bytes) as file ``name``, in the background."""
        return self.writer.submit(self._write, name, buffer)

    def read(self, name: str, buffer: torch.Tensor, after: Future[None] | None = None) -> Future[None]:
        """Fill ``buffer`` from the start of file ``name``, in the background; ``after`` (a write of the same file
        submitted earlier) finishes first. No deadlock: writes never wait for reads, and with one pool the tasks start
        in submission order, so ``after`` is running or done when this read starts."""
        if after is None:
            return self.pool.submit(self._read, name, buffer)

        def read_after() -> None:
            after.result()
            self._read(name, buffer)

        return self.pool.submit(read_after)

    def wait(self, future: Future[None]) -> None:
        """Block on ``future`` (its error, naming the path, is raised here), counting the time waited."""
        start = time.perf_counter()
        try:
            future.result()
        finally:
            self.wait_seconds += time.perf_counter() - start

    def file_bytes(self) -> dict[str, int]:
        """Size of every swap file of this rank, by name."""
        return {p.name: p.stat().st_size for p in sorted(self.root.iterdir()) if not p.name.startswith(".")}

    def close(self, remove: Callable[[str], bool] | None = None) -> None:
        self.pool.shutdown(wait=True)
        if self.writer is not self.pool:
            self.writer.shutdown(wait=True)
        if remove is not None:
            for p in list(self.root.iterdir()):
                if remove(p.name):
                    p.unlink(missing_ok=True)
