"""The output directory of ``addnorm lab``, ``addnorm lab merge`` and ``addnorm train``: checked and created before
anything runs, and locked (``OUT/.lock``) while one of them writes into it."""

from __future__ import annotations

from pathlib import Path

from addnorm.outpaths import out_dir, out_lock  # noqa: F401 - runner.py and merge.py take out_lock from here


def prepare_out_dir(out: Path, flag: str = "--out") -> Path:
    """Create the output directory ``out`` (and its parents); a ValueError naming ``flag`` when it is empty, a
    file, not writable or cannot be created, before anything runs (the checks of :mod:`addnorm.outpaths`)."""
    return out_dir(out, flag)
