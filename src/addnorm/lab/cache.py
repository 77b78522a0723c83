"""The cache of finished experiments: ``OUT/runs/<name>-<key>/result.json`` (see runner.py for the whole layout of
an output directory).

``key`` hashes everything that can change a result: the experiment's name and config, quick, seed, device, the
addnorm version, the library's sources, the source of the experiment's module and torch's version. A result is
reused only when its key matches, it has the shape of a record (a verdict, metrics, figures, ...: anything else
is a cache miss, recomputed) and its figures are still there. Failures are never cached.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import math
from pathlib import Path
from typing import Any

import torch

from addnorm.io import json_default as _json_default
from addnorm.lab.core import KINDS, VERDICTS, Experiment

RECORD_FILE = "result.json"
TASKS_DIR = "tasks"  # under OUT/runs/: finished ctx.map tasks of unfinished experiments (tasks.py)


# Files that only present results (report, command line): editing them must not throw away a 3-minute cache.
_PRESENTATION_FILES = frozenset(
    {
        "cli.py",
        "__main__.py",
        "lab/cli.py",
        "lab/report.py",
        "lab/formatting.py",
        "lab/docs.py",
        "lab/seed_record.py",
        "lab/seeds_advice.py",
        "lab/pooled.py",
        "lab/merge.py",
    }
)


@functools.lru_cache(maxsize=1)
def package_digest() -> str:
    """A hash of every addnorm source file that can change a result: the experiments run the library (models,
    norms, kernels, training loop), so a fix anywhere in it must invalidate cached verdicts, not only a change in
    the experiment's own module. Computed once per process."""
    import addnorm

    root = Path(addnorm.__file__).parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel not in _PRESENTATION_FILES:
            h.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def code_version(exp: Experiment) -> str:
    """addnorm's version, a hash of the library's sources (:func:`package_digest`) and a hash of the source of the
    module that defines the experiment (which may live outside the package)."""
    import addnorm

    try:  # the whole file, read by path: the same key whether the module ran as __main__ or was imported
        source = Path(inspect.getfile(exp.run)).read_bytes()
    except (OSError, TypeError):
        source = exp.run.__qualname__.encode()  # no source file (e.g. defined in a REPL): fall back to the name
    digest = hashlib.sha256(source).hexdigest()[:12]
    return f"{addnorm.__version__}+{package_digest()}+{digest}"


def cache_key(exp: Experiment, *, quick: bool, seed: int, device: torch.device) -> str:
    payload = {
        "name": exp.name,
        "config": exp.config,
        "quick": bool(quick),
        "seed": int(seed),
        "device": str(device),
        "code": code_version(exp),
        # the report's header names this torch: results computed under another one must not be shown under it
        "torch": torch.__version__,
    }
    blob = json.dumps(payload, sort_keys=True, default=_json_default)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def run_dir(out: Path, exp_name: str, key: str) -> Path:
    return Path(out) / "runs" / f"{exp_name}-{key}"


def load_cached(out: Path, exp: Experiment, key: str) -> dict | None:
    """The stored record for ``key`` if it is complete and well formed (:func:`valid_record`) and every figure is
    present, else None (recomputed). Never raises for what is in the file."""
    d = run_dir(out, exp.name, key)
    try:
        record = json.loads((d / RECORD_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not valid_record(record, name=exp.name, key=key):
        return None
    if any(not (Path(out) / f).is_file() for f in record["figures"]):
        return None
    return record


_OPTIONAL_TEXT = ("claim", "source", "criterion", "summary", "reason", "precondition")


def valid_record(record: Any, *, name: str, key: str) -> bool:
    """Whether ``record`` has the shape run_one writes: a hand-edited or foreign file of valid JSON but the wrong
    shape (``[]``, ``null``, ``verdict: 42``, ``figures: [null]``, ...) must be a cache miss, not a traceback or a
    made-up verdict in the report."""
    if not isinstance(record, dict) or record.get("key") != key or record.get("name") != name:
        return False
    if record.get("verdict") not in VERDICTS or "error" in record:  # failures are never cached
        return False
    if not isinstance(record.get("metrics"), dict) or not isinstance(record.get("timings", {}), dict):
        return False
    if record.get("kind", "empirical") not in KINDS:
        return False
    if any(not isinstance(record.get(f, ""), str) for f in _OPTIONAL_TEXT):
        return False
    seconds = record.get("seconds", 0.0)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
        return False
    figures = record.get("figures")
    if not isinstance(figures, list):
        return False
    prefix = ("runs", f"{name}-{key}")
    for f in figures:  # a figure is embedded into the page: it must be this run's own file, nothing outside
        if not isinstance(f, str) or "\\" in f:
            return False
        parts = Path(f).parts
        if len(parts) < 3 or parts[:2] != prefix or ".." in parts or Path(f).is_absolute():
            return False
    return True
