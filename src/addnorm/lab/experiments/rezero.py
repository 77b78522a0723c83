"""ReZero (Bachlechner et al. 2020): x + a F(x) with a learned scalar a initialised to 0 and no norm anywhere.

The paper's two results, tested where they can show: the vanilla residual stack x + F(x) without norm fails at
depth while ReZero trains it, and ReZero reaches a target loss in fewer steps than Pre-LN (its Table 2 counts
iterations to a target loss on enwiki8: 56% fewer for 12 layers). Every run is a ``ctx.map`` task, the verdict is
read from pre-registered rules over per-model-seed units (:mod:`addnorm.lab.evidence`): two positive controls (the
unnormalized stack fails here; Pre-LN reaches the target, so its step count is defined) and two claim rules.
"""

from __future__ import annotations

from collections.abc import Sequence

from addnorm.lab.core import Change, Context, Result
from addnorm.lab.evidence import Rule
from addnorm.lab.experiments.rules_common import judge_values, loss_panel
from addnorm.lab.experiments.training_batch import train_runs
from addnorm.lab.experiments.training_setup import (
    TRAINED_EXCESS,
    finite,
    fmt_seeds,
    grid_tasks,
    pyplot,
    registrar,
    save,
    seed_list,
    seed_values,
    settings,
)

# The target of each seed: the training loss Pre-LN ends at (the mean of its last SMOOTH steps); a run reaches it
# when the running mean of its last SMOOTH training losses first gets there (one step's loss is too noisy at B = 8).
SMOOTH = 10
# Pre-LN must learn: its final training loss at least this many nats below its first (else its level is no target).
LEARNS = 1.0
FIXED = "2026-12-02 at 8821e08"

RULES = (
    Rule(
        name="x + F(x) fails",
        statistic="1 if the unnormalized x + F(x) run diverged or ended with excess >= 0.5 nats, else 0",
        op=">",
        threshold=0.5,
        role="positive",
    ),
    Rule(
        name="Pre-LN learns",
        statistic="Pre-LN's first training loss - its final one (mean of the last 10 steps), nats",
        op=">",
        threshold=LEARNS,
        role="positive",
    ),
    Rule(name="ReZero trains", statistic="ReZero's excess loss (nats)", op="<", threshold=TRAINED_EXCESS),
    Rule(
        name="ReZero is faster",
        statistic="steps to Pre-LN's final training loss, ReZero / Pre-LN (ReZero never reaching it: counted at the "
        "run's length)",
        op="<",
        threshold=1.0,
    ),
)

CRITERION = (
    "Per model seed (paired): ReZero's excess loss, and steps to the target (the training loss Pre-LN ends at, the "
    f"mean of its last {SMOOTH} steps; a run reaches it when the mean of its last {SMOOTH} training losses first "
    "does), ReZero over Pre-LN, ReZero never reaching it counted at the run's length. Reproduced iff the bootstrap "
    f"95% interval of the mean excess is below {TRAINED_EXCESS} (ReZero trains) and that of the mean step ratio "
    "below 1 (ReZero is faster)."
)
PRECONDITION = (
    "The unnormalized x + F(x) fails at this depth and LR (diverged or excess >= 0.5: the mean of that 0/1 "
    f"indicator's interval above 0.5), and Pre-LN learns (its training loss falls by more than {LEARNS:g} nat, "
    "interval above): otherwise the depth does not need what ReZero offers, or Pre-LN's final loss is no target."
)

CHANGES = (
    Change(
        date="2026-12-02",
        what="12 layers at lr 3e-3 -> 16 layers at lr 1e-2, 200 -> 150 steps; convergence speed scored as steps to a "
        "target loss (Pre-LN's final training loss) instead of the mean training loss over the first half; positive "
        "controls that x + F(x) fails and Pre-LN learns",
        showed="not reproduced at lab seeds 0-2: x + F(x) trained at 12 layers / lr 3e-3 (excess 0.20-0.55) and "
        "ReZero's first-half training loss was above Pre-LN's at 9/9 model seeds",
        reason="the claim's first half needs a regime where x + F(x) fails (branch-scaling saw it diverge at 9/9 "
        "model seeds at 16 layers / lr 1e-2), and the mean loss of the first steps penalises a = 0 under Adam, "
        "which grows a by about lr per step; the paper counts steps to a target loss. The target was first fixed at "
        "optimum + 0.5 nats; a probe (model seeds 0-2, lab seed 0) then showed Pre-LN never reaching it (excess "
        "0.56-0.74; ReZero 0.14-0.34), so it became Pre-LN's own final loss (the same loss in fewer steps), "
        "recorded in docs/lab-notes.md before any run of the experiment",
    ),
)


register = registrar({"rezero": CRITERION}, {"rezero": PRECONDITION}, version=2)


def steps_to_target(losses: Sequence[float | None], target: float, window: int = SMOOTH) -> int | None:
    """The first step (1-based count of steps trained) at which the mean of the last ``window`` training losses is
    <= ``target``; None when it never is (a missing loss, i.e. a diverged step, ends the search)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window!r}")
    run = []
    for t, v in enumerate(losses):
        if not finite(v):
            return None
        run.append(v)
        if len(run) >= window and sum(run[-window:]) / window <= target:
            return t + 1
    return None


def final_level(losses: Sequence[float | None], window: int = SMOOTH) -> float | None:
    """The mean of the last ``window`` training losses (None when the run stopped early or one is missing)."""
    tail = list(losses[-window:])
    return sum(tail) / len(tail) if len(tail) == window and all(map(finite, tail)) else None


def rezero_values(
    ex_none: Sequence[float | None],
    div_none: Sequence[bool],
    ex_rezero: Sequence[float | None],
    curve_rezero: Sequence[Sequence[float | None]],
    curve_pre: Sequence[Sequence[float | None]],
    budget: int,
) -> tuple[dict[str, list], dict[str, list]]:
    """The per-seed values of :data:`RULES` from the per-seed numbers and per-step training losses (paired by
    seed); ``budget``: the run's length. Also the per-seed steps to the target, shown beside them."""
    if not len(ex_none) == len(div_none) == len(ex_rezero) == len(curve_rezero) == len(curve_pre):
        raise ValueError("rezero_values: the arms' per-seed lists must be paired by seed")
    fails = [1.0 if d or not finite(e) or e >= TRAINED_EXCESS else 0.0 for e, d in zip(ex_none, div_none)]
    target = [final_level(c) for c in curve_pre]
    learned = [c[0] - t if t is not None and c and finite(c[0]) else None for c, t in zip(curve_pre, target)]
    steps_pre = [None if t is None else steps_to_target(c, t) for c, t in zip(curve_pre, target)]
    steps_rez = [None if t is None else steps_to_target(c, t) for c, t in zip(curve_rezero, target)]
    ratio = [None if p is None else (budget if z is None else z) / p for z, p in zip(steps_rez, steps_pre)]
    vals = {
        "x + F(x) fails": fails,
        "Pre-LN learns": learned,
        "ReZero trains": list(ex_rezero),
        "ReZero is faster": ratio,
    }
    shown = {"target": target, "ReZero steps": steps_rez, "Pre-LN steps": steps_pre, "ratio": ratio}
    return vals, shown


@register(
    "rezero",
    claim="x + a F(x) with a learned scalar a initialised to 0 and no norm (ReZero) trains a deep stack that the "
    "unnormalized residual stack x + F(x) cannot, and reaches a target loss in fewer steps than Pre-LN.",
    source="Bachlechner et al. 2020, ReZero is All You Need: Fast Convergence at Large Depth, arXiv:2003.04887 "
    "(Table 2: iterations to a target loss vs Pre-/Post-LN; the unnormalized residual Transformer fails at depth)",
    config={
        "lr": 1e-2,
        "default": {"layers": 16, "steps": 150, "seeds": 3},
        "quick": {"layers": 4, "steps": 20, "seeds": 2},
    },
    rules=RULES,
    fixed=FIXED,
    changes=CHANGES,
)
def rezero_experiment(ctx: Context) -> Result:
    """Bachlechner et al. train 12-layer (and deeper) Transformers: the vanilla residual stack without norm does not
    train, ReZero reaches enwiki8's target loss in 56% fewer iterations than Pre-LN. Scaled here: 16 layers, d = 32,
    Adam lr 1e-2, warmup 10% then cosine, 150 steps, 3 model seeds; arms x + F(x) (placement "none", no final
    norm), ReZero (placement "rezero", no norm anywhere) and Pre-LN with its final norm. At 12 layers and lr 3e-3
    (the first setup) x + F(x) trained, so the claim's first half could not show; at 16 layers and lr 1e-2 it
    diverged at 9 of 9 model seeds in branch-scaling. Speed: steps until the training loss, averaged over the last
    10 steps, reaches the loss Pre-LN ends at (the paper's statistic, steps to a target loss: the same loss in
    fewer steps)."""
    s = settings(ctx)
    steps, layers = s["steps"], s["layers"]
    seeds = seed_list(ctx, s["seeds"])
    arms = {p: ({"placement": p, "n_layers": layers}, {}) for p in ("none", "rezero", "pre")}
    ctx.progress(f"{len(arms) * len(seeds)} runs of {steps} steps")
    train = {"steps": steps, "lr": s["lr"], "warmup": max(1, steps // 10)}
    keys, tasks = grid_tasks(ctx, arms, seeds, train, curve_points=steps)
    runs = dict(zip(keys, train_runs(ctx, tasks)))
    ex = {p: seed_values(runs, p, seeds, "excess") for p in arms}
    div = seed_values(runs, "none", seeds, "diverged")
    curves = {p: [runs[(p, sd)]["loss_curve"] for sd in seeds] for p in ("rezero", "pre")}
    values, shown = rezero_values(ex["none"], div, ex["rezero"], curves["rezero"], curves["pre"], steps)
    ev, verdict, reason = judge_values(RULES, values, seeds, ctx.seed)
    names = {"none": "x + F(x), no norm", "rezero": "ReZero", "pre": "Pre-LN"}
    figures = []
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(1, 1, figsize=(6, 3.5))
        loss_panel(ax, runs, arms, seeds, steps, names, log=True)
        ax.set_title(f"{layers} layers, Adam lr {s['lr']:g}", fontsize=9)
        figures = save(plt, fig, ctx, "rezero.png")
    metrics = {
        "criterion": CRITERION,
        "steps": steps,
        "layers": layers,
        "seeds": seeds,
        "per_seed": {
            **{f"{names[p]} excess": ex[p] for p in arms},
            "target (Pre-LN's final training loss)": shown["target"],
            "ReZero steps to the target": shown["ReZero steps"],
            "Pre-LN steps to the target": shown["Pre-LN steps"],
            "steps to the target, ReZero / Pre-LN": shown["ratio"],
        },
        "diverged_none": div,
        "setup": f"Bachlechner et al. 2020 at d = 32: {layers} layers, Adam lr {s['lr']:g}, warmup 10% then cosine, "
        f"{steps} steps, {len(seeds)} model seeds; target: Pre-LN's final training loss (running mean of {SMOOTH} "
        "steps)",
    }
    line = (
        f"Excess loss by seed ({len(seeds)}): x + F(x) {fmt_seeds(ex['none'])} (diverged {sum(map(bool, div))}), "
        f"ReZero {fmt_seeds(ex['rezero'])}, Pre-LN {fmt_seeds(ex['pre'])}; steps to Pre-LN's final training loss: "
        f"ReZero {'/'.join(str(v) for v in shown['ReZero steps'])}, Pre-LN "
        f"{'/'.join(str(v) for v in shown['Pre-LN steps'])} (ratio {fmt_seeds(shown['ratio'])})."
    )
    return Result(verdict=verdict, metrics=metrics, figures=figures, summary=line, reason=reason, evidence=ev)
