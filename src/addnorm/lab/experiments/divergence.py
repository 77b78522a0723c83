"""Seed 004's advice for finding where a divergence comes from: "record the norm of the residual stream (each
layer's output) regularly; if one layer's norm suddenly jumps, the problem is most likely near that layer ... bisect
from the abnormal layer", validated with :func:`addnorm.diagnostics.localize_jump` (its defaults).

Detection and localization are scored separately. Detection: planted faults of several sizes (one block's learning
rate x30 or x100 from a given step), the harmful ones must be flagged and the clean runs must not; plus a natural
divergence (the unnormalized x + F(x) at 12 layers and a high LR, nothing planted), which must be flagged in the
steps just before its loss blows up. Where
the first jump is named is fixed by the construction in a planted run (a fault in one block of a cumulative stream
moves every later block's output with it, and the scan goes shallow to deep): that it names the faulted block is
a sanity check, shown. Localization is scored in time, which can fail: the faulted block must be named no later
than the step at which the run's loss shows the harm, i.e. before the loss curve alone would have said anything.
Verdict from pre-registered rules over per-model-seed units (:mod:`addnorm.lab.evidence`).
"""

from __future__ import annotations

from collections.abc import Sequence

from addnorm.lab.core import Change, Context, Result
from addnorm.lab.evidence import Rule
from addnorm.lab.experiments.rules_common import judge_values
from addnorm.lab.experiments.seeds_tasks import fault_task
from addnorm.lab.experiments.training_setup import (
    SEED_STYLES,
    finite,
    fmt_seeds,
    nan,
    pyplot,
    registrar,
    save,
    seed_list,
    settings,
)

# A planted fault harms a run when its mean training loss over the last 10% of the steps exceeds the clean run's
# of the same seed by more than this (nats); the harm shows at the first step where the running means (SMOOTH
# steps) of the two runs' training losses differ by more than it.
FAULT_HARM = 0.1
SMOOTH = 10
# A natural run blows up at the first step where its loss is not finite or the running mean of its training loss
# is this many nats above its lowest running mean so far; the first jump must come at most WARN steps before that
# (earlier, it is a flag the run would have raised without diverging: high-LR runs that never blow up flag jumps
# in their first steps).
BLOWUP = 1.0
WARN = 10
# localize_jump sees every run's records from this step on: in the first steps every run's norms move fast as the
# LR ramps up, and runs that never diverge flag jumps there (steps 3-5 in the probes), so a flag there warns of
# nothing.
BURN_IN = 10
# The share of a seed's harmful faulted runs that must be flagged (and named in time).
DETECT_RATE = 0.8
FIXED = "2026-12-02 at 8821e08"

RULES = (
    Rule(
        name="the largest faults harm",
        statistic="share of the seed's largest-size faulted runs whose late loss exceeds the clean run's by > 0.1",
        op=">",
        threshold=0.5,
        role="positive",
    ),
    Rule(
        name="the natural run blows up",
        statistic="1 if the natural run's loss blew up (non-finite, or running mean 1 nat above its low)",
        op=">",
        threshold=0.5,
        role="positive",
    ),
    Rule(
        name="harmful faults detected",
        statistic="share of the seed's harmful faulted runs with a jump flagged at or after the fault's step",
        op=">",
        threshold=DETECT_RATE,
    ),
    Rule(
        name="clean runs quiet",
        statistic="1 if no jump is flagged in the seed's clean run, else 0",
        op=">",
        threshold=0.5,
    ),
    Rule(
        name="named in time",
        statistic="share of the seed's harmful faulted runs whose first jump names the faulted block, at or after "
        "the fault's step and no later than the loss shows the harm",
        op=">",
        threshold=DETECT_RATE,
    ),
    Rule(
        name="natural divergence flagged",
        statistic="1 if the natural run's first jump (from step 10) is flagged in the 10 steps up to its blow-up, "
        "else 0",
        op=">",
        threshold=0.5,
    ),
)

CRITERION = (
    "Per model seed: planted faults (one block's LR x30, x100 from the fault's step, at two blocks) and a clean run "
    "of Pre-LN, and a natural run (x + F(x), 12 layers, lr 1e-2, nothing planted). localize_jump with its defaults (a jump: > 3x the "
    f"median of that layer's last 8 values) over every block's series, recorded at every step, from step {BURN_IN} "
    "on. Reproduced iff the "
    f"bootstrap 95% intervals of the means lie above the thresholds: harmful faulted runs flagged (> {DETECT_RATE:.0%}"
    f"), the faulted block named no later than the harm shows in the loss (> {DETECT_RATE:.0%}), clean runs quiet "
    f"(> 0.5), the natural divergence's first jump flagged in the {WARN} steps up to its blow-up (> 0.5). Detection by fault size, including "
    "the harmless sizes, and the naming of the faulted block (fixed by the construction) are shown. Two stages: 3 "
    "model seeds, then 3 more, once, when a rule's interval (claim or control) straddles its threshold at this run; "
    "the verdict rests on every model seed run."
)
PRECONDITION = (
    f"The largest planted faults harm (late loss above the clean run's by > {FAULT_HARM:g} nats: share > 0.5) and the "
    f"natural run blows up (> 0.5): otherwise there is no divergence to find."
)

CHANGES = (
    Change(
        date="2026-12-01",
        what="the planted fault x30 -> x100",
        showed="probes: at x30 the fault went undetected",
        reason="a fault that does not harm is not a divergence to localize (chosen after the probe, recorded then)",
    ),
    Change(
        date="2026-12-02",
        what="fault sizes swept (x30, x100 at blocks 1 and 4; 150 steps, fault at step 75), a natural divergence "
        "added (x + F(x) at 12 layers, lr 1e-2), detection and localization scored separately; 'names the faulted "
        "block' shown as a sanity check, localization scored in time (named no later than the loss shows the harm)",
        showed="lab seeds 0-2: 89% / 67% / 78% of faulted runs localized against 80%; whenever a jump was flagged it "
        "named the faulted block (21/21), the misses were slow faults in block 4",
        reason="a fault in one block of a cumulative stream is always found first, so naming it cannot fail; a single "
        "fault size chosen after a probe says nothing about the sizes the method misses; a planted fault is not a "
        "natural divergence",
    ),
    Change(
        date="2026-12-02",
        what="localize_jump sees every run from step 10 on (a burn-in); before, from step 0",
        showed="the default run at lab seed 0 (this code before the change): inconclusive; the natural runs blew up at "
        "steps 18/16/13 and their first flags came at steps 3/6/3, so 2 of 3 counted as warnings by the 10-step "
        "window alone; harmful planted faults flagged 6/6, named in time 5/6, clean runs quiet 3/3",
        reason="high-LR runs that never diverge flag jumps at steps 3-5 too (probes), so a flag in the first steps "
        "warns of nothing; counting it made the natural-divergence rule easier to pass, not harder",
    ),
    Change(
        date="2026-12-02",
        what="a pre-registered second stage: 3 model seeds, then 3 more (once) when a rule's 95% interval "
        "straddles its threshold at this run",
        showed="the pooled record (lab seeds 0-2, 3 model seeds each): inconclusive, 'named in time' 0.667 "
        "[0.5, 0.833] against 0.8; at every lab seed a rule's interval straddled its threshold (named in time at "
        "0 and 2, natural divergence flagged at 0 and 1, harmful faults detected at 1, the largest faults harm at 2)",
        reason="with 3 units of shares in steps of 0.5 an interval rarely clears 0.8; more model seeds where the "
        "spread asks for them, by a rule fixed before the runs (never a third stage), instead of more lab seeds "
        "chosen after seeing the verdict",
    ),
)
# Model seeds added once when the first stage leaves a rule undecided (addnorm.lab.stages).
SECOND_STAGE = 3

register = registrar({"localize-divergence": CRITERION}, {"localize-divergence": PRECONDITION}, version=2)


def first_jump(series: Sequence[Sequence[float | None]], start: int = 0):
    """:func:`addnorm.diagnostics.localize_jump` (its defaults) over per-step, per-block values, from step
    ``start`` on (the jump's step counts from the run's first step)."""
    from addnorm.diagnostics import localize_jump

    history = [{"step": t, "layers": [{"residual_rms": v} for v in row]} for t, row in enumerate(series) if t >= start]
    return localize_jump(history)


def late_loss(losses: Sequence[float | None]) -> float | None:
    """Mean of the last 10% of a run's training losses; None when the run stopped early or a value is missing."""
    tail = list(losses[-max(1, len(losses) // 10) :])
    return sum(tail) / len(tail) if tail and all(map(finite, tail)) else None


def running_mean(losses: Sequence[float | None], window: int = SMOOTH) -> list[float | None]:
    """The mean of the last ``window`` losses at each step (fewer at the start); None from the first missing one."""
    out: list[float | None] = []
    for t in range(len(losses)):
        chunk = losses[max(0, t - window + 1) : t + 1]
        if not all(map(finite, chunk)) or (out and out[-1] is None):
            out.append(None)
        else:
            out.append(sum(chunk) / len(chunk))
    return out


def harm_step(losses: Sequence[float | None], clean: Sequence[float | None], fault_step: int) -> int | None:
    """The first step >= ``fault_step`` where the faulted run's running-mean loss exceeds the clean run's by more
    than FAULT_HARM, or where it stopped (a non-finite loss); None when neither happens."""
    a, b = running_mean(losses), running_mean(clean)
    for t in range(fault_step, len(a)):
        if a[t] is None:
            return t
        if t < len(b) and b[t] is not None and a[t] - b[t] > FAULT_HARM:
            return t
    return None


def blowup_step(losses: Sequence[float | None]) -> int | None:
    """The first step where the loss is not finite or its running mean is BLOWUP nats above its lowest so far."""
    low = float("inf")
    for t, m in enumerate(running_mean(losses)):
        if m is None:
            return t
        if m > low + BLOWUP:
            return t
        low = min(low, m)
    return None


def seed_outcome(clean: dict, faults: dict[tuple[int, float], dict], natural: dict, fault_step: int) -> dict:
    """One seed's measurements: ``clean``, each faulted run keyed (block, size), the natural run (fault_task
    results)."""
    clean_late = late_loss(clean["losses"])
    rows = []
    for (block, size), run in faults.items():
        late = late_loss(run["losses"])
        harmed = late is None or (finite(clean_late) and late - clean_late > FAULT_HARM)
        j = first_jump(run["rms"], BURN_IN)
        flagged = j is not None and j.step >= fault_step
        when = harm_step(run["losses"], clean["losses"], fault_step)
        limit = when if when is not None else len(run["losses"])
        named = flagged and j.layer == block
        rows.append(
            {
                "block": block,
                "size": size,
                "harm": None if late is None or not finite(clean_late) else late - clean_late,
                "harmed": harmed,
                "flagged": flagged,
                "named": j.layer if j is not None else None,
                "jump_step": j.step if j is not None else None,
                "harm_step": when,
                "named_in_time": named and j.step <= limit,
            }
        )
    jc = first_jump(clean["rms"], BURN_IN)
    blow = blowup_step(natural["losses"])
    jn = first_jump(natural["rms"], BURN_IN)
    return {
        "faults": rows,
        "clean_flagged": jc is not None,
        "natural_blowup_step": blow,
        "natural_jump_step": jn.step if jn is not None else None,
        "natural_jump_block": jn.layer if jn is not None else None,
    }


def _share(flags: Sequence[bool]) -> float | None:
    return sum(map(bool, flags)) / len(flags) if flags else None


def localize_values(outcomes: Sequence[dict]) -> dict[str, list]:
    """The per-seed values of :data:`RULES` from each seed's :func:`seed_outcome`."""
    vals: dict[str, list] = {r.name: [] for r in RULES}
    for o in outcomes:
        largest = max((r["size"] for r in o["faults"]), default=None)
        harmful = [r for r in o["faults"] if r["harmed"]]
        vals["the largest faults harm"].append(_share([r["harmed"] for r in o["faults"] if r["size"] == largest]))
        blew = o["natural_blowup_step"] is not None
        vals["the natural run blows up"].append(1.0 if blew else 0.0)
        vals["harmful faults detected"].append(_share([r["flagged"] for r in harmful]))
        vals["clean runs quiet"].append(0.0 if o["clean_flagged"] else 1.0)
        vals["named in time"].append(_share([r["named_in_time"] for r in harmful]))
        jn, bl = o["natural_jump_step"], o["natural_blowup_step"]
        vals["natural divergence flagged"].append(
            (1.0 if jn is not None and bl - WARN <= jn <= bl else 0.0) if blew else None
        )
    return vals


@register(
    "localize-divergence",
    claim="Logging each layer's residual-stream norm during training and starting from the first layer whose norm "
    "jumps finds a divergence and the layer it comes from, before the loss shows it (validated: "
    "addnorm.diagnostics.localize_jump on runs with faults of several sizes planted in known blocks, and on a "
    "natural divergence).",
    source="Seed 004 (section 2.5, part 6 'first-hand experience of training stability', third point: 'record the "
    "norm of the residual stream (each layer's output) regularly; if one layer's norm suddenly jumps, the problem "
    "is most likely near that layer ... bisect from the abnormal layer')",
    config={
        "lr": 3e-3,
        "warmup": 20,
        "fault_mults": [30.0, 100.0],
        "natural": {"placement": "none", "layers": 12, "lr": 1e-2},
        "default": {"layers": 6, "steps": 150, "fault_step": 75, "fault_layers": [1, 4], "seeds": 3},
        "quick": {"layers": 3, "steps": 24, "fault_step": 12, "fault_layers": [1], "seeds": 2},
    },
    suite="extended",
    rules=RULES,
    fixed=FIXED,
    changes=CHANGES,
    second_stage=SECOND_STAGE,
)
def localize_divergence(ctx: Context) -> Result:
    """Planted faults: from the fault's step, one block's learning rate is 30x or 100x the others' (a
    misconfigured parameter group, the kind of local fault the seed's bisection is for) in a 6-layer Pre-LN model
    (d = 32, Adam lr 3e-3 constant after a 20-step warmup, 150 steps, fault at step 75) at blocks 1 and 4, 3 model
    seeds (3 more when the first 3 leave a rule undecided: addnorm.lab.stages), plus a clean run per seed. Pre-LN
    because its block outputs are the residual stream itself. The natural divergence: the unnormalized x + F(x) (its block outputs are the stream too) at 12 layers and lr 1e-2, nothing
    planted: in a probe its loss blew up at step 18 (2.9 -> 14 nats) and recovered; Post-LN at lr 3e-2 and 1e-1
    and Pre-LN at lr 0.1 and 0.3 (6 layers) never blew up. Every series is recorded at every step by addnorm.diagnostics.Monitor and
    handed to localize_jump unchanged."""
    s = settings(ctx)
    steps, layers, fault_step = s["steps"], s["layers"], s["fault_step"]
    seeds = seed_list(ctx, s["seeds"])
    planted = [(b, m) for b in s["fault_layers"] for m in s["fault_mults"]]
    kinds = ["clean", *planted, "natural"]
    ctx.progress(f"{len(kinds) * len(seeds)} runs of {steps} steps")
    base = {"layers": layers, "steps": steps, "warmup": s["warmup"], "fault_step": fault_step, "lang_seed": ctx.seed}
    tasks = []
    for sd in seeds:
        for k in kinds:
            if k == "clean":
                tasks.append({**base, "lr": s["lr"], "fault_layer": None, "fault_mult": 1.0, "seed": sd})
            elif k == "natural":
                nat = s["natural"]
                tasks.append(
                    {**base, "layers": nat["layers"], "lr": nat["lr"], "placement": nat["placement"]}
                    | {"fault_layer": None, "fault_mult": 1.0, "seed": sd}
                )
            else:
                tasks.append({**base, "lr": s["lr"], "fault_layer": k[0], "fault_mult": k[1], "seed": sd})
    results = ctx.map(fault_task, tasks)
    runs = {
        (k if isinstance(k, str) else tuple(k), sd): results[i * len(kinds) + j]
        for i, sd in enumerate(seeds)
        for j, k in enumerate(kinds)
    }
    outcomes = [
        seed_outcome(runs[("clean", sd)], {k: runs[(k, sd)] for k in planted}, runs[("natural", sd)], fault_step)
        for sd in seeds
    ]
    ev, verdict, reason = judge_values(RULES, localize_values(outcomes), seeds, ctx.seed)
    figures = []
    plt = pyplot()
    if plt is not None:
        panels = ["clean", *[k for k in planted if k[1] == max(s["fault_mults"])], "natural"]
        fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2))
        for ax, k in zip(axes, panels):
            for i, sd in enumerate(seeds):
                series = runs[(k, sd)]["rms"]
                for b in range(len(series[0]) if series else 0):
                    ax.plot(
                        [nan(row[b]) for row in series],
                        SEED_STYLES[i % 4],
                        color=f"C{b}",
                        lw=0.8,
                        label=f"block {b}" if i == 0 else None,
                    )
            ax.set_yscale("log")
            if k != "natural":
                ax.axvline(fault_step, color="grey", lw=0.5)
            title = k if isinstance(k, str) else f"block {k[0]} x{k[1]:g}"
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("step")
        axes[0].set_ylabel("block output RMS")
        axes[0].legend(fontsize=6)
        figures = save(plt, fig, ctx, "localize_divergence.png")
    per_seed: dict[str, list] = {}
    for b, m in planted:
        rows = [next(r for r in o["faults"] if (r["block"], r["size"]) == (b, m)) for o in outcomes]
        per_seed[f"block {b} x{m:g}: late loss - clean's"] = [r["harm"] for r in rows]
        per_seed[f"block {b} x{m:g}: flagged"] = [r["flagged"] for r in rows]
        per_seed[f"block {b} x{m:g}: block named"] = [r["named"] for r in rows]
        per_seed[f"block {b} x{m:g}: jump step / harm step"] = [f"{r['jump_step']}/{r['harm_step']}" for r in rows]
    per_seed["clean run flagged"] = [o["clean_flagged"] for o in outcomes]
    per_seed["natural run: blow-up step"] = [o["natural_blowup_step"] for o in outcomes]
    per_seed["natural run: jump step"] = [o["natural_jump_step"] for o in outcomes]
    per_seed["natural run: block named"] = [o["natural_jump_block"] for o in outcomes]
    all_rows = [r for o in outcomes for r in o["faults"]]
    by_size = {
        f"x{m:g}": f"{sum(r['flagged'] for r in all_rows if r['size'] == m)}/{sum(r['size'] == m for r in all_rows)} "
        f"flagged, {sum(r['harmed'] for r in all_rows if r['size'] == m)} harmful"
        for m in s["fault_mults"]
    }
    detected = [r for r in all_rows if r["flagged"]]
    sanity = f"{sum(r['named'] == r['block'] for r in detected)}/{len(detected)}"
    metrics = {
        "criterion": CRITERION,
        "steps": steps,
        "layers": layers,
        "fault_step": fault_step,
        "seeds": seeds,
        "per_seed": per_seed,
        "detection_by_size": by_size,
        "named_the_faulted_block_when_flagged (sanity)": sanity,
        "setup": f"Pre-LN, {layers} layers, d = 32, Adam lr {s['lr']:g} constant after {s['warmup']} warmup steps, "
        f"{steps} steps; from step {fault_step} one block's LR x{s['fault_mults']} (blocks {s['fault_layers']}); "
        f"natural: {s['natural']['placement']}, {s['natural']['layers']} layers, lr {s['natural']['lr']:g}; {len(seeds)} model seeds, one clean run "
        "each",
    }
    shares = {n: [u["value"] for u in us] for n, us in ev["units"].items()}
    line = (
        f"Detection by fault size: {'; '.join(f'{k} {v}' for k, v in by_size.items())}; harmful runs flagged by seed "
        f"{fmt_seeds(shares['harmful faults detected'])}, named in time {fmt_seeds(shares['named in time'])}; clean "
        f"runs flagged {sum(per_seed['clean run flagged'])}/{len(seeds)}; natural run blow-up / jump step "
        f"{'; '.join(f'{a}/{b}' for a, b in zip(per_seed['natural run: blow-up step'], per_seed['natural run: jump step']))}"
        f"; named the faulted block when flagged (sanity, by construction): {sanity}."
    )
    return Result(verdict=verdict, metrics=metrics, figures=figures, summary=line, reason=reason, evidence=ev)
