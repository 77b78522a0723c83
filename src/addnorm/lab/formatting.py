"""What every view of the lab's results shares (the terminal table, report.md and index.html of report.py, and
docs/lab-results.md of docs.py): the kinds' titles, records grouped by kind, values, times and per-seed numbers as
text, and the headline of counted verdicts."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from addnorm.lab.core import KINDS

# How each kind is headed, and what it is (shown under the heading).
KIND_TITLES = {
    "empirical": ("Empirical claims", "what a paper says happens, tested here; these are the counted verdicts"),
    "sanity": (
        "Sanity checks",
        "numerics and identities that must hold if the code is right; not evidence, not counted",
    ),
    "demonstration": (
        "Demonstrations",
        "an article's exercise illustrated with figures; the verdict says whether "
        "it showed what it should; not counted",
    ),
}
ENGINE_NOTE = (
    "Batched engine (--engine batched): the training runs of one architecture trained as one stacked computation; "
    "their numbers equal the default (sequential) engine's up to float rounding, so a verdict at its criterion's "
    "boundary can differ between the two engines. The recorded results (docs/lab-results.md) use this engine, which "
    "pays for their three lab seeds; the default `addnorm lab` uses the sequential one."
)


def engine_text(meta: dict) -> str:
    """The header's engine part (", engine E"), or "" for a results.json written before engines existed."""
    return f", engine {meta['engine']}" if meta.get("engine") else ""


QUICK_NOTE = (
    "Quick sizes (--quick): a smoke run for checking the installation, not evidence; verdicts at quick "
    "sizes can differ from the default sizes'."
)


def stages_text(record: dict) -> str:
    """What a record's two-stage seed design did at its run (stages.py), or "" for an experiment of one stage."""
    st = record.get("stages")
    if not isinstance(st, dict):
        return ""
    first, second = st["declared"]["first"], st["declared"]["second"]
    design = (
        f"Two stages of model seeds (pre-registered): {first} model seeds, then {second} more, once, when a rule's "
        "95% interval straddles its threshold."
    )
    if not st["taken"]:
        return f"{design} Second stage not needed at this run: every rule was decided by the first {first}."
    return (
        f"{design} Second stage taken at this run (model seeds {', '.join(map(str, st['second_stage_seeds']))}): "
        f"after the first {first} (verdict {st['first_stage']['verdict']}) {'; '.join(st['why'])}. This run's "
        f"verdict rests on both stages ({first + second} model seeds)."
    )


def kind_of(record: dict) -> str:
    kind = record.get("kind") or "empirical"
    return kind if kind in KINDS else "empirical"


def by_kind(records: Iterable[dict]) -> dict[str, list[dict]]:
    """The records grouped by kind, in :data:`KINDS` order (empirical first), each group in run order."""
    groups: dict[str, list[dict]] = {k: [] for k in KINDS}
    for r in records:
        groups[kind_of(r)].append(r)
    return groups


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


def fmt_seconds(seconds: Any) -> str:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes} min {rest} s"


def timing_text(meta: dict[str, Any], total: int | None = None) -> str:
    """How long the run took. After a fully cached rerun the run itself took ~0 s: say that the results came from
    the cache and how long computing them took (the records' stored seconds), not "run took 0.0 s"."""
    seconds, computed, cached = meta.get("seconds"), meta.get("computed_seconds"), meta.get("cached") or 0
    if seconds is None:  # merged: no single run
        return (
            f"computing the results took {fmt_seconds(computed)}, summed over the experiments"
            if computed is not None
            else ""
        )
    summed = f"{fmt_seconds(computed)}, summed over the experiments"
    if total and cached >= total:
        return f"all {total} results were cached (computing them took {summed}; this run {fmt_seconds(seconds)})"
    text = f"run took {fmt_seconds(seconds)}"
    if cached:
        text += f" ({cached} of {total} results from the cache, computed earlier" + (
            f"; computing all of them took {summed})" if computed is not None else ")"
        )
    jobs, world = meta.get("jobs"), meta.get("world_size") or 1
    if jobs:
        text += f" with --jobs {jobs}" + (f" on each of {world} torchrun ranks" if world > 1 else "")
    return text


def headline(doc: dict[str, Any]) -> str:
    """The counted verdicts (empirical claims), and what else was shown without being counted."""
    c = doc.get("counts") or {}
    groups = by_kind(doc["experiments"])
    text = (
        f"Empirical claims: {c.get('reproduced', 0)} reproduced, {c.get('not reproduced', 0)} not reproduced, "
        f"{c.get('inconclusive', 0)} inconclusive."
    )
    nouns = {"sanity": ("sanity check", "sanity checks"), "demonstration": ("demonstration", "demonstrations")}
    extra = [f"{len(groups[k])} {nouns[k][len(groups[k]) != 1]}" for k in nouns if groups[k]]
    if extra:
        text += f" Also {' and '.join(extra)}, shown apart and not counted."
    return text


def per_seed_table(metrics: Any) -> tuple[list[str], list[list[str]]] | None:
    """``metrics["per_seed"]`` ({label: [value at each seed]}) as a header and rows, seeds from
    ``metrics["seeds"]`` (else 0, 1, ...); None when there is none or it has another shape."""
    if not isinstance(metrics, dict):
        return None
    per_seed = metrics.get("per_seed")
    if not isinstance(per_seed, dict) or not per_seed or not all(isinstance(v, list) for v in per_seed.values()):
        return None
    width = max(len(v) for v in per_seed.values())
    seeds = metrics.get("seeds")
    if not isinstance(seeds, list) or len(seeds) != width:
        seeds = list(range(width))
    header = ["", *[f"seed {fmt_value(s)}" for s in seeds]]
    rows = [
        [str(label), *[fmt_value(x) for x in values], *[""] * (width - len(values))]
        for label, values in per_seed.items()
    ]
    return header, rows


def other_metrics(metrics: Any) -> list[tuple[str, Any]]:
    """The metrics table's rows: everything but what the per-seed table shows."""
    if not isinstance(metrics, dict):
        return []
    if per_seed_table(metrics) is not None:
        metrics = {k: v for k, v in metrics.items() if k not in ("per_seed", "seeds")}
    return flatten_metrics(metrics)
