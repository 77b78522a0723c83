"""The survey's outputs: survey.json (the rows), survey.md (summary and table) and index.html (one self-contained
page: the summary and a table sortable by any column, nothing loaded from the network); and the README's generated
paragraphs (which families hf.apply fuses, the survey's counts), rewritten between marker comments so that no list
of families is kept by hand."""

from __future__ import annotations

import html
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from addnorm.io import atomic_write_text

COLUMNS = (
    "model_type",
    "role",
    "norm",
    "placement",
    "eps",
    "zero_centered_weight",
    "bias",
    "final_norm",
    "qk_norm",
    "residual_scale",
    "hf_apply",
    "hf_ops",
    "doctor",
    "status",
)


def _timed_out(row: dict) -> bool:
    """The doctor ran past the survey's CPU-time limit (a slow model on a busy machine), rather than crashing."""
    # "_Timeout" in surveys written before the exception had a public name
    return str(row.get("doctor_error", "")).startswith(("SurveyTimeout", "_Timeout"))


_DOCTOR_KINDS = (("error", "error"), ("warning", "warning"), ("info", "note"))


def _doctor_cell(findings: list[dict]) -> str:
    """How many errors, warnings and notes, each with its codes: "1 warning (residual-growth); 2 notes
    (skip-path-design x2)", or "-" for none. Notes are the recognised designs and checks left out, said apart
    from the errors so that a released model's deliberate design does not read as a bug."""
    parts = []
    for severity, word in _DOCTOR_KINDS:
        codes = Counter(f["code"] for f in findings if f["severity"] == severity)
        n = sum(codes.values())
        if n:
            listed = ", ".join(f"{c}" + (f" x{k}" if k > 1 else "") for c, k in sorted(codes.items()))
            parts.append(f"{n} {word}{'s' if n > 1 else ''} ({listed})")
    return "; ".join(parts) or "-"


def _cell(row: dict, key: str) -> str:
    value = row.get(key)
    if key == "doctor":
        if row.get("doctor_error"):
            return "timed out" if _timed_out(row) else "crashed"
        if value is None:
            return ""
        return _doctor_cell(value)
    if key == "status" and row.get("status") == "skipped":
        return f"skipped: {row.get('reason', '')}"
    if key == "hf_apply" and row.get("hf_apply") == "fused":
        return "fused (" + ", ".join(row.get("hf_fused_layers", [])) + ")"
    if key == "hf_apply" and row.get("hf_apply") == "norms" and row.get("hf_apply_reason"):
        return f"norms ({row['hf_apply_reason']})"  # why no add was fused
    if key == "hf_ops":  # the fused ops its layers call; none for a model with no fused call (or none measured)
        return ", ".join(value or ()) or ("none" if row.get("status") == "ok" else "")
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
    return "" if value is None else str(value)


def summary(result: dict) -> dict[str, Any]:
    """Counts: architectures analysed and skipped; among decoder LMs (and all), each norm and placement;
    hf.apply outcomes; doctor findings."""
    rows = result["models"]
    ok = [r for r in rows if r["status"] == "ok"]
    dec = [r for r in ok if r.get("role") == "decoder"]
    count = lambda rs, k: dict(Counter(str(r.get(k)) for r in rs).most_common())  # noqa: E731
    findings = Counter(f["code"] for r in ok for f in r.get("doctor") or [] if f["severity"] in ("error", "warning"))
    notes = Counter(f["code"] for r in ok for f in r.get("doctor") or [] if f["severity"] == "info")
    return {
        "architectures": len(rows),
        "analysed": len(ok),
        "skipped": len(rows) - len(ok),
        "decoder_lms": len(dec),
        "decoder_norm": count(dec, "norm"),
        "decoder_placement": count(dec, "placement"),
        "all_norm": count(ok, "norm"),
        "all_placement": count(ok, "placement"),
        "hf_apply": count(ok, "hf_apply"),
        "hf_ops": dict(Counter(op for r in ok for op in r.get("hf_ops") or ["none"]).most_common()),
        "decoder_fused_by_placement": _fused_by_placement(dec),
        "fused_families": sorted(r["model_type"] for r in ok if r.get("hf_apply") == "fused"),
        "doctor_findings": dict(findings.most_common()),
        "doctor_notes": dict(notes.most_common()),
        "doctor_errors": sorted(
            r["model_type"] for r in ok if any(f["severity"] == "error" for f in r.get("doctor") or [])
        ),
        "doctor_crashes": sorted(r["model_type"] for r in ok if r.get("doctor_error") and not _timed_out(r)),
        "doctor_timeouts": sorted(r["model_type"] for r in ok if _timed_out(r)),
    }


def _fused_by_placement(rows: list[dict]) -> dict[str, str]:
    """Per placement: "fused of all" ("9 of 9"), most common placement first."""
    total = Counter(str(r.get("placement")) for r in rows)
    fused = Counter(str(r.get("placement")) for r in rows if r.get("hf_apply") == "fused")
    return {p: f"{fused[p]} of {n}" for p, n in total.most_common()}


def _counts_md(counts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "-"


def summary_markdown(result: dict) -> str:
    s = summary(result)
    lines = [
        f"transformers {result['transformers']}, torch {result.get('torch', '?')}: {s['architectures']} architectures "
        f"with a base model class, {s['analysed']} analysed, {s['skipped']} skipped "
        f"({result.get('seconds', '?')} s).",
        "",
        "| | count |",
        "|---|---|",
        f"| decoder LMs: norm | {_counts_md(s['decoder_norm'])} |",
        f"| decoder LMs: placement | {_counts_md(s['decoder_placement'])} |",
        f"| all analysed: norm | {_counts_md(s['all_norm'])} |",
        f"| all analysed: placement | {_counts_md(s['all_placement'])} |",
        f"| hf.apply | {_counts_md(s['hf_apply'])} |",
        f"| hf.apply: fused ops called (architectures calling each) | {_counts_md(s['hf_ops'])} |",
        f"| decoder LMs fused by hf.apply, per placement | {_counts_md(s['decoder_fused_by_placement'])} |",
        f"| doctor findings (errors, warnings) | {_counts_md(s['doctor_findings'])} |",
        f"| doctor notes (recognised designs, checks left out) | {_counts_md(s['doctor_notes'])} |",
        f"| doctor errors on | {', '.join(s['doctor_errors']) or 'none'} |",
        "",
        f"Fused by hf.apply ({len(s['fused_families'])}): {', '.join(s['fused_families'])}.",
    ]
    if s["doctor_crashes"]:
        lines += ["", f"The doctor crashed on: {', '.join(s['doctor_crashes'])}."]
    if s["doctor_timeouts"]:
        lines += ["", f"The doctor ran past the time limit on: {', '.join(s['doctor_timeouts'])}."]
    return "\n".join(lines) + "\n"


def table_markdown(result: dict, *, status: str | None = "ok") -> str:
    rows = [r for r in result["models"] if status is None or r["status"] == status]
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        out.append("| " + " | ".join(_cell(r, k).replace("|", "\\|") for k in COLUMNS) + " |")
    return "\n".join(out) + "\n"


def markdown(result: dict) -> str:
    skipped = [r for r in result["models"] if r["status"] != "ok"]
    reasons = Counter(r.get("reason", "").split(":")[0] for r in skipped)
    return (
        "# addnorm survey\n\n"
        + summary_markdown(result)
        + "\n## Analysed\n\n"
        + table_markdown(result)
        + f"\n## Skipped ({len(skipped)})\n\n"
        + "\n".join(f"- {n} x {why}" for why, n in reasons.most_common())
        + "\n\n"
        + "\n".join(f"- `{r['model_type']}`: {r.get('reason', '')}" for r in skipped)
        + "\n"
    )


_SORT_JS = """
document.querySelectorAll('th').forEach((th, i) => th.addEventListener('click', () => {
  const body = th.closest('table').tBodies[0], rows = [...body.rows];
  const dir = th.dataset.dir = th.dataset.dir === 'asc' ? 'desc' : 'asc';
  rows.sort((a, b) => {
    const x = a.cells[i].textContent, y = b.cells[i].textContent, nx = parseFloat(x), ny = parseFloat(y);
    const c = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : x.localeCompare(y);
    return dir === 'asc' ? c : -c;
  });
  rows.forEach(r => body.appendChild(r));
}));
"""


def page(result: dict) -> str:
    s = summary(result)
    esc = html.escape

    def counts(title, d):
        return f"<tr><th>{esc(title)}</th><td>{esc(_counts_md(d))}</td></tr>"

    head = "".join(f"<th>{esc(c)}</th>" for c in COLUMNS)
    body = "".join(
        "<tr>" + "".join(f"<td>{esc(_cell(r, c))}</td>" for c in COLUMNS) + "</tr>" for r in result["models"]
    )
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>addnorm survey</title>
<style>body{{font:14px system-ui,sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}}th{{background:#eee;cursor:pointer}}
</style></head><body>
<h1>addnorm survey</h1>
<p>transformers {esc(result["transformers"])}, torch {esc(str(result.get("torch", "?")))}: {s["architectures"]}
architectures, {s["analysed"]} analysed, {s["skipped"]} skipped ({esc(str(result.get("seconds", "?")))} s).
Placement and norm are measured from each tiny model's dataflow; click a column to sort.</p>
<table>{counts("decoder LMs: norm", s["decoder_norm"])}{counts("decoder LMs: placement", s["decoder_placement"])}
{counts("all analysed: norm", s["all_norm"])}{counts("all analysed: placement", s["all_placement"])}
{counts("hf.apply", s["hf_apply"])}{counts("hf.apply: fused ops called", s["hf_ops"])}
{counts("decoder LMs fused, per placement", s["decoder_fused_by_placement"])}
{counts("doctor findings", s["doctor_findings"])}</table>
<p>Fused by hf.apply ({len(s["fused_families"])}): {esc(", ".join(s["fused_families"]))}</p>
<table id="survey"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>
<script>{_SORT_JS}</script></body></html>
"""


def dumps(result: dict) -> str:
    """The result as JSON with one row per line (a regenerated survey diffs row by row)."""
    head = {k: v for k, v in result.items() if k != "models"}
    rows = ",\n".join(json.dumps(r, sort_keys=True) for r in result["models"])
    return json.dumps(head)[:-1] + (", " if head else "") + '"models": [\n' + rows + "\n]}\n"


def load(path: Path) -> dict:
    """A survey.json written by :func:`write` or ``addnorm survey --json``; ValueError naming the file and what is
    wrong with it if it is not one (the README and the docs are rewritten from it: a damaged file must not reach
    them)."""
    try:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a survey from it ({type(e).__name__}: {e})") from e
    if not (isinstance(result, dict) and isinstance(result.get("models"), list) and "transformers" in result):
        raise ValueError(f"{path}: not a survey (expected {{'transformers': ..., 'models': [row, ...]}})")
    problem = _survey_problem(result)
    if problem:
        raise ValueError(f"{path}: not a usable survey: {problem}")
    return result


def _survey_problem(result: dict) -> str:
    """What is wrong with a loaded survey ("" if nothing)."""
    if not isinstance(result["transformers"], str) or not result["transformers"].strip():
        return f"'transformers' is {result['transformers']!r}, not a version string"
    rows = result["models"]
    if not rows:
        return "it has no rows ('models' is empty)"
    seen = set()
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            return f"row {i} is not an object"
        model_type = r.get("model_type")
        if not isinstance(model_type, str) or not model_type:
            return f"row {i} has the model_type {model_type!r}"
        if r.get("status") not in ("ok", "skipped"):
            return f"row {model_type!r} has the status {r.get('status')!r} (not 'ok' or 'skipped')"
        if model_type in seen:
            return f"the model type {model_type!r} has two rows"
        seen.add(model_type)
    only = result.get("only")
    if only is not None and not (isinstance(only, list) and all(isinstance(t, str) for t in only)):
        return f"'only' is {only!r}, not a list of model types"
    return ""


def partial(result: dict, installed: list[str], version: str) -> str:
    """Why ``result`` is not a whole survey ("" if it is one): it was run with ``--only``, or, for the installed
    transformers ``version``, it lacks some of its ``installed`` model types. The README's counts and fused
    families are rewritten only from a whole survey."""
    if result.get("only"):
        return f"it was run with --only {' '.join(result['only'])}"
    if result["transformers"] == version:
        missing = set(installed) - {r["model_type"] for r in result["models"]}
        if missing:
            return (
                f"it covers {len(installed) - len(missing)} of the {len(installed)} architectures of transformers "
                f"{version} (missing: {', '.join(sorted(missing)[:5])}{', ...' if len(missing) > 5 else ''})"
            )
    return ""


# The README's generated paragraphs: each between "<!-- survey:NAME -->" and "<!-- /survey:NAME -->".
def readme_fused_decoders(result: dict) -> list[str]:
    """The fused architectures the README names: the decoder LMs (what people serve); the others it counts."""
    return sorted(
        r["model_type"]
        for r in result["models"]
        if r.get("status") == "ok" and r.get("hf_apply") == "fused" and r.get("role") == "decoder"
    )


def _readme_fused(result: dict) -> str:
    s = summary(result)
    fused = s["fused_families"]
    decoders = readme_fused_decoders(result)
    return (
        f"With transformers {result['transformers']}, `hf.apply` fuses the residual add and norm in {len(fused)} "
        f"architectures ({len(decoders)} decoder LMs, {len(fused) - len(decoders)} encoders, encoder-decoders and "
        f"vision towers) and swaps only the norms in {s['hf_apply'].get('norms', 0)} more "
        f"({s['hf_apply'].get('unsupported', 0)} have no norm it reproduces; {s['skipped']} are not built tiny on "
        "CPU). The fused decoder LMs, as the survey found them (`docs/survey.json`; "
        "tests/integrations/test_hf_every_family.py checks every fused architecture; all of them: `docs/survey.md`): "
        + ", ".join(f"`{t}`" for t in decoders)
        + "."
    )


def _readme_summary(result: dict) -> str:
    s = summary(result)
    top = lambda d: ", ".join(f"{k} {v}" for k, v in d.items() if v > 1 and k != "None")  # noqa: E731
    minutes = result.get("seconds")
    took = f" in about {round(minutes / 60)} minutes" if isinstance(minutes, (int, float)) else ""
    fused = s["decoder_fused_by_placement"]
    return (
        f"transformers {result['transformers']}: {s['analysed']} of {s['architectures']} architectures analysed{took}"
        f"; {s['decoder_lms']} decoder LMs: {top(s['decoder_norm'])}; placement {top(s['decoder_placement'])}; "
        "fused by `hf.apply`: " + ", ".join(f"{p} {fused[p]}" for p in s["decoder_placement"] if p != "None") + "."
    )


README_BLOCKS = {"hf-fused": _readme_fused, "summary": _readme_summary}


def update_readme(text: str, result: dict) -> str:
    """``text`` with every generated paragraph (see README_BLOCKS) rewritten from ``result``; ValueError if a
    block's markers are missing."""
    for name, make in README_BLOCKS.items():
        pattern = re.compile(rf"(<!-- survey:{name} -->\n)(?:.*?\n)?(<!-- /survey:{name} -->)", re.DOTALL)
        if not pattern.search(text):
            raise ValueError(f"no '<!-- survey:{name} -->' ... '<!-- /survey:{name} -->' block to rewrite")
        body = _wrap(make(result)) + "\n" if result["models"] else ""
        text = pattern.sub(lambda m: m.group(1) + body + m.group(2), text)  # noqa: B023 - sub() calls it in this iteration
    return text


def _wrap(text: str, width: int = 118) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False))


def write(result: dict, out: Path) -> list[Path]:
    """survey.json, survey.md and index.html in ``out``; returns their paths."""
    out = Path(out)
    paths = [out / "survey.json", out / "survey.md", out / "index.html"]
    atomic_write_text(paths[0], dumps(result))
    atomic_write_text(paths[1], markdown(result))
    atomic_write_text(paths[2], page(result))
    return paths
