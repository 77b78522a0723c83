"""``addnorm lab merge``: combine the output directories of shard runs (``--shard K/N``) into one report."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from addnorm.lab.cache import RECORD_FILE
from addnorm.lab.outdir import out_lock, prepare_out_dir
from addnorm.lab.report import RESULTS_FILE, read_results, write_report
from addnorm.lab.runner import RunSummary


class MergeConflictError(ValueError):
    """Two shard directories hold different results for the same experiment."""


_META_MUST_AGREE = ("quick", "seed", "device", "addnorm", "code", "engine")
_META_DEFAULTS = {"engine": "sequential"}  # what a results.json written before the field existed ran with
# What determines a result: the same key (code, config, sizes, seed, device, torch) must give the same verdict,
# reason, metrics and evidence (the units the seed record pools). Not timings or seconds: wall-clock values differ
# on every run (core.py's Result.timings).
_RESULT_FIELDS = ("verdict", "reason", "metrics", "evidence", "key")


def merge(dirs: Sequence[Path], out: Path) -> RunSummary:
    """Combine shard output directories into one report in ``out``.

    Records are matched by experiment name; the same name in two directories must carry the same key, verdict,
    reason, metrics and evidence (timings and seconds may differ), else :class:`MergeConflictError`. Runs made with
    different quick/seed/device/engine/version settings do not merge either. Figures are copied into ``out``, which
    is locked (:func:`out_lock`) while merge writes.
    """
    if not dirs:
        raise ValueError("merge needs at least one directory")
    seen: dict[Path, Path] = {}
    for d in map(Path, dirs):  # `merge a a` is a typo for `merge a b`: merging a with itself hides b's absence
        if d.resolve() in seen:
            raise ValueError(f"{d} is given twice (as {seen[d.resolve()]} and {d}): give each shard's directory once")
        seen[d.resolve()] = d
    out = Path(out)
    by_name: dict[str, dict] = {}
    origin: dict[str, Path] = {}
    meta: dict[str, Any] | None = None
    for d in map(Path, dirs):
        path = d / RESULTS_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{d} has no {RESULTS_FILE}: is it an `addnorm lab` output directory?")
        data = read_results(path)
        m = data.get("meta", {})
        if meta is None:
            meta = dict(m)
        else:
            for k in _META_MUST_AGREE:
                mine, first = m.get(k, _META_DEFAULTS.get(k)), meta.get(k, _META_DEFAULTS.get(k))
                if mine != first:
                    raise MergeConflictError(f"{d} was run with {k}={mine!r} but {dirs[0]} with {first!r}")
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
    with out_lock(out):
        return _write_merged(out, dirs, by_name, origin, meta)


def _write_merged(
    out: Path, dirs: Sequence[Path], by_name: dict[str, dict], origin: dict[str, Path], meta: dict[str, Any] | None
) -> RunSummary:
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
    meta = dict(
        meta or {},
        shard=None,
        seconds=None,
        merged_from=[str(d) for d in dirs],
        cached=None,
        computed_seconds=round(
            sum(r.get("seconds") or 0.0 for r in records if isinstance(r.get("seconds"), (int, float))), 1
        ),
    )
    write_report(out, records, meta)
    return RunSummary(records=records, meta=meta)
