"""Training experiments on residual scaling and mixed placements (issue 27): ReZero (no norm, a zero-initialised
scalar on each branch) and Mix-LN's per-layer gradient profile during training.

Same rules as :mod:`training_newer` (whose criteria, controls and registration these share): every run a
``ctx.map`` task, every verdict a pure ``*_verdict`` function with a control, decided by a strict majority of >= 3
seeds paired by seed; criteria and controls written before each experiment's first run.
"""

from __future__ import annotations

from collections.abc import Sequence

from addnorm.lab.core import Context, Result, verdict_from
from addnorm.lab.experiments.training_batch import train_runs
from addnorm.lab.experiments.training_newer import (
    CRITERIA,
    NONUNIFORM,
    PARITY_ABS,
    PARITY_REL,
    register,
)
from addnorm.lab.experiments.training_setup import (
    TRAINED_EXCESS,
    Verdict,
    control,
    finite,
    fmt_seeds,
    grid_tasks,
    majority,
    paired,
    plot_curves,
    plot_seed_profiles,
    pyplot,
    save,
    seed_list,
    seed_values,
    settings,
)


def first_half_mean(curve: Sequence[float | None]) -> float | None:
    """Mean of the first half of a subsampled loss curve (a missing point, i.e. a diverged chunk: None)."""
    half = list(curve[: max(1, len(curve) // 2)])
    return sum(half) / len(half) if half and all(map(finite, half)) else None


def rezero_verdict(
    ex_none: Sequence[float | None],
    div_none: Sequence[bool],
    ex_rezero: Sequence[float | None],
    ex_pre: Sequence[float | None],
    early_rezero: Sequence[float | None],
    early_pre: Sequence[float | None],
) -> Verdict:
    """Per seed (paired): excess losses, whether the unnormalized run diverged, first-half mean training losses."""
    if not paired(ex_pre, ex_none, div_none, ex_rezero, early_rezero, early_pre):
        return None, {}, "the arms' seeds are not paired"
    reason = control([finite(v) and v < TRAINED_EXCESS for v in ex_pre], "Pre-LN did not train")
    if reason:
        return None, {}, reason
    per_seed = []
    for en, dn, ez, fz, fp in zip(ex_none, div_none, ex_rezero, early_rezero, early_pre):
        none_fails = bool(dn) or not finite(en) or en >= TRAINED_EXCESS
        if not finite(ez) or fp is None:
            per_seed.append(None)
            continue
        per_seed.append(none_fails and ez < TRAINED_EXCESS and fz is not None and fz < fp)
    passed, details, reason = majority(per_seed, "the losses")
    faster = [None if a is None or b is None else a < b for a, b in zip(early_rezero, early_pre)]
    return passed, {"holds_by_seed": per_seed, "rezero_faster_by_seed": faster, **details}, reason


def variation(profile: Sequence[float | None] | None) -> float | None:
    """std / mean across the layers of a per-layer profile (None when a layer is missing or the mean is 0)."""
    vals = list(profile or [])
    if len(vals) < 2 or not all(map(finite, vals)):
        return None
    mean = sum(vals) / len(vals)
    if mean <= 0:
        return None
    return (sum((v - mean) ** 2 for v in vals) / len(vals)) ** 0.5 / mean


def mix_verdict(
    u_pre: Sequence[float | None],
    u_mix: Sequence[float | None],
    ex_pre: Sequence[float | None],
    ex_mix: Sequence[float | None],
) -> Verdict:
    """Per seed (paired): the gradient-profile variation u and the excess loss of Pre-LN and Mix-LN."""
    if not paired(u_pre, u_mix, ex_pre, ex_mix):
        return None, {}, "the arms' seeds are not paired"
    reason = control([finite(v) and v < TRAINED_EXCESS for v in ex_pre], "Pre-LN did not train")
    if not reason:
        reason = control(
            [finite(u) and u > NONUNIFORM for u in u_pre],
            f"Pre-LN's gradient profile was already uniform (u <= {NONUNIFORM:g})",
        )
    if reason:
        return None, {}, reason
    per_seed = []
    for up, um, ep, em in zip(u_pre, u_mix, ex_pre, ex_mix):
        if not all(map(finite, (up, um, ep, em))):
            per_seed.append(None)
            continue
        per_seed.append(um < up and em <= ep + max(PARITY_ABS, PARITY_REL * abs(ep)))
    passed, details, reason = majority(per_seed, "the gradient profiles and losses")
    return passed, {"holds_by_seed": per_seed, **details}, reason


# ------------------------------------------------------------------------------------------------ ReZero
@register(
    "rezero",
    claim="x + a F(x) with a learned scalar a initialised to 0 and no norm (ReZero) trains a deep stack that the "
    "unnormalized residual stack x + F(x) cannot, and converges faster than Pre-LN.",
    source="Bachlechner et al. 2020, ReZero is All You Need: Fast Convergence at Large Depth, arXiv:2003.04887 "
    "(Table 2/3: convergence speed vs Pre-/Post-LN; the unnormalized residual Transformer fails at depth)",
    config={
        "lr": 3e-3,
        "default": {"layers": 12, "steps": 200, "seeds": 3},
        "quick": {"layers": 2, "steps": 20, "seeds": 2},
    },
)
def rezero_experiment(ctx: Context) -> Result:
    """Bachlechner et al. train 12-layer (and deeper) Transformers: the vanilla residual stack without norm does not
    train, ReZero converges 56% faster than Pre-LN on enwiki8. Scaled here: 12 layers, d = 32, Adam lr 3e-3 (the
    lr of the ln-vs-rms and dyt runs), warmup 10% then cosine, 200 steps (the 2-minute budget), 3 seeds; arms
    x + F(x) (placement "none", no final norm), ReZero (placement "rezero", no norm anywhere) and Pre-LN with its
    final norm. Convergence speed: the mean training loss over the first half of the run."""
    s = settings(ctx)
    steps, layers = s["steps"], s["layers"]
    seeds = seed_list(ctx, s["seeds"])
    arms = {p: ({"placement": p, "n_layers": layers}, {}) for p in ("none", "rezero", "pre")}
    ctx.progress(f"{len(arms) * len(seeds)} runs of {steps} steps")
    keys, tasks = grid_tasks(ctx, arms, seeds, {"steps": steps, "lr": s["lr"], "warmup": max(1, steps // 10)})
    runs = dict(zip(keys, train_runs(ctx, tasks)))
    ex = {p: seed_values(runs, p, seeds, "excess") for p in arms}
    div = seed_values(runs, "none", seeds, "diverged")
    early = {p: [first_half_mean(runs[(p, sd)]["loss_curve"]) for sd in seeds] for p in arms}
    passed, extra, reason = rezero_verdict(ex["none"], div, ex["rezero"], ex["pre"], early["rezero"], early["pre"])
    names = {"none": "x + F(x), no norm", "rezero": "ReZero", "pre": "Pre-LN"}
    figures = []
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(1, 1, figsize=(6, 3.5))
        plot_curves(ax, runs, list(arms), seeds, steps, names)
        ax.set_xlabel("step (line style: seed)")
        ax.set_ylabel("train loss")
        ax.set_title(f"{layers} layers, Adam lr {s['lr']:g}", fontsize=9)
        ax.legend(fontsize=8)
        figures = save(plt, fig, ctx, "rezero.png")
    metrics = {
        "criterion": CRITERIA["rezero"],
        "steps": steps,
        "layers": layers,
        "seeds": seeds,
        "per_seed": {
            **{f"{names[p]} excess": ex[p] for p in arms},
            **{f"{names[p]} first-half loss": early[p] for p in arms},
        },
        "diverged_none": div,
        "setup": f"Bachlechner et al. 2020 at d = 32: {layers} layers, Adam lr {s['lr']:g}, warmup 10% then cosine, "
        f"{steps} steps, {len(seeds)} seeds",
        **extra,
    }
    line = (
        f"Excess loss by seed ({len(seeds)}): x + F(x) {fmt_seeds(ex['none'])}, ReZero {fmt_seeds(ex['rezero'])}, "
        f"Pre-LN {fmt_seeds(ex['pre'])}; mean train loss over the first half: ReZero {fmt_seeds(early['rezero'])}, "
        f"Pre-LN {fmt_seeds(early['pre'])} (claim holds at {extra.get('seeds_agreeing', 'n/a')} seeds)."
    )
    return Result(verdict=verdict_from(passed), metrics=metrics, figures=figures, summary=line, reason=reason)


# ------------------------------------------------------------------------------------------------ Mix-LN
@register(
    "mix-ln-training",
    claim="During training, Mix-LN (Post-LN in the first quarter of the layers, Pre-LN after) has a more uniform "
    "per-layer gradient-norm profile than Pre-LN, at no loss cost.",
    source="Li et al. 2024, Mix-LN: Unleashing the Power of Deeper Layers by Combining Pre-LN and Post-LN, "
    "arXiv:2412.13795 (per-layer gradient norms during training, Pre-LN vs Mix-LN)",
    config={
        "lr": 1e-3,
        "default": {"layers": 8, "steps": 300, "seeds": 3},
        "quick": {"layers": 4, "steps": 20, "seeds": 2},
    },
)
def mix_ln_training(ctx: Context) -> Result:
    """Li et al. show Pre-LN's deeper layers receiving small gradients (and contributing little) and Post-LN's
    early layers vanishing, with Mix-LN's gradient norms more even across layers, in LLaMA-style models of 71M-7B.
    Scaled here: 8 layers (Mix-LN: the first 2 Post-LN), d = 32, Adam lr 1e-3 (where shallow Post-LN trains in
    depth-sweep), warmup 10% then cosine, 300 steps, 3 seeds; each layer's gradient norm recorded every 10 steps and
    averaged over the run."""
    s = settings(ctx)
    steps, layers = s["steps"], s["layers"]
    seeds = seed_list(ctx, s["seeds"])
    arms = {p: ({"placement": p, "n_layers": layers}, {}) for p in ("pre", "mix")}
    ctx.progress(f"{len(arms) * len(seeds)} runs of {steps} steps")
    train = {"steps": steps, "lr": s["lr"], "warmup": max(1, steps // 10), "monitor": True, "monitor_every": 10}
    keys, tasks = grid_tasks(ctx, arms, seeds, train, layer_grads=True)
    runs = dict(zip(keys, train_runs(ctx, tasks)))
    ex = {p: seed_values(runs, p, seeds, "excess") for p in arms}
    prof = {p: [runs[(p, sd)]["layer_grad_mean"] for sd in seeds] for p in arms}
    u = {p: [variation(v) for v in prof[p]] for p in arms}
    passed, extra, reason = mix_verdict(u["pre"], u["mix"], ex["pre"], ex["mix"])
    names = {"pre": "Pre-LN", "mix": "Mix-LN"}
    figures = []
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        plot_seed_profiles(axes[0], prof, arms, names)
        axes[0].set_yscale("log")
        axes[0].set_xlabel("layer (line style: seed)")
        axes[0].set_ylabel("gradient norm, mean over training")
        axes[0].legend(fontsize=8)
        plot_curves(axes[1], runs, list(arms), seeds, steps, names)
        axes[1].set_xlabel("step (line style: seed)")
        axes[1].set_ylabel("train loss")
        axes[1].legend(fontsize=8)
        figures = save(plt, fig, ctx, "mix_ln_training.png")
    metrics = {
        "criterion": CRITERIA["mix-ln-training"],
        "steps": steps,
        "layers": layers,
        "seeds": seeds,
        "per_seed": {
            **{f"{names[p]} excess": ex[p] for p in arms},
            **{f"{names[p]} gradient variation u": u[p] for p in arms},
        },
        "layer_grad_mean": {f"{p} seed {sd}": prof[p][k] for p in arms for k, sd in enumerate(seeds)},
        "setup": f"Li et al. 2024 at d = 32: {layers} layers, Adam lr {s['lr']:g}, warmup 10% then cosine, {steps} "
        f"steps, {len(seeds)} seeds; per-layer gradient norms every 10 steps",
        **extra,
    }
    line = (
        f"Per-layer gradient variation u (std/mean across layers) by seed ({len(seeds)}): Pre-LN {fmt_seeds(u['pre'])}, "
        f"Mix-LN {fmt_seeds(u['mix'])}; excess loss Pre-LN {fmt_seeds(ex['pre'])}, Mix-LN {fmt_seeds(ex['mix'])} "
        f"(claim holds at {extra.get('seeds_agreeing', 'n/a')} seeds)."
    )
    return Result(verdict=verdict_from(passed), metrics=metrics, figures=figures, summary=line, reason=reason)
