"""Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training instabilities": the max attention
logit and the LR sensitivity with and without QK-layernorm (lr-sensitivity), and the output log-partition log Z with
and without z-loss (z-loss).

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
    curve_steps,
    finite,
    fmt,
    fmt_seeds,
    grid_tasks,
    nan,
    plot_curves,
    pyplot,
    registrar,
    save,
    seed_list,
    seed_values,
    settings,
)

# The lowest LR of the sensitivity grid has "converged" when its excess loss is below this: it then adds at most
# 0.25 / 6 nats to a sensitivity score (after 100 steps it added ~1 nat, two thirds of the score).
CONVERGED_EXCESS = 0.25
# log Z (the output log-partition, log sum exp of the logits) "drifts far negative" below this. At init it is about
# log V > 0 (5.5 at V = 256); Wortsman et al.'s failing runs drift tens of nats below 0.
LOGZ_FAR = -5.0
# lr-sensitivity's mechanism, the paper's comparison (Fig. 1, max attention logit vs LR with and without qk-layernorm,
# log scale): QK-norm's max logit over the grid at least this many orders of magnitude below Pre-LN's at the same seed.
QK_BELOW_PRE_DECADES = 1.0
# lr-sensitivity's positive controls: Pre-LN's max logit over the grid grows this many orders of magnitude above its
# value at the lowest LR, and its worst excess over the grid is GRID_HURTS nats above its best.
PRE_GROWTH_DECADES = 1.0
GRID_HURTS = 0.1

# What was tried to provoke the output-logit instability (one seed each; numbers in docs/lab-notes.md).
Z_LOSS_TRIED = (
    "V=32 (lr 0.03-0.3, 300-3000 steps, tied/untied, with/without biases): late log Z +4.7..+5.7; V=256 untied, "
    "1000 steps: lr 0.1 -> +10.8, lr 0.3 -> +7.5; V=256 tied lr 0.3 -> +5.8; V=512 untied lr 0.3 -> +7.3; V=256 "
    "untied without biases, lr 0.1, 2000 steps -> +11.3; then a model vocabulary of 4096 with 64 tokens used "
    "(rare and unused tokens), untied, no biases, no weight decay, 1000 steps: lr 0.1 constant or cosine -> mean "
    "output logit -12..-14 but log Z +8..+9.7, lr 0.3 cosine -> lowest log Z +4.8, lr 1.0 cosine -> +2.0; none "
    "drifted negative or diverged"
)

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
Z_RULES = (
    Rule(
        name="instability-without",
        statistic="1 if the run without z-loss has log Z below the instability level or diverges, else 0",
        op=">",
        threshold=0.5,
        role="positive",
    ),
    Rule(
        name="z-loss-prevents",
        statistic="1 if the run without z-loss is unstable and its paired run with z-loss is not, else 0",
        op=">",
        threshold=0.5,
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
    "z-loss": (
        UNITS + f"Per seed, unstable = the output log Z falls below {LOGZ_FAR:g} nats during the run or the run "
        "diverges (1) or not (0). Reproduced iff the mean of [unstable without z-loss and not with z-loss 1e-4] > 0.5."
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
    "z-loss": (
        "Positive control: the run without z-loss shows the instability z-loss is meant to fix (log Z below "
        f"{LOGZ_FAR:g} nats, or divergence): mean of the 0/1 units > 0.5. Else inconclusive."
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
Z_CHANGES = (
    Change(
        date="2026-12-01",
        what="setup: a model vocabulary of 4096 with 64 tokens used (rare and unused tokens), untied, no biases, no "
        "weight decay, lr 0.3, cosine decay, 600 steps (commit 9f6be2d); criterion and control unchanged",
        showed="inconclusive: without z-loss log Z drifted up (lowest 5.5, late 10.9-11.8 nats), never negative",
        reason="the drift comes from rarely seen output tokens, which the old language did not have",
    ),
    Change(
        date="2026-12-02",
        what="the strict majority of seeds replaced by bootstrap intervals of per-seed 0/1 units; the control a rule",
        showed="inconclusive at --seed 0, 1, 2 (lowest log Z without z-loss +4.8..+5.5; no run diverged)",
        reason="one verdict per claim from all its evidence, pooled over lab seeds",
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


def z_units(
    min_logz_without: Sequence[float | None],
    diverged_without: Sequence[bool],
    min_logz_with: Sequence[float | None],
    diverged_with: Sequence[bool],
) -> dict[str, list[float | None]]:
    """One value per seed and rule of :data:`Z_RULES`, from the lowest log Z of the runs without / with z-loss
    and whether they diverged (paired by seed). A run with neither a finite log Z nor a divergence gives None."""
    if not len(min_logz_without) == len(diverged_without) == len(min_logz_with) == len(diverged_with) > 0:
        raise ValueError("z_units: the arms' seeds are not paired")

    def unstable(logz, div):
        return True if div else (logz < LOGZ_FAR if finite(logz) else None)

    without = [unstable(z, d) for z, d in zip(min_logz_without, diverged_without)]
    with_z = [unstable(z, d) for z, d in zip(min_logz_with, diverged_with)]
    return {
        "instability-without": [None if u is None else float(u) for u in without],
        "z-loss-prevents": [None if u is None or w is None else float(u and not w) for u, w in zip(without, with_z)],
    }


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


# ------------------------------------------------------------------------------------------------ z-loss
@register(
    "z-loss",
    claim="At a high learning rate without weight decay the output log-partition log Z drifts far negative (output "
    "logit divergence); z-loss 1e-4 * (log Z)^2 prevents it.",
    source="Wortsman et al. 2023, Small-scale proxies for large-scale Transformer training instabilities, "
    "arXiv:2309.14322 (section 3.2); z-loss from Chowdhery et al. 2022, PaLM, arXiv:2204.02311",
    config={
        "version": 3,
        "lr": 0.3,
        "z_loss": 1e-4,
        "layers": 2,
        "vocab": 64,
        "model_vocab": 4096,
        "schedule": "cosine",
        "default": {"steps": 600, "seeds": 3},
        "quick": {"steps": 20, "seeds": 2, "model_vocab": 256},
    },
    rules=Z_RULES,
    fixed="2026-12-02 at 8821e08",
    changes=Z_CHANGES,
)
def z_loss_experiment(ctx: Context) -> Result:
    """Wortsman et al. see output-logit divergence in small models trained long at high LR with no weight decay:
    log Z drifts far negative and the loss diverges; z-loss 1e-4 prevents it. The drift comes from rarely seen output
    tokens whose logits are pushed down through the shared output mean, late in training. Setup here (2026-12-01,
    after the bounded search in ``Z_LOSS_TRIED``): a model vocabulary of 4096 of which the language uses 64 (the
    rest never seen; the language's smoothing makes some of the 64 rare), untied embeddings, no biases, no weight
    decay, lr 0.3 (100x the models' usual LR), 10% warmup then a cosine decay phase, 600 steps. Both the mean output
    logit and log Z are tracked. The criterion and the control are unchanged: when the run without z-loss shows no
    instability the verdict is inconclusive, with what was tried."""
    s = settings(ctx)
    steps, lr, z = s["steps"], s["lr"], s["z_loss"]
    seeds = seed_list(ctx, s["seeds"])
    model = {
        "placement": "pre",
        "n_layers": s["layers"],
        "tie_embeddings": False,
        "bias": False,
        "vocab_size": s["model_vocab"],
    }
    arms = {coef: (model, {"z_loss": coef}) for coef in (0.0, z)}
    ctx.progress(f"{len(arms) * len(seeds)} runs of {steps} steps")
    keys, tasks = grid_tasks(
        ctx,
        arms,
        seeds,
        {"steps": steps, "lr": lr, "warmup": max(1, steps // 10), "schedule": s["schedule"], "weight_decay": 0.0},
        vocab=s["vocab"],
        track_mean_logit=True,
    )
    runs = dict(zip(keys, train_runs(ctx, tasks)))
    col = {
        c: {
            k: seed_values(runs, c, seeds, k)
            for k in ("logz_min", "logz_late", "logz_init", "diverged", "excess", "mean_logit_late", "mean_logit_min")
        }
        for c in arms
    }
    values = z_units(col[0.0]["logz_min"], col[0.0]["diverged"], col[z]["logz_min"], col[z]["diverged"])
    ev, verdict, reason, table = judged(Z_RULES, values, seeds, ctx.seed)
    if verdict == "inconclusive" and reason.startswith("positive control"):
        reason += (
            f". The instability (log Z below {LOGZ_FAR:g} or divergence without z-loss) did not occur. Tried before "
            f"choosing this setup: {Z_LOSS_TRIED}"
        )
    figures = []
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
        names = {0.0: "no z-loss", z: f"z-loss {z:g}"}
        for i, c in enumerate(arms):
            for k, sd in enumerate(seeds):
                for ax, key in ((axes[0], "logz_curve"), (axes[2], "mean_logit_curve")):
                    curve = runs[(c, sd)][key]
                    style = SEED_STYLES[k % len(SEED_STYLES)]
                    label = names[c] if k == 0 else None
                    ax.plot(curve_steps(curve, steps), [nan(v) for v in curve], style, color=f"C{i}", label=label)
        axes[2].set_ylabel(f"mean output logit (all {s['model_vocab']} tokens)")
        plot_curves(axes[1], runs, list(arms), seeds, steps, names)
        axes[0].axhline(0, color="k", lw=0.5)
        axes[0].axhline(LOGZ_FAR, color="r", lw=0.5, ls="--", label=f"instability ({LOGZ_FAR:g})")
        axes[0].set_ylabel("mean output log Z")
        axes[1].set_ylabel("train loss")
        for ax in axes:
            ax.set_xlabel("step (line style: seed)")
            ax.legend(fontsize=8)
        figures = save(plt, fig, ctx, "z_loss.png")
    per_seed = {
        "min logZ no z-loss": col[0.0]["logz_min"],
        "min logZ z-loss": col[z]["logz_min"],
        "late logZ no z-loss": col[0.0]["logz_late"],
        "late logZ z-loss": col[z]["logz_late"],
        "late mean logit no z-loss": col[0.0]["mean_logit_late"],
        "late mean logit z-loss": col[z]["mean_logit_late"],
        "excess no z-loss": col[0.0]["excess"],
        "excess z-loss": col[z]["excess"],
    }
    metrics = {
        "criterion": CRITERIA["z-loss"],
        "lr": lr,
        "z_loss": z,
        "steps": steps,
        "vocab": s["vocab"],
        "seeds": seeds,
        "per_seed": {**per_seed, **{f"unit {name}": vals for name, vals in values.items()}},
        "rules": table,
        "logz_init": col[0.0]["logz_init"],
        "diverged": {"no z-loss": col[0.0]["diverged"], "z-loss": col[z]["diverged"]},
        "tried": Z_LOSS_TRIED,
        "setup": f"Wortsman et al. 2023 section 3.2 at d = 32, 2 layers, a model vocabulary of {s['model_vocab']} "
        f"with {s['vocab']} tokens used: lr {lr:g}, warmup then {s['schedule']} decay, no weight decay, untied, no "
        f"biases, {steps} steps, {len(seeds)} seeds",
    }
    line = (
        f"Lowest log Z by seed ({len(seeds)}) without z-loss {fmt_seeds(col[0.0]['logz_min'])}, late "
        f"{fmt_seeds(col[0.0]['logz_late'])}; with z-loss {z:g}: lowest {fmt_seeds(col[z]['logz_min'])}, late "
        f"{fmt_seeds(col[z]['logz_late'])}; late mean output logit {fmt_seeds(col[0.0]['mean_logit_late'])} vs "
        f"{fmt_seeds(col[z]['mean_logit_late'])}; excess loss {fmt_seeds(col[0.0]['excess'])} vs "
        f"{fmt_seeds(col[z]['excess'])}."
    )
    return Result(verdict=verdict, metrics=metrics, figures=figures, summary=line, reason=reason, evidence=ev)
