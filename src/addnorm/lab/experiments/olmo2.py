"""OLMo 2's reordered norm (x + Norm(F(x))) with QK-norm against Pre-LN with QK-norm across an LR grid, in the
experiment reordered-norm (extended suite).

Evidence: one unit per model seed (3 per lab seed), the two arms of a seed paired (same init and batches); each rule
holds when the bootstrap 95% interval of its units' mean clears it (addnorm.lab.evidence), pooled over lab seeds.
The runs use Wortsman et al.'s protocol and LR-sensitivity score (:mod:`wortsman`) on the lab's language.
"""

from __future__ import annotations

from collections.abc import Sequence

from addnorm.lab.core import Change, Context, Result
from addnorm.lab.evidence import Rule
from addnorm.lab.experiments.training_batch import train_runs
from addnorm.lab.experiments.training_setup import (
    SEED_STYLES,
    finite,
    fmt_seeds,
    grid_tasks,
    nan,
    paired,
    pyplot,
    registrar,
    save,
    seed_list,
    settings,
)
from addnorm.lab.experiments.wortsman import CONVERGED_EXCESS, GRID_HURTS, judged, lr_sensitivity

# "No more LR-sensitive": the reordered arm's sensitivity at most this many nats above Pre-LN + QK-norm's (the
# absolute tolerance of the lab's training comparisons, 0.05 nats; the old rule's 10%-of-the-reference alternative is
# smaller at every recorded sensitivity, 0.01-0.16).
NO_WORSE = 0.05

RULES = (
    Rule(
        name="lowest-lr-converged",
        statistic="the larger of both arms' excess loss at the lowest LR (nats)",
        op="<",
        threshold=CONVERGED_EXCESS,
        role="positive",
    ),
    Rule(
        name="grid-hurts-reference",
        statistic="Pre-LN + QK-norm's worst minus best excess loss over the grid (nats)",
        op=">",
        threshold=GRID_HURTS,
        role="positive",
    ),
    Rule(
        name="margin-rejects-no-qk",
        statistic="LR sensitivity of Pre-LN without QK-norm (the known-worse arm) minus that of Pre-LN + QK-norm",
        op=">",
        threshold=NO_WORSE,
        role="negative",
    ),
    Rule(
        name="no-more-sensitive",
        statistic="LR sensitivity of reordered + QK-norm minus that of Pre-LN + QK-norm",
        op="<",
        threshold=NO_WORSE,
    ),
)

CRITERIA = {
    "reordered-norm": (
        "Units: one per model seed, the arms paired by seed; a rule holds when the bootstrap 95% interval of its "
        "units' mean clears it (pooled over lab seeds). Per seed, sensitivity = mean over the LR grid of "
        "[min(loss(lr), loss_0) - loss*] (lr-sensitivity's score). Reproduced iff sensitivity(reordered + QK-norm) "
        f"- sensitivity(Pre-LN + QK-norm) < {NO_WORSE} nats. Loss spikes (the training loop's rule, OLMo-core's: "
        "above mean + 6 std of the last 128 steps) are counted and shown, not tested: the regime produces almost "
        "none (1 in 108 runs), so 'no more spikes' could only hold as 0 <= 0."
    ),
}
PRECONDITIONS = {
    "reordered-norm": (
        f"Positive controls: the lowest LR of the grid converged (the larger of both arms' excess < "
        f"{CONVERGED_EXCESS} nats), and the grid reaches LRs that hurt Pre-LN + QK-norm (its worst excess minus its "
        f"best > {GRID_HURTS} nats): otherwise the score measures convergence speed, or the grid stresses nothing. "
        "Negative control: the claim's margin rejects a known-worse arm, Pre-LN without QK-norm on the same grid "
        f"(Wortsman et al.: QK-layernorm lowers LR sensitivity): its sensitivity minus Pre-LN + QK-norm's > "
        f"{NO_WORSE} nats (interval above), else a margin that lets anything pass would read as parity. "
        "Else inconclusive."
    ),
}

CHANGES = (
    Change(
        date="2026-12-02",
        what="the spike half ('no more loss spikes', paired by seed) leaves the criterion (spikes shown, not "
        "tested); the strict majority of seeds replaced by bootstrap intervals of per-seed units; 'no more "
        "sensitive' is the sensitivity difference < 0.05 nats (the old max(0.05, 10%) was 0.05 at every recorded "
        "sensitivity)",
        showed="reproduced at --seed 0 and 2, inconclusive at 1 (the grid hurt Pre-LN + QK-norm at 1 of 3 seeds); "
        "the loop's detector found 1 spike in 108 runs, so the spike half held as 0 <= 0 and could not fail",
        reason="a check that cannot fail is not evidence; one verdict per claim from all its evidence",
    ),
    Change(
        date="2026-12-02",
        what="a negative control: a third arm, Pre-LN without QK-norm on the same grid and seeds (18 more runs of "
        "400 steps); its sensitivity minus Pre-LN + QK-norm's must be > 0.05 nats (the claim's margin rejects it)",
        showed="pooled over lab seeds 0-2: reproduced (sensitivity Pre-LN + QK-norm 0.046/0.100/0.099 at lab seed "
        "0, reordered + QK-norm 0.008/0.029/0.038), with no arm known to be worse to show the 0.05-nat margin "
        "could reject anything",
        reason="a parity claim needs a known-worse arm that its margin rejects; the claim's margin and rule are "
        "unchanged",
    ),
)

register = registrar(CRITERIA, PRECONDITIONS, version=1)


# ------------------------------------------------------------------------------------------------ reordered
def reordered_units(
    sens_ref: Sequence[float | None],
    sens_new: Sequence[float | None],
    lowest_ref: Sequence[float | None],
    lowest_new: Sequence[float | None],
    hurt_ref: Sequence[float | None],
    sens_worse: Sequence[float | None],
) -> dict[str, list[float | None]]:
    """One value per seed and rule of :data:`RULES`, paired by seed: both arms' sensitivity and excess at the lowest
    LR; ``hurt_ref`` the reference arm's worst minus best excess over the grid; ``sens_worse`` the sensitivity of
    the known-worse arm (Pre-LN without QK-norm)."""
    if not paired(sens_ref, sens_new, lowest_ref, lowest_new, hurt_ref, sens_worse):
        raise ValueError("reordered_units: the arms' seeds are not paired")
    return {
        "lowest-lr-converged": [max(a, b) if finite(a) and finite(b) else None for a, b in zip(lowest_ref, lowest_new)],
        "grid-hurts-reference": [h if finite(h) else None for h in hurt_ref],
        "margin-rejects-no-qk": [w - r if finite(w) and finite(r) else None for r, w in zip(sens_ref, sens_worse)],
        "no-more-sensitive": [n - r if finite(n) and finite(r) else None for r, n in zip(sens_ref, sens_new)],
    }


@register(
    "reordered-norm",
    claim="The norm on the branch's output, x + Norm(F(x)) (OLMo 2's reordered norm), with QK-norm is no more "
    "sensitive to the learning rate than Pre-LN with QK-norm (OLMo 2 also reports fewer loss spikes: counted and "
    "shown here, not tested).",
    source="OLMo et al. 2025, 2 OLMo 2 Furious, arXiv:2501.00656 (section 3.2, training stability: reordered norm "
    "and QK-norm)",
    config={
        "grid": [3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0],
        "layers": 2,
        "wd": 1e-4,
        "z_loss": 1e-4,
        "default": {"steps": 400, "seeds": 3},
        "quick": {"steps": 12, "seeds": 2, "grid": [3e-3, 1.0]},
    },
    suite="extended",
    rules=RULES,
    fixed="2026-12-02 at 8821e08",
    changes=CHANGES,
)
def reordered_norm(ctx: Context) -> Result:
    """OLMo 2 moves the norm from the sublayer's input to its output (x + RMSNorm(F(x))), adds QK-norm and z-loss,
    and reports fewer loss and gradient spikes (section 3.2). Scaled here as lr-sensitivity (Wortsman et al.'s
    protocol: AdamW (0.9, 0.95), clip 1, warmup 10% then cosine, independent weight decay 1e-4, z-loss 1e-4), at 2
    layers, d = 32, RMSNorm (OLMo 2's norm, QK-norm included), 400 steps per LR, the grid 3e-3 .. 1 (a decade above
    lr-sensitivity's top, so that it reaches LRs that hurt Pre-LN + QK-norm), 3 seeds. Both arms have the final
    norm. The negative control trains a third arm, Pre-LN without QK-norm (known to be more LR-sensitive: Wortsman
    et al.'s Fig. 1, and lr-sensitivity here), on the same grid and seeds: the claim's 0.05-nat margin must reject
    it, else "no more sensitive" could pass for any arm. Spikes: the training loop's detector on each run's
    per-step loss."""
    s = settings(ctx)
    steps, grid = s["steps"], list(s["grid"])
    seeds = seed_list(ctx, s["seeds"])
    # The two arms of the claim, and the known-worse arm of the negative control (Pre-LN without QK-norm).
    variants = {
        "pre+qk": {"placement": "pre", "qk_norm": True},
        "reordered+qk": {"placement": "branch-output", "qk_norm": True},
        "pre": {"placement": "pre", "qk_norm": False},
    }
    train = {
        "steps": steps,
        "warmup": max(1, steps // 10),
        "weight_decay": s["wd"],
        "independent_wd": True,
        "z_loss": s["z_loss"],
    }
    arms = {
        (v, lr): ({**kw, "norm": "rmsnorm", "n_layers": s["layers"]}, {"lr": lr})
        for v, kw in variants.items()
        for lr in grid
    }
    ctx.progress(f"{len(arms) * len(seeds)} runs of {steps} steps")
    keys, tasks = grid_tasks(ctx, arms, seeds, train)
    runs = dict(zip(keys, train_runs(ctx, tasks)))
    ex = {v: {sd: [runs[((v, lr), sd)]["excess"] for lr in grid] for sd in seeds} for v in variants}
    sens = {
        v: [
            lr_sensitivity(
                [runs[((v, lr), sd)]["final_loss"] for lr in grid], [runs[((v, lr), sd)]["initial_loss"] for lr in grid]
            )
            for sd in seeds
        ]
        for v in variants
    }
    spikes = {v: [sum(runs[((v, lr), sd)]["spikes"] for lr in grid) for sd in seeds] for v in variants}
    lowest = {v: [ex[v][sd][0] for sd in seeds] for v in variants}
    hurt = [
        max(ex["pre+qk"][sd]) - min(ex["pre+qk"][sd]) if all(map(finite, ex["pre+qk"][sd])) else None for sd in seeds
    ]
    values = reordered_units(
        sens["pre+qk"], sens["reordered+qk"], lowest["pre+qk"], lowest["reordered+qk"], hurt, sens["pre"]
    )
    ev, verdict, reason, table = judged(RULES, values, seeds, ctx.seed)
    names = {"pre+qk": "Pre-LN + QK-norm", "reordered+qk": "reordered + QK-norm", "pre": "Pre-LN (negative control)"}
    figures = []
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        for i, v in enumerate(variants):
            for k, sd in enumerate(seeds):
                style = "o" + SEED_STYLES[k % len(SEED_STYLES)]
                lab = names[v] if k == 0 else None
                axes[0].plot(grid, [nan(x) for x in ex[v][sd]], style, color=f"C{i}", lw=1, label=lab)
                axes[1].plot(
                    grid, [runs[((v, lr), sd)]["spikes"] for lr in grid], style, color=f"C{i}", lw=1, label=lab
                )
        axes[0].set_ylabel("excess loss (capped at loss_0)")
        axes[1].set_ylabel("loss spikes in the run")
        for ax in axes:
            ax.set_xscale("log")
            ax.set_xlabel("learning rate (line style: seed)")
            ax.legend(fontsize=8)
        figures = save(plt, fig, ctx, "reordered_norm.png")
    metrics = {
        "criterion": CRITERIA["reordered-norm"],
        "grid": grid,
        "steps": steps,
        "seeds": seeds,
        "per_seed": {
            **{f"{names[v]} sensitivity": sens[v] for v in variants},
            **{f"{names[v]} spikes over the grid": spikes[v] for v in variants},
            **{f"{names[v]} excess lr={grid[0]:g}": lowest[v] for v in variants},
            "Pre-LN + QK-norm worst - best excess": hurt,
            **{f"unit {name}": vals for name, vals in values.items()},
        },
        "excess": {f"{v} seed {sd}": ex[v][sd] for v in variants for sd in seeds},
        "spikes": {f"{v} seed {sd}": [runs[((v, lr), sd)]["spikes"] for lr in grid] for v in variants for sd in seeds},
        "diverged": {
            f"{v} seed {sd}": [runs[((v, lr), sd)]["diverged"] for lr in grid] for v in variants for sd in seeds
        },
        "setup": f"OLMo 2 section 3.2 at d = 32, {s['layers']} layers, RMSNorm: AdamW (0.9, 0.95), clip 1, warmup "
        f"{train['warmup']} then cosine, independent wd {s['wd']:g}, z-loss {s['z_loss']:g}, {steps} steps per LR, "
        f"grid {grid}, {len(seeds)} seeds",
        "rules": table,
    }
    line = (
        f"LR sensitivity by seed ({len(seeds)}): Pre-LN + QK-norm {fmt_seeds(sens['pre+qk'])}, reordered + QK-norm "
        f"{fmt_seeds(sens['reordered+qk'])}, Pre-LN without QK-norm (negative control) {fmt_seeds(sens['pre'])}; "
        f"loss spikes over the grid {'/'.join(map(str, spikes['pre+qk']))} vs "
        f"{'/'.join(map(str, spikes['reordered+qk']))} (shown, not tested); excess at lr {grid[0]:g}: "
        f"{fmt_seeds(lowest['pre+qk'])} / {fmt_seeds(lowest['reordered+qk'])}."
    )
    return Result(verdict=verdict, metrics=metrics, figures=figures, summary=line, reason=reason, evidence=ev)
