"""Xiong et al. 2020 on warmup: Post-LN trained with Adam needs learning-rate warmup, Pre-LN does not.

Every training experiment trains a tiny decoder-only Transformer (``addnorm.nn.TransformerLM``, d = 32, 2 heads,
T = 32, B = 8, Xavier init) on the synthetic Markov language of :mod:`addnorm.train.data` (vocabulary 32, 3
successors per token), whose best achievable loss on any validation tokens is known exactly. Losses are *excess
loss* = final validation loss - the best possible loss on the same validation tokens, a diverged run counted at its
initial loss (Wortsman et al. 2023's min(loss, loss_0)); the shared task, model and helpers are in
:mod:`training_setup`.

The verdict is read off pre-registered rules (:mod:`addnorm.lab.evidence`): one unit per model seed, paired
across arms, a bootstrap 95% interval of the units' mean against each rule's threshold; the controls must clearly
hold, else the verdict is inconclusive. ``metrics["per_seed"]`` holds each seed's numbers.

Cost (2026-12-01, idle 2-core machine, ``--jobs 2``): warmup 41 s of driver time in the default run.
"""

from __future__ import annotations

from collections.abc import Sequence

from addnorm.lab.core import Change, Context, Result
from addnorm.lab.evidence import Rule, evidence, units
from addnorm.lab.experiments.rules_common import diff, rules_line, trains_text, verdict_of
from addnorm.lab.experiments.training_batch import train_runs
from addnorm.lab.experiments.training_setup import (
    TRAINED_EXCESS,
    fmt_seeds,
    grid_tasks,
    plot_curves,
    pyplot,
    registrar,
    save,
    seed_list,
    seed_values,
    settings,
)

FIXED = "2026-12-02 at 8821e08"
# "Clearly worse" without warmup: the old per-seed threshold, now on the mean over seeds.
WARMUP_GAP = 0.05

RULES = (
    Rule(
        name="pre-ln-with-warmup-trains",
        statistic=trains_text("Pre-LN's excess loss with warmup"),
        op="<",
        threshold=TRAINED_EXCESS,
        role="positive",
    ),
    Rule(
        name="post-ln-with-warmup-trains",
        statistic=trains_text("Post-LN's excess loss with warmup"),
        op="<",
        threshold=TRAINED_EXCESS,
        role="positive",
    ),
    Rule(
        name="post-ln-needs-warmup",
        statistic="Post-LN's excess loss without warmup minus with warmup (nats)",
        op=">",
        threshold=WARMUP_GAP,
    ),
    Rule(
        name="pre-ln-cares-less",
        statistic="half Post-LN's warmup gap minus Pre-LN's warmup gap (nats; > 0: Pre-LN's gap is under half "
        "Post-LN's)",
        op=">",
        threshold=0.0,
    ),
)

CRITERIA = {
    "warmup": (
        "Per model seed, gap(p) = excess loss without warmup minus with the warmup. Reproduced iff the bootstrap 95% "
        f"interval of the mean gap(Post-LN) is above {WARMUP_GAP} nats and that of gap(Post-LN) / 2 - gap(Pre-LN) "
        "above 0, paired by seed. Controls (positive): Pre-LN with warmup and Post-LN with warmup train (mean excess "
        f"< {TRAINED_EXCESS} nats). Sanity check (not a rule: true by the schedule): every warmup arm reaches the "
        "peak LR and trains at least a third of the run there."
    ),
}
PRECONDITIONS = {
    "warmup": (
        f"Pre-LN with warmup and Post-LN with warmup train (mean excess < {TRAINED_EXCESS} nats, interval below): "
        "the recipe the paper compares against works here. The instability itself (Post-LN without warmup ends "
        "worse) is the claim, so it cannot be its own control: if it does not appear, the claim is not reproduced."
    ),
}

register = registrar(CRITERIA, PRECONDITIONS, version=3)

CHANGES = (
    Change(
        date="2026-11-30",
        what="Setup: every warmup arm finishes its warmup and trains at the peak LR (now warmup 0 vs 250 of a "
        "400-step run, constant after; was warmups up to 400 in a 150-step run).",
        showed="Reproduced for a confounded reason: the best warmup (400 steps) was longer than the 150-step run, "
        "so that arm never reached the peak LR (a lower-LR run); the warmup that finished (50) was worse than none "
        "(excess 1.027 vs 0.949).",
        reason="A warmup arm that ends while the LR is still ramping is a lower-LR run, not a warmup arm.",
    ),
    Change(
        date="2026-12-02",
        what="Verdict read off rules: a bootstrap 95% interval of the mean over model seeds instead of a strict "
        "majority of per-seed passes; the peak-LR control became a sanity check and the controls are now 'Pre-LN "
        "and Post-LN with warmup train'. Model seeds are lab_seed*1000+k (disjoint across lab seeds).",
        showed="Reproduced at lab seeds 0-2 (3/3, 2/3, 3/3 model seeds): Post-LN without warmup 1.07-1.38 (seed 0), "
        "2.17/0.08/2.23 (seed 1), 1.71-1.79 (seed 2) vs 0.06-0.16 with warmup.",
        reason="The peak-LR control passed by construction (every warmup arm reaches the peak LR by its schedule), "
        "so it could not make the verdict inconclusive; the arms with warmup must train for the comparison to say "
        "anything, and that can fail (a too-high LR).",
    ),
)


def warmup_evidence(excess: dict[str, dict[int, Sequence[float | None]]], seeds: Sequence[int], lab_seed: int) -> dict:
    """``excess[p][w]``: per-seed excess losses for p in "post", "pre" and warmups 0 and one other (the largest is
    the warmup arm), paired by seed."""
    hi = max(excess["post"])
    if hi <= 0 or 0 not in excess["post"]:
        raise ValueError(f"warmup_evidence needs warmup 0 and a warmup > 0, got {sorted(excess['post'])}")
    gap = {p: [diff(a, b) for a, b in zip(excess[p][0], excess[p][hi])] for p in ("post", "pre")}
    cares_less = [None if gp is None or gq is None else gp / 2 - gq for gp, gq in zip(gap["post"], gap["pre"])]
    values = {
        "pre-ln-with-warmup-trains": excess["pre"][hi],
        "post-ln-with-warmup-trains": excess["post"][hi],
        "post-ln-needs-warmup": gap["post"],
        "pre-ln-cares-less": cares_less,
    }
    return evidence(RULES, {name: units(v, seeds, lab_seed) for name, v in values.items()})


def peak_lr_sanity(steps_at_peak: dict[str, dict[int, Sequence[int]]], steps: int) -> str:
    """'' when every warmup arm trained at least a third of the run at the peak LR, else what went wrong (a warmup
    arm that never reaches its peak is a lower-LR run, not a warmup arm: a broken setup, not evidence)."""
    for p, by_w in steps_at_peak.items():
        for w, counts in by_w.items():
            if w > 0 and min(counts) < steps / 3:
                return f"{p}-LN with warmup {w} trained only {min(counts)} of {steps} steps at the peak LR"
    return ""


@register(
    "warmup",
    claim="Post-LN trained with Adam needs learning-rate warmup (without it, it ends clearly worse); Pre-LN does "
    "not depend on warmup.",
    source="Xiong et al. 2020, On Layer Normalization in the Transformer Architecture, arXiv:2002.04745 "
    "(section 3.2, Fig. 2)",
    config={
        "lr": 4e-3,
        "warmups": [0, 250],
        "schedule": "constant",
        "default": {"layers": 6, "steps": 400, "seeds": 3},
        "quick": {"layers": 2, "steps": 30, "warmups": [0, 10], "seeds": 2},
    },
    rules=RULES,
    fixed=FIXED,
    changes=CHANGES,
)
def warmup_experiment(ctx: Context) -> Result:
    """Xiong et al. train 6-layer Post-LN/Pre-LN with Adam at lr 5e-4/1e-3 and warmup 4000 (Fig. 2): Post-LN without
    warmup, or with too short a warmup, ends far worse; Pre-LN without warmup matches it. Scaled here: 6 layers
    at d = 32; Adam lr 4e-3 (the papers' 1e-3 at d = 512 is about 4e-3 at d = 32: Xavier weights are 4x larger);
    warmup 0 vs 250 steps of a 400-step run, constant LR after warmup, so the warmup arm trains 150 steps at peak
    (a warmup longer than the run is a lower-LR run, and a 50-step warmup did not help Post-LN)."""
    s = settings(ctx)
    layers, steps, lr, warmups = s["layers"], s["steps"], s["lr"], list(s["warmups"])
    seeds = seed_list(ctx, s["seeds"])
    arms = {(p, w): ({"placement": p, "n_layers": layers}, {"warmup": w}) for p in ("post", "pre") for w in warmups}
    ctx.progress(f"{len(arms) * len(seeds)} runs of {steps} steps")
    keys, tasks = grid_tasks(ctx, arms, seeds, {"steps": steps, "lr": lr, "schedule": s["schedule"]})
    runs = dict(zip(keys, train_runs(ctx, tasks)))
    ex = {p: {w: seed_values(runs, (p, w), seeds, "excess") for w in warmups} for p in ("post", "pre")}
    at_peak = {p: {w: seed_values(runs, (p, w), seeds, "steps_at_peak_lr") for w in warmups} for p in ("post", "pre")}
    ev = warmup_evidence(ex, seeds, ctx.seed)
    verdict, reason, table = verdict_of(ev)
    sanity = peak_lr_sanity(at_peak, steps)
    if sanity:
        verdict, reason = "inconclusive", f"sanity check failed: {sanity} (a lower-LR run, not a warmup arm)"
    figures = []
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
        for ax, p in zip(axes, ("post", "pre")):
            plot_curves(ax, runs, [(p, w) for w in warmups], seeds, steps, {(p, w): f"warmup {w}" for w in warmups})
            ax.set_title(f"{p.capitalize()}-LN, {layers} layers, Adam lr {lr:g}", fontsize=9)
            ax.set_xlabel("step (line style: seed)")
            ax.legend(fontsize=8)
        axes[0].set_ylabel("train loss")
        figures = save(plt, fig, ctx, "warmup_loss.png")
    hi = max(warmups)
    metrics = {
        "criterion": CRITERIA["warmup"],
        "layers": layers,
        "steps": steps,
        "lr": lr,
        "warmups": warmups,
        "seeds": seeds,
        "per_seed": {f"{p} excess w={w}": ex[p][w] for p in ("post", "pre") for w in warmups},
        "rules": table,
        "sanity_peak_lr": sanity or "every warmup arm trained >= a third of the run at the peak LR",
        "steps_at_peak_lr": {f"{p} w={w}": at_peak[p][w] for p in at_peak for w in warmups},
        "diverged": {
            f"{p} w={w}": seed_values(runs, (p, w), seeds, "diverged") for p in ("post", "pre") for w in warmups
        },
        "setup": "Xiong et al. 2020 Fig. 2 (6-layer Post-/Pre-LN, Adam, warmup) at d = 32: lr 4e-3, warmup 0 vs "
        f"{hi} of {steps} steps, constant LR after warmup, {len(seeds)} seeds",
    }
    line = (
        f"Excess loss by seed ({len(seeds)}), warmup 0 / {hi}: Post-LN {fmt_seeds(ex['post'][0])} / "
        f"{fmt_seeds(ex['post'][hi])}, Pre-LN {fmt_seeds(ex['pre'][0])} / {fmt_seeds(ex['pre'][hi])} "
        f"({layers} layers, lr {lr:g}, {steps} steps). Rules (mean [95% CI]): {rules_line(table)}."
    )
    return Result(verdict=verdict, metrics=metrics, figures=figures, summary=line, reason=reason, evidence=ev)
