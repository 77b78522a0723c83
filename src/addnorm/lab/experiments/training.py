"""Training experiments: warmup, depth, learning-rate sensitivity, z-loss, placements, LayerNorm vs RMSNorm.

Every run trains a tiny decoder-only Transformer (``addnorm.nn.TransformerLM``, d = 32, 2 heads, T = 32, B = 8)
on the synthetic Markov language of :mod:`addnorm.train.data`, whose best achievable loss is known exactly, with
the shared loop of :mod:`addnorm.train.loop`. Losses are reported as *excess loss* = loss - optimum; a diverged
run counts at its initial loss (Wortsman et al. 2023's min(loss, loss_0)).

Each verdict comes from a pure ``*_verdict`` function below, fixed before any run and tested on synthetic
numbers; its rule is stated in ``CRITERIA`` and copied into the metrics and the summary.

Cost: runs are tiny; they use the torch threads the runner sets (``addnorm lab --threads``, default 1: at these
sizes a second thread mostly adds synchronisation). The six experiments together take about 155 s of CPU time
in default mode and 40 s with ``--quick``.
"""

from __future__ import annotations

import math
import time
from typing import Sequence

import torch

from addnorm.lab.core import Context, Result, experiment, verdict_from

VOCAB, D_MODEL, HEADS, SEQ, BATCH = 32, 32, 2, 32, 8
LR_GRID = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1)
WARMUPS = (0, 50, 400)
DEPTHS = (6, 24, 48)
PLACEMENTS = ("pre", "post", "sandwich", "mix", "dyt", "deepnorm")
# The papers' Adam lr 1e-3 at d = 512, scaled to d = 32: Adam moves each weight by about lr per step and Xavier
# weights are sqrt(512 / 32) = 4x larger at d = 32, so 4e-3 here is the same relative update.
BASE_LR = 4e-3

CRITERIA = {
    "warmup": (
        "gap(p) = excess loss with warmup 0 minus the best excess loss with warmup 50 or 400. Reproduced iff "
        "gap(Post-LN) > 0.05 nats and gap(Pre-LN) < gap(Post-LN) / 2."
    ),
    "depth-sweep": (
        "degrade(p) = excess loss at the deepest L minus at the shallowest L. Reproduced iff degrade(Post-LN) > 0.1 "
        "nats, degrade(DeepNorm) < degrade(Post-LN) / 2, and no DeepNorm run diverged."
    ),
    "lr-sensitivity": (
        "sensitivity = mean over the 7-point LR grid of [min(loss(lr), loss_0) - loss*], loss* the best final loss "
        "over the grid, computed per seed (model init and batches; the same language). Reproduced iff "
        "sensitivity(Pre-LN + QK-norm) < sensitivity(Pre-LN) at every seed (paired by seed) and Pre-LN's max "
        "attention logit at the three highest LRs exceeds 2x its value at the lowest LR (first seed)."
    ),
    "z-loss": (
        "|log Z| = |mean output log Z over the last 10% of steps|. Reproduced iff |log Z| without z-loss > 2 nats "
        "and |log Z| with z-loss 1e-4 < half of it; inconclusive when the run without z-loss diverged."
    ),
    "placement-comparison": (
        "At init: Pre-LN's residual RMS last/first layer ratio > 2; Sandwich (Peri-LN) ratio < Pre-LN's; Post-LN's "
        "gradient-norm last/first layer ratio > 1 (rising towards the last layers) and > Pre-LN's. Reproduced iff "
        "all four hold."
    ),
    "ln-vs-rms-training": (
        "Reproduced iff |excess(LayerNorm) - excess(RMSNorm)| < max(0.05 nats, 10% of LayerNorm's excess) and "
        "RMSNorm's step time <= 1.05x LayerNorm's (median of interleaved timings)."
    ),
}

def _register(name: str, *, claim: str, source: str, config: dict):
    return experiment(name, claim=claim, source=source, config={"version": 1, **config}, criterion=CRITERIA[name])


def _settings(ctx: Context) -> dict:
    """The run's settings, read from the experiment's registered config only (``ctx.config``, which the runner
    fills and the cache key hashes), so the config shown in the report is exactly what ran: its shared entries
    with the "quick" or "default" sizes merged in."""
    mode = "quick" if ctx.quick else "default"
    if mode not in ctx.config:
        raise ValueError(f"ctx.config has no {mode!r} sizes: pass the experiment's registered config "
                         "(Context(config=EXPERIMENTS[name].config)) or run it through addnorm.lab.runner")  # fmt: skip
    shared = {k: v for k, v in ctx.config.items() if k not in ("quick", "default")}
    return {**shared, **ctx.config[mode]}


# ------------------------------------------------------------------------------------------------ verdicts
def _finite(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def warmup_verdict(excess: dict[str, dict[int, float]]) -> tuple[bool | None, dict]:
    """``excess[placement][warmup]`` for placements "post" and "pre" and warmups 0 plus at least one other."""
    gaps = {}
    for p in ("post", "pre"):
        runs = excess[p]
        with_warmup = [v for w, v in runs.items() if w > 0]
        if not _finite(runs.get(0)) or not with_warmup or not all(map(_finite, with_warmup)):
            return None, {}
        gaps[p] = runs[0] - min(with_warmup)
    passed = gaps["post"] > 0.05 and gaps["pre"] < gaps["post"] / 2
    return passed, {"gap_post": gaps["post"], "gap_pre": gaps["pre"]}


def depth_verdict(excess: dict[str, dict[int, float]], diverged: dict[str, dict[int, bool]]) -> tuple[bool | None,
                                                                                                     dict]:  # fmt: skip
    """``excess[placement][L]`` and ``diverged[placement][L]`` for "post" and "deepnorm" (others ignored)."""
    degrade = {}
    for p in ("post", "deepnorm"):
        runs = excess[p]
        if len(runs) < 2 or not all(map(_finite, runs.values())):
            return None, {}
        degrade[p] = runs[max(runs)] - runs[min(runs)]
    deep_ok = not any(diverged["deepnorm"].values())
    passed = degrade["post"] > 0.1 and degrade["deepnorm"] < degrade["post"] / 2 and deep_ok
    return passed, {"degrade_post": degrade["post"], "degrade_deepnorm": degrade["deepnorm"],
                    "deepnorm_never_diverged": deep_ok}  # fmt: skip


def lr_sensitivity(final: Sequence[float], initial: Sequence[float]) -> float:
    """Wortsman et al. 2023: mean over the grid of min(loss, loss_0) - loss*; a diverged run (non-finite loss)
    counts as loss_0. loss_0 is the mean initial loss; loss* the best finite final loss."""
    loss0 = sum(initial) / len(initial)
    capped = [min(v, loss0) if _finite(v) else loss0 for v in final]
    best = min(capped)
    return sum(c - best for c in capped) / len(capped)


def lr_verdict(sens: dict[str, Sequence[float]], max_logit_pre: Sequence[float | None]) -> tuple[bool | None, dict]:
    """``sens`` per variant ("pre", "pre+qk", ...): the sensitivity at each seed, in the same seed order for every
    variant; ``max_logit_pre``: Pre-LN's max attention logit per grid LR, lowest LR first (None where the run
    recorded none). One seed's noise can order two close variants either way, so QK-norm must win at every seed."""
    low = max_logit_pre[0]
    high = [v for v in max_logit_pre[-3:] if _finite(v)]
    if not _finite(low) or low <= 0 or not high or len(sens["pre"]) != len(sens["pre+qk"]) or not sens["pre"]:
        return None, {}
    growth = max(high) / low
    wins = sum(q < p for p, q in zip(sens["pre"], sens["pre+qk"]))
    passed = wins == len(sens["pre"]) and growth > 2.0
    return passed, {"max_logit_growth_pre": growth, "qk_lower_at_seeds": f"{wins}/{len(sens['pre'])}"}


def z_loss_verdict(logz_without: float, logz_with: float, diverged_without: bool) -> tuple[bool | None, dict]:
    if diverged_without or not _finite(logz_without) or not _finite(logz_with):
        return None, {}
    a, b = abs(logz_without), abs(logz_with)
    return a > 2.0 and b < a / 2, {"abs_logz_without": a, "abs_logz_with": b}


def placement_verdict(residual_ratio: dict[str, float], grad_ratio: dict[str, float]) -> tuple[bool | None, dict]:
    """Ratios last/first layer at init: residual RMS ("pre", "sandwich") and gradient norm ("post", "pre")."""
    needed = [residual_ratio.get("pre"), residual_ratio.get("sandwich"), grad_ratio.get("post"), grad_ratio.get("pre")]
    if not all(map(_finite, needed)):
        return None, {}
    checks = {
        "pre_residual_grows": residual_ratio["pre"] > 2.0,
        "sandwich_bounded_vs_pre": residual_ratio["sandwich"] < residual_ratio["pre"],
        "post_grad_rises_towards_last_layer": grad_ratio["post"] > 1.0,  # the claim itself, not only "more than Pre"
        "post_grad_rises_vs_pre": grad_ratio["post"] > grad_ratio["pre"],
    }
    return all(checks.values()), checks


def ln_rms_verdict(excess_ln: float, excess_rms: float, time_ln: float, time_rms: float) -> tuple[bool | None,
                                                                                                 dict]:  # fmt: skip
    if not all(map(_finite, (excess_ln, excess_rms, time_ln, time_rms))):
        return None, {}
    tol = max(0.05, 0.1 * abs(excess_ln))
    parity = abs(excess_ln - excess_rms) < tol
    speed = time_rms <= 1.05 * time_ln
    return parity and speed, {"loss_parity": parity, "parity_tolerance": tol, "rms_not_slower": speed}


# ------------------------------------------------------------------------------------------------ running
_LANGS: dict[int, object] = {}


def language(seed: int):
    from addnorm.train.data import MarkovLanguage

    if seed not in _LANGS:
        _LANGS[seed] = MarkovLanguage(vocab_size=VOCAB, order=1, branching=3, seed=seed)
    return _LANGS[seed]


def model_config(**overrides):
    """The tiny LM of every experiment: Xavier init (the papers' assumption), plain-PyTorch norms (fastest here)."""
    from addnorm.nn import TransformerConfig

    kw = dict(vocab_size=VOCAB, d_model=D_MODEL, n_layers=2, n_heads=HEADS, max_seq_len=SEQ, norm="layernorm",
              placement="pre", ffn="gelu", init="xavier", backend="torch")  # fmt: skip
    kw.update(overrides)
    if kw["placement"] == "dyt":  # DyT is a norm kind: Pre-LN placement with tanh instead of the norm
        kw.update(placement="pre", norm="dyt")
    return TransformerConfig(**kw)


def run_training(ctx: Context, model_kw: dict, **train_kw):
    """Train one tiny LM; returns the TrainResult. ``seed`` in train_kw (default ctx.seed) sets the model's init and
    the batches; the language itself is always ctx.seed's, so runs at several seeds learn the same task."""
    from addnorm.nn import TransformerLM
    from addnorm.train.loop import TrainConfig, train

    cfg = TrainConfig(**{"batch_size": BATCH, "seq_len": SEQ, "seed": ctx.seed, "device": str(ctx.device),
                         "eval_batches": 2, **train_kw})  # fmt: skip
    torch.manual_seed(cfg.seed)
    model = TransformerLM(model_config(**model_kw))
    return train(model, language(ctx.seed), cfg)


def excess(res) -> float:
    """Final loss - optimum, a diverged run counted at its initial loss (never above it)."""
    final = res.final_loss if _finite(res.final_loss) else res.initial_loss
    return min(final, res.initial_loss) - res.optimum


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None  # figures are extras: metrics carry the results (pip install 'addnorm[lab]')
    return plt


def _save(plt, fig, ctx: Context, name: str) -> list[str]:
    fig.tight_layout()
    fig.savefig(ctx.figure_path(name), dpi=100)
    plt.close(fig)
    return [name]


def _smooth(values: Sequence[float], k: int = 5) -> list[float]:
    out, acc = [], []
    for v in values:
        acc.append(v)
        acc = acc[-k:]
        out.append(sum(acc) / len(acc))
    return out


def _fmt(x) -> str:
    return "n/a" if not _finite(x) else f"{x:.3f}"


# ------------------------------------------------------------------------------------------------ experiments
@_register(
    "warmup",
    claim="Post-LN trained with Adam needs learning-rate warmup (without it, it ends clearly worse); Pre-LN does "
    "not depend on warmup.",
    source="Xiong et al. 2020, On Layer Normalization in the Transformer Architecture, section 3.2",
    config={"lr": BASE_LR, "warmups": list(WARMUPS), "default": {"layers": 6, "steps": 150},
            "quick": {"layers": 4, "steps": 50}},  # fmt: skip
)
def warmup_experiment(ctx: Context) -> Result:
    s = _settings(ctx)
    layers, steps, lr = s["layers"], s["steps"], s["lr"]
    results: dict[str, dict[int, object]] = {"post": {}, "pre": {}}
    for p in results:
        for w in s["warmups"]:
            ctx.progress(f"{p}-LN, warmup {w}")
            results[p][w] = run_training(ctx, {"placement": p, "n_layers": layers}, steps=steps, lr=lr, warmup=w,
                                         schedule="constant")  # fmt: skip
    ex = {p: {w: excess(r) for w, r in runs.items()} for p, runs in results.items()}
    passed, extra = warmup_verdict(ex)
    figures = []
    plt = _pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
        for ax, p in zip(axes, ("post", "pre")):
            for w, r in results[p].items():
                ax.plot(_smooth(r.losses), label=f"warmup {w}")
            ax.axhline(results[p][0].optimum, color="k", ls="--", lw=1, label="optimum")
            ax.set_title(f"{p.capitalize()}-LN, {layers} layers, Adam lr {lr:g}")
            ax.set_xlabel("step")
            ax.legend(fontsize=8)
        axes[0].set_ylabel("train loss (smoothed)")
        figures = _save(plt, fig, ctx, "warmup_loss.png")
    metrics = {
        "criterion": CRITERIA["warmup"], "layers": layers, "steps": steps, "lr": lr,
        "excess_loss": {p: {str(w): v for w, v in runs.items()} for p, runs in ex.items()},
        "diverged": {p: {str(w): r.diverged for w, r in runs.items()} for p, runs in results.items()},
        "optimum": results["pre"][0].optimum, **extra,
    }  # fmt: skip
    best = {p: min(v for w, v in ex[p].items() if w > 0) for p in ex}
    line = (f"Excess loss without / with best warmup: Post-LN {_fmt(ex['post'][0])} / {_fmt(best['post'])}, "
            f"Pre-LN {_fmt(ex['pre'][0])} / {_fmt(best['pre'])} ({steps} steps; a warmup longer than the run means "
            "the LR is still ramping at the end).")  # fmt: skip
    return Result(verdict=verdict_from(passed), metrics=metrics, figures=figures, summary=line)


@_register(
    "depth-sweep",
    claim="Post-LN gets worse (or fails) as depth grows; DeepNorm trains stably at every depth.",
    source="Wang et al. 2022, DeepNet: Scaling Transformers to 1,000 Layers",
    config={"lr": BASE_LR, "default": {"depths": list(DEPTHS), "steps": 60},
            "quick": {"depths": [6, 12, 24], "steps": 15}},  # fmt: skip
)
def depth_sweep(ctx: Context) -> Result:
    s = _settings(ctx)
    depths, steps, lr = tuple(s["depths"]), s["steps"], s["lr"]
    placements = ("post", "pre", "deepnorm")
    results = {p: {} for p in placements}
    for p in placements:
        for n in depths:
            ctx.progress(f"{p}, {n} layers")
            results[p][n] = run_training(ctx, {"placement": p, "n_layers": n}, steps=steps, lr=lr,
                                         warmup=max(1, steps // 10))  # fmt: skip
    ex = {p: {n: excess(r) for n, r in runs.items()} for p, runs in results.items()}
    div = {p: {n: r.diverged for n, r in runs.items()} for p, runs in results.items()}
    passed, extra = depth_verdict(ex, div)
    figures = []
    plt = _pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for p in placements:
            axes[0].plot(list(depths), [ex[p][n] for n in depths], "o-", label=p)
            axes[1].plot(_smooth(results[p][max(depths)].losses), label=p)
        axes[0].set_xscale("log")
        axes[0].set_xticks(list(depths), [str(n) for n in depths])
        axes[0].set_xlabel("layers")
        axes[0].set_ylabel("excess loss (nats)")
        axes[0].legend(fontsize=8)
        axes[1].set_title(f"{max(depths)} layers")
        axes[1].set_xlabel("step")
        axes[1].set_ylabel("train loss (smoothed)")
        axes[1].legend(fontsize=8)
        figures = _save(plt, fig, ctx, "depth_sweep.png")
    metrics = {
        "criterion": CRITERIA["depth-sweep"], "depths": list(depths), "steps": steps, "lr": lr,
        "excess_loss": {p: {str(n): v for n, v in runs.items()} for p, runs in ex.items()},
        "diverged": {p: {str(n): v for n, v in runs.items()} for p, runs in div.items()},
        "max_grad_norm": {p: {str(n): r.max_grad_norm for n, r in runs.items()} for p, runs in results.items()},
        **extra,
    }  # fmt: skip
    line = "Excess loss by depth " + "; ".join(
        f"{p}: " + ", ".join(f"L={n} {_fmt(ex[p][n])}" for n in depths) for p in placements) + "."  # fmt: skip
    return Result(verdict=verdict_from(passed), metrics=metrics, figures=figures,
                  summary=line)  # fmt: skip


def _max_attn_logit(res) -> float | None:
    vals = [layer.get("max_attn_logit") for rec in res.records for layer in rec.get("layers", [])]
    vals = [v for v in vals if _finite(v)]
    return max(vals) if vals else None


@_register(
    "lr-sensitivity",
    claim="Without QK-layernorm the max attention logit grows with the learning rate; QK-layernorm lowers LR "
    "sensitivity (mean excess over the LR grid of min(loss, loss_0) - loss*).",
    source="Wortsman et al. 2023, Small-scale proxies for large-scale Transformer training instabilities",
    config={"grid": list(LR_GRID), "layers": 2, "wd": 1e-4, "z_loss": 1e-4, "default": {"steps": 100, "seeds": 3},
            "quick": {"steps": 25, "seeds": 2}},  # fmt: skip
)
def lr_sensitivity_experiment(ctx: Context) -> Result:
    s = _settings(ctx)
    steps, grid = s["steps"], tuple(s["grid"])
    seeds = [ctx.seed + k for k in range(s["seeds"])]
    variants = {"pre": {"placement": "pre"}, "post": {"placement": "post"},
                "pre+qk": {"placement": "pre", "qk_norm": True}}  # fmt: skip
    # per variant, per seed, the runs over the grid; Post-LN (shown, not in the verdict) at the first seed only
    results = {v: [[] for _ in (seeds if v != "post" else seeds[:1])] for v in variants}
    for v, kw in variants.items():
        for k, seed in enumerate(seeds if v != "post" else seeds[:1]):
            for lr in grid:
                ctx.progress(f"{v}, seed {seed}, lr {lr:g}")
                # Wortsman et al.'s recipe: AdamW (0.9, 0.95), clip 1, warmup + cosine, independent wd 1e-4,
                # z-loss 1e-4
                results[v][k].append(run_training(
                    ctx, {**kw, "n_layers": s["layers"], "record_logits": True}, steps=steps, lr=lr, seed=seed,
                    warmup=max(1, steps // 10), weight_decay=s["wd"], independent_wd=True, z_loss=s["z_loss"],
                    monitor=True, monitor_every=5,
                ))  # fmt: skip
    sens_by_seed = {v: [lr_sensitivity([r.final_loss for r in rs], [r.initial_loss for r in rs]) for rs in per_seed]
                    for v, per_seed in results.items()}  # fmt: skip
    sens = {v: sum(vals) / len(vals) for v, vals in sens_by_seed.items()}  # the mean, for the figure and summary
    first = {v: per_seed[0] for v, per_seed in results.items()}  # the first seed's runs: figure and logits
    logits = {v: [_max_attn_logit(r) for r in rs] for v, rs in first.items()}
    passed, extra = lr_verdict(sens_by_seed, logits["pre"])
    figures = []
    plt = _pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for v, rs in first.items():
            opt = rs[0].optimum
            axes[0].plot(grid, [min(r.final_loss, r.initial_loss) if _finite(r.final_loss) else r.initial_loss
                                   for r in rs], "o-", label=f"{v} (mean sens {sens[v]:.2f})")  # fmt: skip
            axes[1].plot(grid, [x if x is not None else float("nan") for x in logits[v]], "o-", label=v)
        axes[0].axhline(opt, color="k", ls="--", lw=1, label="optimum")
        axes[0].set_ylabel("final loss, first seed (capped at loss_0)")
        axes[1].set_ylabel("max attention logit")
        if any(_finite(x) and x > 0 for xs in logits.values() for x in xs):  # log scale needs a positive value
            axes[1].set_yscale("log")
        for ax in axes:
            ax.set_xscale("log")
            ax.set_xlabel("learning rate")
            ax.legend(fontsize=8)
        figures = _save(plt, fig, ctx, "lr_sensitivity.png")
    metrics = {
        "criterion": CRITERIA["lr-sensitivity"], "grid": list(grid), "steps": steps, "seeds": seeds,
        "sensitivity_mean": sens, "sensitivity_by_seed": sens_by_seed,
        "final_loss_first_seed": {v: [r.final_loss if _finite(r.final_loss) else None for r in rs]
                                  for v, rs in first.items()},
        "diverged_first_seed": {v: [r.diverged for r in rs] for v, rs in first.items()}, "max_attn_logit": logits,
        "optimum": first["pre"][0].optimum, **extra,
    }  # fmt: skip
    top = [x for x in logits["pre"][-3:] if x is not None]
    by_seed = lambda v: "/".join(f"{x:.3f}" for x in sens_by_seed[v])  # noqa: E731
    line = (f"LR sensitivity by seed ({len(seeds)}): pre {by_seed('pre')}, pre+qk {by_seed('pre+qk')} "
            f"(QK-norm lower at {extra.get('qk_lower_at_seeds', '?')}); post {by_seed('post')} (first seed); "
            f"Pre-LN max attention logit {_fmt(logits['pre'][0])} at lr {grid[0]:g} -> "
            f"{_fmt(max(top) if top else None)} at the top three LRs.")  # fmt: skip
    return Result(verdict=verdict_from(passed), metrics=metrics, figures=figures,
                  summary=line)  # fmt: skip


@_register(
    "z-loss",
    claim="At a high learning rate without weight decay the output log-partition log Z drifts far from 0; z-loss "
    "1e-4 * (log Z)^2 keeps it near 0.",
    source="Wortsman et al. 2023, section 3.2 (output logit divergence)",
    config={"lr": 3e-2, "z_loss": 1e-4, "layers": 2, "default": {"steps": 300}, "quick": {"steps": 100}},
)
def z_loss_experiment(ctx: Context) -> Result:
    s = _settings(ctx)
    steps, lr, z = s["steps"], s["lr"], s["z_loss"]
    runs = {}
    for coef in (0.0, z):
        ctx.progress(f"z-loss {coef:g}")
        runs[coef] = run_training(ctx, {"placement": "pre", "n_layers": s["layers"]}, steps=steps, lr=lr,
                                  warmup=steps // 10, weight_decay=0.0, z_loss=coef)  # fmt: skip
    tail = max(1, steps // 10)

    def late(res):
        vals = [v for v in res.logz[-tail:] if _finite(v)]
        return sum(vals) / len(vals) if vals else float("nan")

    without, with_ = late(runs[0.0]), late(runs[z])
    passed, extra = z_loss_verdict(without, with_, runs[0.0].diverged)
    figures = []
    plt = _pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for coef, r in runs.items():
            label = "no z-loss" if coef == 0 else f"z-loss {coef:g}"
            axes[0].plot(r.logz, label=label)
            axes[1].plot(_smooth(r.losses), label=label)
        axes[0].axhline(0, color="k", lw=0.5)
        axes[0].set_ylabel("mean output log Z")
        axes[1].axhline(runs[0.0].optimum, color="k", ls="--", lw=1, label="optimum")
        axes[1].set_ylabel("train loss (smoothed)")
        for ax in axes:
            ax.set_xlabel("step")
            ax.legend(fontsize=8)
        figures = _save(plt, fig, ctx, "z_loss.png")
    metrics = {
        "criterion": CRITERIA["z-loss"], "lr": lr, "z_loss": z, "steps": steps, "late_logz_without": without,
        "late_logz_with": with_, "excess_loss_without": excess(runs[0.0]), "excess_loss_with": excess(runs[z]),
        "diverged_without": runs[0.0].diverged, "diverged_with": runs[z].diverged, **extra,
    }  # fmt: skip
    line = (f"Late mean log Z without z-loss {_fmt(without)}, with z-loss {z:g} {_fmt(with_)}; excess loss "
            f"{_fmt(excess(runs[0.0]))} vs {_fmt(excess(runs[z]))}.")  # fmt: skip
    return Result(verdict=verdict_from(passed), metrics=metrics, figures=figures, summary=line)


def _layer_profile(record: dict, key: str) -> list[float | None]:
    return [layer.get(key) for layer in record.get("layers", [])]


def _ratio(profile: Sequence[float | None]) -> float | None:
    vals = [v for v in profile if _finite(v)]
    if len(vals) < 2 or vals[0] <= 0:
        return None
    return vals[-1] / vals[0]


@_register(
    "placement-comparison",
    claim="Norm placement shapes the residual stream and the gradients: Pre-LN's stream grows with depth, "
    "Sandwich/Peri-LN's grows more slowly than Pre-LN's, Post-LN's gradients rise towards the last layers.",
    source="Xiong et al. 2020 (Lemma 2, Fig. 3); Peri-LN/Sandwich-LN; Mix-LN; DyT (2025); DeepNet 2022",
    config={"placements": list(PLACEMENTS), "lr": BASE_LR, "default": {"layers": 24, "steps": 40},
            "quick": {"layers": 12, "steps": 20}},  # fmt: skip
)
def placement_comparison(ctx: Context) -> Result:
    s = _settings(ctx)
    layers, steps, placements = s["layers"], s["steps"], tuple(s["placements"])
    results = {}
    for p in placements:
        ctx.progress(f"{p}, {layers} layers")
        # records at step 0 (init) and the last step
        results[p] = run_training(ctx, {"placement": p, "n_layers": layers}, steps=steps, lr=s["lr"],
                                  warmup=max(1, steps // 10), monitor=True, monitor_every=steps - 1)  # fmt: skip
    init = {p: r.records[0] for p, r in results.items() if r.records}
    last = {p: r.records[-1] for p, r in results.items() if len(r.records) > 1}
    res_profile = {p: _layer_profile(rec, "residual_rms") for p, rec in init.items()}
    grad_profile = {p: _layer_profile(rec, "grad_norm") for p, rec in init.items()}
    res_ratio = {p: _ratio(v) for p, v in res_profile.items()}
    grad_ratio = {p: _ratio(v) for p, v in grad_profile.items()}
    passed, checks = placement_verdict(res_ratio, grad_ratio)
    figures = []
    plt = _pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
        for p in placements:
            if p in init:
                axes[0].plot([v if v is not None else float("nan") for v in res_profile[p]], label=p)
                axes[1].plot([v if v is not None else float("nan") for v in grad_profile[p]], label=p)
            axes[2].plot(_smooth(results[p].losses), label=p)
        axes[0].set_title("residual RMS after each layer (init)")
        axes[1].set_title("gradient norm per layer (init)")
        axes[2].set_title("train loss (smoothed)")
        for ax in axes[:2]:
            ax.set_xlabel("layer")
            ax.set_yscale("log")
        axes[2].set_xlabel("step")
        for ax in axes:
            ax.legend(fontsize=7)
        figures = _save(plt, fig, ctx, "placement_profiles.png")
    metrics = {
        "criterion": CRITERIA["placement-comparison"], "layers": layers, "steps": steps,
        "excess_loss": {p: excess(r) for p, r in results.items()},
        "diverged": {p: r.diverged for p, r in results.items()},
        "residual_rms_init": res_profile, "grad_norm_init": grad_profile,
        "residual_rms_final": {p: _layer_profile(rec, "residual_rms") for p, rec in last.items()},
        "grad_norm_final": {p: _layer_profile(rec, "grad_norm") for p, rec in last.items()},
        "residual_ratio_last_first": res_ratio, "grad_ratio_last_first": grad_ratio, "checks": checks,
    }  # fmt: skip
    line = ("Residual RMS last/first at init: " + ", ".join(f"{p} {_fmt(res_ratio.get(p))}" for p in placements)
            + "; gradient last/first: " + ", ".join(f"{p} {_fmt(grad_ratio.get(p))}" for p in placements)
            + "; excess loss after training: " + ", ".join(f"{p} {_fmt(excess(r))}" for p, r in results.items())
            + ".")  # fmt: skip
    return Result(verdict=verdict_from(passed), metrics=metrics, figures=figures,
                  summary=line)  # fmt: skip


def _time_steps(ctx: Context, norm: str, layers: int, steps: int) -> float:
    """Seconds per training step (forward + backward + AdamW) of one model, after a warm-up step."""
    from addnorm.nn import TransformerLM

    torch.manual_seed(ctx.seed)
    model = TransformerLM(model_config(norm=norm, n_layers=layers)).to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, _ = language(ctx.seed).batch(0, BATCH, SEQ)
    x = x.to(ctx.device)

    def step():
        loss = model(x).float().logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    step()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


@_register(
    "ln-vs-rms-training",
    claim="RMSNorm trains to the same loss as LayerNorm and is no slower per step.",
    source="Zhang & Sennrich 2019, Root Mean Square Layer Normalization",
    config={"layers": 4, "lr": 3e-3, "default": {"steps": 150, "repeats": 7}, "quick": {"steps": 60, "repeats": 3}},
)
def ln_vs_rms(ctx: Context) -> Result:
    s = _settings(ctx)
    steps, repeats, layers = s["steps"], s["repeats"], s["layers"]
    runs = {}
    for norm in ("layernorm", "rmsnorm"):
        ctx.progress(f"{norm}")
        runs[norm] = run_training(ctx, {"placement": "pre", "norm": norm, "n_layers": layers}, steps=steps,
                                  lr=s["lr"], warmup=steps // 10)  # fmt: skip
    times = {"layernorm": [], "rmsnorm": []}
    for _ in range(repeats):  # interleaved, so both see the same machine load
        for norm in times:
            times[norm].append(_time_steps(ctx, norm, layers, 5))
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    ex = {k: excess(r) for k, r in runs.items()}
    passed, extra = ln_rms_verdict(ex["layernorm"], ex["rmsnorm"], med["layernorm"], med["rmsnorm"])
    figures = []
    plt = _pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        for k, r in runs.items():
            ax.plot(_smooth(r.losses), label=f"{k} ({med[k] * 1e3:.1f} ms/step)")
        ax.axhline(runs["layernorm"].optimum, color="k", ls="--", lw=1, label="optimum")
        ax.set_xlabel("step")
        ax.set_ylabel("train loss (smoothed)")
        ax.legend(fontsize=8)
        figures = _save(plt, fig, ctx, "ln_vs_rms_training.png")
    metrics = {
        "criterion": CRITERIA["ln-vs-rms-training"], "steps": steps, "excess_loss": ex,
        "step_time_s": med, "step_times_s": times, "speedup_rms": med["layernorm"] / med["rmsnorm"], **extra,
    }  # fmt: skip
    line = (f"Excess loss LayerNorm {_fmt(ex['layernorm'])}, RMSNorm {_fmt(ex['rmsnorm'])}; step time "
            f"{med['layernorm'] * 1e3:.1f} vs {med['rmsnorm'] * 1e3:.1f} ms (tiny model: the norm is a small "
            "share of the step).")  # fmt: skip
    return Result(verdict=verdict_from(passed), metrics=metrics, figures=figures,
                  summary=line)  # fmt: skip
