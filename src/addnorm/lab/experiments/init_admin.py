"""Admin's output change under a small weight perturbation (Liu et al. 2020, Section 4), repeated scaled down:
Post-LN's against Pre-LN's over depths, in the experiment admin-output-change.

The method the three paper replications share (at least 6 inits, paired across arms; pure ``*_verdict``
criteria with 5 of 6 inits agreeing), their cost and their verdicts over ``--seed 0`` to ``--seed 4`` are in
:mod:`init_time`'s docstring.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from addnorm.lab.core import Context, Result, experiment, verdict_from
from addnorm.lab.experiments.init_time import (
    Stack,
    all_finite_positive,
    average,
    column_means,
    count_agree,
    flatten,
    init_seeds,
    loglog_slope,
    min_agree,
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
    weight matrix."""
    torch.manual_seed(seed)
    model = Stack(layers=depth, d=d, d_ff=d_ff, heads=heads, placement=placement).to(device)
    x = torch.randn(batch, seq, d).to(device)
    weights = [p for p in model.parameters() if p.dim() == 2]
    vals = []
    with torch.no_grad():
        f = model(x)[0]
        base = [w.clone() for w in weights]
        for _ in range(draws):
            for w, w0 in zip(weights, base):
                w.copy_(w0 + eps * w0.std() * torch.randn_like(w0))
            vals.append(((model(x)[0] - f).pow(2).mean() / f.pow(2).mean()).item())
    return {"change": average(vals)}


def output_change_verdict(
    *, depths: Sequence[int], post_change: Sequence[Sequence[float]], pre_change: Sequence[Sequence[float]]
) -> tuple[bool | None, dict]:
    """``*_change[i][j]``: relative output change of init i at depth ``depths[j]``. Admin's O(N) / O(log N) are
    statements about the expected change, so the slopes are fitted to the init-averaged changes; Post-LN's slope
    must also exceed Pre-LN's init by init (paired) in 5 of 6 inits."""
    n = len(post_change)
    if n == 0 or len(pre_change) != n:
        raise ValueError("output_change_verdict needs the same (non-zero) number of inits for both arms")
    if not all_finite_positive(flatten(post_change) + flatten(pre_change)):
        return None, {"note": "non-finite or zero change"}
    post_slope = loglog_slope(depths, column_means(post_change))
    pre_slope = loglog_slope(depths, column_means(pre_change))
    post_slopes = [loglog_slope(depths, row) for row in post_change]
    pre_slopes = [loglog_slope(depths, row) for row in pre_change]
    k, ok = count_agree([a > b for a, b in zip(post_slopes, pre_slopes)])
    checks = {
        "post_ln_slope_(init_mean)_>=_0.7_(about_linear)": post_slope >= 0.7,
        "pre_ln_slope_(init_mean)_<=_0.6_(about_log)": pre_slope <= 0.6,
        f"post_ln_slope_>_pre_ln's_in_>={min_agree(n)}/{n}_inits_(paired)": ok,
    }
    return all(checks.values()), {
        "checks": checks,
        "post_ln_slope": post_slope,
        "pre_ln_slope": pre_slope,
        "inits_agreeing": {"post_slope_above_pre": k, "of": n},
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
    "N(0, 1) on every weight matrix (eps 0.01), averaged over draws; 6 inits. Reproduced iff the log-log slope of "
    "the init-averaged change vs N is >= 0.7 for Post-LN (about linear), <= 0.6 for Pre-LN (log N from 6 to 48 "
    "has slope ~0.4), and Post-LN's per-init slope exceeds Pre-LN's (paired) in >= 5 of 6 inits.",
    precondition="every change finite and non-zero (else inconclusive)",
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
    change = {p: [[next(out)["change"] for _ in depths] for _ in seeds] for p in arms}  # [arm][init][depth]
    passed, details = output_change_verdict(depths=depths, post_change=change["post"], pre_change=change["pre"])

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
    per_seed = {f"{names[p]} slope": [loglog_slope(depths, row) for row in change[p]] for p in arms}
    return Result(
        verdict=verdict_from(passed),
        metrics={
            "depths": depths,
            "seeds": seeds,
            "per_seed": per_seed,
            "relative_output_change_init_mean": mean,
            **details,
        },
        figures=[f1],
        summary=f"Admin's output-change analysis on encoder-only stacks, N {depths[0]}-{depths[-1]}; log-log slope "
        f"of output change vs N (mean of {len(seeds)} inits): Post-LN "
        f"{details.get('post_ln_slope', float('nan')):.2f} (linear: 1), Pre-LN "
        f"{details.get('pre_ln_slope', float('nan')):.2f} (log N: ~0.4); per-init Post-LN slopes "
        f"{min(per_seed['Post-LN slope']):.2f}-{max(per_seed['Post-LN slope']):.2f}",
        reason=details.get("note", ""),
    )
