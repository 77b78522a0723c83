"""The lab's report: ``results.json`` (machine-readable), ``report.md`` and ``index.html`` (one self-contained page:
figures embedded as base64 PNG, no network), and the verdict table printed in the terminal.

results.json::

    {"experiments": [{"name", "claim", "source", "criterion", "verdict", "metrics", "figures", "summary",
                      "seconds", "cached", "key", "config", "index", ["error"]}, ...],
     "meta": {"addnorm", "torch", "date", "quick", "seed", "device", ...},
     "counts": {"reproduced": n, "not reproduced": n, "inconclusive": n}}
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Any, Iterable

from addnorm.lab.core import VERDICTS

RESULTS_FILE = "results.json"
MARKDOWN_FILE = "report.md"
HTML_FILE = "index.html"

_PUBLIC_FIELDS = ("name", "claim", "source", "criterion", "verdict", "metrics", "figures", "summary", "seconds",
                  "cached", "key", "config", "index", "error")  # fmt: skip


def counts(records: Iterable[dict]) -> dict[str, int]:
    c = {v: 0 for v in VERDICTS}
    for r in records:
        c[r["verdict"]] = c.get(r["verdict"], 0) + 1
    return c


def results_document(records: list[dict], meta: dict[str, Any]) -> dict[str, Any]:
    experiments = [{k: r[k] for k in _PUBLIC_FIELDS if k in r} for r in records]
    return {"experiments": experiments, "meta": meta, "counts": counts(records)}


def write_report(out: Path, records: list[dict], meta: dict[str, Any]) -> dict[str, Any]:
    """Write results.json, report.md and index.html into ``out``; returns the results document."""
    from addnorm import io

    out = Path(out)
    doc = results_document(records, meta)
    io.atomic_write_json(out / RESULTS_FILE, doc)
    io.atomic_write_text(out / MARKDOWN_FILE, render_markdown(doc))
    io.atomic_write_text(out / HTML_FILE, render_html(doc, out))
    return doc


# ------------------------------------------------------------------------------------------------ formatting
def fmt_value(v: Any, max_items: int = 12) -> str:
    """A metric value as short text: 4 significant digits, long lists cut with an ellipsis."""
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        items = [fmt_value(x, max_items) for x in v[:max_items]]
        return "[" + ", ".join(items) + (", ..." if len(v) > max_items else "") + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {fmt_value(x, max_items)}" for k, x in v.items()) + "}"
    return str(v)


def flatten_metrics(metrics: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested dicts become dotted keys, so the metrics table stays two columns wide."""
    rows: list[tuple[str, Any]] = []
    for k, v in metrics.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and len(v) <= 24:
            rows.extend(flatten_metrics(v, key + "."))
        else:
            rows.append((key, v))
    return rows


def terminal_table(doc: dict[str, Any]) -> str:
    """The verdict table printed at the end of a run."""
    rows = [("experiment", "verdict", "time", "")]
    for r in doc["experiments"]:
        how = "error" if r.get("error") else ("cached" if r.get("cached") else "ran")
        secs = r.get("seconds")
        rows.append((r["name"], r["verdict"], f"{secs:.1f}s" if isinstance(secs, (int, float)) else "-", how))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    c = doc["counts"]
    lines.append(", ".join(f"{n} {v}" for v, n in c.items()))
    for r in doc["experiments"]:
        if r.get("error"):
            lines.append(f"{r['name']}: {r['error']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------- markdown
def render_markdown(doc: dict[str, Any]) -> str:
    meta = doc["meta"]
    lines = [
        "# addnorm lab report",
        "",
        f"addnorm {meta.get('addnorm')}, torch {meta.get('torch')}, {meta.get('date')}, device {meta.get('device')}, "
        f"seed {meta.get('seed')}, {'quick' if meta.get('quick') else 'default'} sizes",
        "",
        "| experiment | verdict | summary |",
        "|---|---|---|",
    ]
    for r in doc["experiments"]:
        summary = (r.get("summary") or "").replace("|", "\\|").replace("\n", " ")
        lines.append(f"| [{r['name']}](#{r['name']}) | {r['verdict']} | {summary} |")
    for r in doc["experiments"]:
        lines += ["", f"## {r['name']}", "", f"**Verdict: {r['verdict']}**", "", f"Claim: {r['claim']}", "",
                  f"Source: {r['source']}", ""]  # fmt: skip
        if r.get("criterion"):
            lines += [f"Criterion: {r['criterion']}", ""]
        if r.get("summary"):
            lines += [r["summary"], ""]
        if r.get("error"):
            lines += ["```", r["error"], "```", ""]
        rows = flatten_metrics(r.get("metrics", {}))
        if rows:
            lines += ["| metric | value |", "|---|---|"]
            lines += [f"| {k} | {fmt_value(v)} |".replace("\n", " ") for k, v in rows]
            lines.append("")
        lines += [f"![{Path(f).stem}]({f})" for f in r.get("figures", [])]
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
"""


def _badge(verdict: str) -> str:
    return f'<span class="badge {verdict.replace(" ", "-")}">{html.escape(verdict)}</span>'


def _embed(out: Path, figure: str) -> str:
    data = base64.b64encode((Path(out) / figure).read_bytes()).decode("ascii")
    alt = html.escape(Path(figure).stem)
    return f'<img alt="{alt}" src="data:image/png;base64,{data}">'


def render_html(doc: dict[str, Any], out: Path) -> str:
    e = html.escape
    meta = doc["meta"]
    c = doc["counts"]
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
        + (f" &middot; run took {e(str(meta['seconds']))} s" if meta.get("seconds") is not None else "")
        + (f" &middot; shard {e(str(meta['shard']))}" if meta.get("shard") else "")
        + (f" &middot; merged from {len(meta['merged_from'])} directories" if meta.get("merged_from") else "")
        + "</p>",
        f"<p>{c.get('reproduced', 0)} reproduced, {c.get('not reproduced', 0)} not reproduced, "
        f"{c.get('inconclusive', 0)} inconclusive. Each verdict follows a criterion fixed in the experiment's code "
        "before it runs; an honest &ldquo;not reproduced&rdquo; is a result, not a bug.</p>",
        "<table><tr><th>experiment</th><th>verdict</th><th>summary</th><th>time</th></tr>",
    ]
    for r in doc["experiments"]:
        secs = r.get("seconds")
        t = f"{secs:.1f} s" if isinstance(secs, (int, float)) else "-"
        t += " (cached)" if r.get("cached") else ""
        parts.append(
            f'<tr><td><a href="#{e(r["name"])}">{e(r["name"])}</a></td><td>{_badge(r["verdict"])}</td>'
            f"<td>{e(r.get('summary') or '')}</td><td class=\"t\">{e(t)}</td></tr>"
        )
    parts.append("</table>")
    for r in doc["experiments"]:
        parts += [
            f'<section id="{e(r["name"])}">',
            f"<h2>{e(r['name'])} {_badge(r['verdict'])}</h2>",
            f'<p class="claim"><b>Claim.</b> {e(r["claim"])}</p>',
            f"<p><b>Source.</b> {e(r['source'])}</p>",
        ]
        if r.get("criterion"):
            parts.append(f'<p class="crit"><b>Criterion (fixed before the run).</b> {e(r["criterion"])}</p>')
        if r.get("summary"):
            parts.append(f"<p><b>Finding.</b> {e(r['summary'])}</p>")
        if r.get("error"):
            parts.append(f"<pre>{e(r['error'])}</pre>")
        rows = flatten_metrics(r.get("metrics", {}))
        if rows:
            parts.append("<table><tr><th>metric</th><th>value</th></tr>")
            parts += [f'<tr><td>{e(k)}</td><td class="v">{e(fmt_value(v))}</td></tr>' for k, v in rows]
            parts.append("</table>")
        parts += [_embed(out, f) for f in r.get("figures", [])]
        parts.append("</section>")
    parts.append(
        '<p class="meta">Raw numbers: results.json next to this page. Re-run: <code>addnorm lab</code> '
        "(cached results are reused; <code>--fresh</code> recomputes).</p></body></html>"
    )
    return "\n".join(parts) + "\n"


def load_results(out: Path) -> dict[str, Any]:
    return json.loads((Path(out) / RESULTS_FILE).read_text(encoding="utf-8"))
