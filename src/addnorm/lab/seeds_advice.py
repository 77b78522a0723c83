"""What the seeds say: each checkable statement of the three source articles (``../shared/seeds/``, in Chinese,
paraphrased here, with the section it is in), the lab experiments that test it, and the lab's reading.

Every reading is computed from the results it is shown with, never written by hand: the verdict and each rule's
statistic with its estimate and 95% interval (pooled over the seed record's lab seeds where the page has them,
else this run's evidence; the run's own summary for an experiment that states no rules yet), or a number read from
the run's metrics (the deep Pre-LN arm of depth-sweep, layernorm-scaling's Pre-LN half) or from
``benchmarks/results/generate.md`` (the end-to-end speed of fusion). A statement whose experiment or arm is not in
the run says "not tested in this run". The only fixed text is the statement and, where the seed misquotes its
source, what the source says.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from addnorm.lab.evidence import Judgement, Rule, judge_evidence
from addnorm.lab.formatting import fmt_value
from addnorm.lab.pooled import status

# The end-to-end generate() measurement the fusion statement is read from (repository checkouts only).
GENERATE_RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "generate.md"
# The seed's "5-10% end to end" as a ratio of speeds (unpatched time / fused time).
FUSION_CLAIM = (1.05, 1.10)


@dataclass
class Sources:
    """What readings are computed from: the page's records by name, the pooled verdicts (pooled.py) by name,
    and the generate() results' text (None when the file is absent)."""

    records: dict[str, dict]
    pooled: dict[str, Any]
    generate_md: str | None


def _num(x: Any) -> str:
    return fmt_value(float(x)) if isinstance(x, (int, float)) and math.isfinite(x) else "-"


def _judged(name: str, src: Sources) -> tuple[str, str, list[dict], list[Judgement]] | None:
    """(verdict, where from, rules, judgements) of the experiment, pooled if possible, else this run's evidence."""
    p = src.pooled.get(name)
    if p is not None and p.basis == "pooled" and p.judgements:
        return p.verdict, f"pooled, {p.scope()}", p.rules, p.judgements
    r = src.records.get(name)
    if r and r.get("evidence"):
        verdict, _, judged = judge_evidence(r["evidence"])
        return verdict, "this run", r["evidence"]["rules"], judged
    return None


def _rule_reading(rule: dict, j: Judgement) -> str:
    r = Rule(**rule)
    if j.estimate is None:
        return f"{r.statistic}: no estimate ({j.reason})"
    if r.op in (">", "<"):
        bar = f"{r.op} {r.threshold:g}"
    else:
        bar = f"{'inside' if r.op == 'within' else 'outside'} +-{_num(j.margin)}"
    return f"{r.statistic} = {_num(j.estimate)} [{_num(j.low)}, {_num(j.high)}] ({bar}: {status(r, j)})"


def evidence_reading(name: str, src: Sources, keep: Callable[[dict], bool] = lambda rule: True) -> str:
    """An experiment's verdict and the rules' estimates (those ``keep`` selects) with their intervals."""
    judged = _judged(name, src)
    if judged is not None:
        verdict, where, rules, js = judged
        parts = [_rule_reading(rule, j) for rule, j in zip(rules, js) if keep(rule)]
        return f"{name}: {verdict} ({where}): " + "; ".join(parts) if parts else f"{name}: {verdict} ({where})"
    r, p = src.records.get(name), src.pooled.get(name)
    summary = f": {r['summary']}" if r and r.get("summary") else ""
    if p is not None and p.basis == "majority":
        at = " (this page's run)" if summary else ""
        return f"{name}: {p.verdict} (not pooled: the majority of {p.scope()}; no rules yet){summary}{at}"
    if r is None:
        return f"{name}: not tested in this run"
    return f"{name}: {r['verdict']} (this run; no pre-registered rules yet){summary}"


def _per_seed(name: str, src: Sources) -> dict[str, list]:
    metrics = (src.records.get(name) or {}).get("metrics")
    per = metrics.get("per_seed") if isinstance(metrics, dict) else None
    return per if isinstance(per, dict) else {}


def _mean(values: Any) -> tuple[float | None, int]:
    xs = [v for v in values or [] if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    return (sum(xs) / len(xs), len(xs)) if xs else (None, 0)


def _arm_means(name: str, src: Sources, match: Callable[[str], bool]) -> list[str]:
    out = []
    for label, values in _per_seed(name, src).items():
        if match(label.lower()):
            m, n = _mean(values)
            out.append(
                f"{label}: mean {_num(m)} over {n} seeds of this run" if m is not None else f"{label}: no finite value"
            )
    return out


_PRE = re.compile(r"\bpre\b|pre-ln|pre_ln|preln")
_DEEP = re.compile(r"(?:l\s*=\s*|\b)(12|24)(?:\b|\s*layers)")


def deep_pre_ln(src: Sources) -> str:
    """Seed 003's "from 12 layers use Pre-LN": depth-sweep's Pre-LN arms at 12 or 24 layers, with Post-LN's at
    the same depth when the run has them."""
    if "depth-sweep" not in src.records:
        return "depth-sweep: not tested in this run"
    pre = _arm_means("depth-sweep", src, lambda k: bool(_PRE.search(k) and _DEEP.search(k)))
    if not pre:
        return "depth-sweep has no Pre-LN arm at 12 or 24 layers in this run: not tested in this run"
    post = _arm_means("depth-sweep", src, lambda k: "post" in k and bool(_DEEP.search(k)))
    return "; ".join(pre + post) + f" ({evidence_reading('depth-sweep', src)})"


def _sub_verdict(rules: list[dict], judged: list[Judgement]) -> str:
    """The verdict of a subset of an experiment's rules, by evidence.judge_evidence's logic: a control not met ->
    inconclusive; every claim rule reproduced -> reproduced; one clearly failing -> not reproduced."""
    if any(r.get("role", "claim") != "claim" and not j.holds() for r, j in zip(rules, judged)):
        return "inconclusive"
    claims = [j for r, j in zip(rules, judged) if r.get("role", "claim") == "claim"]
    if claims and all(j.holds() for j in claims):
        return "reproduced"
    return "not reproduced" if any(j.verdict == "not reproduced" for j in claims) else "inconclusive"


_DEPTH_WORDS = re.compile(r"deep|depth|effective")


def pre_ln_depth(src: Sources) -> str:
    """Seed 004's "Pre-Norm may lose effective depth": layernorm-scaling's Pre-LN half, i.e. its claim rules about
    Pre-LN's depth with the controls they need, judged on their own (else its Pre-LN arms' numbers)."""
    name = "layernorm-scaling"

    def about_pre_depth(rule: dict) -> bool:
        text = f"{rule['name']} {rule['statistic']}".lower()
        return bool(_PRE.search(text) and _DEPTH_WORDS.search(text))

    judged = _judged(name, src)
    if judged is not None:
        _, where, rules, js = judged
        claims = [i for i, r in enumerate(rules) if r.get("role", "claim") == "claim" and about_pre_depth(r)]
        if claims:
            keep = [i for i, r in enumerate(rules) if r.get("role", "claim") != "claim" or i in claims]
            sub = [rules[i] for i in keep], [js[i] for i in keep]
            parts = "; ".join(_rule_reading(r, j) for r, j in zip(*sub))
            return f"{name}, its Pre-LN half: {_sub_verdict(*sub)} ({where}): {parts}"
    arms = _arm_means(name, src, lambda k: bool(_PRE.search(k)))
    if arms:
        return "; ".join(arms) + f" ({evidence_reading(name, src)})"
    return evidence_reading(name, src)


_TABLE_ROW = re.compile(r"^\|(.+)\|\s*$")
_MEASURED = re.compile(r"`: (\d{4}-\d\d-\d\d [\d:]+ UTC) - ([^,]+), ([^,;]+)")
_RATIO = re.compile(r"([\d.]+)x \[([\d.]+), ([\d.]+)\]")


def fusion_reading(text: str | None) -> str:
    """Seed 000's "fusing the residual add with LayerNorm gives 5-10% end to end": the newest paired decode
    measurement of benchmarks/results/generate.md (fused vs unpatched, thread CPU time, with its 95% interval),
    where it was measured, and where that leaves the seed's number."""
    if text is None:
        return "benchmarks/results/generate.md not found (not a repository checkout): not measured here"
    lines = text.splitlines()
    where = None
    for i, line in enumerate(lines):
        m = _MEASURED.search(line)
        if m:
            where = m
        row = _TABLE_ROW.match(line)
        if not row or "phase" not in line or "variant" not in line:
            continue
        header = [c.strip() for c in row.group(1).split("|")]
        col = next((k for k, h in enumerate(header) if "x unpatched [95%]" in h), None)
        if col is None:
            continue
        found = []
        for body in lines[i + 2 :]:
            cells = _TABLE_ROW.match(body)
            if not cells:
                break
            c = [x.strip() for x in cells.group(1).split("|")]
            d = dict(zip(header, c))
            ratio = _RATIO.search(c[col]) if len(c) > col else None
            if d.get("phase") == "decode" and d.get("variant") == "fused" and ratio:
                found.append((d.get("dtype", "?"), d.get("batch", "?"), *map(float, ratio.groups())))
        if found:
            return _fusion_text(found, where, header[col])
    return "benchmarks/results/generate.md has no paired decode measurement of the fused model: not measured here"


def _fusion_text(found: list[tuple], where: re.Match | None, column: str) -> str:
    lo_claim, hi_claim = FUSION_CLAIM
    parts = []
    for dtype, batch, ratio, lo, hi in found:
        if hi < lo_claim:
            side = "below the seed's 1.05-1.10x"
        elif lo >= lo_claim:
            side = "at or above 1.05x"
        else:
            side = "undecided against 1.05x"
        parts.append(f"{dtype} batch {batch}: {ratio:.3f}x [{lo:.3f}, {hi:.3f}] ({side})")
    device = where.group(2).strip() if where else "an unrecorded device"
    text = f"decode, fused vs unpatched ({column}): " + "; ".join(parts)
    text += f", measured on {device}" + (f", {where.group(3).strip()}, {where.group(1)}" if where else "")
    if "cuda" not in device.lower():
        text += "; the seed's number is about GPU inference, which benchmarks/results/generate.md has not measured"
    return text


# (seed and place, the statement, experiments that test it, how the reading is computed)
ADVICE: list[tuple[str, str, tuple[str, ...], Callable[[Sources], str]]] = [
    (
        "000, section 4.3 point 1",
        "Xiong et al. showed that Post-Norm's layer outputs grow in variance linearly with depth at init, Pre-Norm's "
        "stay stable (Xiong et al.'s Lemma 2 states the reverse: Pre-LN's grows, Post-LN's is fixed by its norm)",
        ("xiong-init-gradients", "placement-comparison"),
        lambda s: " / ".join(evidence_reading(n, s) for n in ("xiong-init-gradients", "placement-comparison")),
    ),
    (
        "000, section 4.3 point 1; 004, section 4",
        "Pre-Norm can skip warmup; Post-Norm is more sensitive to warmup",
        ("warmup",),
        lambda s: evidence_reading("warmup", s),
    ),
    (
        "000, section 4.5",
        "DeepNorm keeps a Post-Norm-style stack trainable at great depth",
        ("depth-sweep", "deepnet-update-size"),
        lambda s: " / ".join(evidence_reading(n, s) for n in ("depth-sweep", "deepnet-update-size")),
    ),
    (
        "003, 4.5 point 1",
        "At 6 layers or fewer, Post-LN and Pre-LN are about the same",
        ("warmup",),
        lambda s: evidence_reading("warmup", s),
    ),
    (
        "003, 4.5 point 2",
        "From 12 layers up use Pre-LN; a 24-layer Post-LN did not converge",
        ("depth-sweep",),
        deep_pre_ln,
    ),
    (
        "003, 4.5 point 3",
        "Switching a Post-LN-pretrained model to Pre-LN for fine-tuning loses against fine-tuning it as it is",
        ("finetune-post-to-pre",),
        lambda s: evidence_reading("finetune-post-to-pre", s),
    ),
    (
        "003, 4.5 point 4",
        "LayerNorm in fp16 overflows or turns to NaN in training; clamp or compute it in fp32",
        ("half-precision-stats", "fp16-layernorm"),
        lambda s: " / ".join(evidence_reading(n, s) for n in ("half-precision-stats", "fp16-layernorm")),
    ),
    (
        "004, section 4",
        "Pre-Norm keeps training stable, at the cost of some effective depth",
        ("layernorm-scaling",),
        pre_ln_depth,
    ),
    (
        "004, section 6 point 1",
        "Scaling each residual branch's output by a factor shrinking with depth keeps the stream's variance from "
        "swelling at init and lets a deep stack start stably",
        ("branch-scaling", "rezero"),
        lambda s: " / ".join(evidence_reading(n, s) for n in ("branch-scaling", "rezero")),
    ),
    (
        "004, section 6 point 2",
        "A norm's eps and gamma init matter far less than placement and warmup",
        ("norm-hyperparameters",),
        lambda s: evidence_reading("norm-hyperparameters", s),
    ),
    (
        "004, section 6 point 3",
        "Log each layer's residual-stream norm; the first layer whose norm jumps locates the culprit",
        ("localize-divergence",),
        lambda s: evidence_reading("localize-divergence", s),
    ),
    (
        "000, section 3.1; 004, section 2",
        "BatchNorm does not suit Transformers: batch statistics are noisy and variable-length batches do not align",
        ("batchnorm-vs-layernorm", "batchnorm-training"),
        lambda s: " / ".join(evidence_reading(n, s) for n in ("batchnorm-vs-layernorm", "batchnorm-training")),
    ),
    (
        "000, section 5.2",
        "Fusing the residual add with LayerNorm gives about 5-10% end-to-end inference speed-up",
        (),
        lambda s: fusion_reading(s.generate_md),
    ),
]


def _read_generate() -> str | None:
    try:
        return GENERATE_RESULTS.read_text(encoding="utf-8")
    except OSError:
        return None


def seeds_section(
    records: list[dict[str, Any]], pooled: dict[str, Any] | None = None, generate_md: str | None | bool = True
) -> list[str]:
    """Markdown lines of the "What the seeds say" section for a run's experiment records and, when given, the
    pooled verdicts (pooled.pool_record). ``generate_md``: the text of benchmarks/results/generate.md (True reads
    the repository's file)."""
    text = _read_generate() if generate_md is True else generate_md
    src = Sources(records={r.get("name"): r for r in records}, pooled=pooled or {}, generate_md=text)
    lines = [
        "## What the seeds say",
        "",
        "Each checkable statement of the source articles (paraphrased, with its place in the seed), the experiments "
        "that test it, and the lab's reading computed from these results: verdicts with each rule's estimate and "
        "95% interval (pooled where the page pools), numbers read from the runs' metrics, and the fusion speed from "
        "benchmarks/results/generate.md.",
        "",
        "| seed | statement | tested by | the lab's reading |",
        "|---|---|---|---|",
    ]
    for where, statement, names, read in ADVICE:
        cells = [where, statement, ", ".join(names) or "benchmarks/bench_generate.py", read(src)]
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return lines + [""]
