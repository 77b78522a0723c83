"""``addnorm lab seeds``: the record of every empirical experiment's runs at several lab seeds (``--seed``), from
real runs, so a verdict can be pooled over all of them (pooled.py).

Each lab seed trains its own model seeds (seeds.py: lab seed S uses S*1000+k), so runs at lab seeds 0, 1, 2 are
independent evidence. Running the whole lab several times is more than a 2-core machine has in one go, so the runs
are made apart (``addnorm lab --seed S --out sS``) and recorded here:

* :func:`build_record` reads their ``results.json`` (not ``--quick`` ones) and keeps, per experiment and lab seed,
  the run's ``evidence`` (its units and rules), verdict, code identity (registry.code_identity: the experiment's
  code version and config), engine and date: one run per experiment and lab seed. Two runs of one experiment at one
  lab seed with the same code and engine must agree on the verdict; the same code with another ``--engine`` is
  refused unless ``replace`` (--replace: the newer is kept); a run of other code replaces the older. Each run
  dropped (other than an exact repeat) is reported, never lost silently.
* Version 1 records (before evidence was stored) are still read: their entries carry no evidence, so they count
  only as "the verdict at this seed" and are never pooled; adding runs to one writes version 2.

What a results.json must hold to be recorded (else the error names the file): ``meta.seed`` an integer in
[0, 2**32), ``meta.code`` (without it two runs of the same code could not be told apart, and the check above would
silently pass), ``meta.date`` an ISO date no later than :data:`CLOCK_SLACK` after now (a run dated in the future
would otherwise win every "newer run" comparison forever). An entry of an older record dated in the future is never
preferred over a run being recorded.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from addnorm.lab.formatting import kind_of
from addnorm.lab.report import RESULTS_FILE, read_results

__all__ = ["build_record", "load_record", "seed_line", "RECORD_VERSION"]

RECORD_VERSION = 2
READABLE_VERSIONS = (1, 2)
SEED_LIMIT = 2**32  # the range `addnorm lab --seed` accepts
# How far ahead of this machine's clock a run's date may be (clocks of two machines differ by seconds to minutes;
# an hour also covers a wrongly set time zone offset of the other machine's clock, not a date typed by hand).
CLOCK_SLACK = datetime.timedelta(hours=1)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def parse_date(text: Any) -> datetime.datetime | None:
    """An ISO date (a naive one is read as UTC), or None when ``text`` is not one."""
    if not isinstance(text, str):
        return None
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=datetime.timezone.utc)


def run_file(d: Path) -> Path:
    """The results.json of the run ``d`` (its output directory, or the file itself)."""
    d = Path(d)
    return d / RESULTS_FILE if d.is_dir() else d


def _runs(dirs: Iterable[Path]) -> list[tuple[Path, dict]]:
    runs = []
    seen: dict[Path, Path] = {}
    for d in map(Path, dirs):
        path = run_file(d)
        if not path.is_file():
            raise ValueError(f"{d} has no {RESULTS_FILE}: give the output directory of an `addnorm lab` run")
        # `seeds s0 s0` is a typo for `seeds s0 s1`: recording s0 twice hides s1's absence (as lab merge refuses)
        if path.resolve() in seen:
            raise ValueError(f"{d} is given twice (as {seen[path.resolve()]} and {d}): give each run once")
        seen[path.resolve()] = d
        runs.append((path, read_results(path)))
    return runs


def _checked_meta(path: Path, doc: dict) -> tuple[int, str, str]:
    """The run's lab seed, code and date, or a ValueError naming ``path``."""
    meta = doc.get("meta") or {}
    if meta.get("quick"):
        raise ValueError(f"{path} is a --quick run: its verdicts are not recorded (quick sizes are a smoke test)")
    if not isinstance(meta.get("quick"), bool):
        # the code identity does not cover the sizes: a quick run would be pooled with full-size ones unnoticed
        raise ValueError(
            f"{path}: meta.quick must be true or false, got {meta.get('quick')!r}: without it a --quick run (smoke-test "
            "sizes, never recorded) cannot be told from a full-size one, so the run is not recorded"
        )
    seed = meta.get("seed")
    if seed is None:
        raise ValueError(f"{path}: its results.json records no seed (meta.seed)")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"{path}: meta.seed must be an integer in [0, 2**32) like --seed, got {seed!r}")
    code = meta.get("code")
    if not isinstance(code, str) or not code:
        raise ValueError(
            f"{path}: meta.code (the hash of the sources that ran) is missing; without it a second run of the same "
            "code could not be checked against this one, so the run is not recorded"
        )
    date = parse_date(meta.get("date"))
    if date is None:
        raise ValueError(f"{path}: meta.date must be an ISO date (YYYY-MM-DDTHH:MM:SS+00:00), got {meta.get('date')!r}")
    if date > _now() + CLOCK_SLACK:
        raise ValueError(
            f"{path}: meta.date {meta['date']} is in the future (this machine's clock says {_now():%Y-%m-%d %H:%M} "
            "UTC): a wrong clock; fix the date or rerun, a future-dated run would replace every later one"
        )
    return seed, code, meta["date"]


def _evidence_of(path: Path, r: dict, seed: int) -> dict | None:
    ev = r.get("evidence")
    if ev is None:
        return None
    problem = _evidence_problem(ev)
    if problem:
        raise ValueError(f"{path}: the evidence of experiment {r['name']!r} {problem}")
    labs = {u.get("lab_seed") for us in ev["units"].values() for u in us if isinstance(u, dict)}
    if labs - {seed}:
        raise ValueError(
            f"{path}: experiment {r['name']!r} has units of lab seed(s) {sorted(labs - {seed}, key=str)} in a run "
            f"at --seed {seed}"
        )
    return ev


def _entry_date(entry: dict) -> datetime.datetime:
    """When an entry's run was made, for "the newer run counts"; a missing, unreadable or future date sorts first,
    so it never wins over a run with a real date."""
    when = parse_date(entry.get("date"))
    floor = datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)
    return floor if when is None or when > _now() + CLOCK_SLACK else when


def upgrade(record: dict) -> dict[str, dict[str, dict]]:
    """The experiments of a version 1 or 2 record as version 2 entries (a version 1 entry gets evidence None)."""
    if record.get("version") not in READABLE_VERSIONS or not isinstance(record.get("experiments"), dict):
        raise ValueError(f"the previous record is not a seed record of version {READABLE_VERSIONS}")
    out = {}
    for name, by_seed in record["experiments"].items():
        out[name] = {s: {"evidence": None, **e} for s, e in by_seed.items()}
    return out


def build_record(
    dirs: Iterable[Path],
    previous: dict | None = None,
    *,
    replace: bool = False,
    previous_name: str = "the previous record",
    replaced: list[str] | None = None,
) -> dict[str, Any]:
    """The record of the empirical experiments in the runs ``dirs`` (output directories or results.json files),
    added to ``previous`` (an earlier record, version 1 or 2: its entries stay unless a run here replaces them;
    ``previous_name`` names it in errors).

    Returns ``{"version": 2, "experiments": {name: {lab seed (str): {"verdict", "code", "engine", "date",
    "summary", "evidence"}}}}``. At one lab seed the record holds one run per experiment:

    * same code and engine: the runs must agree on the verdict (the lab's results repeat exactly, so otherwise a
      run is broken or a file edited: refused); the newer one is kept, an exact repeat;
    * same code, another engine (``--engine``; equal up to float rounding, so a verdict at a criterion's boundary
      can differ): refused unless ``replace``, since either run is as valid as the other and silently keeping one
      would change what the record pools; with ``replace`` the newer is kept;
    * another code: the newer run replaces the older (older code is never pooled).

    Each run dropped that was not an exact repeat is described in ``replaced`` (when given), so the caller can say
    so. Also refuses quick runs, runs whose meta is unusable (module docstring) and a run given twice.
    """
    experiments = upgrade(previous) if previous is not None else {}
    source: dict[tuple[str, str], Path] = {}  # which file each entry came from, for the messages only
    for path, doc in _runs(dirs):
        seed_int, package, date = _checked_meta(path, doc)
        seed, engine = str(seed_int), (doc.get("meta") or {}).get("engine") or "sequential"
        for r in doc["experiments"]:
            if kind_of(r) != "empirical":
                continue
            entry = {
                "verdict": r["verdict"],
                # the experiment's own code identity when the run recorded it, else the whole package's hash
                "code": r.get("code") or package,
                "engine": engine,
                "date": date,
                "summary": r.get("summary") or "",
                "evidence": _evidence_of(path, r, seed_int),
            }
            old = experiments.setdefault(r["name"], {}).get(seed)
            if old is None:
                experiments[r["name"]][seed] = entry
                source[r["name"], seed] = path
                continue
            where = source.get((r["name"], seed), previous_name)
            old_engine = old.get("engine") or "sequential"
            same_code = old.get("code") == entry["code"]
            if same_code and old_engine == engine and old["verdict"] != entry["verdict"]:
                raise ValueError(
                    f"{r['name']} at --seed {seed}: {where} says {old['verdict']!r} and {path} says "
                    f"{entry['verdict']!r} with the same code {entry['code']}: one of the runs is broken"
                )
            if same_code and old_engine != engine and not replace:
                raise ValueError(
                    f"{r['name']} at --seed {seed}: {where} holds a run of the same code {entry['code']} made with "
                    f"--engine {old_engine} and {path} one made with --engine {engine} (equal up to float rounding, "
                    "so a verdict at its criterion's boundary can differ): the record keeps one run per lab seed and "
                    "will not drop either unasked; give --replace to keep the newer one, or leave one run out"
                )
            newer = _entry_date(entry) >= _entry_date(old)
            if not (same_code and old_engine == engine):  # an exact repeat drops nothing
                kept, dropped = (entry, old) if newer else (old, entry)
                kept_from, dropped_from = (path, where) if newer else (where, path)
                if replaced is not None:
                    replaced.append(
                        f"{r['name']} at --seed {seed}: kept the newer run ({_describe(kept)}, {kept_from}), "
                        f"dropped the run ({_describe(dropped)}) from {dropped_from}"
                    )
            if newer:
                experiments[r["name"]][seed] = entry
                source[r["name"], seed] = path
    ordered = {name: dict(sorted(by_seed.items(), key=lambda kv: int(kv[0]))) for name, by_seed in experiments.items()}
    return {"version": RECORD_VERSION, "experiments": ordered}


def _describe(entry: dict) -> str:
    """A recorded run in words: its verdict, code, engine and date."""
    return (
        f"{entry.get('verdict')}, code {entry.get('code')}, --engine {entry.get('engine') or 'sequential'}, "
        f"dated {entry.get('date')}"
    )


def load_record(path: Path) -> dict[str, Any]:
    """A record written by ``addnorm lab seeds`` (version 1 or 2), checked enough to fail with the file's name."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{path} is not a readable seed record: {err}") from None
    version = record.get("version") if isinstance(record, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and version > RECORD_VERSION:
        raise ValueError(
            f"{path} is a seed record of version {version}, written by a newer addnorm (this one reads versions "
            f"{' and '.join(map(str, READABLE_VERSIONS))}): upgrade addnorm to read or add to it"
        )
    if not isinstance(record, dict) or record.get("version") not in READABLE_VERSIONS:
        raise ValueError(
            f"{path} is not a seed record of version {' or '.join(map(str, READABLE_VERSIONS))} "
            "(write it with `addnorm lab seeds`)"
        )
    experiments = record.get("experiments")
    if not isinstance(experiments, dict) or not all(
        isinstance(by_seed, dict) and all(isinstance(e, dict) and "verdict" in e for e in by_seed.values())
        for by_seed in experiments.values()
    ):
        raise ValueError(f"{path}: 'experiments' must map each name to {{seed: {{'verdict': ...}}}}")
    # "007" next to "7" would be one lab seed counted twice in the pooled interval, as two independent ones
    bad = [
        f"{n} at {s!r}"
        for n, by_seed in experiments.items()
        for s in by_seed
        if not (str(s).isascii() and str(s).isdigit() and str(int(s)) == s and int(s) < SEED_LIMIT)
    ]
    if bad:
        raise ValueError(
            f"{path}: lab seeds must be integers in [0, 2**32) written plainly (no sign, no leading zero), got "
            f"{', '.join(bad)}"
        )
    for name, by_seed in experiments.items():
        for seed, entry in by_seed.items():
            problem = _evidence_problem(entry.get("evidence"))
            if problem:
                raise ValueError(f"{path}: the evidence of {name} at lab seed {seed} {problem}")
            ev = entry.get("evidence")
            labs = {u.get("lab_seed") for us in (ev or {}).get("units", {}).values() for u in us}
            if labs - {int(seed)}:  # pooling groups units by their lab seed: these would join another seed's
                raise ValueError(
                    f"{path}: the evidence of {name} at lab seed {seed} has units of lab seed(s) "
                    f"{sorted(labs - {int(seed)}, key=str)}"
                )
    return record


def _evidence_problem(ev: Any) -> str:
    """What is wrong with a stored evidence dict ("" if nothing): its rules must be rules and every rule must have
    a list of units."""
    from addnorm.lab.evidence import Rule

    if ev is None:
        return ""
    if not isinstance(ev, dict) or not isinstance(ev.get("rules"), list) or not isinstance(ev.get("units"), dict):
        return "is not {'rules': [...], 'units': {...}}"
    try:
        names = [Rule(**r).name for r in ev["rules"]]
    except (TypeError, ValueError) as err:
        return f"has a rule that is not one: {err}"
    for n in names:
        us = ev["units"].get(n)
        if not isinstance(us, list) or not all(isinstance(u, dict) and {"lab_seed", "value"} <= u.keys() for u in us):
            return f"has no list of units for its rule {n!r}"
    return ""


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
