"""What the training experiments' pre-registered rules share: per-seed differences, the parity margin, the
known-worse arm a parity margin must reject, and the verdict and lines read off the evidence.

A parity claim ("B trains to the same loss as A") is judged on the paired difference excess(B) - excess(A) per
model seed: reproduced when the bootstrap 95% interval of its mean lies inside +-PARITY_SPREADS x the standard
deviation of A's excess across the seeds (the measured seed-to-seed spread, so the margin is the noise of the
regime, not a fixed number of nats). Its negative control is a known-worse arm: A trained for half the steps
(:func:`half_budget`), whose difference from A the same margin must reject. In these regimes the loss is still
falling at the end of the run (the excess losses are 0.02-0.4 nats, the optimum is 0), so half the budget is
genuinely worse; if it is not, the control fails and the verdict says the margin could not be shown to reject
anything (inconclusive), instead of calling a too-wide margin parity.

Also the tail the experiments share after their runs: the evidence and verdict of one value per seed and rule
(:func:`judge_values`), and their figures' training-loss panel (:func:`loss_panel`).
"""

from __future__ import annotations

from collections.abc import Sequence

from addnorm.lab.evidence import Rule, evidence, judge_evidence, units
from addnorm.lab.experiments.training_setup import TRAINED_EXCESS, finite, plot_curves

# Parity margin: one standard deviation of the baseline arm's excess across seeds. A difference between two arms
# smaller than the difference between two seeds of one arm is parity at this regime's noise; the old fixed floor
# (max(0.05 nats, 10%)) let an arm four times worse than LayerNorm's 0.015 excess pass.
PARITY_SPREADS = 1.0


def diff(a, b) -> float | None:
    """a - b, None when either is not finite."""
    return a - b if finite(a) and finite(b) else None


def diffs(a: Sequence, b: Sequence) -> list[float | None]:
    """Per-seed a - b (paired)."""
    if len(a) != len(b):
        raise ValueError(f"the arms are not paired by seed: {len(a)} vs {len(b)} values")
    return [diff(x, y) for x, y in zip(a, b)]


def worse_by(a: Sequence, b: Sequence) -> list[float | None]:
    """Per seed, how much a ends worse than b: max(0, a - b) (0 when a is better: a one-sided "no worse" claim
    judged as parity of this number)."""
    return [None if d is None else max(0.0, d) for d in diffs(a, b)]


def half_budget(steps: int) -> int:
    """The known-worse arm's run length: half the steps (at least 1)."""
    return max(1, steps // 2)


def trains_text(what: str) -> str:
    return f"{what} (nats; < {TRAINED_EXCESS} means it trained)"


def judge_values(rules: Sequence[Rule], values: dict[str, Sequence], seeds: Sequence[int], lab_seed: int) -> tuple:
    """(evidence, verdict, reason) of one value per model seed and rule (``values[rule.name][k]`` came from
    ``seeds[k]``, paired across rules), judged by ``rules``: the evidence an experiment returns in ``Result.evidence``
    and the verdict read off it (the reason names the rule that decided an inconclusive or failed verdict)."""
    ev = evidence(rules, {name: units(v, seeds, lab_seed) for name, v in values.items()})
    verdict, reason, _ = judge_evidence(ev)
    return ev, verdict, reason


def loss_panel(ax, runs: dict, arms, seeds: list[int], steps: int, names: dict, *, log=False, fontsize=8) -> None:
    """A figure's training-loss panel: each arm's curve at every seed (one colour per arm, the seed's line style),
    labelled, with a legend; ``log``: a log scale (curves that diverge)."""
    plot_curves(ax, runs, list(arms), seeds, steps, names)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("step (line style: seed)")
    ax.set_ylabel("train loss")
    ax.legend(fontsize=fontsize)


def verdict_of(ev: dict) -> tuple[str, str, dict]:
    """(verdict, reason, {rule name: its judgement as a dict}) of an evidence dict; the reason only when the verdict
    is inconclusive (``Result.reason``'s contract: the failing rule of a *not reproduced* is in the table)."""
    verdict, reason, judged = judge_evidence(ev)
    reason = reason if verdict == "inconclusive" else ""
    table = {
        j.rule: {
            "verdict": j.verdict,
            "estimate": j.estimate,
            "ci95": [j.low, j.high],
            "margin": j.margin,
            "n": j.n,
            "n_missing": j.n_missing,
        }
        for j in judged
    }
    return verdict, reason, table


def rules_line(table: dict) -> str:
    """The rules' estimates and intervals in a summary line."""
    parts = []
    for name, j in table.items():
        if j["estimate"] is None:
            parts.append(f"{name}: n/a")
            continue
        lo, hi = j["ci95"]
        margin = f", margin {j['margin']:.3g}" if j["margin"] is not None else ""
        parts.append(f"{name} {j['estimate']:.3g} [{lo:.3g}, {hi:.3g}]{margin}")
    return "; ".join(parts)


def parity_rules(baseline: str, arm: str, claim: str, *, one_sided: bool = False) -> tuple[Rule, ...]:
    """The three rules of a parity claim, "``arm`` trains to the same loss as ``baseline``": the baseline trains
    (positive control), the margin rejects the baseline at half its steps (negative control), and the paired
    difference is inside the margin (the claim, named ``claim``). ``one_sided``: "no worse than" (the difference
    is how much worse the arm ends, 0 when it is better)."""
    spread = f"the spread is that of {baseline}'s excess over the seeds"
    if one_sided:
        what = "how much worse {} ends than {} (nats, 0 when better; " + spread + ")"
    else:
        what = "excess of {} minus {}'s (nats; " + spread + ")"
    return (
        Rule(
            name=f"{baseline.lower()}-trains",
            statistic=trains_text(f"{baseline}'s excess loss"),
            op="<",
            threshold=TRAINED_EXCESS,
            role="positive",
        ),
        Rule(
            name="margin-rejects-half-budget",
            statistic=what.format(f"{baseline} trained half the steps", baseline),
            op="outside",
            threshold=PARITY_SPREADS,
            role="negative",
            relative=True,
        ),
        Rule(
            name=claim,
            statistic=what.format(arm, baseline),
            op="within",
            threshold=PARITY_SPREADS,
            relative=True,
        ),
    )


def parity_evidence(
    rules: Sequence[Rule],
    baseline: Sequence,
    arm: Sequence,
    half: Sequence,
    seeds: Sequence[int],
    lab_seed: int,
    *,
    one_sided: bool = False,
) -> dict:
    """The evidence of :func:`parity_rules` from per-seed excess losses (paired by seed) of the baseline, the arm
    and the baseline trained half the steps; every unit carries the baseline's excess as its scale (the margin is
    the spread of those)."""
    gap = worse_by if one_sided else diffs
    values = {
        rules[0].name: list(baseline),
        rules[1].name: gap(half, baseline),
        rules[2].name: gap(arm, baseline),
    }
    return evidence(rules, {name: units(v, seeds, lab_seed, scales=list(baseline)) for name, v in values.items()})
