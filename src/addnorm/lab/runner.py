"""Run lab experiments with a result cache, so a second run is instant and a killed run resumes where it stopped.

Layout of an output directory::

    OUT/runs/<name>-<key>/result.json   one finished experiment (written atomically, last)
    OUT/runs/<name>-<key>/*.png         its figures
    OUT/results.json, report.md, index.html   the report over the selected experiments (see report.py)

``key`` hashes everything that can change a result: the experiment's name and config, quick, seed, device, the
addnorm version, the library's sources, the source of the experiment's module and torch's version. A result is
reused only when its key matches and its figures are still there. An experiment that raises is recorded as
"inconclusive" with the error, and is not cached (so the next run retries it); KeyboardInterrupt and SystemExit
are not caught: the run stops, keeping what finished.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import math
import os
import shutil
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

# The writers live in addnorm.io (train's checkpoints use them too); re-exported here for existing callers.
from addnorm.io import atomic_write_json, atomic_write_text, strict_json  # noqa: F401
from addnorm.io import json_default as _json_default
from addnorm.lab.core import EXPERIMENTS, Context, Experiment, Result

RECORD_FILE = "result.json"
# Experiments derive seeds such as seed * 1000 + repeat and hand them to numpy and torch generators.
SEED_LIMIT = 2**32
RESULTS_FILE = "results.json"


# ----------------------------------------------------------------------------------------------- small utilities
def parse_shard(text: str) -> tuple[int, int]:
    """``"K/N"`` -> (K, N) with 1 <= K <= N."""
    try:
        k_text, n_text = str(text).split("/")
        k, n = int(k_text), int(n_text)
    except ValueError:
        raise ValueError(f"shard must look like K/N (e.g. 2/3), got {text!r}") from None
    if n < 1 or not 1 <= k <= n:
        raise ValueError(f"shard K/N needs 1 <= K <= N, got {text!r}")
    return k, n


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


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        # fail before running anything, not once per experiment
        raise ValueError(f"device {device!r} was asked for but torch.cuda.is_available() is False")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


# ------------------------------------------------------------------------------------------------- selection
def load_experiments() -> dict[str, Experiment]:
    """Import every experiment module (registering them) and return the registry."""
    import addnorm.lab.experiments  # noqa: F401 - importing registers

    return EXPERIMENTS


def select(only: Sequence[str] | None = None, shard: tuple[int, int] | None = None,
           registry: dict[str, Experiment] | None = None) -> list[tuple[int, Experiment]]:  # fmt: skip
    """The experiments to run, as (position in the whole selection, experiment).

    ``only`` keeps the named ones (unknown names raise ValueError listing the known ones); ``shard=(K, N)`` then
    keeps every N-th starting at the K-th, so the N shards partition the selection the same way on every machine.
    """
    registry = load_experiments() if registry is None else registry
    if only:
        unknown = [n for n in only if n not in registry]
        if unknown:
            raise ValueError(f"unknown experiment(s) {unknown}; known: {', '.join(registry)}")
        wanted = set(only)
        chosen = [e for e in registry.values() if e.name in wanted]
    else:
        chosen = list(registry.values())
    indexed = list(enumerate(chosen))
    if shard is not None:
        k, n = shard
        if n < 1 or not 1 <= k <= n:
            raise ValueError(f"shard K/N needs 1 <= K <= N, got {k}/{n}")
        indexed = [(i, e) for i, e in indexed if i % n == k - 1]
    return indexed


# ----------------------------------------------------------------------------------------------------- cache
# Files that only present results (report, command line): editing them must not throw away a 3-minute cache.
_PRESENTATION_FILES = frozenset({"cli.py", "__main__.py", "lab/cli.py", "lab/report.py"})


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
    """The stored record for ``key`` if it is complete (record + every figure present), else None."""
    d = run_dir(out, exp.name, key)
    try:
        record = json.loads((d / RECORD_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if record.get("key") != key or any(not (Path(out) / f).is_file() for f in record.get("figures", [])):
        return None
    return record


# ------------------------------------------------------------------------------------------------------- run
@dataclass(kw_only=True)
class RunOptions:
    """What ``addnorm lab`` was asked to do (one field per flag)."""

    out: Path = Path("addnorm-report")
    only: list[str] | None = None
    quick: bool = False
    seed: int = 0
    device: str = "auto"
    fresh: bool = False
    shard: tuple[int, int] | None = None
    progress: bool = True  # tqdm bar on stderr
    # torch intra-op threads for the run (None: leave torch's setting). The experiments' tensors are tiny, so on a
    # busy machine one thread is often several times faster than threads that wait on each other.
    threads: int | None = None

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        if not 0 <= self.seed < SEED_LIMIT:  # numpy's generators refuse negative seeds; torch's overflow at 2**64
            raise ValueError(f"seed (--seed) must be in [0, 2**32), got {self.seed}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be an int >= 1 (or None to keep torch's setting), got {self.threads!r}")


@dataclass(kw_only=True)
class RunSummary:
    records: list[dict]
    meta: dict[str, Any]
    ran: list[str] = field(default_factory=list)  # computed this time
    reused: list[str] = field(default_factory=list)  # taken from the cache
    failed: list[str] = field(default_factory=list)  # raised (recorded as inconclusive)


def _base_record(exp: Experiment, index: int, key: str) -> dict:
    return {
        "name": exp.name,
        "claim": exp.claim,
        "source": exp.source,
        "criterion": exp.criterion,
        "config": exp.config,
        "index": index,
        "key": key,
    }


def run_one(exp: Experiment, *, index: int, out: Path, quick: bool, seed: int, device: torch.device,
            progress: Callable[[str], None] = lambda message: None) -> dict:  # fmt: skip
    """Run ``exp`` and store its record (atomically) unless it raised. Returns the record."""
    key = cache_key(exp, quick=quick, seed=seed, device=device)
    d = run_dir(out, exp.name, key)
    if d.exists():  # stale figures from a killed or failed attempt must not leak into this one
        shutil.rmtree(d)
    record = _base_record(exp, index, key)
    ctx = Context(quick=quick, seed=seed, device=device, figure_dir=d, progress=progress, config=dict(exp.config))
    torch.manual_seed(seed)
    start = time.perf_counter()
    try:
        result = exp.run(ctx)
        if not isinstance(result, Result):
            raise TypeError(f"experiment {exp.name!r} must return a Result, got {type(result).__name__}")
        missing = [f for f in result.figures if not (d / f).is_file()]
        if missing:
            raise FileNotFoundError(f"experiment {exp.name!r} listed figures it did not write: {missing}")
        json.dumps(result.metrics, default=_json_default)  # fail here, not when writing the report
    except Exception as err:  # noqa: BLE001 - any failure of one experiment is recorded, the run goes on
        record.update(
            verdict="inconclusive", metrics={}, figures=[], summary=f"error: {type(err).__name__}: {err}",
            error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc(limit=8),
            seconds=round(time.perf_counter() - start, 3), cached=False,
        )  # fmt: skip
        return record
    record.update(
        verdict=result.verdict,
        metrics=result.metrics,
        figures=[f"runs/{d.name}/{f}" for f in result.figures],
        summary=result.summary,
        seconds=round(time.perf_counter() - start, 3),
    )
    atomic_write_json(d / RECORD_FILE, record)  # last: its presence means "complete"
    return dict(record, cached=False)


def run_meta(options: RunOptions, device: torch.device) -> dict[str, Any]:
    import datetime
    import platform

    import addnorm

    return {
        "addnorm": addnorm.__version__,
        "code": package_digest(),  # which sources produced the results (merge refuses to mix two)
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": options.quick,
        "seed": options.seed,
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "shard": f"{options.shard[0]}/{options.shard[1]}" if options.shard else None,
        "only": list(options.only) if options.only else None,
    }


def run(options: RunOptions, registry: dict[str, Experiment] | None = None) -> RunSummary:
    """Run (or reuse) the selected experiments, then write the report into ``options.out``."""
    device = resolve_device(options.device)
    chosen = select(options.only, options.shard, registry)
    out = prepare_out_dir(options.out)
    if options.threads is None:
        return _run_selected(options, chosen, device, out)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(options.threads)
    try:
        return _run_selected(options, chosen, device, out)
    finally:
        torch.set_num_threads(threads_before)


def _run_selected(options: RunOptions, chosen: list[tuple[int, Experiment]], device: torch.device,
                  out: Path) -> RunSummary:  # fmt: skip
    from addnorm.lab.report import write_report

    summary = RunSummary(records=[], meta=run_meta(options, device))
    start = time.perf_counter()

    bar = None
    if options.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(chosen), unit="exp", desc="addnorm lab", dynamic_ncols=True)
    try:
        for index, exp in chosen:
            if bar is not None:
                bar.set_description(exp.name)
            key = cache_key(exp, quick=options.quick, seed=options.seed, device=device)
            record = None if options.fresh else load_cached(out, exp, key)
            if record is not None:
                record = dict(record, index=index, cached=True)
                summary.reused.append(exp.name)
            else:
                hook = (lambda message: bar.set_postfix_str(message, refresh=True)) if bar is not None else (
                    lambda message: None)  # fmt: skip
                record = run_one(exp, index=index, out=out, quick=options.quick, seed=options.seed, device=device,
                                 progress=hook)  # fmt: skip
                (summary.failed if "error" in record else summary.ran).append(exp.name)
            summary.records.append(record)
            if bar is not None:
                bar.set_postfix_str(record["verdict"], refresh=False)
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    summary.meta["seconds"] = round(time.perf_counter() - start, 1)  # this run's wall time, cache hits included
    write_report(out, summary.records, summary.meta)
    return summary


# ----------------------------------------------------------------------------------------------------- merge
class MergeConflictError(ValueError):
    """Two shard directories hold different results for the same experiment."""


_META_MUST_AGREE = ("quick", "seed", "device", "addnorm", "code")
_RESULT_FIELDS = ("verdict", "metrics", "figures", "key")


def merge(dirs: Sequence[Path], out: Path) -> RunSummary:
    """Combine shard output directories into one report in ``out``.

    Records are matched by experiment name; the same name in two directories must carry the same key, verdict,
    metrics and figures, else :class:`MergeConflictError`. Runs made with different quick/seed/device/version
    settings do not merge either. Figures are copied into ``out``.
    """
    from addnorm.lab.report import write_report

    if not dirs:
        raise ValueError("merge needs at least one directory")
    out = Path(out)
    by_name: dict[str, dict] = {}
    origin: dict[str, Path] = {}
    meta: dict[str, Any] | None = None
    for d in map(Path, dirs):
        path = d / RESULTS_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{d} has no {RESULTS_FILE}: is it an `addnorm lab` output directory?")
        data = _read_results(path)
        m = data.get("meta", {})
        if meta is None:
            meta = dict(m)
        else:
            for k in _META_MUST_AGREE:
                if m.get(k) != meta.get(k):
                    raise MergeConflictError(
                        f"{d} was run with {k}={m.get(k)!r} but {dirs[0]} with {meta.get(k)!r}"
                    )
        for rec in data.get("experiments", []):
            name = rec["name"]
            if name in by_name:
                prev = by_name[name]
                diff = [f for f in _RESULT_FIELDS if prev.get(f) != rec.get(f)]
                if diff:
                    raise MergeConflictError(
                        f"experiment {name!r} differs between {origin[name]} and {d} in {', '.join(diff)}"
                    )
                continue
            by_name[name] = rec
            origin[name] = d
    prepare_out_dir(out)
    for name, rec in by_name.items():
        for fig in rec.get("figures", []):
            src, dst = origin[name] / fig, out / fig
            if not src.is_file():
                raise FileNotFoundError(f"figure {fig} of {name!r} is missing from {origin[name]}")
            if src.resolve() != dst.resolve():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
        # keep the cache usable from the merged directory too
        if "error" not in rec and rec.get("key"):
            src_rec = origin[name] / "runs" / f"{name}-{rec['key']}" / RECORD_FILE
            dst_rec = out / "runs" / f"{name}-{rec['key']}" / RECORD_FILE
            if src_rec.is_file() and src_rec.resolve() != dst_rec.resolve():
                dst_rec.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src_rec, dst_rec)
    records = sorted(by_name.values(), key=lambda r: (r.get("index", 1 << 30), r["name"]))
    meta = dict(meta or {}, shard=None, seconds=None, merged_from=[str(d) for d in dirs])
    write_report(out, records, meta)
    return RunSummary(records=records, meta=meta)


def _read_results(path: Path) -> dict:
    """A shard's results.json, checked enough that merge fails with the file's name, not a traceback."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{path} is not a readable results file: {err}") from None
    records = data.get("experiments") if isinstance(data, dict) else None
    if not isinstance(records, list) or not all(isinstance(r, dict) and {"name", "verdict"} <= r.keys()
                                                for r in records):  # fmt: skip
        raise ValueError(f"{path} is not an `addnorm lab` results file (no 'experiments' list of records with a "
                         "name and a verdict)")  # fmt: skip
    if not isinstance(data.get("meta", {}), dict):
        raise ValueError(f"{path} is not an `addnorm lab` results file ('meta' is not an object)")
    return data
