"""``addnorm lab seeds``: the verdict of each empirical experiment at several ``--seed`` values, from real runs.

A lab verdict rests on three model seeds inside one run; ``--seed S`` moves all of them (seeds S, S+1, S+2) and the
language (seed S). Issue 27 asks that every empirical verdict be the same at ``--seed`` 0, 1 and 2, or that the
verdict's own text say that it flips. Running the whole lab three times for each page is more than a 2-core machine
has, so the runs at other seeds are made apart (``addnorm lab --only NAME --seed S``) and recorded here:

* :func:`build_record` reads the ``results.json`` of such runs (not ``--quick`` ones) and keeps, per experiment
  and seed, the verdict with the run's code hash and date. Two runs of one experiment at one seed must agree on the
  verdict unless their code differs; then the newer run counts.
* ``addnorm lab doc --seed-record FILE`` prints under each empirical verdict the line of :func:`seed_line`: the
  verdicts at every recorded seed, "**flips with --seed**" where they differ, and a warning where the page's own
  run disagrees with the record at its seed (the record is older than the code).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from addnorm.lab.formatting import kind_of
from addnorm.lab.report import RESULTS_FILE, read_results

__all__ = ["build_record", "load_record", "seed_line"]

RECORD_VERSION = 1


def _runs(dirs: Iterable[Path]) -> list[tuple[Path, dict]]:
    runs = []
    for d in map(Path, dirs):
        path = d / RESULTS_FILE if d.is_dir() else d
        if not path.is_file():
            raise ValueError(f"{d} has no {RESULTS_FILE}: give the output directory of an `addnorm lab` run")
        runs.append((d, read_results(path)))
    return runs


def build_record(dirs: Iterable[Path], previous: dict | None = None) -> dict[str, Any]:
    """The record of the empirical verdicts in the runs ``dirs`` (output directories or results.json files),
    added to ``previous`` (an earlier record: its entries stay unless a run here replaces them).

    Returns ``{"version": 1, "experiments": {name: {seed (str): {"verdict", "code", "date", "summary"}}}}``.
    Quick runs are refused (their sizes are not the verdict's). Two runs of the same code at the same seed that
    disagree are refused: the lab's results repeat exactly, so that means a broken run or an edited file.
    """
    experiments: dict[str, dict[str, dict]] = {}
    source: dict[tuple[str, str], Path] = {}  # which directory each entry came from, for the error message only
    if previous is not None:
        if previous.get("version") != RECORD_VERSION or not isinstance(previous.get("experiments"), dict):
            raise ValueError(f"the previous record is not a version-{RECORD_VERSION} seed record")
        experiments = {name: dict(by_seed) for name, by_seed in previous["experiments"].items()}
    for d, doc in _runs(dirs):
        meta = doc.get("meta") or {}
        if meta.get("quick"):
            raise ValueError(f"{d} is a --quick run: its verdicts are not recorded (quick sizes are a smoke test)")
        if meta.get("seed") is None:
            raise ValueError(f"{d}: its results.json records no seed")
        seed = str(meta["seed"])
        for r in doc["experiments"]:
            if kind_of(r) != "empirical":
                continue
            entry = {"verdict": r["verdict"], "code": meta.get("code"), "date": meta.get("date")}
            entry["summary"] = r.get("summary") or ""
            old = experiments.setdefault(r["name"], {}).get(seed)
            if old is not None and old.get("code") == entry["code"] and old["verdict"] != entry["verdict"]:
                where = source.get((r["name"], seed), "the previous record")
                raise ValueError(
                    f"{r['name']} at --seed {seed}: {where} says {old['verdict']!r} and {d} says "
                    f"{entry['verdict']!r} with the same code {entry['code']}: one of the runs is broken"
                )
            if old is None or str(entry["date"] or "") >= str(old.get("date") or ""):
                experiments[r["name"]][seed] = entry
                source[r["name"], seed] = d
    ordered = {name: dict(sorted(by_seed.items(), key=lambda kv: int(kv[0]))) for name, by_seed in experiments.items()}
    return {"version": RECORD_VERSION, "experiments": ordered}


def load_record(path: Path) -> dict[str, Any]:
    """A record written by ``addnorm lab seeds``, checked enough to fail with the file's name."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{path} is not a readable seed record: {err}") from None
    if not isinstance(record, dict) or record.get("version") != RECORD_VERSION:
        raise ValueError(f"{path} is not a version-{RECORD_VERSION} seed record (write it with `addnorm lab seeds`)")
    experiments = record.get("experiments")
    if not isinstance(experiments, dict) or not all(
        isinstance(by_seed, dict) and all(isinstance(e, dict) and "verdict" in e for e in by_seed.values())
        for by_seed in experiments.values()
    ):
        raise ValueError(f"{path}: 'experiments' must map each name to {{seed: {{'verdict': ...}}}}")
    return record


def seed_line(record: dict[str, Any], result: dict, run_seed: Any) -> str | None:
    """The sentence under an experiment's verdict: its verdict at each recorded ``--seed``, whether it flips, and
    whether this run (at ``run_seed``) disagrees with the record. None when the record has nothing on it."""
    by_seed = (record.get("experiments") or {}).get(result["name"])
    if not by_seed:
        return None
    verdicts = {seed: e["verdict"] for seed, e in by_seed.items()}
    here = None if run_seed is None else str(run_seed)
    if here is not None:
        verdicts[here] = result["verdict"]  # this run is the newest word at its own seed
    seeds = sorted(verdicts, key=int)
    listed = ", ".join(f"{verdicts[s]} at `--seed {s}`" for s in seeds)
    if len(seeds) < 2:
        return f"Across seeds: only `--seed {seeds[0]}` is recorded ({listed})."
    if len(set(verdicts.values())) == 1:
        text = f"Across seeds: the same verdict at every recorded seed ({listed})."
    else:
        text = f"Across seeds: **this verdict flips with `--seed`**: {listed}; it does not hold at every seed."
    recorded_here = by_seed.get(here) if here is not None else None
    if recorded_here is not None and recorded_here["verdict"] != result["verdict"]:
        text += (
            f" (The recorded run at `--seed {here}`, code {recorded_here.get('code')}, said "
            f"{recorded_here['verdict']}: the code changed since, so the other seeds' runs may be out of date too.)"
        )
    return text
