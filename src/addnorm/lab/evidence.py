"""A verdict as a statistic with an interval: what one run (or every recorded run) of an experiment says.

An empirical experiment measures *units*: one number per model seed (or per init), paired across its arms, e.g.
"excess loss without warmup minus with warmup, Post-LN". A :class:`Rule`, fixed before any run, says which side
of a threshold the claim puts the units' mean on. The verdict is read off a bootstrap 95% interval of that mean:

* ``>`` / ``<``: *reproduced* when the whole interval is on the claim's side of the threshold, *not reproduced*
  when it is wholly on the other side, *inconclusive* when it straddles it;
* ``within`` (parity): the mean difference lies inside (-margin, margin); *reproduced* when the interval is inside,
  *not reproduced* when it is wholly outside, else *inconclusive*. ``outside`` is its mirror, used by negative
  controls (a known-worse arm that the parity margin must reject).

A parity margin is either absolute or ``relative`` to the measured seed-to-seed spread (``threshold`` x the
standard deviation of each unit's ``scale``, e.g. the baseline arm's excess loss), so it tracks the noise of the
regime instead of a fixed number of nats.

Controls are rules too. A *positive* control shows the effect the claim needs is visible in this regime (Post-LN
without warmup fails; 8 layers beat 2); a *negative* control shows a parity margin can reject a known-worse arm.
A control that is not clearly met makes the verdict *inconclusive*, never *not reproduced*: a missing regime is
not a failed claim.

Pooling: the units of several runs (lab seeds) are concatenated and the estimate is their mean. The interval comes
from a two-stage bootstrap: each resample draws the lab seeds with replacement, then units within each drawn lab
seed. A lab seed is more than a draw of inits: it draws its own task data (a language, a corpus), so units of one lab
seed are not independent of each other, and an interval that resampled units only within each lab seed would
ignore the spread between lab seeds (too narrow where the lab seeds disagree). With one lab seed (one run's own
verdict) this is the plain bootstrap over its units. The resampling generator is seeded from the data, so the same
units always give the same interval.

Everything here is plain data in and out (JSON-able dicts), so the seed record can store a run's evidence and
judge it again, pooled with other runs, without importing the experiment.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "Rule",
    "Unit",
    "Judgement",
    "judge",
    "judge_evidence",
    "undecided",
    "units",
    "pool_evidence",
    "BOOTSTRAP",
]

OPS = (">", "<", "within", "outside")
ROLES = ("claim", "positive", "negative")
# Resamples of the percentile bootstrap: the 2.5% / 97.5% quantiles of 4000 resample means move by well under 1%
# of the interval's width between generator seeds.
BOOTSTRAP = 4000
# A rule whose units are mostly missing (runs that gave no finite number) cannot be judged: at least this share
# of its units must be finite.
MIN_FINITE_SHARE = 2 / 3
# The reason of a rule whose interval straddles its threshold: undecided by these units, where more units could
# decide it (unlike a rule that had too few finite units or no spread to derive a margin from).
STRADDLES = "the 95% interval straddles the threshold"


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One pre-registered statistic: ``name`` (short id), ``statistic`` (what one unit's value is, in words),
    ``op`` and ``threshold`` (see the module docstring); ``relative``: a ``within``/``outside`` margin is
    ``threshold`` x the standard deviation of the units' ``scale`` values; ``role``: "claim" or a control."""

    name: str
    statistic: str
    op: str
    threshold: float
    role: str = "claim"
    relative: bool = False

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"Rule {self.name!r}: op must be one of {OPS}, got {self.op!r}")
        if self.role not in ROLES:
            raise ValueError(f"Rule {self.name!r}: role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.threshold, (int, float)) or not math.isfinite(self.threshold):
            raise ValueError(f"Rule {self.name!r}: threshold must be a finite number, got {self.threshold!r}")
        if self.op in ("within", "outside") and self.threshold <= 0:
            raise ValueError(f"Rule {self.name!r}: a {self.op} margin must be > 0, got {self.threshold!r}")
        if self.relative and self.op not in ("within", "outside"):
            raise ValueError(f"Rule {self.name!r}: relative=True applies to within/outside margins only")

    def text(self) -> str:
        """The rule in words, for the report."""
        if self.op in (">", "<"):
            return f"mean of {self.statistic} {self.op} {self.threshold:g}"
        margin = f"{self.threshold:g} x the seed-to-seed spread" if self.relative else f"{self.threshold:g}"
        side = "inside" if self.op == "within" else "outside"
        return f"mean of {self.statistic} {side} +-({margin})"


@dataclass(frozen=True, kw_only=True)
class Unit:
    """One unit's value: ``seed`` (the model seed or init it came from), ``lab_seed`` (the run's ``--seed``),
    ``value`` (None or non-finite when the run gave no number), ``scale`` (for relative margins)."""

    seed: int
    lab_seed: int
    value: float | None
    scale: float | None = None


def units(values: Sequence[float | None], seeds: Sequence[int], lab_seed: int, scales=None) -> list[dict]:
    """The JSON form of one run's units, paired by seed: ``values[i]`` came from ``seeds[i]``."""
    if len(values) != len(seeds) or (scales is not None and len(scales) != len(seeds)):
        raise ValueError(f"units: {len(values)} values for {len(seeds)} seeds (scales: {scales!r})")
    out = []
    for i, (v, s) in enumerate(zip(values, seeds)):
        sc = None if scales is None else _num(scales[i])
        out.append(asdict(Unit(seed=int(s), lab_seed=int(lab_seed), value=_num(v), scale=sc)))
    return out


def _num(v) -> float | None:
    if v is None or isinstance(v, bool):
        return None if v is None else float(v)
    v = float(v)
    return v if math.isfinite(v) else None


@dataclass(kw_only=True)
class Judgement:
    """A rule applied to units: the verdict, the mean and its 95% interval, how many units were finite, the margin
    used (within/outside), and why it could not decide (``reason``)."""

    rule: str
    verdict: str
    estimate: float | None
    low: float | None
    high: float | None
    n: int
    n_missing: int
    margin: float | None = None
    reason: str = ""
    per_lab_seed: dict[str, list[float | None]] = field(default_factory=dict)

    def holds(self) -> bool:
        return self.verdict == "reproduced"

    def text(self) -> str:
        if self.estimate is None:
            return f"{self.rule}: no estimate ({self.reason})"
        m = f", margin {self.margin:.3g}" if self.margin is not None else ""
        return f"{self.rule}: {self.estimate:.3g} [{self.low:.3g}, {self.high:.3g}] over {self.n} units{m}"


def _generator(values: Sequence[float], lab_seeds: Sequence[int]) -> np.random.Generator:
    blob = json.dumps([list(map(float, values)), list(map(int, lab_seeds))]).encode()
    return np.random.default_rng(int.from_bytes(hashlib.sha256(blob).digest()[:8], "little"))


def bootstrap_interval(values: Sequence[float], strata: Sequence[int], level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values``: with one stratum (lab seed) the plain bootstrap of
    its units; with several, two stages per resample: the strata drawn with replacement, then units within each
    drawn stratum (see the module docstring for why)."""
    x = np.asarray(values, dtype=np.float64)
    strata = np.asarray(strata)
    if x.size == 0:
        raise ValueError("bootstrap_interval needs at least one value")
    rng = _generator(x, strata)
    groups = [x[strata == s] for s in np.unique(strata)]
    if len(groups) == 1:
        picks = rng.integers(0, x.size, size=(BOOTSTRAP, x.size))
        means = x[picks].mean(axis=1)
    else:
        drawn = rng.integers(0, len(groups), size=(BOOTSTRAP, len(groups)))
        sums, counts = np.zeros(BOOTSTRAP), np.zeros(BOOTSTRAP)
        for slot in range(len(groups)):
            for g, group in enumerate(groups):
                rows = np.flatnonzero(drawn[:, slot] == g)
                picks = rng.integers(0, group.size, size=(rows.size, group.size))
                sums[rows] += group[picks].sum(axis=1)
                counts[rows] += group.size
        means = sums / counts
    a = (1 - level) / 2
    return float(np.quantile(means, a)), float(np.quantile(means, 1 - a))


def judge(rule: Rule, unit_list: Iterable[dict]) -> Judgement:
    """Apply ``rule`` to units (dicts as made by :func:`units`)."""
    unit_list = list(unit_list)
    by_lab: dict[str, list[float | None]] = {}
    for u in unit_list:
        by_lab.setdefault(str(u["lab_seed"]), []).append(u["value"])
    good = [u for u in unit_list if u["value"] is not None]
    n, missing = len(good), len(unit_list) - len(good)
    base = {"rule": rule.name, "n": n, "n_missing": missing, "per_lab_seed": by_lab}
    if not unit_list or n < MIN_FINITE_SHARE * len(unit_list) or n < 2:
        why = f"only {n} of {len(unit_list)} units gave a finite {rule.statistic}"
        return Judgement(verdict="inconclusive", estimate=None, low=None, high=None, reason=why, **base)
    values = [u["value"] for u in good]
    mean = float(np.mean(values))
    low, high = bootstrap_interval(values, [u["lab_seed"] for u in good])
    margin = None
    if rule.op in ("within", "outside"):
        margin = rule.threshold
        if rule.relative:
            scales = [u["scale"] for u in good if u.get("scale") is not None]
            if len(scales) < 2:
                why = f"a relative margin needs the spread of at least 2 finite scales, got {len(scales)}"
                return Judgement(verdict="inconclusive", estimate=mean, low=low, high=high, reason=why, **base)
            margin = rule.threshold * float(np.std(scales, ddof=1))
            if margin <= 0:
                why = "the measured seed-to-seed spread is 0: no margin can be derived from it"
                return Judgement(verdict="inconclusive", estimate=mean, low=low, high=high, reason=why, **base)
    if rule.op == ">":
        verdict = _side(low > rule.threshold, high <= rule.threshold)
    elif rule.op == "<":
        verdict = _side(high < rule.threshold, low >= rule.threshold)
    elif rule.op == "within":
        verdict = _side(-margin < low and high < margin, low >= margin or high <= -margin)
    else:  # outside
        verdict = _side(low >= margin or high <= -margin, -margin < low and high < margin)
    reason = "" if verdict != "inconclusive" else STRADDLES
    return Judgement(verdict=verdict, estimate=mean, low=low, high=high, margin=margin, reason=reason, **base)


def _side(holds: bool, fails: bool) -> str:
    return "reproduced" if holds else ("not reproduced" if fails else "inconclusive")


def judge_evidence(evidence: dict[str, Any]) -> tuple[str, str, list[Judgement]]:
    """The verdict of an experiment's evidence ``{"rules": [rule dicts], "units": {rule name: [unit dicts]}}``.

    Every control must be clearly met (its interval clears its threshold), else the verdict is inconclusive with the
    control named; then every claim rule must be reproduced for *reproduced*, and one claim rule clearly failing gives
    *not reproduced*. Returns (verdict, reason, judgements in rule order)."""
    rules = [Rule(**r) for r in evidence["rules"]]
    if not any(r.role == "claim" for r in rules):
        raise ValueError("evidence has no claim rule")
    judged = [judge(r, evidence["units"].get(r.name, [])) for r in rules]
    for r, j in zip(rules, judged):
        if r.role != "claim" and not j.holds():
            what = "positive control" if r.role == "positive" else "negative control"
            return "inconclusive", f"{what} not shown: {r.text()}; {j.text()}", judged
    claims = [(r, j) for r, j in zip(rules, judged) if r.role == "claim"]
    if all(j.holds() for _, j in claims):
        return "reproduced", "", judged
    failed = [(r, j) for r, j in claims if j.verdict == "not reproduced"]
    if failed:
        return "not reproduced", "; ".join(f"{r.text()} fails: {j.text()}" for r, j in failed), judged
    open_ = [(r, j) for r, j in claims if not j.holds()]
    return "inconclusive", "; ".join(f"{r.text()} undecided: {j.text()}" for r, j in open_), judged


def undecided(evidence: dict[str, Any]) -> list[tuple[Rule, Judgement]]:
    """The rules of ``evidence`` (claim and controls) whose 95% interval straddles their threshold, each with its
    judgement, in rule order: the rules these units leave undecided."""
    rules = [Rule(**r) for r in evidence["rules"]]
    judged = [(r, judge(r, evidence["units"].get(r.name, []))) for r in rules]
    return [(r, j) for r, j in judged if j.verdict == "inconclusive" and j.reason == STRADDLES]


def evidence(rules: Sequence[Rule], unit_map: dict[str, list[dict]]) -> dict[str, Any]:
    """The JSON form an experiment returns in ``Result.evidence``; checks every rule has its units."""
    names = [r.name for r in rules]
    if len(set(names)) != len(names):
        raise ValueError(f"evidence: rule names repeat: {names}")
    missing = [n for n in names if n not in unit_map]
    if missing:
        raise ValueError(f"evidence: no units for rules {missing}")
    return {"rules": [asdict(r) for r in rules], "units": {n: list(unit_map[n]) for n in names}}


def pool_evidence(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One evidence dict from several runs' evidence of the same experiment: their rules must be identical (the
    same pre-registered criterion), their units are concatenated. Two runs with the same lab seed are refused
    (their units would be counted twice)."""
    if not runs:
        raise ValueError("pool_evidence needs at least one run")
    rules = runs[0]["rules"]
    seen: set[int] = set()
    pooled: dict[str, list[dict]] = {r["name"]: [] for r in rules}
    for run in runs:
        if run["rules"] != rules:
            raise ValueError("pool_evidence: the runs were judged by different rules; pool runs of one criterion only")
        labs = {u["lab_seed"] for us in run["units"].values() for u in us}
        if labs & seen:
            raise ValueError(f"pool_evidence: lab seed(s) {sorted(labs & seen)} appear in two runs")
        seen |= labs
        for name in pooled:
            pooled[name].extend(run["units"][name])
    return {"rules": rules, "units": pooled}
