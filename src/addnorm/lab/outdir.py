"""The output directory of ``addnorm lab``, ``addnorm lab merge`` and ``addnorm train``: checked and created before
anything runs, and locked (``OUT/.lock``) while one of them writes into it."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from addnorm.outpaths import out_dir

LOCK_FILE = ".lock"


def prepare_out_dir(out: Path, flag: str = "--out") -> Path:
    """Create the output directory ``out`` (and its parents); a ValueError naming ``flag`` when it is empty, a
    file, not writable or cannot be created, before anything runs (the checks of :mod:`addnorm.outpaths`)."""
    return out_dir(out, flag)


@contextlib.contextmanager
def out_lock(out: Path, flag: str = "--out", command: str = "addnorm lab"):
    """Hold ``OUT/.lock`` for the run, so two runs of ``command`` (``addnorm lab``, ``addnorm train``) never write
    into one folder at once (a second lab deleted the first's figures mid-run; a second train interleaved its log
    with the first's). The second gets a ValueError naming the holder. The lock is an flock: the kernel releases it
    when its process dies, so a killed run leaves no stale lock behind."""
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
                f"{flag} {str(out)!r} is in use by another `{command}` run ({holder}); wait for it "
                "to finish, or give another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock
