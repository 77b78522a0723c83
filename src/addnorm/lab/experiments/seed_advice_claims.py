"""Seed advice tested as claims: a norm's eps and gain init against placement and warmup (seed 004), and
switching a Post-LN-pretrained model to Pre-LN for fine-tuning (seed 003). The tasks are in :mod:`seeds_tasks`.

Every verdict is read off pre-registered rules (:mod:`addnorm.lab.evidence`): one unit per model seed, a bootstrap
95% interval of the units' mean against each rule's threshold, controls that make the verdict inconclusive when
the regime the claim needs is absent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from addnorm.lab.core import Change, Context, Result
from addnorm.lab.evidence import Rule, evidence, units
from addnorm.lab.experiments.rules_common import diffs, rules_line, trains_text, verdict_of
from addnorm.lab.experiments.seeds_tasks import finetune_task, hyper_task
from addnorm.lab.experiments.training_setup import (
    SEED_STYLES,
    TRAINED_EXCESS,
    finite,
    fmt_seeds,
    nan,
    plot_curves,
    pyplot,
    registrar,
    save,
    seed_list,
    settings,
)

FIXED = "2026-12-02 at 8821e08"
# norm-hyperparameters: "far less" = the smaller of the placement and warmup spreads is more than this many times
# the larger of the eps and gamma spreads.
FAR_LESS = 3.0
# finetune-post-to-pre: a difference of excess losses that counts ("loses", "transfers"), in nats.
LOSES = 0.05

HYPER_RULES = (
    Rule(
        name="post-ln-without-warmup-fails",
        statistic="Post-LN's excess loss without warmup, mean over its eps/gamma cells (nats; > "
        f"{TRAINED_EXCESS}: it failed to train)",
        op=">",
        threshold=TRAINED_EXCESS,
        role="positive",
    ),
    Rule(
        name="pre-ln-with-warmup-trains",
        statistic=trains_text("Pre-LN's excess loss with warmup, mean over its eps/gamma cells"),
        op="<",
        threshold=TRAINED_EXCESS,
        role="positive",
    ),
    Rule(
        name="structure-beats-norm",
        statistic=f"min(spread placement, spread warmup) - {FAR_LESS:g} x max(spread eps, spread gamma) (nats)",
        op=">",
        threshold=0.0,
    ),
)
_CHECKPOINT_NAMES = ("short", "medium", "long")
FINETUNE_RULES = (
    Rule(
        name="pretraining-transfers",
        statistic="excess of Post-LN from scratch minus the Post-LN fine-tune's, after the short fine-tuning "
        "(100 steps) on the related language (nats)",
        op=">",
        threshold=LOSES,
        role="positive",
    ),
    *(
        Rule(
            name=f"switch-loses-{name}",
            statistic=f"excess of the switched (Pre-LN) fine-tune minus the Post-LN fine-tune's after {steps} "
            "fine-tuning steps (nats)",
            op=">",
            threshold=LOSES,
        )
        for name, steps in zip(_CHECKPOINT_NAMES, (100, 300, 1000))
    ),
)

CRITERIA = {
    "norm-hyperparameters": (
        "A 2^4 factorial at equal budget: eps {1e-6, 1e-3} x gamma init {0.5, 1} x placement {Pre-LN, Post-LN} x "
        "warmup {0, half the run}, every cell at every seed. Per model seed, the spread of a factor = |mean excess "
        "loss over the 8 cells at one level - mean over the 8 at the other| (its main effect). Reproduced iff the "
        f"bootstrap 95% interval of the mean of min(spread placement, spread warmup) - {FAR_LESS:g} x max(spread eps, "
        "spread gamma) is above 0. Controls (positive): Post-LN without warmup fails (mean excess over its cells > "
        f"{TRAINED_EXCESS} nats) and Pre-LN with warmup trains (< {TRAINED_EXCESS})."
    ),
    "finetune-post-to-pre": (
        "Per model seed: a Post-LN model pretrained on one language is fine-tuned on a related one (a quarter of its "
        "rules redrawn) as it is, and with the same weights rearranged as Pre-LN; one fine-tuning run each, read at "
        "100, 300 and 1000 steps (constant LR after a 10-step warmup, so each reading is a fine-tuning of that "
        "length). Reproduced iff at every budget the bootstrap 95% interval of the mean of excess(switched) - "
        f"excess(Post-LN fine-tune) is above {LOSES} nats. Control (positive): the pretraining transfers (Post-LN "
        f"from scratch minus the Post-LN fine-tune > {LOSES} nats at 100 steps)."
    ),
}
PRECONDITIONS = {
    "norm-hyperparameters": (
        f"Post-LN without warmup fails (mean excess over its eps/gamma cells > {TRAINED_EXCESS} nats) and Pre-LN with "
        f"warmup trains (< {TRAINED_EXCESS}): 'placement and warmup matter more' can only be scored where they matter "
        "at all; otherwise the verdict is inconclusive."
    ),
    "finetune-post-to-pre": (
        "The pretraining transfers: after 100 fine-tuning steps the Post-LN fine-tune beats Post-LN trained from "
        f"scratch on the related language by > {LOSES} nats; otherwise the pretraining did nothing and the "
        "comparison says nothing about it."
    ),
}

register = registrar(CRITERIA, PRECONDITIONS, version=2)

HYPER_CHANGES = (
    Change(
        date="2026-12-01",
        what="4 layers and 160 steps instead of 6 and 200 (before any verdict was seen).",
        showed="The first start was stopped at 6 of 48 runs per seed, all of them Pre-LN cells; no verdict.",
        reason="48 runs of a 6-layer model did not fit the 2-minute budget.",
    ),
    Change(
        date="2026-12-02",
        what="Positive controls added (Post-LN without warmup fails; Pre-LN with warmup trains); back to 6 layers, "
        "240 steps (warmup 0 or 120), the warmup experiment's depth and LR; verdict from the bootstrap interval of "
        "min(placement, warmup) - 3 x max(eps, gamma) instead of a strict majority of per-seed passes; model seeds "
        "lab_seed*1000+k.",
        showed="Not reproduced at lab seeds 0-2 (0/3 model seeds each), but Post-LN without warmup trained in most "
        "cells (stuck only at model seed 0 of lab seed 0; 0.07-0.29 at seeds 1-2), so warmup's spread was "
        "0.004-0.06 nats; gamma init 0.5 was worse than 1 in 71 of 72 paired cells.",
        reason="'Placement and warmup matter more than eps/gamma' cannot be scored where Post-LN trains without "
        "warmup: that regime is missing, which is inconclusive, not a failed claim; the depth at which the warmup "
        "experiment shows Post-LN failing without warmup is the regime the seed speaks of.",
    ),
)
FINETUNE_CHANGES = (
    Change(
        date="2026-12-02",
        what="Fine-tuning read at 100, 300 and 1000 steps of one run with a constant LR after a 10-step warmup "
        "(was 100 steps, 10% warmup then cosine); the switch must lose by > 0.05 nats at every budget (was "
        "max(0.05, 10%) at a strict majority of seeds, 100 steps only); Pre-LN from scratch no longer trained (it "
        "was shown, never used by a rule: its 1000 steps pay for the longer fine-tunings); model seeds "
        "lab_seed*1000+k.",
        showed="Reproduced at lab seeds 0-2 (3/3 model seeds each): after 100 steps the switched model 0.22-0.48 "
        "nats worse, but it started 0.5-1.6 nats worse, so 100 steps could not close the gap.",
        reason="At 100 steps from a start 0.5-1.6 nats apart the claim could not fail; whether the switch still "
        "loses after the gap has had time to close is the seed's point.",
    ),
)


# ------------------------------------------------------------------------------------------------ norm-hyperparameters
FACTORS = ("placement", "warmup", "eps", "gamma")


def main_effects(cells: Sequence[tuple[dict, float | None]]) -> dict[str, float | None]:
    """Per factor, |mean excess at one level - mean at the other| over ``cells`` = [(levels by factor, excess)]
    (a two-level factorial; None when a cell is not finite or a factor does not have exactly two levels)."""
    out: dict[str, float | None] = {}
    for f in FACTORS:
        levels = sorted({c[f] for c, _ in cells}, key=str)
        if len(levels) != 2 or not all(finite(v) for _, v in cells):
            out[f] = None
            continue
        means = []
        for lv in levels:
            vals = [v for c, v in cells if c[f] == lv]
            means.append(sum(vals) / len(vals))
        out[f] = abs(means[0] - means[1])
    return out


def cell_mean(cells: Sequence[tuple[dict, float | None]], placement: str, warm: bool) -> float | None:
    """Mean excess over the eps/gamma cells of one placement, with (``warm``) or without warmup."""
    vals = [v for c, v in cells if c["placement"] == placement and bool(c["warmup"]) == warm]
    return sum(vals) / len(vals) if vals and all(map(finite, vals)) else None


def hyper_evidence(
    effects: Sequence[dict], pre_warm: Sequence, post_cold: Sequence, seeds: Sequence[int], lab_seed: int
) -> dict:
    """Per seed: the factors' main effects (:func:`main_effects`), Pre-LN-with-warmup's and Post-LN-without-
    warmup's mean excess over their cells."""
    if not len(effects) == len(pre_warm) == len(post_cold) == len(seeds):
        raise ValueError("hyper_evidence: the seeds' numbers are not paired")
    margin = []
    for e in effects:
        ok = all(finite(e.get(f)) for f in FACTORS)
        margin.append(min(e["placement"], e["warmup"]) - FAR_LESS * max(e["eps"], e["gamma"]) if ok else None)
    values = {
        "post-ln-without-warmup-fails": list(post_cold),
        "pre-ln-with-warmup-trains": list(pre_warm),
        "structure-beats-norm": margin,
    }
    return evidence(HYPER_RULES, {name: units(v, seeds, lab_seed) for name, v in values.items()})


@register(
    "norm-hyperparameters",
    claim="A norm's own hyperparameters (eps, the gain's init) matter far less to the final loss than the "
    "structural choices: the placement (Pre or Post) and the warmup.",
    source="Seed 004 (section 2.5 'Residual connection and layer normalization', part 6 'first-hand experience of "
    "training stability', second point: 'normalization hyperparameters are surprisingly insensitive ... fix the "
    "placement first, then warmup, leave the norm's parameters at their defaults')",
    config={
        "lr": 4e-3,
        "schedule": "constant",
        "eps": [1e-6, 1e-3],
        "gamma": [0.5, 1.0],
        "default": {"layers": 6, "steps": 240, "seeds": 3},
        "quick": {"layers": 1, "steps": 4, "seeds": 2},
    },
    suite="extended",
    rules=HYPER_RULES,
    fixed=FIXED,
    changes=HYPER_CHANGES,
)
def norm_hyperparameters(ctx: Context) -> Result:
    """The seed's ranking for a limited tuning budget, measured as main effects on the final loss of a 2^4
    factorial (every combination, so no factor is judged at one setting of the others). The regime is the lab's
    `warmup` experiment, where the structural choices can matter (there Post-LN without warmup was stuck at 8 of 9
    recorded model seeds at 6 layers): Adam lr 4e-3 constant after the warmup, d = 32, 6 layers and 240 steps with
    warmup 0 or 120 (the warmup arm trains half the run at the peak LR), 3 seeds, each seed training all 16 cells
    (48 runs). The positive control checks that regime in the run itself: Post-LN without warmup must fail. eps spans 1e-6 to 1e-3 (torch's default 1e-5 in between:
    the common range); gamma init 0.5 or 1 (the default), on every norm including the final one."""
    s = settings(ctx)
    steps, layers = s["steps"], s["layers"]
    seeds = seed_list(ctx, s["seeds"])
    cells = [
        {"placement": p, "warmup": w, "eps": e, "gamma": g}
        for p in ("pre", "post")
        for w in (0, steps // 2)
        for e in s["eps"]
        for g in s["gamma"]
    ]
    ctx.progress(f"{len(cells) * len(seeds)} runs of {steps} steps")
    tasks = [
        {
            "model": {"placement": c["placement"], "n_layers": layers, "eps": c["eps"]},
            "gamma": c["gamma"],
            "train": {"steps": steps, "lr": s["lr"], "warmup": c["warmup"], "schedule": s["schedule"], "seed": sd},
            "lang_seed": ctx.seed,
        }
        for sd in seeds
        for c in cells
    ]
    results = ctx.map(hyper_task, tasks)
    runs = {(i, sd): results[k * len(cells) + i] for k, sd in enumerate(seeds) for i in range(len(cells))}
    ex = {sd: [(c, runs[(i, sd)]["excess"]) for i, c in enumerate(cells)] for sd in seeds}
    effects = [main_effects(ex[sd]) for sd in seeds]
    pre_warm = [cell_mean(ex[sd], "pre", True) for sd in seeds]
    post_cold = [cell_mean(ex[sd], "post", False) for sd in seeds]
    ev = hyper_evidence(effects, pre_warm, post_cold, seeds, ctx.seed)
    verdict, reason, table = verdict_of(ev)
    figures = []
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        for k in range(len(seeds)):
            axes[0].plot(FACTORS, [nan(effects[k][f]) for f in FACTORS], "o" + SEED_STYLES[k % 4], color="C0", lw=1)
        axes[0].set_yscale("log")
        axes[0].set_ylabel("spread of excess loss (nats)")
        axes[0].set_xlabel("factor (one line per seed)")
        names = {}
        labels = []
        for i, c in enumerate(cells):
            if c["eps"] == s["eps"][0] and c["gamma"] == 1.0:
                labels.append(i)
                names[i] = f"{c['placement']}-LN, warmup {c['warmup']}"
        plot_curves(axes[1], runs, labels, seeds, steps, names)
        axes[1].set_xlabel(f"step (eps {s['eps'][0]:g}, gamma 1; line style: seed)")
        axes[1].set_ylabel("train loss")
        axes[1].legend(fontsize=7)
        figures = save(plt, fig, ctx, "norm_hyperparameters.png")
    per_seed = {f"spread {f}": [e[f] for e in effects] for f in FACTORS}
    per_seed["Pre-LN with warmup, mean excess"] = pre_warm
    per_seed["Post-LN without warmup, mean excess"] = post_cold
    metrics = {
        "criterion": CRITERIA["norm-hyperparameters"],
        "steps": steps,
        "layers": layers,
        "seeds": seeds,
        "per_seed": per_seed,
        "cells": [{**c, "excess by seed": [runs[(i, sd)]["excess"] for sd in seeds]} for i, c in enumerate(cells)],
        "setup": f"{layers} layers, d = 32, Adam lr {s['lr']:g} {s['schedule']} after warmup 0 or {steps // 2}, "
        f"{steps} steps, {len(seeds)} seeds x 16 cells",
        "rules": table,
    }
    line = (
        "Spread of excess loss by seed: "
        + "; ".join(f"{f} {fmt_seeds(per_seed[f'spread {f}'])}" for f in FACTORS)
        + f" nats; Post-LN without warmup {fmt_seeds(post_cold)}, Pre-LN with warmup {fmt_seeds(pre_warm)} (mean "
        f"excess over their eps/gamma cells). Rules (mean [95% CI]): {rules_line(table)}."
    )
    return Result(verdict=verdict, metrics=metrics, figures=figures, summary=line, reason=reason, evidence=ev)


# ------------------------------------------------------------------------------------------------ finetune
def finetune_evidence(
    at: dict[str, dict[int, Sequence]], checkpoints: Sequence[int], seeds: Sequence[int], lab_seed: int
) -> dict:
    """``at[arm][step]``: per-seed excess after ``step`` fine-tuning steps for arm in "post", "pre" (every
    checkpoint) and "scratch-post" (the first); ``checkpoints``: the three budgets, shortest first."""
    if len(checkpoints) != len(_CHECKPOINT_NAMES):
        raise ValueError(f"finetune_evidence needs {len(_CHECKPOINT_NAMES)} checkpoints, got {list(checkpoints)}")
    first = checkpoints[0]
    values = {"pretraining-transfers": diffs(at["scratch-post"][first], at["post"][first])}
    for name, step in zip(_CHECKPOINT_NAMES, checkpoints):
        values[f"switch-loses-{name}"] = diffs(at["pre"][step], at["post"][step])
    return evidence(FINETUNE_RULES, {name: units(v, seeds, lab_seed) for name, v in values.items()})


ARMS = ("post", "pre", "scratch-post")
ARM_NAMES = {"post": "Post-LN fine-tune", "pre": "switched to Pre-LN", "scratch-post": "Post-LN from scratch"}


@register(
    "finetune-post-to-pre",
    claim="A model pretrained with Post-LN fine-tunes worse when switched to Pre-LN than when fine-tuned as it "
    "is: its weights are adapted to the Post-LN structure.",
    source="Seed 003 (section 4.5 'choices in real projects', point 3: 'if the pretrained model uses Post-LN, do "
    "not switch it to Pre-LN for fine-tuning ... it may lose points')",
    config={
        "lr": 1e-3,
        "changed": 0.25,
        "finetune_warmup": 10,
        "default": {"layers": 4, "pretrain_steps": 300, "checkpoints": [100, 300, 1000], "seeds": 3},
        "quick": {"layers": 2, "pretrain_steps": 12, "checkpoints": [2, 4, 6], "finetune_warmup": 1, "seeds": 2},
    },
    suite="extended",
    rules=FINETUNE_RULES,
    fixed=FIXED,
    changes=FINETUNE_CHANGES,
)
def finetune_post_to_pre(ctx: Context) -> Result:
    """Pretraining then fine-tuning, scaled down: a 4-layer Post-LN model (d = 32, Adam lr 1e-3, warmup 10% then
    cosine: the LR at which Post-LN trains in depth-sweep) pretrained 300 steps on the lab's language, then
    fine-tuned on a related language whose next-token rules differ in a quarter of the contexts, at the same LR,
    constant after a 10-step warmup, for 1000 steps, evaluated every 100 (the readings at 100, 300 and 1000 steps
    are fine-tunings of those lengths). Arms per seed: fine-tune as Post-LN; the same weights in a Pre-LN model
    (each norm moved to its branch's input, a final norm added at its identity init); Post-LN trained from scratch
    on the related language for the shortest budget (the control: pretraining must help)."""
    s = settings(ctx)
    layers, seeds = s["layers"], seed_list(ctx, s["seeds"])
    pre_steps, checkpoints = s["pretrain_steps"], sorted(s["checkpoints"])
    every = math.gcd(*checkpoints)
    pretrain = {"steps": pre_steps, "lr": s["lr"], "warmup": max(1, pre_steps // 10)}
    tune = {"lr": s["lr"], "warmup": s["finetune_warmup"], "schedule": "constant", "eval_every": every}
    length = {"post": checkpoints[-1], "pre": checkpoints[-1], "scratch-post": checkpoints[0]}
    ctx.progress(f"{len(seeds)} pretrainings of {pre_steps} steps, {len(ARMS) * len(seeds)} fine-tunings")
    tasks = [
        {
            "arm": a,
            "layers": layers,
            "pretrain": pretrain,
            "finetune": {**tune, "steps": length[a]},
            "changed": s["changed"],
            "seed": sd,
            "lang_seed": ctx.seed,
        }
        for sd in seeds
        for a in ARMS
    ]
    results = ctx.map(finetune_task, tasks)
    runs = {(a, sd): results[k * len(ARMS) + j] for k, sd in enumerate(seeds) for j, a in enumerate(ARMS)}
    at = {
        a: {c: [runs[(a, sd)]["excess_at"].get(str(c)) for sd in seeds] for c in checkpoints if c <= length[a]}
        for a in ARMS
    }
    start = {a: [runs[(a, sd)]["start_loss"] for sd in seeds] for a in ("post", "pre")}
    pre_ex = [runs[("post", sd)]["pretrain"]["excess"] for sd in seeds]
    ev = finetune_evidence(at, checkpoints, seeds, ctx.seed)
    verdict, reason, table = verdict_of(ev)
    figures = []
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        plot_curves(axes[0], runs, ["post", "pre"], seeds, checkpoints[-1], ARM_NAMES)
        axes[0].set_xlabel("fine-tuning step (line style: seed)")
        axes[0].set_ylabel("train loss on the related language")
        axes[0].legend(fontsize=7)
        for j, a in enumerate(("post", "pre")):
            for k in range(len(seeds)):
                axes[1].plot(
                    checkpoints,
                    [nan(at[a][c][k]) for c in checkpoints],
                    "o" + SEED_STYLES[k % 4],
                    color=f"C{j}",
                    label=ARM_NAMES[a] if k == 0 else None,
                )
        axes[1].plot(
            [checkpoints[0]] * len(seeds),
            [nan(v) for v in at["scratch-post"][checkpoints[0]]],
            "s",
            color="C2",
            label=ARM_NAMES["scratch-post"],
        )
        axes[1].set_xscale("log")
        axes[1].set_xlabel("fine-tuning steps")
        axes[1].set_ylabel("excess loss (line style: seed)")
        axes[1].legend(fontsize=7)
        figures = save(plt, fig, ctx, "finetune_post_to_pre.png")
    per_seed = {f"{ARM_NAMES[a]} excess after {c} steps": at[a][c] for a in ARMS for c in at[a]}
    per_seed.update({f"{ARM_NAMES[a]} loss before fine-tuning": start[a] for a in start})
    per_seed["pretraining excess (first language)"] = pre_ex
    metrics = {
        "criterion": CRITERIA["finetune-post-to-pre"],
        "layers": layers,
        "pretrain_steps": pre_steps,
        "checkpoints": checkpoints,
        "seeds": seeds,
        "per_seed": per_seed,
        "rules": table,
        "setup": f"{layers} layers, d = 32, Adam lr {s['lr']:g}, pretraining {pre_steps} steps (Post-LN), fine-tuning "
        f"{checkpoints[-1]} steps (constant LR after {s['finetune_warmup']}) read at {checkpoints} on a language with "
        f"{s['changed']:.0%} of its rules redrawn, {len(seeds)} seeds",
    }
    line = (
        "Excess loss after fine-tuning by seed ("
        + str(len(seeds))
        + "): "
        + "; ".join(
            f"after {c} steps: as Post-LN {fmt_seeds(at['post'][c])}, switched {fmt_seeds(at['pre'][c])}"
            for c in checkpoints
        )
        + f"; Post-LN from scratch after {checkpoints[0]} {fmt_seeds(at['scratch-post'][checkpoints[0]])}; loss before "
        f"fine-tuning: as Post-LN {fmt_seeds(start['post'])}, switched {fmt_seeds(start['pre'])}. Rules (mean [95% CI]): "
        f"{rules_line(table)}."
    )
    return Result(verdict=verdict, metrics=metrics, figures=figures, summary=line, reason=reason, evidence=ev)
