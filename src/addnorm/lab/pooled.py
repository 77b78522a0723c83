"""One verdict per empirical experiment from every recorded run of its current code (the seed record,
seed_record.py, plus the page's own run).

For each experiment, the entries of the record whose code identity (registry.code_identity) equals the current
code's are *current*; the others ran older code and are listed, never pooled. Then, in this order:

* **pooled**: the current entries that carry evidence are pooled (evidence.pool_evidence: units concatenated,
  a two-stage bootstrap: lab seeds drawn with replacement, then units within each) and judged once (evidence.judge_evidence): the verdict, each rule's
  estimate and 95% interval, over N lab seeds x M units (model seeds or inits) each;
* **not pooled** (majority): current entries without evidence (an experiment not yet expressed as rules, or a
  version 1 record): the verdict most lab seeds gave (more than half of them, else inconclusive);
* **this run alone**: no recorded run of the current code; the page's own run's verdict, if any.

The page's own run is the newest word at its lab seed, except that a run of older code never displaces a recorded
run of the current code; :func:`page_conflicts` names where it and the record's run of the same code there differ.

The headline counts these verdicts and says how many rest on each basis.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from addnorm.lab.core import VERDICTS
from addnorm.lab.evidence import Judgement, Rule, judge, judge_evidence, pool_evidence
from addnorm.lab.formatting import fmt_value, kind_of

__all__ = [
    "Pooled",
    "page_conflicts",
    "pool_record",
    "pooled_headline",
    "basis_text",
    "judgement_rows",
    "verdict_basis",
]


@dataclass(kw_only=True)
class Pooled:
    """An experiment's counted verdict and what it rests on (see the module docstring)."""

    name: str
    verdict: str
    basis: str
    reason: str = ""
    rules: list[dict] = field(default_factory=list)
    judgements: list[Judgement] = field(default_factory=list)
    lab_seeds: list[str] = field(default_factory=list)  # the lab seeds pooled (or counted in the majority)
    units_per_seed: list[int] = field(default_factory=list)  # units of the first claim rule at each pooled lab seed
    rows: list[list[str]] = field(default_factory=list)  # the per-lab-seed table (see per_seed_header)
    older: list[str] = field(default_factory=list)  # lab seeds whose recorded run is of older code

    def scope(self) -> str:
        """ "3 lab seeds x 3 units each" (or "x 2-3 units"), for the text."""
        n = len(self.lab_seeds)
        if self.basis != "pooled":
            return f"{n} lab seed{'s' * (n != 1)}"
        return f"{n} lab seed{'s' * (n != 1)}" + _each(self.units_per_seed, " model seeds (units) each")


def _each(counts: list[int], what: str) -> str:
    """ " x 3<what>" or " x 2-3<what>" for units per lab seed; "" when none were counted."""
    if not counts:
        return ""
    lo, hi = min(counts), max(counts)
    return f" x {lo}{what}" if lo == hi else f" x {lo}-{hi}{what}"


def _page_entries(page: dict | None) -> tuple[str | None, dict[str, dict]]:
    """The page's own run (not --quick) as record entries: its lab seed and {name: entry}."""
    meta = (page or {}).get("meta") or {}
    if page is None or meta.get("quick") or not isinstance(meta.get("seed"), int):
        return None, {}
    out = {}
    for r in page.get("experiments") or []:
        if kind_of(r) != "empirical" or r.get("code") is None:
            continue
        entry = {"verdict": r["verdict"], "code": r["code"], "date": meta.get("date")}
        entry.update(engine=meta.get("engine") or "sequential", evidence=r.get("evidence"))
        out[r["name"]] = entry
    return str(meta["seed"]), out


def _entries(
    record: dict | None, page: dict | None, current_codes: dict[str, str] | None = None
) -> dict[str, dict[str, dict]]:
    """The record's entries, with the page's own run (not --quick) as the newest word at its lab seed; except that
    a page's run of older code never displaces a recorded run of the current code there (``current_codes``)."""
    out = {name: dict(by_seed) for name, by_seed in ((record or {}).get("experiments") or {}).items()}
    seed, mine = _page_entries(page)
    for name, entry in mine.items():
        recorded = out.get(name, {}).get(seed)
        now = (current_codes or {}).get(name)
        if recorded is not None and now is not None and recorded.get("code") == now != entry["code"]:
            continue
        out.setdefault(name, {})[seed] = entry
    return out


def page_conflicts(record: dict | None, page: dict | None) -> list[str]:
    """Where the page's run and the record's entry at its lab seed are runs of the same code that differ (another
    --engine, another verdict or other evidence): pooling the page's run there would pool a run the record does not
    hold. One sentence per experiment; [] when none."""
    seed, mine = _page_entries(page)
    recorded_all = (record or {}).get("experiments") or {}
    out = []
    for name, entry in mine.items():
        recorded = recorded_all.get(name, {}).get(seed)
        if recorded is None or recorded.get("code") != entry["code"]:
            continue
        theirs = recorded.get("engine") or "sequential"
        if theirs != entry["engine"]:
            what = f"the record's run was made with --engine {theirs}, the page's with --engine {entry['engine']}"
        elif recorded.get("verdict") != entry["verdict"]:
            what = f"the record says {recorded.get('verdict')!r}, the page's run {entry['verdict']!r}"
        elif (recorded.get("evidence") or None) != (entry["evidence"] or None):
            what = "their evidence (units) differs"
        else:
            continue
        out.append(f"{name} at --seed {seed} (same code {entry['code']}): {what}")
    return out


def _unit_values(units: list[dict]) -> str:
    return ", ".join("-" if u.get("value") is None else fmt_value(u["value"]) for u in units)


def _seed_row(seed: str, entry: dict, current: bool, rules: list[dict]) -> list[str]:
    code = "current" if current else f"older ({entry.get('code')})"
    if (entry.get("engine") or "sequential") != "sequential":  # pooled too; equal up to float rounding (core.ENGINES)
        code += f", engine {entry['engine']}"
    row = [seed, entry["verdict"], code, str(entry.get("date") or "-")[:10]]
    ev = entry.get("evidence")
    for rule in rules:
        units = (ev or {}).get("units", {}).get(rule["name"]) if ev and ev.get("rules") == rules else None
        if not units:
            row.append("-")
            continue
        j = judge(Rule(**rule), units)
        mean = "no estimate" if j.estimate is None else fmt_value(j.estimate)
        row.append(f"{mean} ({_unit_values(units)})")
    return row


def per_seed_header(rules: list[dict]) -> list[str]:
    return ["lab seed", "verdict at this seed", "code", "date", *[f"{r['name']}: mean (units)" for r in rules]]


def _majority(verdicts: list[str]) -> str:
    top, n = Counter(verdicts).most_common(1)[0]
    return top if n * 2 > len(verdicts) else "inconclusive"


def pool_one(name: str, by_seed: dict[str, dict], current_code: str | None, page_verdict: str | None) -> Pooled:
    seeds = sorted(by_seed, key=int)
    current = [s for s in seeds if current_code is not None and by_seed[s].get("code") == current_code]
    older = [s for s in seeds if s not in current]
    with_ev = [s for s in current if by_seed[s].get("evidence")]
    rules = by_seed[with_ev[-1]]["evidence"]["rules"] if with_ev else []
    rows = [_seed_row(s, by_seed[s], s in current, rules) for s in seeds]
    if with_ev:
        try:
            pooled = pool_evidence([by_seed[s]["evidence"] for s in with_ev])
            verdict, reason, judged = judge_evidence(pooled)
        except (ValueError, TypeError, KeyError) as err:  # same code, other rules: a damaged record; say so
            why = f"the recorded evidence cannot be pooled: {err}"
            return Pooled(
                name=name, verdict="inconclusive", basis="pooled", reason=why, lab_seeds=with_ev, rows=rows, older=older
            )
        claim = next(r["name"] for r in rules if r.get("role", "claim") == "claim")
        per = Counter(str(u["lab_seed"]) for u in pooled["units"][claim])
        unpooled = [s for s in current if s not in with_ev]
        if unpooled:
            reason = (reason + "; " if reason else "") + f"lab seed(s) {', '.join(unpooled)} stored no evidence"
        return Pooled(
            name=name,
            verdict=verdict,
            basis="pooled",
            reason=reason,
            rules=rules,
            judgements=judged,
            lab_seeds=with_ev,
            units_per_seed=[per[s] for s in with_ev],
            rows=rows,
            older=older,
        )
    if current:
        verdict = _majority([by_seed[s]["verdict"] for s in current])
        return Pooled(name=name, verdict=verdict, basis="majority", lab_seeds=current, rows=rows, older=older)
    verdict = page_verdict if page_verdict in VERDICTS else "inconclusive"
    why = "" if page_verdict else "no run of the current code: neither in the record nor on this page"
    return Pooled(name=name, verdict=verdict, basis="run", reason=why, rows=rows, older=older)


def pool_record(
    record: dict | None, current_codes: dict[str, str] | None = None, page: dict | None = None
) -> dict[str, Pooled]:
    """The counted verdict of every empirical experiment in the record or on the page (a results document).
    ``current_codes``: each empirical experiment's current code identity (registry.code_identity); None takes the
    page's own records' codes as current (and only the page's experiments). Experiments on the page come first,
    in its order, then the record's other experiments that ``current_codes`` names."""
    page_records = [r for r in (page or {}).get("experiments") or [] if kind_of(r) == "empirical"]
    entries = _entries(record, page, current_codes)
    names = [r["name"] for r in page_records]
    if current_codes is None:
        current_codes = {r["name"]: r["code"] for r in page_records if r.get("code")}
    else:  # the record's other experiments that are still registered (as empirical: current_codes has only those)
        names += [n for n in entries if n in current_codes and n not in names]
    page_verdicts = {r["name"]: r["verdict"] for r in page_records}
    return {
        n: pool_one(n, entries.get(n, {}), current_codes.get(n), page_verdicts.get(n)) for n in dict.fromkeys(names)
    }


def basis_text(p: Pooled) -> str:
    """What an experiment's counted verdict rests on, in a sentence."""
    if p.basis == "pooled" and len(p.lab_seeds) > 1:
        seeds = ", ".join(p.lab_seeds)
        text = f"Pooled verdict over lab seeds {seeds} ({p.scope()}): every recorded run of the current code."
    elif p.basis == "pooled":
        text = f"Rests on one lab seed ({p.lab_seeds[0]}, {p.scope()}): no other recorded run of the current code."
    elif p.basis == "majority":
        text = (
            f"Not pooled: the verdict more than half of the {p.scope()} of the current code gave (those runs stored "
            "no evidence, only their verdicts)."
        )
    else:
        text = "This run alone: the record holds no run of the current code" + (f" ({p.reason})." if p.reason else ".")
    if p.older:
        text += f" Runs of older code at lab seed(s) {', '.join(p.older)} are listed, not pooled."
    return text


def pooled_headline(pooled: dict[str, Pooled]) -> str:
    """The counted verdicts and what they rest on."""
    c = Counter(p.verdict for p in pooled.values())
    text = (
        f"Empirical claims: {c['reproduced']} reproduced, {c['not reproduced']} not reproduced, "
        f"{c['inconclusive']} inconclusive."
    )
    many = [p for p in pooled.values() if p.basis == "pooled" and len(p.lab_seeds) > 1]
    one = [p for p in pooled.values() if p.basis == "pooled" and len(p.lab_seeds) == 1]
    parts = []
    if many:
        labs = sorted({s for p in many for s in p.lab_seeds}, key=int)
        each = _each([u for p in many for u in p.units_per_seed], " model seeds each")
        parts.append(f"{len(many)} pooled over {len(labs)} lab seeds ({', '.join(labs)}){each}")
    if one:
        labs = sorted({p.lab_seeds[0] for p in one}, key=int)
        parts.append(f"{len(one)} judged on the evidence of one lab seed ({', '.join(labs)})")
    k = sum(p.basis == "majority" for p in pooled.values())
    if k:
        parts.append(f"{k} not pooled (the majority of the lab seeds' verdicts: their runs stored no evidence)")
    k = sum(p.basis == "run" for p in pooled.values())
    if k:
        parts.append(f"{k} from this run alone (no recorded run of the current code)")
    return text + (" " + "; ".join(parts) + "." if parts else "")


def status(rule: Rule, j: Judgement) -> str:
    """A rule's outcome in words: a claim rule's verdict, or whether a control is met."""
    if rule.role == "claim":
        return j.verdict
    return {"reproduced": "met", "not reproduced": "not met"}.get(j.verdict, "undecided")


def judgement_rows(rules: list[dict], judged: list[Judgement]) -> tuple[list[str], list[list[str]]]:
    """The rules' table: role, rule, estimate with its 95% interval, units, verdict."""
    header = ["rule", "role", "criterion", "estimate [95% interval]", "units", "outcome"]
    rows = []
    for rule, j in zip(rules, judged):
        r = Rule(**rule)
        est = "-" if j.estimate is None else f"{fmt_value(j.estimate)} [{fmt_value(j.low)}, {fmt_value(j.high)}]"
        if j.margin is not None:
            est += f", margin {fmt_value(j.margin)}"
        units = f"{j.n}" + (f" (+{j.n_missing} missing)" if j.n_missing else "")
        rows.append([r.name, r.role, r.text(), est, units, status(r, j) + (f": {j.reason}" if j.reason else "")])
    return header, rows


def run_judgements(record: dict) -> tuple[str, str, list[Judgement]] | None:
    """A single run's record judged from its own evidence (None when it has none)."""
    ev = record.get("evidence")
    if not ev:
        return None
    return judge_evidence(ev)


def verdict_basis(r: dict, pooled: dict | None, seed: Any) -> tuple[str, list[str], list[tuple[list, list]]]:
    """What a report shows for the record ``r`` of a run at lab seed ``seed``: the verdict (the pooled one when
    ``pooled`` has it), the sentences saying what it rests on, and its tables (header, rows): the rules' estimates
    with their intervals and, when pooled, the per-lab-seed table."""
    if kind_of(r) != "empirical":
        return r["verdict"], [], []
    p = (pooled or {}).get(r["name"])
    if p is not None:
        tables = [judgement_rows(p.rules, p.judgements)] if p.judgements else []
        tables += [(per_seed_header(p.rules), p.rows)] if p.rows else []
        differs = [f"This run (lab seed {seed}) alone: {r['verdict']}."] if p.verdict != r["verdict"] else []
        return p.verdict, [basis_text(p), *differs], tables
    judged = run_judgements(r)
    text = f"This run alone (lab seed {seed}): its own units; no seed record pooled."
    if judged is None:
        return r["verdict"], [text + " The experiment states no pre-registered rules yet (its criterion is below)."], []
    return r["verdict"], [text], [judgement_rows(r["evidence"]["rules"], judged[2])]
