"""The seeds' advice on finding and avoiding faults (issue 27): bisecting a divergence from the first layer whose
residual-stream norm jumps (seed 004), and LayerNorm statistics in fp16 (seed 003). Criteria and controls are in
:mod:`training_seeds` (written before the first default run of each).
"""

from __future__ import annotations

from collections.abc import Sequence

from addnorm.lab.core import Context, Result, verdict_from
from addnorm.lab.experiments.seeds_tasks import fault_task, fp16_task
from addnorm.lab.experiments.training_seeds import (
    CRITERIA,
    FAULT_HARM,
    FP16_MAX,
    LOCALIZE_RATE,
    beyond,
    register,
)
from addnorm.lab.experiments.training_setup import (
    D_MODEL,
    SEED_STYLES,
    TRAINED_EXCESS,
    Verdict,
    control,
    finite,
    fmt_seeds,
    majority,
    nan,
    plot_curves,
    pyplot,
    save,
    seed_list,
    seeds_needed,
    settings,
)


# ------------------------------------------------------------------------------------------------ localize
def first_jump(rms: Sequence[Sequence[float | None]]):
    """:func:`addnorm.diagnostics.localize_jump` (its defaults) over per-step, per-block residual RMS values."""
    from addnorm.diagnostics import localize_jump

    history = [{"step": t, "layers": [{"residual_rms": v} for v in row]} for t, row in enumerate(rms)]
    return localize_jump(history)


def late_loss(losses: Sequence[float | None]) -> float | None:
    """Mean of the last 10% of a run's training losses; None when the run stopped early or a value is missing."""
    tail = list(losses[-max(1, len(losses) // 10) :])
    return sum(tail) / len(tail) if tail and all(map(finite, tail)) else None


def localize_verdict(
    found: Sequence[tuple[int, int | None, int | None]],
    fault_step: int,
    clean_found: Sequence[int | None],
    harm: Sequence[float | None],
) -> Verdict:
    """``found``: per faulted run (faulted layer, named layer or None, step of the jump or None);
    ``clean_found``: per seed, the layer named in the clean run (None: no jump); ``harm``: per faulted run, its late
    training loss minus the clean run's of the same seed (None when either stopped early: counted as harm)."""
    if not found or not clean_found or len(harm) != len(found):
        return None, {}, "no runs, or the faulted runs and their harms are not paired"
    harmed = [h is None or h > FAULT_HARM for h in harm]
    reason = control(harmed, f"the planted fault did not raise the late training loss by > {FAULT_HARM:g} nats")
    if reason:
        return None, {"harmed_by_run": harmed}, reason
    correct = [named == k and step is not None and step >= fault_step for k, named, step in found]
    rate = sum(correct) / len(correct)
    quiet = sum(1 for c in clean_found if c is None)
    passed = rate >= LOCALIZE_RATE and quiet >= seeds_needed(len(clean_found))
    details = {
        "localized_by_run": correct,
        "localized_rate": rate,
        "clean_runs_quiet": f"{quiet}/{len(clean_found)}",
        "harmed_by_run": harmed,
    }
    return passed, details, ""


@register(
    "localize-divergence",
    claim="Logging each layer's residual-stream norm during training and starting from the first layer whose norm "
    "jumps finds the layer a divergence comes from (validated: addnorm.diagnostics.localize_jump on runs with a "
    "fault planted in a known block).",
    source="Seed 004 (section 2.5, part 6 'first-hand experience of training stability', third point: 'record the "
    "norm of the residual stream (each layer's output) regularly; if one layer's norm suddenly jumps, the problem "
    "is most likely near that layer ... bisect from the abnormal layer')",
    config={
        "lr": 3e-3,
        "warmup": 20,
        "fault_mult": 100.0,
        "default": {"layers": 6, "steps": 200, "fault_step": 100, "fault_layers": [0, 2, 4], "seeds": 3},
        "quick": {"layers": 3, "steps": 24, "fault_step": 12, "fault_layers": [1], "seeds": 2},
    },
    suite="extended",
)
def localize_divergence(ctx: Context) -> Result:
    """A divergence planted at a known place: from the fault's step on, one block's learning rate is 100x the
    others' (a misconfigured parameter group, the kind of local fault the seed's bisection is for), in a 6-layer
    Pre-LN model (d = 32, Adam lr 3e-3 constant after a 20-step warmup, 200 steps, fault at step 100) at blocks 0,
    2 and 4, 3 seeds, plus a clean run per seed. Pre-LN because its block outputs are the residual stream itself
    (in Post-LN every block's output is a norm's output, RMS ~1 whatever happens before it). Every block's output
    RMS is recorded at every step by addnorm.diagnostics.Monitor and handed to localize_jump unchanged."""
    s = settings(ctx)
    steps, layers, fault_step = s["steps"], s["layers"], s["fault_step"]
    seeds = seed_list(ctx, s["seeds"])
    faults = [None, *s["fault_layers"]]
    ctx.progress(f"{len(faults) * len(seeds)} runs of {steps} steps")
    base = {"layers": layers, "lr": s["lr"], "steps": steps, "warmup": s["warmup"], "fault_step": fault_step}
    tasks = [
        {**base, "fault_layer": f, "fault_mult": s["fault_mult"], "seed": sd, "lang_seed": ctx.seed}
        for sd in seeds
        for f in faults
    ]
    results = ctx.map(fault_task, tasks)
    runs = {(f, sd): results[k * len(faults) + j] for k, sd in enumerate(seeds) for j, f in enumerate(faults)}
    jumps = {key: first_jump(r["rms"]) for key, r in runs.items()}
    found, harm, naive = [], [], []
    for sd in seeds:
        clean = late_loss(runs[(None, sd)]["losses"])
        for f in s["fault_layers"]:
            j = jumps[(f, sd)]
            found.append((f, j.layer if j else None, j.step if j else None))
            late = late_loss(runs[(f, sd)]["losses"])
            harm.append(late - clean if finite(late) and finite(clean) else None)
            last = [v if finite(v) else float("inf") for v in runs[(f, sd)]["rms"][-1]]
            naive.append(max(range(len(last)), key=last.__getitem__) == f)
    clean_found = [jumps[(None, sd)].layer if jumps[(None, sd)] else None for sd in seeds]
    passed, extra, reason = localize_verdict(found, fault_step, clean_found, harm)
    figures = []
    plt = pyplot()
    if plt is not None:
        panels = [None, *s["fault_layers"]]
        fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2), sharey=True)
        for ax, f in zip(axes, panels):
            for k, sd in enumerate(seeds):
                rms = runs[(f, sd)]["rms"]
                for i in range(layers):
                    ax.plot(
                        [nan(row[i]) for row in rms],
                        SEED_STYLES[k % 4],
                        color=f"C{i}",
                        lw=0.8,
                        label=f"block {i}" if k == 0 else None,
                    )
                j = jumps[(f, sd)]
                if j is not None:
                    ax.plot([j.step], [j.value], "kx")
            ax.set_yscale("log")
            ax.axvline(fault_step, color="grey", lw=0.5)
            ax.set_title("clean" if f is None else f"fault in block {f}", fontsize=9)
            ax.set_xlabel("step (x: first jump found)")
        axes[0].set_ylabel("block output RMS")
        axes[0].legend(fontsize=6)
        figures = save(plt, fig, ctx, "localize_divergence.png")
    per_seed = {}
    for i, f in enumerate(s["fault_layers"]):
        rows = [found[k * len(s["fault_layers"]) + i] for k in range(len(seeds))]
        per_seed[f"fault in block {f}: block named"] = [r[1] for r in rows]
        per_seed[f"fault in block {f}: step of the jump"] = [r[2] for r in rows]
        per_seed[f"fault in block {f}: late loss - clean's"] = [
            harm[k * len(s["fault_layers"]) + i] for k in range(len(seeds))
        ]
    per_seed["clean run: block named"] = clean_found
    per_seed["clean run: late training loss"] = [late_loss(runs[(None, sd)]["losses"]) for sd in seeds]
    metrics = {
        "criterion": CRITERIA["localize-divergence"],
        "steps": steps,
        "layers": layers,
        "fault_step": fault_step,
        "seeds": seeds,
        "per_seed": per_seed,
        "chance_rate": 1 / layers,
        "naive_rate": sum(naive) / len(naive),
        "setup": f"Pre-LN, {layers} layers, d = 32, Adam lr {s['lr']:g} constant after {s['warmup']} warmup steps, "
        f"{steps} steps; from step {fault_step} one block's LR x{s['fault_mult']:g} (blocks {s['fault_layers']}), "
        f"{len(seeds)} seeds, one clean run each",
        **extra,
    }
    rate = extra.get("localized_rate")
    line = (
        f"First jump named the faulted block in {sum(extra.get('localized_by_run', []))} of {len(found)} faulted "
        f"runs ({'n/a' if rate is None else f'{rate:.0%}'}; chance {1 / layers:.0%}, the largest-RMS rule "
        f"{metrics['naive_rate']:.0%}); clean runs with no jump flagged: {extra.get('clean_runs_quiet', 'n/a')}; "
        f"late training loss above the clean run's: {fmt_seeds(harm)} nats."
    )
    return Result(verdict=verdict_from(passed), metrics=metrics, figures=figures, summary=line, reason=reason)


# ------------------------------------------------------------------------------------------------ fp16
STATS = ("fp16", "fp32", "clamp")
STAT_NAMES = {"fp16": "fp16 statistics", "fp32": "fp32 statistics", "clamp": "clamp + fp16 statistics"}


def harmed(run: dict, fp32: dict) -> bool | None:
    """The seed's failure: a non-finite loss, a divergence, or an excess clearly above the fp32-statistics run's."""
    if run["diverged"] or not finite(run["final_loss"]):
        return True
    return beyond(run["excess"], fp32["excess"])


def fp16_verdict(runs: Sequence[dict[str, dict]]) -> Verdict:
    """``runs``: per seed, {"fp16", "fp32", "clamp"} -> the task's result."""
    if not runs or any(set(r) != set(STATS) for r in runs):
        return None, {}, "every seed needs the three arms"
    reached = [finite(r["fp32"]["max_sumsq"]) and r["fp32"]["max_sumsq"] > FP16_MAX for r in runs]
    reason = control(reached, f"the fp32-statistics run never met a per-token sum of squares > {FP16_MAX:.0f}")
    if not reason:
        trains = [finite(r["fp32"]["excess"]) and r["fp32"]["excess"] < TRAINED_EXCESS for r in runs]
        reason = control(trains, "the fp32-statistics run did not train")
    if reason:
        return None, {"regime_reached_by_seed": reached}, reason
    h16 = [harmed(r["fp16"], r["fp32"]) for r in runs]
    hcl = [harmed(r["clamp"], r["fp32"]) for r in runs]
    per_seed = [None if a is None or b is None else (a and not b) for a, b in zip(h16, hcl)]
    passed, details, reason = majority(per_seed, "the losses")
    return (
        passed,
        {"fp16_harmed_by_seed": h16, "clamp_harmed_by_seed": hcl, "holds_by_seed": per_seed, **details},
        reason,
    )


@register(
    "fp16-layernorm",
    claim="A LayerNorm whose statistics are computed in fp16 overflows and breaks training (the loss turns to NaN) "
    "where fp32 statistics, or a clamp before the norm, do not.",
    source="Seed 003 (section 4.5 'choices in real projects', point 4: 'in mixed-precision training LayerNorm "
    "overflows easily in FP16; add a torch.clamp before it or compute it in FP32 ... the loss became NaN halfway')",
    config={
        "lr": 1e-2,
        "default": {"layers": 6, "steps": 300, "seeds": 3},
        "quick": {"layers": 2, "steps": 12, "seeds": 2},
    },
    suite="extended",
)
def fp16_layernorm(ctx: Context) -> Result:
    """The regime where fp16 statistics can overflow: Pre-LN's residual stream grows during training at a high LR
    (peri-ln-training measured its RMS at 18-70 after 400 steps at lr 1e-2), and a norm's sum of squares over its
    32 features passes 65504 once a token's RMS passes 45. 6-layer Pre-LN, d = 32, Adam lr 1e-2, warmup 10% then
    cosine, 300 steps, 3 seeds. The model runs in fp32 and only the norms' statistics change: every LayerNorm's
    input is rounded to fp16 (the activations of mixed precision) and its mean and variance are summed in fp16
    (naive), in fp32 (addnorm's contract for half inputs), or in fp16 after the seed's clamp to +-sqrt(65504 / 32)
    (the bound at which the sum of squares cannot overflow). Why not the whole model in fp16: the claim is about the
    norm; fp16 matmuls elsewhere would add their own overflows (and run slowly on CPU)."""
    s = settings(ctx)
    steps, layers = s["steps"], s["layers"]
    seeds = seed_list(ctx, s["seeds"])
    # a hair under the bound at which D_MODEL squares sum to 65504: fp16 rounding of the squares must not reach it
    clamp = (FP16_MAX / D_MODEL) ** 0.5 * 0.99
    train = {"steps": steps, "lr": s["lr"], "warmup": max(1, steps // 10)}
    ctx.progress(f"{len(STATS) * len(seeds)} runs of {steps} steps")
    tasks = [
        {
            "model": {"n_layers": layers, "placement": "pre"},
            "stats": st,
            "clamp": clamp if st == "clamp" else None,
            "train": {**train, "seed": sd},
            "lang_seed": ctx.seed,
        }
        for sd in seeds
        for st in STATS
    ]
    results = ctx.map(fp16_task, tasks)
    runs = {(st, sd): results[k * len(STATS) + j] for k, sd in enumerate(seeds) for j, st in enumerate(STATS)}
    by_seed = [{st: runs[(st, sd)] for st in STATS} for sd in seeds]
    passed, extra, reason = fp16_verdict(by_seed)
    figures = []
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(1, 1, figsize=(6, 3.5))
        plot_curves(ax, runs, list(STATS), seeds, steps, STAT_NAMES)
        ax.set_xlabel("step (line style: seed)")
        ax.set_ylabel("train loss")
        ax.legend(fontsize=8)
        figures = save(plt, fig, ctx, "fp16_layernorm.png")
    per_seed = {}
    for st in STATS:
        per_seed[f"{STAT_NAMES[st]} excess"] = [runs[(st, sd)]["excess"] for sd in seeds]
        per_seed[f"{STAT_NAMES[st]} overflows"] = [runs[(st, sd)]["overflows"] for sd in seeds]
        per_seed[f"{STAT_NAMES[st]} first overflow step"] = [runs[(st, sd)]["first_overflow_step"] for sd in seeds]
        per_seed[f"{STAT_NAMES[st]} diverged"] = [runs[(st, sd)]["diverged"] for sd in seeds]
    per_seed["fp32 statistics: largest sum of squares"] = [runs[("fp32", sd)]["max_sumsq"] for sd in seeds]
    metrics = {
        "criterion": CRITERIA["fp16-layernorm"],
        "steps": steps,
        "layers": layers,
        "seeds": seeds,
        "clamp": clamp,
        "per_seed": per_seed,
        "setup": f"Pre-LN, {layers} layers, d = 32, Adam lr {s['lr']:g}, warmup 10% then cosine, {steps} steps, "
        f"{len(seeds)} seeds; model in fp32, each LayerNorm's input rounded to fp16, statistics as per arm",
        **extra,
    }
    line = (
        f"Excess loss by seed ({len(seeds)}): "
        + "; ".join(f"{STAT_NAMES[st]} {fmt_seeds(per_seed[f'{STAT_NAMES[st]} excess'])}" for st in STATS)
        + "; overflowed norm calls (fp16 statistics): "
        + "/".join(str(v) for v in per_seed["fp16 statistics overflows"])
        + "; largest sum of squares with fp32 statistics: "
        + "/".join(f"{nan(v):.3g}" for v in per_seed["fp32 statistics: largest sum of squares"])
        + f" (claim holds at {extra.get('seeds_agreeing', 'n/a')} seeds)."
    )
    return Result(verdict=verdict_from(passed), metrics=metrics, figures=figures, summary=line, reason=reason)
