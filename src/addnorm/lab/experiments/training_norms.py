"""Training experiments (3/3): norm placements at init, LayerNorm vs RMSNorm (quality and the norm's speed).

Same model, language, seeds and rules as :mod:`training` (its docstring): every run is a ``ctx.map`` task, every
verdict a pure ``*_verdict`` function with a control, decided by a strict majority of >= 3 seeds.

Repeatability of ``ln-vs-rms-training`` (two default runs on one shared 2-core machine at load 5-7, 2026-11-30):
RMS/LN time ratio, written out 0.70 (95% CI 0.57-0.85) then 0.83 (0.71-0.98); addnorm's cpu kernels 0.91
(0.76-1.08) then 1.12 (0.96-1.30). Both runs: inconclusive (the addnorm interval straddles 1.05), the losses
identical (they are deterministic). The point estimates moved by ~0.2 under that load. Since issue 27 the speed is
a benchmark row, not part of the verdict.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from addnorm.lab.core import Context, Result, verdict_from
from addnorm.lab.experiments.training_batch import train_runs
from addnorm.lab.experiments.training_setup import (
    SEED_STYLES,
    TRAINED_EXCESS,
    control,
    finite,
    fmt,
    fmt_seeds,
    grid_tasks,
    majority,
    nan,
    plot_curves,
    pyplot,
    registrar,
    save,
    seed_list,
    seed_values,
    settings,
)

PLACEMENTS = ("pre", "post", "sandwich", "mix", "dyt", "deepnorm")
# "No slower": RMSNorm's time ratio to LayerNorm at most this (5% allows for matched-but-not-identical code).
SPEED_TOLERANCE = 1.05
# The range of the increment ratio r (placement-comparison) read as "variance grows linearly in depth": r = 1 exactly
# for linear growth; [0.5, 2] leaves room for init noise and still excludes linear RMS growth (r ~ 3) and any
# exponential growth faster than ~1.03x per layer at 24 layers.
LINEAR_R = (0.5, 2.0)

CRITERIA = {
    "placement-comparison": (
        "A demonstration, not counted (issue 27: no cited paper claims slower growth at init). Per init, "
        "v_l = residual RMS^2 after layer l and r = mean increment v_(l+1) - v_l over the top half of the layers / "
        "over the bottom half (block 0 left out): about 1 when the variance grows linearly in depth (Lemma 2), 3 when "
        f"the RMS grows linearly, q^L when it grows q-fold per layer (1.1x per layer at 24 layers: ~9). It shows "
        f"what it should iff Pre-LN's r is in [{LINEAR_R[0]}, {LINEAR_R[1]}] (linear variance growth) at >= 5 of 6 "
        "inits (all of them when fewer than 6 run). The other placements and the gradient profiles are shown."
    ),
    "ln-vs-rms-training": (
        "Per seed: |excess(LayerNorm) - excess(RMSNorm)| < max(0.05 nats, 10% of LayerNorm's excess). Reproduced iff "
        "that holds at a strict majority of the seeds (at least 2), paired by seed. The speed of the norm is a "
        "benchmark row shown with the result (the norm alone, fwd+bwd, two matched pairs, 95% interval of the time "
        "ratio), not part of the verdict: no counted verdict depends on wall-clock time (issue 27; until 2026-12-01 "
        "it also required 'no slower', and flipped to inconclusive under machine load)."
    ),
}
PRECONDITIONS = {
    "placement-comparison": "",
    "ln-vs-rms-training": (
        f"The LayerNorm model trains (excess < {TRAINED_EXCESS} nats) at a strict majority of the seeds (a parity "
        "of two untrained models would say nothing)."
    ),
}


register = registrar(CRITERIA, PRECONDITIONS, version=2)


# ------------------------------------------------------------------------------------------------ verdicts
def inits_needed(n: int) -> int:
    """Init-time claims are cheap to measure at many inits, so they must hold at all but one of 6 (5 of 6), and at
    every init when fewer than 6 run (the --quick smoke sizes)."""
    return n - 1 if n >= 6 else n


def increment_ratio(profile: Sequence[float | None]) -> float | None:
    """r = mean increment of v = RMS^2 over the top half of the layers / over the bottom half, block 0 left out
    (the block next to the embeddings is an edge effect). Linear variance growth gives 1, linear RMS growth ~3,
    q-fold RMS growth per layer q^(2 * half) (a top/bottom ratio of the RMS itself cannot tell these apart)."""
    vals = list(profile[1:])
    if len(vals) < 5 or not all(map(finite, vals)):
        return None
    v = [x * x for x in vals]
    inc = [b - a for a, b in zip(v, v[1:])]
    half = len(inc) // 2
    bottom, top = sum(inc[:half]) / half, sum(inc[-half:]) / half
    return top / bottom if bottom > 0 else None


def placement_check(ratio_pre: Sequence[float | None]) -> tuple:
    """``ratio_pre``: Pre-LN's increment ratio r per init. True iff r is in LINEAR_R at all but one of 6 inits."""
    n = len(ratio_pre)
    per_init = [None if not finite(r) else bool(LINEAR_R[0] <= r <= LINEAR_R[1]) for r in ratio_pre]
    need = inits_needed(n)
    decided = [v for v in per_init if v is not None]
    wins = sum(decided)
    details = {"inits_agreeing": f"{wins}/{n}", "inits_needed": need, "holds_by_init": per_init}
    if n == 0 or len(decided) < need:
        return None, details, f"only {len(decided)} of {n} inits gave finite profiles"
    return wins >= need, details, ""


def ratio_ci(ln_times: Sequence[float], rms_times: Sequence[float]) -> tuple[float, float, float]:
    """Geometric mean of the paired ratios rms/ln and its 95% t-interval (on the log ratios). The t quantile is
    1.96 + 2.4 / df (within 0.5% of the exact one for df >= 10)."""
    logs = [math.log(r / l) for l, r in zip(ln_times, rms_times)]
    n = len(logs)
    if n < 3:
        raise ValueError(f"a confidence interval needs at least 3 paired timings, got {n}")
    mean = sum(logs) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in logs) / (n - 1))
    half = (1.96 + 2.4 / (n - 1)) * sd / math.sqrt(n)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def ln_rms_verdict(excess_ln: Sequence[float], excess_rms: Sequence[float]) -> tuple:
    """``excess_*``: per seed (paired). Loss parity only; the norm's speed is reported, never a verdict."""
    reason = control([finite(v) and v < TRAINED_EXCESS for v in excess_ln], "the LayerNorm model did not train")
    if reason:
        return None, {}, reason
    parity_seed = []
    for a, b in zip(excess_ln, excess_rms):
        parity_seed.append(None if not (finite(a) and finite(b)) else abs(a - b) < max(0.05, 0.1 * abs(a)))
    parity, details, reason = majority(parity_seed, "the losses")
    return parity, {"loss_parity_by_seed": parity_seed, **details}, reason


def speed_rows(ratio_cis: dict[str, Sequence[float]]) -> dict[str, str]:
    """Benchmark reading of each pair's (geomean, low, high) time ratio RMS/LN: 'no slower' / 'slower' /
    'undecided' against SPEED_TOLERANCE (shown in the report's timings, not used by any verdict)."""
    return {
        k: "n/a"
        if not all(map(finite, ci))
        else "no slower"
        if ci[2] <= SPEED_TOLERANCE
        else "slower"
        if ci[1] > SPEED_TOLERANCE
        else "undecided"
        for k, ci in ratio_cis.items()
    }


# ------------------------------------------------------------------------------------------------ placements
def _layer_profile(record: dict | None, key: str) -> list[float | None]:
    return [layer.get(key) for layer in (record or {}).get("layers", [])]


def quarter_growth(profile: Sequence[float | None]) -> float | None:
    """Mean of the top quarter of layers over the mean of the bottom quarter, block 0 left out: a statistic over
    many layers, not a ratio of two single ones (block 0, next to the embeddings, is an edge effect)."""
    vals = list(profile[1:])
    q = max(1, len(vals) // 4)
    bottom, top = vals[:q], vals[-q:]
    if len(vals) < 2 or not all(map(finite, bottom + top)) or sum(bottom) <= 0:
        return None
    return (sum(top) / q) / (sum(bottom) / q)


@register(
    "placement-comparison",
    claim="At initialization, norm placement sets how the residual stream grows with depth: Pre-LN's stream variance "
    "grows linearly with depth (Xiong et al.'s Lemma 2), not exponentially; Post-LN's stays at the norm's scale; "
    "Sandwich/Peri-LN, Mix-LN, DyT and DeepNorm shown alongside.",
    source="Xiong et al. 2020, On Layer Normalization in the Transformer Architecture, arXiv:2002.04745 (Lemma 2); "
    "Ding et al. 2021, CogView (Sandwich-LN), arXiv:2105.13290; Kim et al. 2025, Peri-LN, arXiv:2502.02732; shown "
    "alongside: Li et al. 2024, Mix-LN, arXiv:2412.13795; Zhu et al. 2025, Transformers without Normalization "
    "(DyT), arXiv:2503.10622; Wang et al. 2022, DeepNet, arXiv:2203.00555",
    kind="demonstration",
    config={
        "version": 3,
        "placements": list(PLACEMENTS),
        "init_std": 1.0,
        "tie_embeddings": False,
        "default": {"layers": 24, "seeds": 6},
        "quick": {"layers": 8, "seeds": 2},
    },
)
def placement_comparison(ctx: Context) -> Result:
    """Xiong et al.'s Lemma 2 is a statement at initialization with unit-scale inputs (||x||^2 ~ d) and Xavier
    weights. Measured here on the first forward and backward of a 24-layer decoder-only model, d = 32, at 6 inits,
    with an initialization consistent across the stack: Xavier linears (an untied Xavier LM head) and unit-scale
    token and position embeddings. (The library's default N(0, 0.02) embeddings next to Xavier linears make block 0
    an outlier, and made the old last/first-layer ratios rest on one block.) No training: the claim is about init.

    Narrowed from the earlier version, which also tested "Post-LN's gradients rise towards the last layers" on this
    decoder-only stack: Xiong et al. measured that profile in the decoder of a 6-6 encoder-decoder (Fig. 3), where
    xiong-init-gradients now tests it; in a decoder-only stack with consistent init, Post-LN's per-layer gradient
    profile is flat (issue 14's variant runs: top/bottom quarter 0.98), so the gradient profiles are shown here,
    not tested. The criterion was rewritten for these reasons before this version ran.

    First run of this version (seed 0, 2026-11-30): Pre-LN's g was 1.9-2.7 at all 6 inits, as Lemma 2 predicts,
    but Sandwich's (2.0-2.5) was lower than Pre-LN's at only 2 of 6: not reproduced. Read with care: Peri-LN's
    evidence is about the hidden states *during training* (Pre-LN's grow large, Peri-LN's stay bounded), while at
    init both add about one unit-RMS branch output per sublayer.

    Issue 27 (2026-12-01, before the rerun): no cited paper makes the init-time Sandwich claim, and g cannot tell
    linear from exponential growth (linear variance growth gives g ~ 1.8-2.4 at 24 layers, 1.1x per layer 2.36),
    while its control (Post-LN flat) held by construction. So this is now a demonstration of Lemma 2 with a
    statistic that separates the two: the increment ratio r of the variance (:func:`increment_ratio`). Peri-LN's
    training-time claim is tested by peri-ln-training."""
    s = settings(ctx)
    layers, placements = s["layers"], list(s["placements"])
    seeds = seed_list(ctx, s["seeds"])
    model = {"n_layers": layers, "init_std": s["init_std"], "tie_embeddings": s["tie_embeddings"]}
    arms = {p: ({"placement": p, **model}, {}) for p in placements}
    ctx.progress(f"{len(arms) * len(seeds)} models at init")
    keys, tasks = grid_tasks(
        ctx, arms, seeds, {"steps": 1, "lr": 1e-3, "warmup": 0, "monitor": True, "monitor_every": 1}, init_record=True
    )
    runs = dict(zip(keys, train_runs(ctx, tasks)))
    res_profile = {
        p: [_layer_profile(runs[(p, sd)]["init_record"], "residual_rms") for sd in seeds] for p in placements
    }
    grad_profile = {p: [_layer_profile(runs[(p, sd)]["init_record"], "grad_norm") for sd in seeds] for p in placements}
    growth = {p: [quarter_growth(v) for v in res_profile[p]] for p in placements}
    grad_growth = {p: [quarter_growth(v) for v in grad_profile[p]] for p in placements}
    ratio = {p: [increment_ratio(v) for v in res_profile[p]] for p in placements}
    calibration = {  # r of ideal 24-layer profiles: what linear and exponential growth look like to the statistic
        "linear variance": increment_ratio([math.sqrt(1 + 0.5 * k) for k in range(layers + 1)]),
        "linear RMS": increment_ratio([1.0 + k for k in range(layers + 1)]),
        "1.1x per layer": increment_ratio([1.1**k for k in range(layers + 1)]),
    }
    passed, extra, reason = placement_check(ratio["pre"])
    figures = []
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
        for i, p in enumerate(placements):
            for k in range(len(seeds)):
                style = SEED_STYLES[k % len(SEED_STYLES)]
                axes[0].plot(
                    [nan(v) for v in res_profile[p][k]], style, color=f"C{i}", lw=1, label=p if k == 0 else None
                )
                axes[1].plot(
                    [nan(v) for v in grad_profile[p][k]], style, color=f"C{i}", lw=1, label=p if k == 0 else None
                )
            axes[2].plot([i] * len(seeds), [nan(v) for v in ratio[p]], "o", color=f"C{i}", alpha=0.7)
        axes[0].set_title("residual RMS after each layer (init)", fontsize=9)
        axes[1].set_title("gradient norm per layer (init; shown, not tested)", fontsize=9)
        axes[2].set_title("r = top / bottom half mean increment of RMS^2 (one dot per init)", fontsize=9)
        for bound in LINEAR_R:
            axes[2].axhline(bound, color="k", ls="--", lw=0.8)
        axes[2].set_yscale("log")
        axes[2].set_xticks(range(len(placements)), placements, fontsize=8)
        for ax in axes[:2]:
            ax.set_xlabel("layer (line style: init)")
            ax.set_yscale("log")
            ax.legend(fontsize=7)
        figures = save(plt, fig, ctx, "placement_profiles.png")
    per_seed = {
        **{f"{p} residual r": ratio[p] for p in placements},
        **{f"{p} residual g": growth[p] for p in placements},
        **{f"{p} grad g": grad_growth[p] for p in placements},
    }
    metrics = {
        "criterion": CRITERIA["placement-comparison"],
        "layers": layers,
        "seeds": seeds,
        "per_seed": per_seed,
        "r_calibration": calibration,
        "residual_rms_init": {f"{p} seed {sd}": res_profile[p][k] for p in placements for k, sd in enumerate(seeds)},
        "grad_norm_init": {f"{p} seed {sd}": grad_profile[p][k] for p in placements for k, sd in enumerate(seeds)},
        "setup": (
            f"Xiong et al. 2020 Lemma 2 at init: {layers} layers, d = 32, Xavier linears, unit-scale untied "
            f"embeddings, {len(seeds)} inits"
        ),
        **extra,
    }
    line = (
        "Increment ratio r of the residual variance (top / bottom half of layers, block 0 out; linear variance 1, "
        + ", ".join(f"{k} {fmt(v)}" for k, v in calibration.items() if k != "linear variance")
        + ") by init: "
        + ", ".join(f"{p} {fmt_seeds(ratio[p])}" for p in placements)
        + f"; Pre-LN's variance grows linearly (r in {list(LINEAR_R)}) at {extra.get('inits_agreeing', 'n/a')} inits. "
        "RMS growth g (top / bottom quarter): " + ", ".join(f"{p} {fmt_seeds(growth[p])}" for p in placements) + "."
    )
    return Result(verdict=verdict_from(passed), metrics=metrics, figures=figures, summary=line, reason=reason)


# ------------------------------------------------------------------------------------------------ LN vs RMS
def _written_out_ln(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    xc = x - mu
    return xc * torch.rsqrt((xc * xc).mean(-1, keepdim=True) + eps) * w + b


def _written_out_rms(x, w, b, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def norm_timing_task(*, rows: int, hidden: int, reps: int, seed: int) -> dict:
    """Seconds of forward + backward for LayerNorm and RMSNorm, fp32 (rows, hidden), as two matched pairs:
    "plain" (both written out the same way in torch ops, autograd backward) and "addnorm" (addnorm.layer_norm /
    rms_norm on the cpu backend). Interleaved: every repetition times all four, alternating the order within each
    pair, so both members of a pair see the same machine load. Two untimed calls each warm up (and compile)."""
    import addnorm

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g).requires_grad_()
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).requires_grad_()
    b = (0.1 * torch.randn(hidden, generator=g)).requires_grad_()
    dy = torch.randn(rows, hidden, generator=g)
    eps = 1e-5
    impls = {
        "plain": {"ln": lambda: _written_out_ln(x, w, b, eps), "rms": lambda: _written_out_rms(x, w, b, eps)},
        "addnorm": {
            "ln": lambda: addnorm.layer_norm(x, w, b, eps, backend="cpu"),
            "rms": lambda: addnorm.rms_norm(x, w, eps, backend="cpu"),
        },
    }

    def once(fn) -> float:
        x.grad = w.grad = b.grad = None
        t0 = time.perf_counter()
        fn().backward(dy)
        return time.perf_counter() - t0

    for pair in impls.values():
        for fn in pair.values():
            once(fn)
            once(fn)
    times = {pair: {"ln": [], "rms": []} for pair in impls}
    for r in range(reps):
        for pair, fns in impls.items():
            for kind in ("ln", "rms") if r % 2 == 0 else ("rms", "ln"):
                times[pair][kind].append(once(fns[kind]))
    return times


@register(
    "ln-vs-rms-training",
    claim="RMSNorm trains to the same loss as LayerNorm (its speed, the paper's other claim, is measured as a "
    "benchmark row shown with the result, not a verdict).",
    source="Zhang & Sennrich 2019, Root Mean Square Layer Normalization, arXiv:1910.07467",
    config={
        "layers": 4,
        "lr": 3e-3,
        "default": {"steps": 300, "seeds": 3, "rows": 4096, "hidden": 1024, "reps": 30},
        "quick": {"steps": 20, "seeds": 2, "rows": 256, "hidden": 1024, "reps": 5},
    },
)
def ln_vs_rms(ctx: Context) -> Result:
    """Zhang & Sennrich report RMSNorm matching LayerNorm's quality at 7%-64% less running time on their models.
    Quality here: Pre-LN, 4 layers, d = 32, Adam lr 3e-3, warmup 10% then cosine, 300 steps, 3 seeds, LayerNorm vs
    RMSNorm paired by seed. Speed on the norm itself, at a size where it dominates (4096 x 1024 fp32, forward +
    backward), with implementations of matched quality: both written out the same way in torch, and both through
    addnorm's cpu kernels; interleaved, 30 repetitions, 95% interval of the ratio. (Issue 13: the model's step
    time put the norm at a small share and compared torch's fused F.layer_norm with an unfused F.rms_norm; its
    ratio moved between 1.03 and 1.19 from run to run.) Timings go to ``Result.timings``.

    Issue 27 (2026-12-01, before the rerun): the verdict is loss parity only. The speed criterion flipped the verdict
    to inconclusive in 2 of 4 recorded runs under machine load; a verdict that changes with the machine's load is not
    a verdict, so the speed is now a benchmark row (``timings["speed_reading"]``) shown next to the result."""
    s = settings(ctx)
    steps, seeds = s["steps"], seed_list(ctx, s["seeds"])
    arms = {
        norm: ({"placement": "pre", "norm": norm, "n_layers": s["layers"]}, {}) for norm in ("layernorm", "rmsnorm")
    }
    ctx.progress(f"{len(arms) * len(seeds)} runs of {steps} steps, then the norm timings")
    keys, tasks = grid_tasks(ctx, arms, seeds, {"steps": steps, "lr": s["lr"], "warmup": max(1, steps // 10)})
    runs = dict(zip(keys, train_runs(ctx, tasks)))
    times = ctx.map(
        norm_timing_task, [{"rows": s["rows"], "hidden": s["hidden"], "reps": s["reps"], "seed": ctx.seed}]
    )[0]
    ex = {k: seed_values(runs, k, seeds, "excess") for k in arms}
    cis = {pair: ratio_ci(t["ln"], t["rms"]) for pair, t in times.items()}
    passed, extra, reason = ln_rms_verdict(ex["layernorm"], ex["rmsnorm"])
    median_ms = {pair: {k: 1e3 * sorted(v)[len(v) // 2] for k, v in t.items()} for pair, t in times.items()}
    figures = []
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        plot_curves(axes[0], runs, list(arms), seeds, steps)
        axes[0].set_xlabel("step (line style: seed)")
        axes[0].set_ylabel("train loss")
        axes[0].legend(fontsize=8)
        for i, (pair, t) in enumerate(times.items()):
            ratios = [r / l for l, r in zip(t["ln"], t["rms"])]
            axes[1].plot([i] * len(ratios), ratios, "o", alpha=0.4, color=f"C{i}")
            g, lo, hi = cis[pair]
            axes[1].errorbar([i + 0.15], [g], yerr=[[g - lo], [hi - g]], fmt="s", color="k", capsize=4)
        axes[1].axhline(1.0, color="k", lw=0.5)
        axes[1].axhline(SPEED_TOLERANCE, color="r", lw=0.5, ls="--")
        axes[1].set_xticks(range(len(times)), list(times))
        axes[1].set_xlim(-0.5, len(times) - 0.5)
        axes[1].set_ylabel("time RMSNorm / LayerNorm")
        axes[1].set_title(f"the norm alone, {s['rows']}x{s['hidden']} fwd+bwd (95% CI)", fontsize=9)
        figures = save(plt, fig, ctx, "ln_vs_rms_training.png")
    metrics = {
        "criterion": CRITERIA["ln-vs-rms-training"],
        "steps": steps,
        "seeds": seeds,
        "per_seed": {"layernorm excess": ex["layernorm"], "rmsnorm excess": ex["rmsnorm"]},
        "norm_timing_shape": [s["rows"], s["hidden"]],
        "timing_reps": s["reps"],
        "setup": f"Zhang & Sennrich 2019 at d = 32: Pre-LN, {s['layers']} layers, lr {s['lr']:g}, {steps} steps, "
        f"{len(seeds)} seeds; speed on the norm alone, {s['rows']}x{s['hidden']} fp32 fwd+bwd",
        **extra,
    }
    timings = {
        "norm_median_ms": median_ms,
        "ratio_rms_over_ln": {p: {"geomean": g, "ci95": [lo, hi]} for p, (g, lo, hi) in cis.items()},
        "speed_reading": speed_rows(cis),
        "norm_times_s": times,
    }
    line = (
        f"Excess loss by seed ({len(seeds)}): LayerNorm {fmt_seeds(ex['layernorm'])}, RMSNorm "
        f"{fmt_seeds(ex['rmsnorm'])} (parity at {extra.get('seeds_agreeing', 'n/a')} seeds). Benchmark row, not part "
        f"of the verdict: the norm alone ({s['rows']}x{s['hidden']}, fwd+bwd, {s['reps']} interleaved "
        "reps), time RMS/LN: "
        + ", ".join(
            f"{p} {g:.2f} (95% CI {lo:.2f}-{hi:.2f}; {median_ms[p]['ln']:.1f} vs {median_ms[p]['rms']:.1f} ms)"
            for p, (g, lo, hi) in cis.items()
        )
        + "."
    )
    return Result(
        verdict=verdict_from(passed), metrics=metrics, figures=figures, summary=line, timings=timings, reason=reason
    )
