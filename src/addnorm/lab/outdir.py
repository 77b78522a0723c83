"""The output directory of ``addnorm lab``, ``addnorm lab merge`` and ``addnorm train``: checked and created before
anything runs, and locked (``OUT/.lock``) while one of them writes into it."""

from __future__ import annotations

import json
from pathlib import Path

from addnorm.outpaths import out_dir, out_lock  # noqa: F401 - runner.py and merge.py take out_lock from here

# The report files a lab run (or merge) writes at OUT's top level, replacing what is there.
REPORT_FILES = ("results.json", "report.md", "index.html")


def _is_lab_output(out: Path) -> bool:
    """Whether ``out`` was written by ``addnorm lab`` or ``lab merge``: it holds the cache folder ``runs/`` (a first
    run killed before its report has only that) or a results.json with an experiments list and a meta."""
    if (out / "runs").is_dir():
        return True
    try:
        doc = json.loads((out / "results.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and isinstance(doc.get("experiments"), list) and isinstance(doc.get("meta"), dict)


def prepare_out_dir(out: Path, flag: str = "--out") -> Path:
    """Create the output directory ``out`` (and its parents); a ValueError naming ``flag`` when it is empty, a
    file, not writable or cannot be created, before anything runs (the checks of :mod:`addnorm.outpaths`), or
    when it holds a results.json, report.md or index.html that no lab run wrote (a website's index.html, one's own
    notes): the report would replace them."""
    path = Path(out)
    if path.is_dir() and not _is_lab_output(path):
        foreign = [name for name in REPORT_FILES if (path / name).exists()]
        if foreign:
            raise ValueError(
                f"{flag} {str(out)!r} holds {', '.join(foreign)} that no `addnorm lab` run wrote (it has no runs/ "
                "cache and no lab results.json): the report would replace them; give another directory"
            )
    return out_dir(out, flag)
