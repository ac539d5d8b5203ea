"""Files that survive a crash, and locks that hold on a shared file system.

A replaced file is written beside itself, fsynced, renamed over the old one and its directory
fsynced: a crash leaves the old file or the new one, whole. An appended line is flushed and
fsynced under the file's lock. The profile cache often lives in a home directory on NFS (a SLURM
cluster's), where flock may lock nothing across hosts or fail outright (no lockd; Lustre without
`-o flock`), so a lock here is a file created with O_CREAT | O_EXCL, which is atomic on local
file systems and on NFSv3 and later (Optuna's JournalFileOpenLock). A lock its holder left behind
(a crash) is broken once its file is `stale` seconds old; of two sweeps breaking the same stale
lock at the same instant both may enter, and the worst that does is a skipped line or a lost
version, never a damaged file.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import tempfile
import time
import uuid
from pathlib import Path
from typing import BinaryIO, Iterator

log = logging.getLogger(__name__)
STALE = 30.0  # seconds: a lock held for a write of a few lines is not held this long but by a crashed holder
POLL_MAX = 0.05  # seconds between tries for a held lock, at most


def write_atomically(path: Path, text: str) -> None:
    """Replace the file with the text, so that a crash leaves the old file or the new, whole."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    sync_directory(path.parent)


def append_line(path: Path, line: str, stale: float = STALE) -> None:
    """Append one line under the file's lock, flushed and fsynced before the lock is let go. A
    torn last line (a crash mid-append) is ended first, so that it alone is lost."""
    with locked(lock_of(path), stale), path.open("a+b") as f:
        end = f.seek(0, os.SEEK_END)
        f.write((b"\n" if _torn(f, end) else b"") + line.encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())
    if end == 0:
        sync_directory(path.parent)  # the new file's name


def _torn(f: BinaryIO, end: int) -> bool:
    """Whether the file's last line has no end (the write of it was cut short)."""
    if end == 0:
        return False
    f.seek(end - 1)
    return f.read(1) != b"\n"


def sync_directory(path: Path) -> None:
    """fsync a directory, so that a name just created or renamed in it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:  # a file system that cannot sync a directory (some FUSE ones) says so
        if err.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def lock_of(path: Path) -> Path:
    return path.with_name(f"{path.name}.lock")


@contextlib.contextmanager
def locked(path: Path, stale: float = STALE) -> Iterator[None]:
    """Hold the lock file, waiting while another holds it (breaking it once stale)."""
    token, wait = _token(), 0.001
    while not _create(path, token):
        _break_if_stale(path, stale)
        time.sleep(wait)
        wait = min(2 * wait, POLL_MAX)
    try:
        yield
    finally:
        _release(path, token)


@contextlib.contextmanager
def claimed(path: Path, stale: float) -> Iterator[bool]:
    """Hold the lock file if it is free now (True), else False at once."""
    token = _token()
    mine = _create(path, token) or (_break_if_stale(path, stale) and _create(path, token))
    try:
        yield mine
    finally:
        if mine:
            _release(path, token)


def _token() -> str:
    return f"{socket.gethostname()} pid {os.getpid()} {uuid.uuid4().hex}"


def _create(path: Path, token: str) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return True


def _break_if_stale(path: Path, stale: float) -> bool:
    """Remove the lock where its file is older than `stale` seconds; True when it is gone."""
    try:
        age = time.time() - path.stat().st_mtime
        if age < stale:
            return False
        holder = path.read_text()
        path.unlink()
    except FileNotFoundError:
        return True
    log.warning("%s: broke a lock held for %.0f s by %s (it crashed, or its clock is off)", path, age,
                holder.rsplit(" ", 1)[0] or "a process that never wrote its name")
    return True


def _release(path: Path, token: str) -> None:
    """Remove the lock file, unless it is no longer ours (broken as stale, then taken)."""
    with contextlib.suppress(FileNotFoundError):
        if path.read_text() == token:
            path.unlink()
