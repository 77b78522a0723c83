"""The seeds' own advice as experiments (issue 27): a norm's eps and gain init against placement and warmup (seed
004), and switching a Post-LN-pretrained model to Pre-LN for fine-tuning (seed 003). The criteria and controls of
the two fault experiments (:mod:`training_seeds_faults`: localizing a planted divergence, fp16 statistics) are
stated here too, so the four are written down in one place.

Same rules as :mod:`training_newer`: every run a ``ctx.map`` task (here from :mod:`seeds_tasks`), every verdict a
pure ``*_verdict`` function with a control, decided by a strict majority of >= 3 seeds paired by seed. The
criteria and controls below were written before the first default run of each experiment; the probes made
before them (to find a regime where the effect can appear) are recorded in docs/lab-notes.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from addnorm.lab.core import Context, Result, verdict_from
from addnorm.lab.experiments.seeds_tasks import FP16_MAX, finetune_task, hyper_task
from addnorm.lab.experiments.training_setup import (
    SEED_STYLES,
    TRAINED_EXCESS,
    Verdict,
    control,
    finite,
    fmt,
    fmt_seeds,
    majority,
    nan,
    plot_curves,
    pyplot,
    registrar,
    save,
    seed_list,
    settings,
)

# norm-hyperparameters: "far less" = the smaller of the placement and warmup spreads is more than this many times
# the larger of the eps and gamma spreads.
FAR_LESS = 3.0
# A difference of excess losses counts (a "loses", a "beats", a "harmed") beyond max(0.05 nats, 10% of the
# baseline's): the parity tolerance of ln-vs-rms-training, dyt and peri-ln-training.
TOL_ABS, TOL_REL = 0.05, 0.10
# localize-divergence: the share of faulted runs the first jump must name correctly; the harm a planted fault must
# do (late training loss above the clean run's of the same seed) for there to be a divergence to localize.
LOCALIZE_RATE = 0.8
FAULT_HARM = 0.1

CRITERIA = {
    "norm-hyperparameters": (
        "A 2^4 factorial at equal budget: eps {1e-6, 1e-3} x gamma init {0.5, 1} x placement {Pre-LN, Post-LN} x "
        "warmup {0, half the run}, every cell at every seed. Per seed, the spread of a factor = |mean excess loss "
        "over the 8 cells at one level - mean over the 8 at the other| (its main effect; two levels each, so the "
        f"four spreads are comparable). Reproduced iff, at a strict majority of the seeds (at least 2), min(spread "
        f"placement, spread warmup) > {FAR_LESS:g} x max(spread eps, spread gamma)."
    ),
    "finetune-post-to-pre": (
        "Per seed: a Post-LN model pretrained on one language is fine-tuned on a related one (a quarter of its "
        "rules redrawn) as it is, and with the same weights rearranged as Pre-LN, at equal fine-tuning budget. "
        f"The switch loses iff excess(Pre-LN fine-tune) > excess(Post-LN fine-tune) + max({TOL_ABS} nats, "
        f"{TOL_REL:.0%} of the Post-LN fine-tune's). Reproduced iff it loses at a strict majority of the seeds "
        "(at least 2), paired by seed."
    ),
    "localize-divergence": (
        "Per run, addnorm.diagnostics.localize_jump with its defaults (a jump: > 3x the median of that layer's last "
        "8 values, at least 3 seen) over every block's residual-stream RMS, recorded at every step. A faulted run "
        "is localized iff the first jump is in the faulted block and at or after the fault's step. Reproduced iff "
        f"at least {LOCALIZE_RATE:.0%} of the faulted runs (every faulted block at every seed) are localized, and "
        "no jump is flagged in the clean run at a strict majority of the seeds. Chance (1 / layers) and a naive "
        "rule (the block with the largest RMS at the end) are shown, not tested."
    ),
    "fp16-layernorm": (
        "Per seed (paired), three runs differing only in the LayerNorms' statistics: fp16 sums (naive), fp32 "
        "statistics, and the seed's clamp before fp16 statistics. A run is harmed iff its loss goes non-finite, "
        f"it diverges, or its excess loss exceeds the fp32 run's by more than max({TOL_ABS} nats, {TOL_REL:.0%} of "
        "the fp32 run's). Reproduced iff, at a strict majority of the seeds (at least 2), the fp16-statistics run "
        "is harmed and the clamp run is not. The overflow count (steps x norms whose fp16 sum of squares "
        "overflowed) is shown for every arm."
    ),
}
PRECONDITIONS = {
    "norm-hyperparameters": (
        f"Pre-LN with warmup trains (excess < {TRAINED_EXCESS} nats, mean over its eps/gamma cells) at a strict "
        "majority of the seeds: a grid that does not train at the budget has nothing to spread over."
    ),
    "finetune-post-to-pre": (
        "The pretraining transfers: the Post-LN fine-tune beats Post-LN trained from scratch on the related "
        f"language at the same budget (excess lower by more than max({TOL_ABS} nats, {TOL_REL:.0%})), at a strict "
        "majority of the seeds; otherwise the pretraining did nothing and the comparison says nothing about it."
    ),
    "localize-divergence": (
        f"The planted fault harms the run: its mean training loss over the last 10% of steps exceeds the clean run's "
        f"of the same seed by > {FAULT_HARM:g} nats, in a strict majority of the faulted runs (else there is no "
        "divergence to localize)."
    ),
    "fp16-layernorm": (
        f"The regime where fp16 statistics can overflow is reached: in the fp32-statistics run a norm input's "
        f"per-token sum of squared deviations exceeds {FP16_MAX:.0f} (the largest fp16 number), and that run trains "
        f"(excess < {TRAINED_EXCESS} nats), each at a strict majority of the seeds."
    ),
}

register = registrar(CRITERIA, PRECONDITIONS, version=1)


def beyond(a: float | None, b: float | None) -> bool | None:
    """a > b + max(TOL_ABS, TOL_REL * |b|) (None when either is not finite)."""
    if not (finite(a) and finite(b)):
        return None
    return a > b + max(TOL_ABS, TOL_REL * abs(b))


# ------------------------------------------------------------------------------------------------ verdicts
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


def hyper_verdict(effects: Sequence[dict], pre_warm: Sequence[float | None]) -> Verdict:
    """Per seed: the factors' main effects (:func:`main_effects`) and Pre-LN-with-warmup's mean excess."""
    if len(effects) != len(pre_warm) or not effects:
        return None, {}, "the seeds' numbers are not paired"
    reason = control([finite(v) and v < TRAINED_EXCESS for v in pre_warm], "Pre-LN with warmup did not train")
    if reason:
        return None, {}, reason
    per_seed, ratios = [], []
    for e in effects:
        if not all(finite(e.get(f)) for f in FACTORS):
            per_seed.append(None)
            ratios.append(None)
            continue
        structure, norm = min(e["placement"], e["warmup"]), max(e["eps"], e["gamma"])
        ratios.append(structure / norm if norm > 0 else float("inf"))
        per_seed.append(structure > FAR_LESS * norm)
    passed, details, reason = majority(per_seed, "the spreads")
    return passed, {"holds_by_seed": per_seed, "structure_over_norm_by_seed": ratios, **details}, reason


def finetune_verdict(
    ex_post: Sequence[float | None], ex_pre: Sequence[float | None], ex_scratch: Sequence[float | None]
) -> Verdict:
    """Per seed (paired): excess after fine-tuning as Post-LN, as Pre-LN, and of Post-LN from scratch."""
    n = len(ex_post)
    if n == 0 or len(ex_pre) != n or len(ex_scratch) != n:
        return None, {}, "the arms' seeds are not paired"
    transfers = [beyond(s, p) for p, s in zip(ex_post, ex_scratch)]
    reason = control([bool(t) for t in transfers], "the Post-LN fine-tune did not beat training from scratch")
    if reason:
        return None, {"transfers_by_seed": transfers}, reason
    per_seed = [beyond(r, p) for p, r in zip(ex_post, ex_pre)]
    passed, details, reason = majority(per_seed, "the fine-tuned losses")
    return passed, {"transfers_by_seed": transfers, "switch_loses_by_seed": per_seed, **details}, reason


# ------------------------------------------------------------------------------------------------ norm-hyperparameters
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
        "default": {"layers": 4, "steps": 160, "seeds": 3},
        "quick": {"layers": 1, "steps": 4, "seeds": 2},
    },
    suite="extended",
)
def norm_hyperparameters(ctx: Context) -> Result:
    """The seed's ranking for a limited tuning budget, measured as main effects on the final loss of a 2^4
    factorial (every combination, so no factor is judged at one setting of the others). The regime is the lab's
    `warmup` experiment, where the structural choices are known to be able to matter (Post-LN without warmup stuck
    at lr 4e-3 at every depth tried, issue 13): Adam lr 4e-3 constant after the warmup, d = 32; here 4 layers and
    160 steps with warmup 0 or 80 (the warmup arm trains half the run at the peak LR), 3 seeds, each seed training
    all 16 cells (48 runs: the 2-minute budget sets the depth and the length). eps spans 1e-6 to 1e-3 (torch's default 1e-5 in between:
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
    pre_warm = []
    for sd in seeds:
        vals = [v for c, v in ex[sd] if c["placement"] == "pre" and c["warmup"]]
        pre_warm.append(sum(vals) / len(vals) if all(map(finite, vals)) else None)
    passed, extra, reason = hyper_verdict(effects, pre_warm)
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
    metrics = {
        "criterion": CRITERIA["norm-hyperparameters"],
        "steps": steps,
        "layers": layers,
        "seeds": seeds,
        "per_seed": per_seed,
        "cells": [{**c, "excess by seed": [runs[(i, sd)]["excess"] for sd in seeds]} for i, c in enumerate(cells)],
        "setup": f"{layers} layers, d = 32, Adam lr {s['lr']:g} {s['schedule']} after warmup 0 or {steps // 2}, "
        f"{steps} steps, {len(seeds)} seeds x 16 cells",
        **extra,
    }
    line = (
        "Spread of excess loss by seed: "
        + "; ".join(f"{f} {fmt_seeds(per_seed[f'spread {f}'])}" for f in FACTORS)
        + f" nats (structure / norm ratio {fmt_seeds(extra.get('structure_over_norm_by_seed', []))}; claim holds at "
        f"{extra.get('seeds_agreeing', 'n/a')} seeds)."
    )
    return Result(verdict=verdict_from(passed), metrics=metrics, figures=figures, summary=line, reason=reason)


# ------------------------------------------------------------------------------------------------ finetune
ARMS = ("post", "pre", "scratch-post", "scratch-pre")
ARM_NAMES = {
    "post": "Post-LN fine-tune",
    "pre": "switched to Pre-LN",
    "scratch-post": "Post-LN from scratch",
    "scratch-pre": "Pre-LN from scratch",
}


@register(
    "finetune-post-to-pre",
    claim="A model pretrained with Post-LN fine-tunes worse when switched to Pre-LN than when fine-tuned as it "
    "is: its weights are adapted to the Post-LN structure.",
    source="Seed 003 (section 4.5 'choices in real projects', point 3: 'if the pretrained model uses Post-LN, do "
    "not switch it to Pre-LN for fine-tuning ... it may lose points')",
    config={
        "lr": 1e-3,
        "changed": 0.25,
        "default": {"layers": 4, "pretrain_steps": 300, "finetune_steps": 100, "seeds": 3},
        "quick": {"layers": 2, "pretrain_steps": 12, "finetune_steps": 6, "seeds": 2},
    },
    suite="extended",
)
def finetune_post_to_pre(ctx: Context) -> Result:
    """Pretraining then fine-tuning, scaled down: a 4-layer Post-LN model (d = 32, Adam lr 1e-3, warmup 10% then
    cosine: the LR at which Post-LN trains in depth-sweep) pretrained 300 steps on the lab's language, then
    fine-tuned 100 steps (same LR and schedule shape) on a related language whose next-token rules differ in a
    quarter of the contexts. Arms per seed: fine-tune as Post-LN; the same weights in a Pre-LN model (each norm
    moved to its branch's input, a final norm added at its identity init); and Post-LN and Pre-LN trained from
    scratch on the related language for the same 100 steps (the control: pretraining must help)."""
    s = settings(ctx)
    layers, seeds = s["layers"], seed_list(ctx, s["seeds"])
    pre_steps, ft_steps = s["pretrain_steps"], s["finetune_steps"]
    pretrain = {"steps": pre_steps, "lr": s["lr"], "warmup": max(1, pre_steps // 10)}
    finetune = {"steps": ft_steps, "lr": s["lr"], "warmup": max(1, ft_steps // 10)}
    ctx.progress(f"{len(seeds)} pretrainings of {pre_steps} steps, {len(ARMS) * len(seeds)} runs of {ft_steps}")
    tasks = [
        {
            "arm": a,
            "layers": layers,
            "pretrain": pretrain,
            "finetune": finetune,
            "changed": s["changed"],
            "seed": sd,
            "lang_seed": ctx.seed,
        }
        for sd in seeds
        for a in ARMS
    ]
    results = ctx.map(finetune_task, tasks)
    runs = {(a, sd): results[k * len(ARMS) + j] for k, sd in enumerate(seeds) for j, a in enumerate(ARMS)}
    ex = {a: [runs[(a, sd)]["excess"] for sd in seeds] for a in ARMS}
    start = {a: [runs[(a, sd)]["start_loss"] for sd in seeds] for a in ("post", "pre")}
    pre_ex = [runs[("post", sd)]["pretrain"]["excess"] for sd in seeds]
    passed, extra, reason = finetune_verdict(ex["post"], ex["pre"], ex["scratch-post"])
    figures = []
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        plot_curves(axes[0], runs, list(ARMS), seeds, ft_steps, ARM_NAMES)
        axes[0].set_xlabel("fine-tuning step (line style: seed)")
        axes[0].set_ylabel("train loss on the related language")
        axes[0].legend(fontsize=7)
        for j, a in enumerate(ARMS):
            axes[1].plot([j] * len(seeds), [nan(v) for v in ex[a]], "o", color=f"C{j}")
        axes[1].set_xticks(range(len(ARMS)), [ARM_NAMES[a] for a in ARMS], fontsize=7, rotation=15)
        axes[1].set_ylabel("excess loss, end (dot: seed)")
        figures = save(plt, fig, ctx, "finetune_post_to_pre.png")
    per_seed = {f"{ARM_NAMES[a]} excess": ex[a] for a in ARMS}
    per_seed.update({f"{ARM_NAMES[a]} loss before fine-tuning": start[a] for a in start})
    per_seed["pretraining excess (first language)"] = pre_ex
    metrics = {
        "criterion": CRITERIA["finetune-post-to-pre"],
        "layers": layers,
        "pretrain_steps": pre_steps,
        "finetune_steps": ft_steps,
        "seeds": seeds,
        "per_seed": per_seed,
        "setup": f"{layers} layers, d = 32, Adam lr {s['lr']:g}, pretraining {pre_steps} steps (Post-LN), "
        f"fine-tuning {ft_steps} steps on a language with {s['changed']:.0%} of its rules redrawn, {len(seeds)} seeds",
        **extra,
    }
    line = (
        f"Excess loss after fine-tuning by seed ({len(seeds)}): "
        + "; ".join(f"{ARM_NAMES[a]} {fmt_seeds(ex[a])}" for a in ARMS)
        + f"; loss before fine-tuning: as Post-LN {fmt_seeds(start['post'])}, switched {fmt_seeds(start['pre'])} "
        f"(pretraining excess {fmt(min(pre_ex, key=nan))}-{fmt(max(pre_ex, key=nan))}; switch loses at "
        f"{extra.get('seeds_agreeing', 'n/a')} seeds)."
    )
    return Result(verdict=verdict_from(passed), metrics=metrics, figures=figures, summary=line, reason=reason)
