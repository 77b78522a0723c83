"""The lab's report: ``results.json`` (machine-readable), ``report.md`` and ``index.html`` (one self-contained page:
figures embedded as base64 PNG, no network), and the verdict table printed in the terminal.

results.json::

    {"experiments": [{"name", "claim", "source", "criterion", "kind", "precondition", "verdict", "reason",
                      "metrics", "timings", "figures", "summary", "seconds", "cached", "key", "config", "index",
                      ["error"]}, ...],
     "meta": {"addnorm", "torch", "date", "quick", "seed", "device", "engine", "jobs", "world_size", "seconds",
              "computed_seconds", "cached", ...},
     "counts": {"reproduced": n, "not reproduced": n, "inconclusive": n},      empirical claims only
     "counts_by_kind": {"empirical": {...}, "sanity": {...}, "demonstration": {...}}}

Each record also carries ``evidence`` (the units and rules its verdict was judged by, or null), ``code`` (the
experiment's code identity) and its pre-registration (``rules``, ``fixed``, ``changes``; registry.py); one that
declares a second stage of model seeds carries ``stages`` (stages.py: whether this run took it, and why).

Which verdicts a report shows: a plain run's report judges each experiment on this run alone (one lab seed) and
says so; ``addnorm lab --seed-record FILE`` (or ``addnorm lab doc --seed-record FILE``) shows the pooled verdict
over every recorded run of the current code (pooled.py) and says, per experiment, what it rests on.

Only empirical claims are evidence: the headline and ``counts`` cover them alone; sanity checks and demonstrations
are shown in sections of their own, labelled, and not counted (see core.py). A record without ``kind`` (written
before kinds existed) is empirical.
"""

from __future__ import annotations

import base64
import html
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from addnorm.lab.core import VERDICTS
from addnorm.lab.formatting import (
    ENGINE_NOTE,
    KIND_TITLES,
    QUICK_NOTE,
    by_kind,
    engine_text,
    flatten_metrics,
    fmt_value,
    headline,
    kind_of,
    other_metrics,
    per_seed_table,
    stages_text,
    timing_text,
)
from addnorm.lab.pooled import pooled_headline, verdict_basis
from addnorm.lab.registry import change_text, preregistration_lines, rule_text
from addnorm.lab.seeds_advice import seeds_section

RESULTS_FILE = "results.json"
MARKDOWN_FILE = "report.md"
HTML_FILE = "index.html"

_PUBLIC_FIELDS = (
    "name",
    "claim",
    "source",
    "criterion",
    "kind",
    "suite",
    "precondition",
    "verdict",
    "reason",
    "metrics",
    "timings",
    "figures",
    "summary",
    "seconds",
    "cached",
    "key",
    "config",
    "index",
    "error",
    "evidence",
    "code",
    "rules",
    "fixed",
    "changes",
    "stages",
)


def counts(records: Iterable[dict]) -> dict[str, int]:
    c = {v: 0 for v in VERDICTS}
    for r in records:
        c[r["verdict"]] = c.get(r["verdict"], 0) + 1
    return c


def results_document(records: list[dict], meta: dict[str, Any]) -> dict[str, Any]:
    experiments = [{k: r[k] for k in _PUBLIC_FIELDS if k in r} for r in records]
    groups = by_kind(experiments)
    return {
        "experiments": experiments,
        "meta": meta,
        "counts": counts(groups["empirical"]),
        "counts_by_kind": {k: counts(g) for k, g in groups.items()},
    }


def write_report(out: Path, records: list[dict], meta: dict[str, Any]) -> dict[str, Any]:
    """Write results.json, report.md and index.html into ``out``; returns the results document."""
    from addnorm import io

    out = Path(out)
    doc = results_document(records, meta)
    io.atomic_write_json(out / RESULTS_FILE, doc)
    write_views(out, doc)
    return doc


def write_views(out: Path, doc: dict[str, Any], pooled: dict | None = None) -> None:
    """(Re)write report.md and index.html of ``doc``, with the pooled verdicts when given (pooled.pool_record)."""
    from addnorm import io

    io.atomic_write_text(Path(out) / MARKDOWN_FILE, render_markdown(doc, pooled))
    io.atomic_write_text(Path(out) / HTML_FILE, render_html(doc, Path(out), pooled))


# -------------------------------------------------------------------------------------------------- terminal
def terminal_table(doc: dict[str, Any]) -> str:
    """The verdict table printed at the end of a run: empirical claims first (counted), then sanity checks and
    demonstrations, each under its own label."""
    header = ("experiment", "verdict", "time", "ran/cached")
    rows: list[tuple[str, ...] | str] = []
    for kind, records in by_kind(doc["experiments"]).items():
        if not records:
            continue
        rows.append(f"{KIND_TITLES[kind][0]}" + (" (counted)" if kind == "empirical" else " (not counted)"))
        for r in records:
            how = "error" if r.get("error") else ("cached" if r.get("cached") else "ran")
            secs = r.get("seconds")
            rows.append((r["name"], r["verdict"], f"{secs:.1f}s" if isinstance(secs, (int, float)) else "-", how))
    cells = [header] + [r for r in rows if isinstance(r, tuple)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    line = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
    lines = [line(header), "  ".join("-" * w for w in widths)]
    lines += [f"[{r}]" if isinstance(r, str) else line(r) for r in rows]
    lines.append(headline(doc))
    meta = doc.get("meta") or {}
    timing = timing_text(meta, len(doc["experiments"]))
    if timing:
        lines.append(timing[0].upper() + timing[1:] + ".")
    if meta.get("quick"):
        lines.append(QUICK_NOTE)
    if meta.get("engine") == "batched":
        lines.append(ENGINE_NOTE)
    for r in doc["experiments"]:
        if r.get("error"):
            lines.append(f"{r['name']}: {r['error']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------- markdown
def _md_cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(_md_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]


def md_experiment_body(r: dict, *, figures: bool = True, pooled: dict | None = None, seed: Any = None) -> list[str]:
    """An experiment's section after its heading: verdict (pooled when ``pooled`` has it) and what it rests on,
    the rules' estimates with 95% intervals, claim, source, pre-registration and change log, control, reason,
    finding, per-seed numbers, metrics, timings (and figures)."""
    verdict, basis, tables = verdict_basis(r, pooled, seed)
    lines = [
        f"**Verdict: {verdict}**" + ("" if kind_of(r) == "empirical" else f" ({kind_of(r)}, not counted)"),
        "",
    ]
    for text in basis:
        lines += [text, ""]
    for header, rows in tables:
        lines += md_table(header, rows) + [""]
    lines += [f"Claim: {r['claim']}", "", f"Source: {r['source']}", ""]
    lines += preregistration_lines(r)
    if r.get("criterion") and r.get("rules"):  # without rules, preregistration_lines gave the criterion
        lines += [f"Criterion in words: {r['criterion']}", ""]
    if r.get("precondition"):
        lines += [f"Control (precondition): {r['precondition']}", ""]
    if r.get("reason"):
        lines += [f"Why {r['verdict']}: {r['reason']}", ""]
    if stages_text(r):
        lines += [stages_text(r), ""]
    if r.get("summary"):
        lines += [r["summary"], ""]
    if r.get("error"):
        lines += ["```", r["error"], "```", ""]
    seeds = per_seed_table(r.get("metrics"))
    if seeds is not None:
        lines += ["Per seed:", "", *md_table(*seeds), ""]
    rows = other_metrics(r.get("metrics"))
    if rows:
        lines += md_table(["metric", "value"], [[k, fmt_value(v)] for k, v in rows]) + [""]
    timings = flatten_metrics(r["timings"]) if isinstance(r.get("timings"), dict) else []
    if timings:
        lines += md_table(
            ["timing (wall clock, differs per run)", "value"], [[k, fmt_value(v)] for k, v in timings]
        ) + [""]
    if figures:
        lines += [f"![{Path(f).stem}]({f})" for f in r.get("figures", [])]
    return lines


def _shown(r: dict, pooled: dict | None) -> str:
    """The verdict a report shows for ``r``: the pooled one when there is one."""
    p = (pooled or {}).get(r["name"]) if kind_of(r) == "empirical" else None
    return r["verdict"] if p is None else p.verdict


def _headline(doc: dict[str, Any], pooled: dict | None) -> str:
    if pooled:
        return pooled_headline(pooled)
    seed = (doc.get("meta") or {}).get("seed")
    return (
        f"{headline(doc)} Every verdict here rests on this run alone (lab seed {seed}); the verdicts pooled over "
        "the recorded lab seeds: `addnorm lab --seed-record FILE` or `addnorm lab doc --seed-record FILE`."
    )


def render_markdown(doc: dict[str, Any], pooled: dict | None = None) -> str:
    meta = doc["meta"]
    lines = [
        "# addnorm lab report",
        "",
        f"addnorm {meta.get('addnorm')}, torch {meta.get('torch')}, {meta.get('date')}, device {meta.get('device')}, "
        f"seed {meta.get('seed')}, {'quick' if meta.get('quick') else 'default'} sizes"
        + (f", suite {meta['suite']}" if meta.get("suite") else "")
        + engine_text(meta),
        "",
    ]
    timing = timing_text(meta, len(doc["experiments"]))
    if timing:
        lines += [timing[0].upper() + timing[1:] + ".", ""]
    if meta.get("quick"):
        lines += [f"> **{QUICK_NOTE}**", ""]
    if meta.get("engine") == "batched":
        lines += [f"> **{ENGINE_NOTE}**", ""]
    lines += [_headline(doc, pooled), ""]
    groups = by_kind(doc["experiments"])
    for kind, records in groups.items():
        if not records:
            continue
        title, what = KIND_TITLES[kind]
        lines += [f"**{title}** ({what})", ""]
        lines += md_table(
            ["experiment", "verdict", "summary"],
            [[f"[{r['name']}](#{r['name']})", _shown(r, pooled), r.get("summary") or ""] for r in records],
        ) + [""]
    for kind, records in groups.items():
        if records:
            lines += ["", f"# {KIND_TITLES[kind][0]}"]
        for r in records:
            lines += ["", f"## {r['name']}", "", *md_experiment_body(r, pooled=pooled, seed=meta.get("seed"))]
    lines += ["", *seeds_section(doc["experiments"], pooled)]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------------- html
_CSS = """
body{font:15px/1.5 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;margin:2em auto;
padding:0 1em;color:#1b1f23;background:#fff}
h1{margin-bottom:.2em}h2{margin-top:2em;border-bottom:1px solid #ddd;padding-bottom:.2em}
table{border-collapse:collapse;margin:.8em 0}td,th{border:1px solid #ddd;padding:.25em .6em;text-align:left;
vertical-align:top}th{background:#f6f8fa}td.v{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:13px;
word-break:break-word;max-width:720px}
.badge{display:inline-block;padding:.1em .6em;border-radius:1em;font-weight:600;font-size:13px;color:#fff;
white-space:nowrap}td.t{white-space:nowrap;text-align:right}
.reproduced{background:#1a7f37}.not-reproduced{background:#cf222e}.inconclusive{background:#9a6700}
.meta{color:#57606a;font-size:13px}.claim{font-size:16px}.crit{background:#f6f8fa;padding:.5em .8em;
border-left:3px solid #8c959f}pre{background:#f6f8fa;padding:.6em;overflow:auto}
img{max-width:100%;border:1px solid #eee;margin:.4em 0}
h2.kind{border-bottom:2px solid #1b1f23}.kindlabel{font-size:13px;color:#57606a;font-weight:400}
.quick{background:#fff8c5;border:1px solid #d4a72c;padding:.5em .8em}
"""


def _badge(verdict: str) -> str:
    return f'<span class="badge {verdict.replace(" ", "-")}">{html.escape(verdict)}</span>'


def _embed(out: Path, figure: str) -> str:
    data = base64.b64encode((Path(out) / figure).read_bytes()).decode("ascii")
    alt = html.escape(Path(figure).stem)
    return f'<img alt="{alt}" src="data:image/png;base64,{data}">'


def _html_table(header: list[str], rows: list[list[str]], value_class: str = "v") -> list[str]:
    e = html.escape
    parts = ["<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>"]
    for row in rows:
        parts.append(
            "<tr><td>"
            + e(row[0])
            + "</td>"
            + "".join(f'<td class="{value_class}">{e(c)}</td>' for c in row[1:])
            + "</tr>"
        )
    parts.append("</table>")
    return parts


def _html_preregistration(r: dict) -> list[str]:
    """The rules (with when they were fixed) and the change log, next to the verdict."""
    e = html.escape
    parts = []
    if r.get("rules"):
        items = "".join(f"<li>{e(rule_text(rule))}</li>" for rule in r["rules"])
        parts.append(
            f'<div class="crit"><b>Pre-registered rules (fixed {e(r.get("fixed") or "date not recorded")}).</b>'
            f"<ul>{items}</ul></div>"
        )
    if r.get("changes"):
        items = "".join(f"<li>{e(change_text(c))}</li>" for c in r["changes"])
        parts.append(f'<div class="crit"><b>Changes after a recorded run.</b><ul>{items}</ul></div>')
    return parts


def render_html(doc: dict[str, Any], out: Path, pooled: dict | None = None) -> str:
    e = html.escape
    meta = doc["meta"]
    timing = timing_text(meta, len(doc["experiments"]))
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>addnorm lab report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>addnorm lab report</h1>",
        f'<p class="meta">addnorm {e(str(meta.get("addnorm")))} &middot; torch {e(str(meta.get("torch")))} '
        f"&middot; python {e(str(meta.get('python')))} &middot; {e(str(meta.get('date')))} &middot; device "
        f"{e(str(meta.get('device')))} &middot; seed {e(str(meta.get('seed')))} &middot; "
        f"{'quick sizes (--quick)' if meta.get('quick') else 'default sizes'}"
        + (f" &middot; suite {e(str(meta['suite']))}" if meta.get("suite") else "")
        + (f" &middot; engine {e(str(meta['engine']))}" if meta.get("engine") else "")
        + (f" &middot; {e(timing)}" if timing else "")
        + (f" &middot; shard {e(str(meta['shard']))}" if meta.get("shard") else "")
        + (f" &middot; merged from {len(meta['merged_from'])} directories" if meta.get("merged_from") else "")
        + "</p>",
    ]
    if meta.get("quick"):
        parts.append(f'<p class="quick"><b>{e(QUICK_NOTE)}</b></p>')
    if meta.get("engine") == "batched":
        parts.append(f'<p class="quick"><b>{e(ENGINE_NOTE)}</b></p>')
    parts.append(
        f"<p>{e(_headline(doc, pooled))} Each verdict follows a criterion fixed in the experiment's code before it "
        "runs; an honest &ldquo;not reproduced&rdquo; is a result, not a bug.</p>"
    )
    groups = by_kind(doc["experiments"])
    for kind, records in groups.items():
        if not records:
            continue
        title, what = KIND_TITLES[kind]
        parts += [
            f'<h3>{e(title)}</h3><p class="meta">{e(what)}</p>',
            "<table><tr><th>experiment</th><th>verdict</th><th>summary</th><th>time</th></tr>",
        ]
        for r in records:
            secs = r.get("seconds")
            t = f"{secs:.1f} s" if isinstance(secs, (int, float)) else "-"
            t += " (cached)" if r.get("cached") else ""
            parts.append(
                f'<tr><td><a href="#{e(r["name"])}">{e(r["name"])}</a></td><td>{_badge(_shown(r, pooled))}</td>'
                f'<td>{e(r.get("summary") or "")}</td><td class="t">{e(t)}</td></tr>'
            )
        parts.append("</table>")
    for kind, records in groups.items():
        if records:
            parts.append(f'<h2 class="kind">{e(KIND_TITLES[kind][0])}</h2>')
        for r in records:
            label = "" if kind == "empirical" else f' <span class="kindlabel">{e(kind)}, not counted</span>'
            verdict, basis, tables = verdict_basis(r, pooled, meta.get("seed"))
            parts += [f'<section id="{e(r["name"])}">', f"<h3>{e(r['name'])} {_badge(verdict)}{label}</h3>"]
            parts += [f'<p class="meta">{e(text)}</p>' for text in basis]
            for header, rows in tables:
                parts += _html_table(header, rows)
            parts += [
                f'<p class="claim"><b>Claim.</b> {e(r["claim"])}</p>',
                f"<p><b>Source.</b> {e(r['source'])}</p>",
            ]
            parts += _html_preregistration(r)
            if r.get("criterion"):
                parts.append(f'<p class="crit"><b>Criterion (fixed before the run).</b> {e(r["criterion"])}</p>')
            if r.get("precondition"):
                parts.append(f'<p class="crit"><b>Control (precondition).</b> {e(r["precondition"])}</p>')
            if r.get("reason"):
                parts.append(f"<p><b>Why {e(r['verdict'])}.</b> {e(r['reason'])}</p>")
            if stages_text(r):
                parts.append(f"<p><b>Seeds.</b> {e(stages_text(r))}</p>")
            if r.get("summary"):
                parts.append(f"<p><b>Finding.</b> {e(r['summary'])}</p>")
            if r.get("error"):
                parts.append(f"<pre>{e(r['error'])}</pre>")
            seeds = per_seed_table(r.get("metrics"))
            if seeds is not None:
                parts += ["<p><b>Per seed.</b></p>", *_html_table(*seeds)]
            rows = other_metrics(r.get("metrics"))
            if rows:
                parts += _html_table(["metric", "value"], [[k, fmt_value(v)] for k, v in rows])
            timings = flatten_metrics(r["timings"]) if isinstance(r.get("timings"), dict) else []
            if timings:
                parts += _html_table(
                    ["timing (wall clock, differs per run)", "value"], [[k, fmt_value(v)] for k, v in timings]
                )
            parts += [_embed(out, f) for f in r.get("figures", [])]
            parts.append("</section>")
    parts.append(
        '<p class="meta">Raw numbers: results.json next to this page. Re-run: <code>addnorm lab</code> '
        "(cached results are reused; <code>--fresh</code> recomputes).</p></body></html>"
    )
    return "\n".join(parts) + "\n"


def load_results(out: Path) -> dict[str, Any]:
    return json.loads((Path(out) / RESULTS_FILE).read_text(encoding="utf-8"))


def read_results(path: Path) -> dict:
    """A run's results.json, checked enough that merge and doc fail with the file's name, not a traceback."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{path} is not a readable results file: {err}") from None
    records = data.get("experiments") if isinstance(data, dict) else None
    if not isinstance(records, list) or not all(
        isinstance(r, dict) and {"name", "verdict"} <= r.keys() for r in records
    ):
        raise ValueError(
            f"{path} is not an `addnorm lab` results file (no 'experiments' list of records with a name and a verdict)"
        )
    if not isinstance(data.get("meta", {}), dict):
        raise ValueError(f"{path} is not an `addnorm lab` results file ('meta' is not an object)")
    for r in records:
        problem = _record_problem(r)
        if problem:
            raise ValueError(
                f"{path} is not a valid `addnorm lab` results file: experiment {r.get('name')!r} {problem}"
            )
    return data


_SAFE_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def _record_problem(r: dict) -> str:
    """What is wrong with one record of a results file ("" if nothing): merge copies its figures and the report
    embeds them, so a figure must be a relative path inside runs/."""
    if not isinstance(r["name"], str) or not r["name"]:
        return "has no name"
    # merge builds runs/<name>-<key>/ from these two: "x/../../evil" would write outside --out
    if not _SAFE_PART.fullmatch(r["name"]):
        return f"has the name {r['name']!r}, which is not a plain file name (letters, digits, '.', '_', '-')"
    key = r.get("key")
    if key is not None and not (isinstance(key, str) and _SAFE_PART.fullmatch(key)):
        return f"has the key {key!r}, which is not a plain file name (letters, digits, '.', '_', '-')"
    if r["verdict"] not in VERDICTS:
        return f"has the verdict {r['verdict']!r} (not one of {', '.join(VERDICTS)})"
    if not isinstance(r.get("metrics", {}), dict):
        return "has metrics that are not an object"
    figures = r.get("figures", [])
    if not isinstance(figures, list) or not all(isinstance(f, str) for f in figures):
        return "has figures that are not a list of file names"
    for f in figures:
        parts = Path(f).parts
        if Path(f).is_absolute() or ".." in parts or not parts or parts[0] != "runs" or "\\" in f:
            return f"has the figure {f!r} outside its runs/ folder"
    return ""
