"""The pre-registration of every experiment in one place: its rules (claim and controls), when they were fixed,
the changes made after a run had been recorded, and the identity of the code that judges it.

* :func:`code_identity` names the code of one experiment: the code version the cache keys on (addnorm's version,
  the library's sources, the experiment's own module; see cache.py) and the experiment's config. Two runs with the
  same identity ran the same experiment, so their units may be pooled (seed_record.py, pooled.py); an edit to
  another experiment's module or to a presentation file (report, docs, command line) leaves it unchanged.
* :func:`record_fields` is what the runner copies into each result record (results.json), so a record says
  which code and which pre-registration it was judged by, without importing the experiment again.
* :func:`criteria_text` / :func:`criteria_json` are ``addnorm lab criteria``: every experiment's rules,
  controls, thresholds, the date and commit they were fixed and its change log, for an audit.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from typing import Any

from addnorm.io import json_default
from addnorm.lab.core import Experiment

__all__ = ["code_identity", "preregistration", "record_fields", "change_text", "criteria_text", "criteria_json"]

ROLE_TITLES = {"claim": "claim", "positive": "positive control", "negative": "negative control"}


def code_identity(exp: Experiment) -> str:
    """A short hash of the experiment's code version (cache.code_version) and its config."""
    from addnorm.lab.cache import code_version

    blob = json.dumps({"code": code_version(exp), "config": exp.config}, sort_keys=True, default=json_default)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def preregistration(exp: Experiment) -> dict[str, Any]:
    """The experiment's rules, when they were fixed and its change log, as JSON-able data."""
    return {
        "rules": [asdict(r) for r in exp.rules],
        "fixed": exp.fixed,
        "changes": [asdict(c) for c in exp.changes],
    }


def record_fields(exp: Experiment) -> dict[str, Any]:
    """The fields the runner adds to an experiment's result record: ``code`` (:func:`code_identity`) and the
    pre-registration (:func:`preregistration`)."""
    return {"code": code_identity(exp), **preregistration(exp)}


def change_text(change: dict[str, Any]) -> str:
    """One change-log entry in words: when, what the run before it showed, what changed and why."""
    return (
        f"Changed on {change.get('date')} after a run showed {change.get('showed')}: {change.get('what')} "
        f"(why: {change.get('reason')})"
    )


def rule_text(rule: dict[str, Any]) -> str:
    """A rule dict (evidence.Rule as JSON) in words, with its role."""
    from addnorm.lab.evidence import Rule

    r = Rule(**rule)
    return f"{ROLE_TITLES[r.role]} `{r.name}`: {r.text()}"


def preregistration_lines(record: dict[str, Any]) -> list[str]:
    """Markdown lines of a record's pre-registration: its rules with the date they were fixed, or the criterion
    text for an experiment that has no rules yet; then its change log (every change, oldest first)."""
    lines: list[str] = []
    rules = record.get("rules") or []
    if rules:
        fixed = record.get("fixed") or "date not recorded"
        lines += [f"Pre-registered rules (fixed {fixed}):", ""]
        lines += [f"- {rule_text(r)}" for r in rules] + [""]
    elif record.get("criterion"):
        empirical = (record.get("kind") or "empirical") == "empirical"
        label = "Criterion (no pre-registered rules yet; its text)" if empirical else "Criterion"
        lines += [f"{label}: {record['criterion']}", ""]
    changes = record.get("changes") or []
    if changes:
        lines += ["Changes after a recorded run:", ""]
        lines += [f"- {change_text(c)}" for c in changes] + [""]
    elif rules:
        lines += ["Changes after a recorded run: none recorded.", ""]
    return lines


def criteria_json(registry: dict[str, Experiment]) -> list[dict[str, Any]]:
    """Every experiment's pre-registration as data (``addnorm lab criteria --json``)."""
    return [
        {
            "name": exp.name,
            "kind": exp.kind,
            "suite": exp.suite,
            "claim": exp.claim,
            "source": exp.source,
            "criterion": exp.criterion,
            "precondition": exp.precondition,
            "config": exp.config,
            "second_stage": exp.second_stage,
            **preregistration(exp),
        }
        for exp in registry.values()
    ]


def criteria_text(registry: dict[str, Experiment]) -> str:
    """Every experiment's pre-registration as text (``addnorm lab criteria``)."""
    out: list[str] = []
    for item in criteria_json(registry):
        out += [f"{item['name']}  [{item['suite']}, {item['kind']}]", f"  claim: {item['claim']}"]
        if item["rules"]:
            out.append(f"  rules, fixed {item['fixed'] or 'date not recorded'}:")
            out += [f"    - {rule_text(r)}" for r in item["rules"]]
        else:
            out.append(f"  no pre-registered rules yet; criterion: {item['criterion'] or '(none stated)'}")
            if item["precondition"]:
                out.append(f"  control: {item['precondition']}")
        if item["config"]:
            out.append(f"  config: {json.dumps(item['config'], sort_keys=True, default=json_default)}")
        if item["second_stage"]:
            out.append(
                f"  second stage: {item['second_stage']} more model seeds, once, when the first stage leaves a "
                "rule's 95% interval straddling its threshold"
            )
        out += [f"  - {change_text(c)}" for c in item["changes"]] or (["  changes: none recorded"])
        out.append("")
    return "\n".join(out)
