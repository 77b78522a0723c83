"""Output paths from the command line, checked before anything runs or is written.

One set of rules for every command that writes (``lab``, ``lab merge``, ``lab doc``, ``survey``, ``train``): an
empty path is refused (``--out ""`` used to mean the current folder, where it replaced an ``index.html``), a
directory must not be a file and a file must not be a directory, the place must be writable, and two outputs of
one command must not be the same file (the second silently replaced the first). Each refusal is a ValueError
that names the flag and the problem. :func:`describe_os_error` turns an OSError met later (a full disk) into the
words a user can act on. :func:`out_lock` holds ``OUT/.lock`` while a run writes into ``OUT``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = ["LOCK_FILE", "check_distinct", "describe_os_error", "out_dir", "out_file", "out_lock"]

LOCK_FILE = ".lock"


def _text(value: str | os.PathLike, flag: str, what: str) -> str:
    text = os.fspath(value) if value is not None else ""
    if not str(text).strip():
        raise ValueError(f"{flag} is empty: give a {what} path ('.' for the current folder)")
    return str(text)


def _writable_ancestor(path: Path, flag: str) -> None:
    """The nearest existing folder of ``path`` must be a folder we may create entries in."""
    probe = path
    while not probe.exists():
        if probe.is_symlink():  # a dangling link: its target's folder decides
            probe = Path(os.path.realpath(probe))
            continue
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{flag} {str(path)!r}: {str(probe)!r} is a file, so nothing can be created under it")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {str(path)!r}: the folder {str(probe)!r} is not writable (permission denied)")


def out_dir(value: str | os.PathLike, flag: str = "--out", *, create: bool = True) -> Path:
    """The output directory ``value``, checked (and created with its parents when ``create``)."""
    path = Path(_text(value, flag, "directory"))
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a file, not a directory: give a directory path")
    _writable_ancestor(path, flag)
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:  # a race, a read-only file system, ...
            raise ValueError(f"{flag} {str(path)!r}: cannot create the directory ({describe_os_error(err)})") from None
    return path


def out_file(value: str | os.PathLike, flag: str) -> Path:
    """The output file ``value``, checked: not empty, not a directory, in a folder that can be written."""
    path = Path(_text(value, flag, "file"))
    if path.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a directory, not a file: give a file path")
    target = Path(os.path.realpath(path)) if path.is_symlink() else path  # atomic writes go through a link
    _writable_ancestor(target.parent, flag)
    return path


def check_distinct(outputs: Iterable[tuple[str, str | os.PathLike]]) -> None:
    """Refuse two outputs (``(what, path)`` pairs) that are one file: the second write would replace the first."""
    seen: dict[str, str] = {}
    for what, path in outputs:
        key = os.path.realpath(os.fspath(path))
        if key in seen:
            raise ValueError(f"{seen[key]} and {what} are the same file ({key}): one would overwrite the other")
        seen[key] = what


_PLAIN = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
}


def describe_os_error(err: OSError) -> str:
    """``err`` in words: what went wrong (full disk, permissions, ...) and on which file."""
    what = _PLAIN.get(err.errno) or err.strerror or str(err) or type(err).__name__
    return f"{what}: {err.filename}" if err.filename else what


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
