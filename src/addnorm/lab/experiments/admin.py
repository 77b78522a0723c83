"""Admin's output change under a small weight perturbation (Liu et al. 2020, Section 4), repeated scaled down:
Post-LN's against Pre-LN's over depths, in the experiment admin-output-change.

Evidence: one unit per init (6 per lab seed, ``--seed * 1000 + k``), Post-LN and Pre-LN of init k from the same
seed; each rule of :data:`RULES` holds when the bootstrap 95% interval of its units' mean clears it, and the runs of
several lab seeds pool. The positive control is Admin's mechanism: Post-LN's output depends on its residual branches
far more than Pre-LN's (the branch's share of the sum it is added to, in the deeper half of the deepest stack).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from addnorm.lab.core import Change, Context, Result, experiment
from addnorm.lab.evidence import Rule
from addnorm.lab.experiments.init_time import (
    Stack,
    all_finite_positive,
    average,
    column_means,
    init_seeds,
    judged,
    loglog_slope,
    require_pyplot,
    save_figure,
    sizes,
)


# -------------------------------------------------------------------------------------- admin-output-change
def admin_change_task(
    *,
    placement: str,
    depth: int,
    seed: int,
    draws: int,
    eps: float,
    d: int,
    d_ff: int,
    heads: int,
    batch: int,
    seq: int,
    device: str = "cpu",
) -> dict:
    """Mean over ``draws`` of ||F(x; W + dW) - F(x; W)||^2 / ||F(x; W)||^2, dW = eps * std(W) * N(0, 1) on every
    weight matrix; and, on the unperturbed model, each sublayer's branch share ||f(x)||^2 / ||x + f(x)||^2 (f the
    residual branch's output, x the stream it is added to: Admin's dependency on the residual branch)."""
    torch.manual_seed(seed)
    model = Stack(layers=depth, d=d, d_ff=d_ff, heads=heads, placement=placement).to(device)
    x = torch.randn(batch, seq, d).to(device)
    weights = [p for p in model.parameters() if p.dim() == 2]
    vals, share, inputs = [], [], {}

    def grab_input(residual, args):
        inputs[id(residual)] = args[0]

    def grab_branch(residual, sublayer, args, out):
        stream = inputs[id(residual)]
        share.append((out.pow(2).sum() / (stream + out).pow(2).sum()).item())

    # the stream enters the Residual; what is added to it leaves its sublayer (for Pre-LN, after the input norm)
    hooks = [r.register_forward_pre_hook(grab_input) for r in model.subs]
    hooks += [r.sublayer.register_forward_hook(functools.partial(grab_branch, r)) for r in model.subs]
    with torch.no_grad():
        f = model(x)[0]
        for h in hooks:
            h.remove()
        base = [w.clone() for w in weights]
        for _ in range(draws):
            for w, w0 in zip(weights, base):
                w.copy_(w0 + eps * w0.std() * torch.randn_like(w0))
            vals.append(((model(x)[0] - f).pow(2).mean() / f.pow(2).mean()).item())
    return {"change": average(vals), "branch_share": share}


# Admin's O(N) for Post-LN against O(log N) for Pre-LN, as log-log slopes of the change against N over 6-48 layers:
# linear has slope 1, log N about 0.4; the criterion fixed before the first run put "about linear" at >= 0.7 and
# "about log" at <= 0.6.
LINEAR, LOG = 0.7, 0.6
# The positive control: Post-LN's branch share (deeper half of the deepest stack) this many times Pre-LN's. Admin's
# Fig. 4: Post-LN's output depends on every branch about equally (share ~1/2), Pre-LN's on each deep branch little.
DEPENDS = 2.0

RULES = (
    Rule(
        name="post-depends-on-branches",
        statistic="Post-LN's / Pre-LN's mean branch share ||f||^2/||x + f||^2 over the deeper half of the sublayers "
        "at the largest depth",
        op=">",
        threshold=DEPENDS,
        role="positive",
    ),
    Rule(name="post-about-linear", statistic="Post-LN's log-log slope of the change vs N", op=">", threshold=LINEAR),
    Rule(name="pre-about-log", statistic="Pre-LN's log-log slope of the change vs N", op="<", threshold=LOG),
    Rule(name="post-above-pre", statistic="Post-LN's slope minus Pre-LN's (paired)", op=">", threshold=0.0),
)

CHANGES = (
    Change(
        date="2026-12-02",
        what="slopes judged as the bootstrap 95% interval of per-init slopes (was: slopes of the init-averaged "
        "change, and Post-LN above Pre-LN in 5 of 6 inits); a positive control (Post-LN's dependency on its "
        "branches, Admin's mechanism) replaces 'every change finite and non-zero', which could not fail",
        showed="reproduced at --seed 0 to 4 (init-averaged slopes Post-LN 1.14-1.17, Pre-LN 0.30-0.37; per-init "
        "Post-LN slopes 0.23-1.77)",
        reason="one verdict per claim from all its evidence, pooled over lab seeds, with a control that can fail",
    ),
)


def admin_units(
    *,
    depths: Sequence[int],
    post_change: Sequence[Sequence[float]],
    pre_change: Sequence[Sequence[float]],
    post_share: Sequence[Sequence[float]],
    pre_share: Sequence[Sequence[float]],
) -> dict[str, list[float | None]]:
    """One value per init and rule of :data:`RULES`. ``*_change[i][j]``: relative output change of init i at depth
    ``depths[j]``; ``*_share[i]``: init i's branch share per sublayer at the largest depth."""
    n = len(post_change)
    if n == 0 or any(len(a) != n for a in (pre_change, post_share, pre_share)):
        raise ValueError("admin_units needs the same (non-zero) number of inits in every argument")

    def slope(row):
        return loglog_slope(depths, row) if all_finite_positive(row) else None

    def deep_half(row):
        half = list(row[len(row) // 2 :])
        return average(half) if half and all_finite_positive(half) else None

    post_s, pre_s = [slope(r) for r in post_change], [slope(r) for r in pre_change]
    dep = [
        None if a is None or b is None else a / b for a, b in zip(map(deep_half, post_share), map(deep_half, pre_share))
    ]
    return {
        "post-depends-on-branches": dep,
        "post-about-linear": post_s,
        "pre-about-log": pre_s,
        "post-above-pre": [None if a is None or b is None else a - b for a, b in zip(post_s, pre_s)],
    }


@experiment(
    "admin-output-change",
    claim="A small random perturbation of the weights changes a Post-LN model's output about linearly in its "
    "depth N, a Pre-LN model's only about like log N (Post-LN depends heavily on its residual branches).",
    source="Liu et al. 2020, Understanding the Difficulty of Training Transformers, arXiv:2004.08249 (Section 4: "
    "output change under a parameter perturbation, O(N) for Post-LN vs O(log N) for Pre-LN)",
    config={
        "default": {
            "depths": [6, 12, 24, 48],
            "inits": 6,
            "draws": 4,
            "eps": 0.01,
            "d": 64,
            "d_ff": 128,
            "heads": 2,
            "batch": 8,
            "seq": 16,
        },
        "quick": {
            "depths": [4, 8, 16],
            "inits": 6,
            "draws": 2,
            "eps": 0.01,
            "d": 64,
            "d_ff": 128,
            "heads": 2,
            "batch": 2,
            "seq": 8,
        },
    },
    criterion="change(N) = mean ||F(x; W + dW) - F(x; W)||^2 / mean ||F(x; W)||^2 with dW = eps * std(W) * "
    "N(0, 1) on every weight matrix (eps 0.01), averaged over draws; units: one per init (6 per lab seed), Post-LN "
    "and Pre-LN paired, each rule judged by the bootstrap 95% interval of the units' mean. Reproduced iff the "
    "log-log slope of change vs N is > 0.7 for Post-LN (about linear), < 0.6 for Pre-LN (log N from 6 to 48 has "
    "slope ~0.4), and Post-LN's exceeds Pre-LN's.",
    precondition="Positive control: Post-LN's output depends on its residual branches more than 2x as much as "
    "Pre-LN's (mean branch share ||f||^2 / ||x + f||^2 over the deeper half of the sublayers at the largest depth): "
    "Admin's mechanism for the claim, else inconclusive.",
    rules=RULES,
    fixed="2026-12-02 at 8821e08",
    changes=CHANGES,
)
def admin_output_change(ctx: Context) -> Result:
    """Admin's analysis is of the output change of an N-layer stack at init (its experiments use 6- and 18-layer
    encoder-decoders on WMT14); here encoder-only stacks of 6-48 layers, d 64, FFN 128, 2 heads, Xavier."""
    s = sizes(ctx)
    depths, seeds, dev = s["depths"], init_seeds(ctx, s["inits"]), str(ctx.device)
    arms = ("post", "pre")
    names = {"post": "Post-LN", "pre": "Pre-LN"}
    ctx.progress(f"{len(arms) * len(depths) * len(seeds)} perturbed models")
    hp = {k: s[k] for k in ("draws", "eps", "d", "d_ff", "heads", "batch", "seq")}
    tasks = [dict(placement=p, depth=L, seed=sd, device=dev, **hp) for p in arms for sd in seeds for L in depths]
    out = iter(ctx.map(admin_change_task, tasks))
    res = {p: [[next(out) for _ in depths] for _ in seeds] for p in arms}  # [arm][init][depth]
    change = {p: [[r["change"] for r in row] for row in res[p]] for p in arms}
    share = {p: [row[-1]["branch_share"] for row in res[p]] for p in arms}
    values = admin_units(
        depths=depths,
        post_change=change["post"],
        pre_change=change["pre"],
        post_share=share["post"],
        pre_share=share["pre"],
    )
    ev, verdict, reason, table = judged(RULES, values, seeds, ctx.seed)
    plt = require_pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    mean = {p: column_means(change[p]) for p in arms}
    for p, color in (("post", "tab:blue"), ("pre", "tab:orange")):
        for i, row in enumerate(change[p]):
            ax.loglog(
                depths,
                row,
                "o-",
                color=color,
                lw=0.8,
                ms=3,
                alpha=0.5,
                label=f"{names[p]} (one line per init)" if i == 0 else None,
            )
        ax.loglog(depths, mean[p], "s-", color=color, lw=2, label=f"{names[p]} mean")
    ax.loglog(depths, [mean["post"][0] * L / depths[0] for L in depths], "k--", lw=1, label="~N")
    ax.loglog(depths, [mean["pre"][0] * math.log(L) / math.log(depths[0]) for L in depths], "k:", lw=1, label="~log N")
    ax.set_xlabel("layers N")
    ax.set_ylabel("relative output change")
    ax.set_title(f"output change after a {s['eps']:.0%} weight perturbation")
    ax.legend(fontsize=8)
    f1 = save_figure(fig, ctx, "output_change.png")
    per_seed = {f"{names[p]} slope": values["post-about-linear" if p == "post" else "pre-about-log"] for p in arms}
    per_seed["Post-LN / Pre-LN branch share"] = values["post-depends-on-branches"]

    def est(name):
        e = table[name]
        return "n/a" if e["estimate"] is None else f"{e['estimate']:.2f} [{e['ci95'][0]:.2f}, {e['ci95'][1]:.2f}]"

    return Result(
        verdict=verdict,
        metrics={
            "depths": depths,
            "seeds": seeds,
            "per_seed": per_seed,
            "rules": table,
            "relative_output_change_init_mean": mean,
            "post_ln_slope_of_init_mean": loglog_slope(depths, mean["post"]),
            "pre_ln_slope_of_init_mean": loglog_slope(depths, mean["pre"]),
        },
        figures=[f1],
        summary=f"Admin's output-change analysis on encoder-only stacks, N {depths[0]}-{depths[-1]}; log-log slope "
        f"of output change vs N (mean of {len(seeds)} per-init slopes, 95% interval): Post-LN "
        f"{est('post-about-linear')} (linear: 1), Pre-LN {est('pre-about-log')} (log N: ~0.4). Control: Post-LN's "
        f"branch share over Pre-LN's {est('post-depends-on-branches')}.",
        reason=reason,
        evidence=ev,
    )
