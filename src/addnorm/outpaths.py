"""Output paths from the command line, checked before anything runs or is written.

One set of rules for every command that writes (``lab``, ``lab merge``, ``lab doc``, ``survey``, ``train``): an
empty path is refused (``--out ""`` used to mean the current folder, where it replaced an ``index.html``), a
directory must not be a file and a file must not be a directory, the place must be writable, and two outputs of
one command must not be the same file (the second silently replaced the first). Each refusal is a ValueError
that names the flag and the problem. :func:`describe_os_error` turns an OSError met later (a full disk) into the
words a user can act on.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["check_distinct", "describe_os_error", "out_dir", "out_file"]


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
