"""Crash-safe checkpoint files: write to a staging directory, commit on every rank at once, verify on load.

Why: a rank killed in the middle of ``save_checkpoint`` (or a full disk, or a copy cut short) must
never leave a checkpoint that loads with wrong numbers. So one save is a small protocol shared by
every rank (``CheckpointWriter``):

1. rank 0 clears a stale staging directory ``SAVE_DIR/.TAG.saving`` (left by an earlier crash) and
   creates it; barrier;
2. each rank writes its files into it, each to a temporary name, flushed, fsynced and renamed,
   recording its size and CRC-32 while writing (no second read);
3. the ranks exchange their records and their outcome: if any rank failed, every rank raises and
   nothing is committed (the previous ``TAG`` and ``latest`` are untouched);
4. rank 0 writes ``manifest.json`` (every file, its size, checksum and writer), swaps the staging
   directory into ``SAVE_DIR/TAG`` (an older ``TAG`` is moved aside first, then removed), writes
   ``latest`` last, and tells every rank the checkpoint is committed.

``CheckpointReader`` loads files of a committed checkpoint and checks each against the manifest
first: a truncated file, flipped bytes, or a missing file raise ``CheckpointCorruptError`` naming
the file and what differs. Assumes a file system every rank sees (as the ``latest`` file does).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import torch
import torch.distributed as dist

from dscompile.errors import DSCompileError
from dscompile.runtime.devices import collective_device

LATEST = "latest"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_CHUNK = 8 << 20


class CheckpointError(DSCompileError):
    """A checkpoint that cannot be saved or loaded; the message names the directory or file and the fix."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is missing, truncated or altered since it was saved."""


@dataclass
class FileRecord:
    """What the manifest keeps about one file: enough to tell it is whole and unchanged."""

    name: str
    bytes: int
    crc32: int
    rank: int


# ------------------------------------------------------------------------------------ writing
class _ChecksumWriter:
    """A write-only file object that counts and checksums what passes through it."""

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle = handle
        self.size = 0
        self.crc = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        return self.handle.write(view)

    def flush(self) -> None:
        self.handle.flush()


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # some file systems cannot open a directory; the rename still happened
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _atomic_file(path: Path) -> Iterator[_ChecksumWriter]:
    """Write ``path`` under a temporary name; rename it into place only once it is complete and on disk."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            writer = _ChecksumWriter(handle)
            yield writer
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def atomic_save(obj: Any, path: str | os.PathLike, rank: int = 0) -> FileRecord:
    """``torch.save(obj, path)``, crash-safe: a reader sees the old file, or the complete new one."""
    path = Path(path)
    with _atomic_file(path) as writer:
        torch.save(obj, writer)
    return FileRecord(path.name, writer.size, writer.crc, rank)


def atomic_write_text(path: str | os.PathLike, text: str) -> FileRecord:
    path = Path(path)
    with _atomic_file(path) as writer:
        writer.write(text.encode())
    return FileRecord(path.name, writer.size, writer.crc, 0)


def file_checksum(path: Path) -> tuple[int, int]:
    """(size, CRC-32) of a file, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def _world(group: Any) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


class CheckpointWriter:
    """One checkpoint save by every rank of ``group`` (all must enter and leave it together).

        with CheckpointWriter(save_dir, tag) as ckpt:
            if rank == 0:
                ckpt.save(meta, "mp_rank_00_model_states.pt")
            ckpt.save(shard, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")

    On leaving, the checkpoint is committed (manifest, directory swap, ``latest``) on every rank,
    or, when any rank raised, on none: every rank then raises.
    """

    def __init__(self, save_dir: str | os.PathLike, tag: str, *, save_latest: bool = True, group: Any = None) -> None:
        tag = str(tag)
        if not tag or "/" in tag or tag.startswith(".") or tag == LATEST:
            raise CheckpointError(f"checkpoint tag {tag!r} must be a plain directory name (no '/', not hidden, not 'latest')")
        self.save_dir = Path(save_dir)
        self.tag = tag
        self.save_latest = save_latest
        self.group = group
        self.rank, self.world = _world(group)
        self.directory = self.save_dir / tag
        self.staging = self.save_dir / f".{tag}.saving"
        self.records: list[FileRecord] = []

    # -- collectives (no-ops on one process) ---------------------------------------------------
    @contextlib.contextmanager
    def _peers(self) -> Iterator[None]:
        """A collective of the save failing means another rank died or stalled while saving: say so."""
        try:
            yield
        except RuntimeError as exc:
            raise CheckpointError(
                f"checkpoint {self.directory} not saved: rank {self.rank} lost contact with another rank during save_checkpoint "
                f"(it died, or stalled past the process group timeout); the previous checkpoints and '{LATEST}' are unchanged. "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def _all_gather(self, value: Any) -> list[Any]:
        if self.world == 1:
            return [value]
        out: list[Any] = [None] * self.world
        with self._peers():
            dist.all_gather_object(out, value, group=self.group)
        return out

    def _from_rank0(self, value: Any) -> Any:
        if self.world == 1:
            return value
        box = [value]
        with self._peers():
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0, group=self.group)
        return box[0]

    # -- protocol ------------------------------------------------------------------------------
    def __enter__(self) -> CheckpointWriter:
        problem = None
        if self.rank == 0:
            try:
                self.save_dir.mkdir(parents=True, exist_ok=True)
                if self.staging.exists():
                    shutil.rmtree(self.staging)  # a save that never committed (killed, failed): discard it
                self.staging.mkdir()
            except OSError as exc:
                problem = f"cannot create {self.staging}: {exc}"
        problem = self._from_rank0(problem)
        if problem:
            raise CheckpointError(problem)
        return self

    def save(self, obj: Any, name: str) -> Path:
        """Write one file of this checkpoint (``torch.save``), atomically, and record it for the manifest."""
        if name in (MANIFEST, LATEST) or "/" in name:
            raise CheckpointError(f"checkpoint file name {name!r} is reserved or not a plain name")
        record = atomic_save(obj, self.staging / name, self.rank)
        self.records.append(record)
        return self.directory / name

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        outcome = None if exc is None else f"{type(exc).__name__}: {exc}"
        gathered = self._all_gather(([asdict(r) for r in self.records], outcome))
        failed = [(rank, why) for rank, (_, why) in enumerate(gathered) if why]
        if failed:
            if exc is None:
                rank, why = failed[0]
                raise CheckpointError(
                    f"checkpoint {self.directory} not saved: rank {rank} failed writing its files ({why}); "
                    f"the previous checkpoints and '{LATEST}' are unchanged"
                )
            return False  # this rank's own exception propagates
        problem = None
        if self.rank == 0:
            try:
                self._commit([FileRecord(**r) for records, _ in gathered for r in records])
            except Exception as exc:  # told to every rank below, then raised everywhere
                problem = f"{type(exc).__name__}: {exc}"
        problem = self._from_rank0(problem)
        if problem:
            raise CheckpointError(f"checkpoint {self.directory} not committed: {problem}")
        return False

    def _commit(self, records: list[FileRecord]) -> None:
        names = [r.name for r in records]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise CheckpointError(f"several ranks wrote {duplicates}")
        manifest = {
            "format": MANIFEST_FORMAT,
            "tag": self.tag,
            "world_size": self.world,
            "saved_at": time.time(),
            "files": {r.name: {"bytes": r.bytes, "crc32": r.crc32, "rank": r.rank} for r in sorted(records, key=lambda r: r.name)},
        }
        atomic_write_text(self.staging / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        old = self.save_dir / f".{self.tag}.replaced"
        if old.exists():
            shutil.rmtree(old)
        if self.directory.exists():
            os.replace(self.directory, old)  # a crash right here leaves TAG absent (never half-written)
        os.replace(self.staging, self.directory)
        _fsync_dir(self.save_dir)
        if old.exists():
            shutil.rmtree(old)
        if self.save_latest:
            atomic_write_text(self.save_dir / LATEST, self.tag)


# ------------------------------------------------------------------------------------ reading
def read_latest(load_dir: str | os.PathLike) -> str | None:
    """The tag named by ``load_dir/latest``, or None when there is none."""
    path = Path(load_dir) / LATEST
    if not path.is_file():
        return None
    tag = path.read_text().strip()
    return tag or None


def resolve_checkpoint_dir(load_dir: str | os.PathLike, tag: str | None) -> Path:
    """``load_dir/tag`` (``tag`` defaults to ``latest``), with errors that say what exists instead."""
    root = Path(load_dir)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    if tag is None:
        tag = read_latest(root)
        if tag is None:
            raise CheckpointError(f"{root} has no '{LATEST}' file naming a checkpoint; pass tag= (tags here: {', '.join(available_tags(root)) or 'none'})")
    directory = root / str(tag)
    if not directory.is_dir():
        hint = ""
        if (root / f".{tag}.replaced").is_dir():
            hint = f"; a save replacing it was interrupted: the previous version is {root / f'.{tag}.replaced'} (rename it to {tag})"
        raise CheckpointError(f"checkpoint {directory} does not exist (tags here: {', '.join(available_tags(root)) or 'none'}){hint}")
    return directory


def available_tags(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


class CheckpointReader:
    """Loads the files of one checkpoint directory, each verified against its manifest first.

    ``require_manifest=False`` reads a directory without one (a checkpoint written by DeepSpeed or
    by an older dscompile) unverified.
    """

    def __init__(self, directory: str | os.PathLike, *, require_manifest: bool = True) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory {self.directory} does not exist")
        path = self.directory / MANIFEST
        self.manifest: dict[str, Any] | None = None
        if path.is_file():
            try:
                self.manifest = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise CheckpointCorruptError(f"{path} is not valid JSON ({exc}): the checkpoint's manifest is damaged") from None
        elif require_manifest:
            raise CheckpointCorruptError(
                f"{self.directory} has no {MANIFEST}: it was not completely saved (interrupted save_checkpoint) "
                "or was written without one; load another tag"
            )
        self._verified: set[str] = set()

    def has(self, name: str) -> bool:
        if self.manifest is not None:
            return name in self.manifest["files"]
        return (self.directory / name).is_file()

    def names(self) -> list[str]:
        if self.manifest is not None:
            return sorted(self.manifest["files"])
        return sorted(p.name for p in self.directory.iterdir() if p.is_file())

    def verify(self, name: str) -> Path:
        """Check ``name`` is present, whole and unchanged; returns its path."""
        path = self.directory / name
        if not path.is_file():
            saved = f" (the manifest lists it: {self.manifest['files'][name]['bytes']} bytes)" if self.manifest and name in self.manifest["files"] else ""
            raise CheckpointCorruptError(f"checkpoint file {path} is missing{saved}")
        if self.manifest is None or name in self._verified:
            return path
        entry = self.manifest["files"].get(name)
        if entry is None:
            raise CheckpointCorruptError(f"checkpoint file {path} is not in {self.directory / MANIFEST}: it was not written by this save")
        actual = path.stat().st_size
        if actual != entry["bytes"]:
            how = "truncated" if actual < entry["bytes"] else "longer than saved"
            raise CheckpointCorruptError(f"checkpoint file {path} is {actual} bytes, {entry['bytes']} when saved: it is {how}")
        size, crc = file_checksum(path)
        if crc != entry["crc32"] or size != entry["bytes"]:
            raise CheckpointCorruptError(
                f"checkpoint file {path} does not match the checksum recorded when it was saved (CRC-32 {crc:08x}, "
                f"expected {entry['crc32']:08x}): its bytes were altered or damaged"
            )
        self._verified.add(name)
        return path

    def load(self, name: str, *, weights_only: bool = False) -> Any:
        """``torch.load`` of one verified file onto the CPU; a damaged file raises naming it."""
        path = self.verify(name)
        try:
            return torch.load(path, map_location="cpu", weights_only=weights_only)
        except Exception as exc:
            raise CheckpointCorruptError(f"checkpoint file {path} cannot be read: {type(exc).__name__}: {exc}") from exc


def check_tag_agreement(tag: str, mode: str) -> None:
    """DeepSpeed's ``checkpoint.tag_validation``: the ranks must save under one tag (a rank-specific tag leaves a
    checkpoint that no other world size can find). ``Warn`` (the default) logs on the ranks whose tag differs,
    ``Fail`` raises there and ``Ignore`` skips the check. Two small all-reduces (MAX and MIN of the tag's hash)."""
    if mode.lower() == "ignore" or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    digest = torch.tensor(list(hashlib.sha1(tag.encode()).digest()), dtype=torch.int32, device=collective_device())
    high, low = digest.clone(), digest.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    if torch.equal(high, digest) and torch.equal(low, digest):
        return
    message = (
        f"checkpoint tag {tag!r} on rank {dist.get_rank()} differs from another rank's: a tag holding rank-specific text "
        "leaves a checkpoint that cannot be found again (checkpoint.tag_validation)"
    )
    if mode.lower() == "fail":
        raise DSCompileError(message + "; pass the same tag on every rank, or set checkpoint.tag_validation to Warn or Ignore")
    logging.getLogger("dscompile.checkpoint").warning(message)
