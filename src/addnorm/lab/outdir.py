"""The output directory of ``addnorm lab`` and ``addnorm lab merge``: created before anything runs, and locked
(``OUT/.lock``) while one of them writes into it."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

LOCK_FILE = ".lock"


def prepare_out_dir(out: Path, flag: str = "--out") -> Path:
    """Create the output directory ``out`` (and its parents); a ValueError naming ``flag`` when it is a file or
    cannot be created, before anything runs."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {str(out)!r} is a file, not a directory: give a directory path")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a parent is a file, no permission, read-only file system, ...
        raise ValueError(f"{flag} {str(out)!r}: cannot create the directory ({err.strerror or err})") from None
    return out


@contextlib.contextmanager
def out_lock(out: Path, flag: str = "--out"):
    """Hold ``OUT/.lock`` for the run, so two ``addnorm lab`` runs never write into one folder at once (the second
    deleted the first's figures mid-run). The second gets a ValueError naming the holder. The lock is an flock:
    the kernel releases it when its process dies, so a killed run leaves no stale lock behind."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock (documented)
        yield
        return
    path = Path(out) / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
            raise ValueError(
                f"{flag} {str(out)!r} is in use by another `addnorm lab` run ({holder}); wait for it "
                "to finish, or give another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock
