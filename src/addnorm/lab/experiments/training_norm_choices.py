"""Training experiments on which norm, and where (issue 27, extended suite): OLMo 2's norm on the branch's output
with QK-norm across an LR grid (reordered-norm), and BatchNorm in a Transformer's norm slot (batchnorm-training).

Same model, seeds and rules as :mod:`training_newer` (its docstring): every run a ``ctx.map`` task, every verdict a
pure ``*_verdict`` function with a control, decided by a strict majority of >= 3 seeds paired by seed.
reordered-norm trains on the lab's language (:func:`train_task`); batchnorm-training on padded sentences of varied
sources and lengths (:func:`~addnorm.lab.experiments.language_tasks.language_task`, see BN_LANGUAGE). The criteria
and controls below were written before the first run of each experiment.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from addnorm.lab.core import Context, Result, verdict_from
from addnorm.lab.experiments.language_tasks import language_task
from addnorm.lab.experiments.training_batch import train_runs
from addnorm.lab.experiments.training_logits import CONVERGED_EXCESS, lr_sensitivity
from addnorm.lab.experiments.training_newer import PARITY_ABS, PARITY_REL
from addnorm.lab.experiments.training_setup import (
    BATCH,
    SEED_STYLES,
    SEQ,
    TRAINED_EXCESS,
    Verdict,
    control,
    finite,
    fmt_seeds,
    grid_tasks,
    majority,
    nan,
    paired,
    plot_curves,
    pyplot,
    registrar,
    save,
    seed_list,
    seed_values,
    settings,
)

# reordered-norm: the grid must reach LRs that hurt the reference arm (Pre-LN + QK-norm): its excess at some LR at
# least this many nats above its best, else "no more LR-sensitive" is true of any two flat curves.
GRID_HURTS = 0.1
# batchnorm-training's batches: padded sentences from 4 sources of 7 tokens each, drawn 8:4:2:1 (SentenceMixture's
# defaults), lengths uniform on 4..T+1: the variety of content, length and token frequency of NLP batches.
BN_LANGUAGE = {"kind": "sentences", "sources": 4, "tokens_per_source": 7, "min_len": 4}
# batchnorm-training: the batch statistics "deviate strongly" from the running ones when the mean deviation is more
# than this many times what i.i.d. samples of the same size would give (iid_deviation below).
STRONG = 3.0

CRITERIA = {
    "reordered-norm": (
        "Per seed, sensitivity = mean over the LR grid of [min(loss(lr), loss_0) - loss*] (lr-sensitivity's score) "
        "and spikes = loss spikes summed over the grid (the training loop's rule, OLMo-core's: a step's loss above "
        "mean + 6 std of the last 128 steps; a non-finite loss counts). Reproduced iff, at a strict majority of the "
        "seeds (at least 2), paired by seed: sensitivity(reordered + QK-norm) <= sensitivity(Pre-LN + QK-norm) + "
        f"max({PARITY_ABS} nats, {PARITY_REL:.0%} of it) and spikes(reordered + QK-norm) <= spikes(Pre-LN + QK-norm)."
    ),
    "batchnorm-training": (
        "Per seed: d_mean = mean over the BatchNorm layers and the second half of the training steps of "
        "mean_c |mu_batch - mu_running| / sigma_running, d_var likewise of |var_batch - var_running| / var_running "
        "(running statistics as they stood before the step's update), each divided by what i.i.d. samples of the "
        "batch's size (its unpadded positions, which the statistics use) would give (ratio 1). Batches are padded "
        f"sentences of varied sources and lengths (SentenceMixture). Reproduced iff, at a strict majority of the seeds (at least 2): "
        f"excess(BatchNorm) > excess(LayerNorm) + max({PARITY_ABS} nats, {PARITY_REL:.0%} of LayerNorm's), paired by "
        f"seed, and both ratios exceed {STRONG:g}."
    ),
}
PRECONDITIONS = {
    "reordered-norm": (
        f"The lowest LR of the grid converged (excess < {CONVERGED_EXCESS} nats, both arms), and the grid reaches "
        f"LRs that hurt Pre-LN + QK-norm (its excess somewhere >= its best + {GRID_HURTS} nats), each at a strict "
        "majority of the seeds: otherwise the score measures convergence speed, or the grid stresses nothing."
    ),
    "batchnorm-training": (
        f"The LayerNorm model trains (excess < {TRAINED_EXCESS} nats) at a strict majority of the seeds, and every "
        "BatchNorm run gave its statistics: otherwise 'worse than LayerNorm' compares broken runs."
    ),
}

register = registrar(CRITERIA, PRECONDITIONS, version=1)


# ------------------------------------------------------------------------------------------------ reordered
def reordered_verdict(
    sens_ref: Sequence[float | None],
    sens_new: Sequence[float | None],
    spikes_ref: Sequence[int | None],
    spikes_new: Sequence[int | None],
    lowest_ref: Sequence[float | None],
    lowest_new: Sequence[float | None],
    hurt_ref: Sequence[float | None],
) -> Verdict:
    """Per seed (paired): both arms' sensitivity, spike count and excess at the lowest LR; ``hurt_ref`` the
    reference arm's worst minus best excess over the grid."""
    if not paired(sens_ref, sens_new, spikes_ref, spikes_new, lowest_ref, lowest_new, hurt_ref):
        return None, {}, "the arms' seeds are not paired"
    converged = [
        finite(a) and finite(b) and a < CONVERGED_EXCESS and b < CONVERGED_EXCESS
        for a, b in zip(lowest_ref, lowest_new)
    ]
    reason = control(converged, f"the lowest LR did not converge (excess >= {CONVERGED_EXCESS} nats)")
    if not reason:
        reason = control(
            [finite(h) and h >= GRID_HURTS for h in hurt_ref],
            f"no LR of the grid hurt Pre-LN + QK-norm by {GRID_HURTS} nats",
        )
    if reason:
        return None, {}, reason
    per_seed = []
    for sr, sn, kr, kn in zip(sens_ref, sens_new, spikes_ref, spikes_new):
        if not (finite(sr) and finite(sn)) or kr is None or kn is None:
            per_seed.append(None)
            continue
        per_seed.append(sn <= sr + max(PARITY_ABS, PARITY_REL * abs(sr)) and kn <= kr)
    passed, details, reason = majority(per_seed, "the sensitivities")
    return passed, {"holds_by_seed": per_seed, **details}, reason


@register(
    "reordered-norm",
    claim="The norm on the branch's output, x + Norm(F(x)) (OLMo 2's reordered norm), with QK-norm is no more "
    "sensitive to the learning rate than Pre-LN with QK-norm, and has no more loss spikes.",
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
)
def reordered_norm(ctx: Context) -> Result:
    """OLMo 2 moves the norm from the sublayer's input to its output (x + RMSNorm(F(x))), adds QK-norm and z-loss,
    and reports fewer loss and gradient spikes (section 3.2). Scaled here as lr-sensitivity (Wortsman et al.'s
    protocol: AdamW (0.9, 0.95), clip 1, warmup 10% then cosine, independent weight decay 1e-4, z-loss 1e-4), at 2
    layers, d = 32, RMSNorm (OLMo 2's norm, QK-norm included), 400 steps per LR, the grid 3e-3 .. 1 (a decade above
    lr-sensitivity's top, so that it reaches LRs that hurt Pre-LN + QK-norm), 3 seeds. Both arms have the final
    norm. Spikes: the training loop's detector on each run's per-step loss."""
    s = settings(ctx)
    steps, grid = s["steps"], list(s["grid"])
    seeds = seed_list(ctx, s["seeds"])
    variants = {"pre+qk": "pre", "reordered+qk": "branch-output"}
    train = {
        "steps": steps,
        "warmup": max(1, steps // 10),
        "weight_decay": s["wd"],
        "independent_wd": True,
        "z_loss": s["z_loss"],
    }
    arms = {
        (v, lr): ({"placement": p, "qk_norm": True, "norm": "rmsnorm", "n_layers": s["layers"]}, {"lr": lr})
        for v, p in variants.items()
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
    passed, extra, reason = reordered_verdict(
        sens["pre+qk"], sens["reordered+qk"], spikes["pre+qk"], spikes["reordered+qk"], *lowest.values(), hurt
    )
    names = {"pre+qk": "Pre-LN + QK-norm", "reordered+qk": "reordered + QK-norm"}
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
        },
        "excess": {f"{v} seed {sd}": ex[v][sd] for v in variants for sd in seeds},
        "spikes": {f"{v} seed {sd}": [runs[((v, lr), sd)]["spikes"] for lr in grid] for v in variants for sd in seeds},
        "diverged": {
            f"{v} seed {sd}": [runs[((v, lr), sd)]["diverged"] for lr in grid] for v in variants for sd in seeds
        },
        "setup": f"OLMo 2 section 3.2 at d = 32, {s['layers']} layers, RMSNorm: AdamW (0.9, 0.95), clip 1, warmup "
        f"{train['warmup']} then cosine, independent wd {s['wd']:g}, z-loss {s['z_loss']:g}, {steps} steps per LR, "
        f"grid {grid}, {len(seeds)} seeds",
        **extra,
    }
    line = (
        f"LR sensitivity by seed ({len(seeds)}): Pre-LN + QK-norm {fmt_seeds(sens['pre+qk'])}, reordered + QK-norm "
        f"{fmt_seeds(sens['reordered+qk'])}; loss spikes over the grid {'/'.join(map(str, spikes['pre+qk']))} vs "
        f"{'/'.join(map(str, spikes['reordered+qk']))}; excess at lr {grid[0]:g}: {fmt_seeds(lowest['pre+qk'])} / "
        f"{fmt_seeds(lowest['reordered+qk'])} (claim holds at {extra.get('seeds_agreeing', 'n/a')} seeds)."
    )
    return Result(verdict=verdict_from(passed), metrics=metrics, figures=figures, summary=line, reason=reason)


# ------------------------------------------------------------------------------------------------ batchnorm
def iid_deviation(n: int, momentum: float) -> tuple[float, float]:
    """E|mu_batch - mu_running| / sigma and E|var_batch - var_running| / var for i.i.d. Gaussian samples, n per
    batch, running averages with ``momentum`` (their own noise: a fraction m / (2 - m) of one batch's variance)."""
    spread = 1.0 + momentum / (2.0 - momentum)
    mean_abs = math.sqrt(2.0 / math.pi)  # E|Z| for Z ~ N(0, 1)
    return mean_abs * math.sqrt(spread / n), mean_abs * math.sqrt(2.0 * spread / n)


def batch_stats_probe(net, data, cfg):
    """A ``train_task`` probe: each training step's deviation of every BatchNorm's batch statistics from its
    running statistics (as they stood before the step updates them); after training, their means over the second
    half of the steps, and the i.i.d. reference."""
    from addnorm.nn.norm_kinds import SequenceBatchNorm

    steps: dict[int, list[tuple[float, ...]]] = {}
    mods = [m for m in net.modules() if isinstance(m, SequenceBatchNorm)]

    def record(module, args):
        if not module.training or not torch.is_grad_enabled():  # training steps only, not the evaluations
            return
        h = args[0] if len(args) < 2 or args[1] is None else args[0] + args[1]
        flat = h.detach().reshape(-1, module.d_model).float()
        mask = args[2] if len(args) > 2 else None
        if mask is not None and module.mask_padding:  # the samples the norm's statistics use: unpadded positions
            flat = flat[~mask.reshape(-1)]
        mu, var = flat.mean(0), flat.var(0, unbiased=False)
        rm, rv = module.running_mean.float(), module.running_var.float()
        d_mean = float(((mu - rm).abs() / rv.sqrt()).mean())
        d_var = float(((var - rv).abs() / rv).mean())
        ref_mean, ref_var = iid_deviation(flat.shape[0], module.momentum)  # this batch's own sample count
        steps.setdefault(id(module), []).append((d_mean, d_var, d_mean / ref_mean, d_var / ref_var, flat.shape[0]))

    handles = [m.register_forward_pre_hook(record) for m in mods]

    def finish(net, result) -> dict:
        for h in handles:
            h.remove()
        per_layer, per_layer_ratio, counts = [], [], []
        for m in mods:
            late = steps.get(id(m), [])[len(steps.get(id(m), [])) // 2 :]
            means = [sum(r[j] for r in late) / len(late) if late else None for j in range(5)]
            per_layer.append(means[:2])
            per_layer_ratio.append(means[2:4])
            counts.append(means[4])
        n = counts[0] if counts and finite(counts[0]) else None
        ref = iid_deviation(round(n), mods[0].momentum) if n else (None, None)
        return {
            "per_layer": per_layer,
            "per_layer_ratio": per_layer_ratio,
            "samples_per_step": n,
            "iid_mean": ref[0],
            "iid_var": ref[1],
        }

    return finish


def deviation_ratios(probe: dict | None) -> tuple[float | None, float | None]:
    """(d_mean, d_var) over their i.i.d. references, each step's deviation divided by the reference at that step's
    own sample count (unpadded positions), averaged over the steps and the BatchNorm layers."""
    rows = (probe or {}).get("per_layer_ratio") or []
    if not rows or not all(finite(a) and finite(b) for a, b in rows):
        return None, None
    return sum(r[0] for r in rows) / len(rows), sum(r[1] for r in rows) / len(rows)


def batchnorm_verdict(
    ex_ln: Sequence[float | None],
    ex_bn: Sequence[float | None],
    r_mean: Sequence[float | None],
    r_var: Sequence[float | None],
) -> Verdict:
    """Per seed (paired): excess of LayerNorm and BatchNorm, BatchNorm's deviation ratios (mean, variance)."""
    if not paired(ex_ln, ex_bn, r_mean, r_var):
        return None, {}, "the arms' seeds are not paired"
    reason = control([finite(v) and v < TRAINED_EXCESS for v in ex_ln], "the LayerNorm model did not train")
    if not reason and not all(finite(a) and finite(b) for a, b in zip(r_mean, r_var)):
        reason = "a BatchNorm run gave no batch statistics (diverged before its second half?)"
    if reason:
        return None, {}, reason
    worse, strong, per_seed = [], [], []
    for el, eb, rm, rv in zip(ex_ln, ex_bn, r_mean, r_var):
        if not (finite(el) and finite(eb)):
            worse.append(None)
            strong.append(None)
            per_seed.append(None)
            continue
        worse.append(eb > el + max(PARITY_ABS, PARITY_REL * abs(el)))
        strong.append(rm > STRONG and rv > STRONG)
        per_seed.append(worse[-1] and strong[-1])
    passed, details, reason = majority(per_seed, "the losses")
    return passed, {"worse_by_seed": worse, "deviates_by_seed": strong, "holds_by_seed": per_seed, **details}, reason


@register(
    "batchnorm-training",
    claim="In a Transformer, BatchNorm in place of LayerNorm trains worse, and its batch statistics deviate strongly "
    "from its running statistics during training.",
    source="Shen et al. 2020, PowerNorm: Rethinking Batch Normalization in Transformers, arXiv:2003.07845 (section "
    "3, Fig. 2-3: batch vs running statistics in training; Table 1: BatchNorm vs LayerNorm)",
    config={
        "lr": 1e-3,
        "language": BN_LANGUAGE,
        "default": {"layers": 4, "steps": 300, "seeds": 3},
        "quick": {"layers": 2, "steps": 12, "seeds": 2},
    },
    suite="extended",
)
def batchnorm_training(ctx: Context) -> Result:
    """Shen et al. train Post-LN Transformers (fairseq's IWSLT/WMT setups) with BatchNorm in place of LayerNorm:
    BLEU drops, and the batch mean and variance fluctuate far from the running statistics (far more than in a
    ResNet on CIFAR-10), which inference then uses. Scaled here: Post-LN (the paper's placement), 4 layers, d = 32,
    Adam lr 1e-3 with warmup 10% then cosine (where shallow Post-LN trains in depth-sweep), 300 steps, 3 seeds;
    BatchNorm over the batch and sequence positions (B x T = 256 samples per channel, momentum 0.1) in every norm
    slot; validation in eval mode, i.e. with the running statistics, as at inference. The i.i.d. reference stands
    in for the paper's CV baseline: well-behaved batch statistics deviate only by sampling noise. (In a causal LM
    the batch statistics also mix future positions into each one during training; eval mode does not.)

    Changed after the runs at --seed 0, 1, 2 (written before the rerun, docs/lab-notes.md): on the lab's Markov
    language every row of every batch is a window of one stationary chain, so batches are alike and the deviation
    was 0.4-1.1x the i.i.d. level at all 9 seeds: the setup could not show the mechanism the paper names, the
    variety of NLP batches. The batches are now padded sentences (BN_LANGUAGE, SentenceMixture): each row one
    sentence from one of 4 sources with their own 7 tokens and frequencies 8:4:2:1 (the last source's tokens are
    rare), of a length uniform on 4..33 tokens, padded with token 0, which attention and the BatchNorm statistics
    leave out (the padding mask; fairseq-style NLP BatchNorms mask padding too). Both arms train on it."""
    s = settings(ctx)
    steps, layers = s["steps"], s["layers"]
    seeds = seed_list(ctx, s["seeds"])
    arms = {
        "layernorm": ({"placement": "post", "n_layers": layers, "norm": "layernorm"}, {}),
        "batchnorm": ({"placement": "post", "n_layers": layers, "norm": "batchnorm"}, {}),
    }
    ctx.progress(f"{len(arms) * len(seeds)} runs of {steps} steps")
    train = {"steps": steps, "lr": s["lr"], "warmup": max(1, steps // 10)}
    keys, tasks = grid_tasks(ctx, {"layernorm": arms["layernorm"]}, seeds, train, language=s["language"])
    bn_keys, bn_tasks = grid_tasks(
        ctx,
        {"batchnorm": arms["batchnorm"]},
        seeds,
        train,
        probe=f"{__name__}:batch_stats_probe",
        language=s["language"],
    )
    runs = dict(zip(keys + bn_keys, ctx.map(language_task, tasks + bn_tasks)))
    ex = {a: seed_values(runs, a, seeds, "excess") for a in arms}
    ratios = [deviation_ratios(runs[("batchnorm", sd)].get("probe")) for sd in seeds]
    r_mean, r_var = [r[0] for r in ratios], [r[1] for r in ratios]
    passed, extra, reason = batchnorm_verdict(ex["layernorm"], ex["batchnorm"], r_mean, r_var)
    names = {"layernorm": "LayerNorm", "batchnorm": "BatchNorm"}
    figures = []
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        plot_curves(axes[0], runs, list(arms), seeds, steps, names)
        axes[0].set_xlabel("step (line style: seed)")
        axes[0].set_ylabel("train loss")
        axes[0].legend(fontsize=8)
        for k, sd in enumerate(seeds):
            probe = runs[("batchnorm", sd)].get("probe") or {}
            rows = probe.get("per_layer_ratio") or []
            for j, what in enumerate(("mean", "var")):
                vals = [nan(r[j]) for r in rows]
                axes[1].plot(
                    range(len(vals)),
                    vals,
                    "o" + SEED_STYLES[k % len(SEED_STYLES)],
                    color=f"C{j + 2}",
                    lw=1,
                    label=f"{what} deviation" if k == 0 else None,
                )
        axes[1].axhline(STRONG, color="r", lw=0.5, ls="--", label=f"'strong' ({STRONG:g}x i.i.d.)")
        axes[1].axhline(1.0, color="gray", lw=0.5, ls=":", label="i.i.d. samples")
        axes[1].set_yscale("log")
        axes[1].set_xlabel("BatchNorm layer (line style: seed)")
        axes[1].set_ylabel("batch vs running statistics / i.i.d.")
        axes[1].legend(fontsize=7)
        figures = save(plt, fig, ctx, "batchnorm_training.png")
    metrics = {
        "criterion": CRITERIA["batchnorm-training"],
        "steps": steps,
        "layers": layers,
        "seeds": seeds,
        "per_seed": {
            **{f"{names[a]} excess": ex[a] for a in arms},
            "BatchNorm mean deviation / i.i.d.": r_mean,
            "BatchNorm variance deviation / i.i.d.": r_var,
        },
        "batch_statistics": {f"seed {sd}": runs[("batchnorm", sd)].get("probe") for sd in seeds},
        "setup": f"Shen et al. 2020 at d = 32: Post-LN, {layers} layers, Adam lr {s['lr']:g}, warmup "
        f"{train['warmup']} then cosine, {steps} steps, {len(seeds)} seeds, B x T = {BATCH} x {SEQ} positions per "
        f"batch of padded sentences ({s['language']}; unpadded positions per step: "
        f"{fmt_seeds([(runs[('batchnorm', sd)].get('probe') or {}).get('samples_per_step') for sd in seeds])}); "
        "validation with the running statistics",
        **extra,
    }
    line = (
        f"Excess loss by seed ({len(seeds)}): LayerNorm {fmt_seeds(ex['layernorm'])}, BatchNorm "
        f"{fmt_seeds(ex['batchnorm'])}; BatchNorm's batch-vs-running deviation over the i.i.d. level: mean "
        f"{fmt_seeds(r_mean)}, variance {fmt_seeds(r_var)} (claim holds at {extra.get('seeds_agreeing', 'n/a')} "
        "seeds)."
    )
    return Result(verdict=verdict_from(passed), metrics=metrics, figures=figures, summary=line, reason=reason)
