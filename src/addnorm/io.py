"""Files that a crash never leaves half-written, with the permissions users expect, and strict JSON.

Every output addnorm writes (lab records and reports, training checkpoints and logs) goes through
:func:`atomic_write_bytes`: a temporary file in the same directory, fsync, then ``os.replace``, so a reader (or a
kill at any moment) sees the old file or the new one, never a torn one. ``tempfile.mkstemp`` creates files mode
0600; a new file is given the mode a plain ``open()`` would (0666 minus the umask), so a report is readable by the
people it is written for, and a file that exists keeps its own mode (a user's 0600 or 0755 is theirs). A path that
is a symbolic link is written through: its target gets the new content and the link stays a link (``os.replace``
on the link itself would swap it for a regular file).
"""

from __future__ import annotations

import json
import math
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)  # the only portable way to read it: set, then restore at once
    os.umask(mask)
    return mask


def _mode_for(path: Path) -> int:
    """The mode the written file gets: the existing file's, else what ``open()`` would give a new one."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return 0o666 & ~_umask()


def atomic_write(path: Path, write: Callable[[Any], None], *, binary: bool) -> None:
    """Call ``write(file)`` on a temporary file next to ``path`` (next to its target when ``path`` is a symbolic
    link), then move it into place atomically."""
    path = Path(path)
    if path.is_symlink():  # realpath follows chains and relative links from the link's own folder
        path = Path(os.path.realpath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = _mode_for(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text), binary=False)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data), binary=True)


def atomic_write_json(path: Path, data: Any) -> None:
    """Strict JSON (what jq and browsers accept): non-finite floats are stored as the strings "inf", "-inf" and
    "nan" (an fp16 overflow is a result worth keeping, and JSON has no literal for it)."""
    text = json.dumps(strict_json(data), indent=2, sort_keys=False, allow_nan=False)
    atomic_write_text(path, text + "\n")


def strict_json(obj: Any) -> Any:
    """``obj`` with tensors/numpy values as lists and numbers, and non-finite floats as "inf"/"-inf"/"nan"."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else ("nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf"))
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return strict_json(json_default(obj))


def json_default(obj: Any) -> Any:
    """numpy scalars and tensors slip into metrics easily: store them as plain numbers/lists."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"metrics must be JSON-serializable, got {type(obj).__name__}")
