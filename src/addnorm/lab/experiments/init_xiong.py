"""Xiong et al. 2020's gradients at initialization, repeated scaled down: Theorem 1 (the last FFN layer's gradient
against depth), Lemma 2 (the Pre-LN residual stream's bounds) and Fig. 3 (per-layer gradients in the decoder of an
encoder-decoder), in the experiment xiong-init-gradients.

The method the three paper replications share (at least 6 inits, paired across arms; pure ``*_verdict``
criteria with 5 of 6 inits agreeing), their cost and their verdicts over ``--seed 0`` to ``--seed 4`` are in
:mod:`init_time`'s docstring.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

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


def top_bottom_ratio(profile: Sequence[float]) -> float:
    """Mean of the top third of a per-layer profile over the mean of its bottom third (at least one layer each):
    a statistic over several layers, so one odd layer (next to the embedding or the head) does not decide it."""
    k = max(1, len(profile) // 3)
    return average(profile[-k:]) / average(profile[:k])


# -------------------------------------------------------------------------------------- xiong-init-gradients
def xiong_stack_task(
    *, placement: str, depth: int, seed: int, d: int, batch: int, seq: int, vocab: int, device: str = "cpu"
) -> dict:
    """Theorem 1's setting: one head with W_Q = W_K = 0, d x d ReLU FFN, Xavier, no biases. Returns every layer's
    FFN W2 gradient norm and the Pre-LN quantity of Lemma 2, ||x_l||^2 / d, after every layer."""
    torch.manual_seed(seed)
    model = Stack(layers=depth, d=d, d_ff=d, placement=placement, uniform_attention=True).to(device)
    head = nn.Linear(d, vocab, bias=False).to(device)
    nn.init.xavier_normal_(head.weight)
    x0 = torch.randn(batch, seq, d).to(device)  # E||x_0||^2 = d; drawn on the CPU: the same numbers anywhere
    target = torch.randint(0, vocab, (batch, seq)).to(device)
    out, streams = model(x0)
    nn.functional.cross_entropy(head(out).flatten(0, 1), target.flatten()).backward()
    return {
        "ffn_w2_grad": [w.grad.norm().item() for w in model.ffn_out_weights()],
        "sq_norm_over_d": [z.pow(2).sum(-1).mean().item() / d for z in streams],
    }


def xiong_encdec_task(
    *,
    placement: str,
    seed: int,
    layers: int,
    d: int,
    d_ff: int,
    heads: int,
    batch: int,
    seq: int,
    vocab: int,
    device: str = "cpu",
) -> dict:
    """Fig. 3's setting: an encoder-decoder (original Transformer: ReLU, Xavier, sinusoidal positions, sqrt(d)
    embeddings) at init, next-token loss on random tokens. Returns the FFN output weight's gradient norm per layer
    of the decoder and of the encoder."""
    from addnorm.nn import TransformerEncoderDecoder
    from addnorm.nn.config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(
        vocab_size=vocab,
        d_model=d,
        n_layers=layers,
        n_heads=heads,
        d_ff=d_ff,
        norm="layernorm",
        placement=placement,
        ffn="relu",
        positional="sinusoidal",
        init="xavier",
        embed_scale=True,
        final_norm=None if placement == "pre" else False,
        max_seq_len=seq + 1,
        backend="torch",
    )
    model = TransformerEncoderDecoder(config).to(device)
    src = torch.randint(0, vocab, (batch, seq)).to(device)
    tgt = torch.randint(0, vocab, (batch, seq + 1)).to(device)
    logits = model(src, tgt[:, :-1])
    nn.functional.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten()).backward()
    grad = lambda blocks: [b.ffn.sublayer.fc_out.weight.grad.norm().item() for b in blocks]  # noqa: E731
    return {"decoder": grad(model.decoder_blocks), "encoder": grad(model.encoder_blocks)}


def lemma2_in_bounds(sq_norm_over_d: Sequence[float], slack: float = 0.1) -> bool:
    """Pre-LN: ||x_l||^2 / d within [(1 + l/2)(1 - slack), (1 + 3l/2)(1 + slack)] for l = 1..L (x_0 has 1)."""
    return all(
        (1 + l / 2) * (1 - slack) <= v <= (1 + 1.5 * l) * (1 + slack) for l, v in enumerate(sq_norm_over_d, start=1)
    )


def xiong_verdict(
    *,
    depths: Sequence[int],
    pre_last: Sequence[Sequence[float]],
    post_last: Sequence[Sequence[float]],
    pre_profile: Sequence[float],
    post_profile: Sequence[float],
    pre_norm_in_bounds: bool,
) -> tuple[bool | None, dict]:
    """``*_last[i][j]``: last-layer FFN W2 gradient norm of init i at depth ``depths[j]`` (Theorem 1);
    ``*_profile[i]``: top-third / bottom-third ratio of init i's decoder gradient profile (Fig. 3);
    ``pre_norm_in_bounds``: the init-averaged Pre-LN stream inside Lemma 2's bounds at every layer and depth.

    Theorem 1 bounds the expected gradient, so its slopes are fitted to the init-averaged gradients; the paired
    per-init comparison (Pre-LN's slope below Post-LN's) and the profiles must hold in 5 of 6 inits."""
    n = len(pre_last)
    if n == 0 or len(post_last) != n or len(pre_profile) != n or len(post_profile) != n:
        raise ValueError("xiong_verdict needs the same (non-zero) number of inits in every argument")
    if not all_finite_positive(flatten(pre_last) + flatten(post_last) + list(pre_profile) + list(post_profile)):
        return None, {"note": "non-finite or zero gradients"}
    pre_slope, post_slope = loglog_slope(depths, column_means(pre_last)), loglog_slope(depths, column_means(post_last))
    pre_slopes = [loglog_slope(depths, row) for row in pre_last]
    post_slopes = [loglog_slope(depths, row) for row in post_last]
    k_slope, ok_slope = count_agree([a < b for a, b in zip(pre_slopes, post_slopes)])
    k_post, ok_post = count_agree([r > 1.5 for r in post_profile])
    k_pre, ok_pre = count_agree([0.5 <= r <= 2 for r in pre_profile])
    k_pair, ok_pair = count_agree([a > b for a, b in zip(post_profile, pre_profile)])
    need = f"{min_agree(n)}/{n}"
    checks = {
        "pre_ln_last_grad_slope_(init_mean)_in_[-0.75,-0.25]": -0.75 <= pre_slope <= -0.25,
        "post_ln_last_grad_slope_(init_mean)_in_[-0.25,0.25]": -0.25 <= post_slope <= 0.25,
        f"pre_ln_slope_<_post_ln_slope_in_>={need}_inits": ok_slope,
        "pre_ln_stream_in_lemma2_bounds": bool(pre_norm_in_bounds),
        f"post_ln_decoder_top/bottom_>_1.5_in_>={need}_inits": ok_post,
        f"pre_ln_decoder_top/bottom_in_[0.5,2]_in_>={need}_inits": ok_pre,
        f"post_ln_decoder_top/bottom_>_pre_ln's_in_>={need}_inits": ok_pair,
    }
    return all(checks.values()), {
        "checks": checks,
        "pre_ln_slope": pre_slope,
        "post_ln_slope": post_slope,
        "inits_agreeing": {
            "slope_pre_below_post": k_slope,
            "post_profile_rises": k_post,
            "pre_profile_flat": k_pre,
            "post_profile_above_pre": k_pair,
            "of": n,
        },
    }


@experiment(
    "xiong-init-gradients",
    claim="At initialization the last FFN layer's gradient does not depend on depth L for Post-LN and decays like "
    "L^(-1/2) for Pre-LN, whose residual stream satisfies (1 + l/2) d <= E||x_l||^2 <= (1 + 3l/2) d; in the "
    "decoder of an encoder-decoder, Post-LN's per-layer gradients grow toward the output while Pre-LN's stay "
    "about flat.",
    source="Xiong et al. 2020, On Layer Normalization in the Transformer Architecture, arXiv:2002.04745 (Lemma 2, "
    "Theorem 1, Fig. 3); Liu et al. 2020, Understanding the Difficulty of Training Transformers, arXiv:2004.08249 "
    "(the same per-layer gradient measurement in a 6-6 encoder-decoder)",
    config={
        "default": {
            "depths": [6, 12, 24, 48],
            "inits": 6,
            "d": 64,
            "batch": 8,
            "seq": 16,
            "vocab": 64,
            "encdec": {"layers": 6, "d": 64, "d_ff": 128, "heads": 4, "batch": 8, "seq": 16, "vocab": 64},
        },
        "quick": {
            "depths": [4, 8, 16],
            "inits": 6,
            "d": 64,
            "batch": 2,
            "seq": 8,
            "vocab": 64,
            "encdec": {"layers": 6, "d": 64, "d_ff": 128, "heads": 4, "batch": 2, "seq": 8, "vocab": 64},
        },
        "assumptions": "Theorem 1 part: one head, W_Q = W_K = 0, d x d FFN with ReLU, Xavier normal, no biases; "
        "Fig. 3 part: 6-6 encoder-decoder, 4 heads, ReLU FFN 2d, Xavier, sinusoidal",
    },
    criterion="Theorem 1 (last-layer FFN W2 gradient vs L, Theorem 1's model): log-log slope of the init-averaged "
    "gradient in [-0.75, -0.25] for Pre-LN and in [-0.25, 0.25] for Post-LN, and Pre-LN's slope below Post-LN's in "
    ">= 5 of 6 inits (paired); Lemma 2: the init-averaged Pre-LN ||x_l||^2/d inside [1 + l/2, 1 + 3l/2] (10% "
    "slack) at every layer and depth. Fig. 3 (FFN output-weight gradient per decoder layer of a 6-6 "
    "encoder-decoder; profile statistic = mean of the top third of layers / mean of the bottom third): Post-LN > "
    "1.5, Pre-LN in [0.5, 2], and Post-LN's above Pre-LN's, each in >= 5 of 6 inits. Reproduced iff all hold.",
    precondition="every gradient finite and non-zero (else inconclusive)",
)
def xiong_init_gradients(ctx: Context) -> Result:
    s = sizes(ctx)
    depths, seeds, dev = s["depths"], init_seeds(ctx, s["inits"]), str(ctx.device)
    arms = ("post", "pre")
    ctx.progress(f"Theorem 1 model: {len(arms) * len(depths) * len(seeds)} inits x depths")
    common = {k: s[k] for k in ("d", "batch", "seq", "vocab")}
    tasks = [dict(placement=p, depth=L, seed=sd, device=dev, **common) for p in arms for sd in seeds for L in depths]
    out = iter(ctx.map(xiong_stack_task, tasks))
    grads = {p: [[next(out) for _ in depths] for _ in seeds] for p in arms}  # [arm][init][depth] -> task result
    last = {p: [[r["ffn_w2_grad"][-1] for r in row] for row in grads[p]] for p in arms}
    sq_mean = {
        L: column_means([grads["pre"][i][j]["sq_norm_over_d"] for i in range(len(seeds))]) for j, L in enumerate(depths)
    }
    in_bounds = all(lemma2_in_bounds(sq_mean[L]) for L in depths)
    ctx.progress("Fig. 3 model: 6-6 encoder-decoder")
    tasks = [dict(placement=p, seed=sd, device=dev, **s["encdec"]) for p in arms for sd in seeds]
    out = iter(ctx.map(xiong_encdec_task, tasks))
    encdec = {p: [next(out) for _ in seeds] for p in arms}
    profile = {p: [top_bottom_ratio(r["decoder"]) for r in encdec[p]] for p in arms}
    passed, details = xiong_verdict(
        depths=depths,
        pre_last=last["pre"],
        post_last=last["post"],
        pre_profile=profile["pre"],
        post_profile=profile["post"],
        pre_norm_in_bounds=in_bounds,
    )

    plt = require_pyplot()
    names = {"post": "Post-LN", "pre": "Pre-LN"}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = (("post", "decoder"), ("pre", "decoder"), ("post", "encoder"))
    for ax, (p, side) in zip(axes, panels):
        for r in encdec[p]:
            prof = r[side]
            ax.plot(range(1, len(prof) + 1), [v / prof[0] for v in prof], "o-", lw=1, ms=3, alpha=0.7)
        ax.axhline(1.0, color="k", lw=0.8, ls=":")
        ax.set_title(f"{names[p]} {side} ({len(seeds)} inits)")
        ax.set_xlabel("layer")
        ax.set_yscale("log")
    axes[0].set_ylabel("FFN W2 grad norm / layer 1")
    f1 = save_figure(fig, ctx, "encdec_grad_profile.png")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for p, color in (("post", "tab:blue"), ("pre", "tab:orange")):
        for i, row in enumerate(last[p]):
            axes[0].loglog(
                depths,
                row,
                "o-",
                color=color,
                lw=0.8,
                ms=3,
                alpha=0.5,
                label=f"{names[p]} (one line per init)" if i == 0 else None,
            )
    mean_pre = column_means(last["pre"])
    axes[0].loglog(depths, [mean_pre[0] * math.sqrt(depths[0] / L) for L in depths], "k--", lw=1, label="~L^(-1/2)")
    axes[0].set_xlabel("layers L")
    axes[0].set_ylabel("last-layer ||dLoss/dW2||")
    axes[0].set_title("Theorem 1: last-layer gradient vs depth")
    axes[0].legend(fontsize=8)
    L = depths[-1]
    ls = list(range(1, L + 1))
    axes[1].fill_between(ls, [1 + l / 2 for l in ls], [1 + 1.5 * l for l in ls], alpha=0.2, label="Lemma 2 bounds")
    for i in range(len(seeds)):
        axes[1].plot(ls, grads["pre"][i][-1]["sq_norm_over_d"], lw=0.8, alpha=0.6)
    axes[1].set_xlabel("layer l")
    axes[1].set_ylabel("||x_l||^2 / d")
    axes[1].set_title(f"Pre-LN residual stream, L={L}, one line per init")
    axes[1].legend()
    f2 = save_figure(fig, ctx, "depth_scaling.png")
    per_seed = {f"{names[p]} last-grad slope": [loglog_slope(depths, row) for row in last[p]] for p in arms}
    per_seed.update({f"{names[p]} dec top/bottom": profile[p] for p in arms})
    per_seed["Post-LN enc top/bottom"] = [top_bottom_ratio(r["encoder"]) for r in encdec["post"]]
    return Result(
        verdict=verdict_from(passed),
        metrics={
            "depths": depths,
            "seeds": seeds,
            "per_seed": per_seed,
            "last_layer_grad_init_mean": {p: column_means(last[p]) for p in arms},
            "decoder_profile_init_mean": {p: column_means([r["decoder"] for r in encdec[p]]) for p in arms},
            "encoder_profile_init_mean": {p: column_means([r["encoder"] for r in encdec[p]]) for p in arms},
            "pre_ln_sq_norm_over_d_at_last_layer": {str(L): sq_mean[L][-1] for L in depths},
            "lemma2_bounds_at_last_layer": {str(L): [1 + L / 2, 1 + 1.5 * L] for L in depths},
            **details,
        },
        figures=[f1, f2],
        summary=f"Theorem 1 (mean of {len(seeds)} inits, L {depths[0]}-{depths[-1]}): last-layer gradient slope "
        f"Pre-LN {details.get('pre_ln_slope', float('nan')):.2f} (theory -0.5), Post-LN "
        f"{details.get('post_ln_slope', float('nan')):.2f} (theory 0). Fig. 3 (6-6 encoder-decoder, decoder "
        f"top/bottom third): Post-LN {min(profile['post']):.2f}-{max(profile['post']):.2f}, Pre-LN "
        f"{min(profile['pre']):.2f}-{max(profile['pre']):.2f} over inits",
        reason=details.get("note", ""),
    )
