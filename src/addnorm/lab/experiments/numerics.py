"""Numerics: LayerNorm vs RMSNorm, half-precision statistics, BatchNorm vs LayerNorm on sequences.

None of these is evidence for a paper's empirical claim: ``ln-vs-rms`` and ``half-precision-stats`` are
demonstrations (they illustrate the identity RMS(x)^2 = Var(x) + mean(x)^2 and the fp16/bf16 traps of computing
norm statistics, with figures), ``batchnorm-vs-layernorm`` is a sanity check (every one of its checks holds by
construction of batch vs per-token statistics). Each criterion is still a pure ``*_verdict`` function, fixed before
the run and testable on synthetic numbers. Cost: all three ~2 s of CPU at default sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from addnorm.lab.core import Context, Result, experiment, verdict_from
from addnorm.lab.experiments.init_time import require_pyplot, save_figure, sizes
from addnorm.ops.add_norm import layer_norm, rms_norm
from addnorm.reference import stats_naive, stats_two_pass, stats_welford, stats_welford_chan

FP16_MAX = torch.finfo(torch.float16).max  # 65504


# ------------------------------------------------------------------------------------------------- ln-vs-rms
def ln_rms_verdict(offsets: Sequence[float], mean_abs_diff: Sequence[float]) -> tuple[bool | None, dict]:
    """``offsets`` = row mean / row std (ascending, the first 0); ``mean_abs_diff`` = mean |LN(x) - RMS(x)|.

    First order in m = mean/std: LN(x) - RMSNorm(x) = -m + O(m^2), so mean |diff| ~ m as m -> 0."""
    if not all(math.isfinite(v) for v in mean_abs_diff):
        return None, {"note": "non-finite difference"}
    small = [(m, v) for m, v in zip(offsets, mean_abs_diff) if 0 < m <= 0.1]
    checks = {
        "identical_at_zero_mean_(<1e-6)": mean_abs_diff[0] < 1e-6,
        "diff_shrinks_monotonically_as_mean_goes_to_0": all(a < b for a, b in zip(mean_abs_diff, mean_abs_diff[1:])),
        "diff/(mean/std)_in_[0.8,1.25]_for_mean/std<=0.1": bool(small) and all(0.8 <= v / m <= 1.25 for m, v in small),
    }
    return all(checks.values()), {"checks": checks}


@experiment(
    "ln-vs-rms",
    claim="RMS(x)^2 = Var(x) + mean(x)^2, so RMSNorm and LayerNorm agree when the row mean is near 0: their "
    "difference shrinks in proportion to mean/std and vanishes at mean 0.",
    source="the identity RMS(x)^2 = Var(x) + mean(x)^2; Zhang & Sennrich 2019, Root Mean Square Layer "
    "Normalization, arXiv:1910.07467 (RMSNorm drops LayerNorm's re-centering)",
    kind="demonstration",
    config={
        "default": {"d": 256, "rows": 512, "offsets": [0, 1e-4, 1e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3]},
        "quick": {"d": 64, "rows": 64, "offsets": [0, 1e-4, 1e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3]},
    },
    criterion="rows z with exact mean 0 and std 1 (fp64), x = z + m. Reproduced iff mean |LN(x) - RMSNorm(x)| "
    "(no affine, eps 1e-12) is < 1e-6 at m = 0, rises strictly with m, and is within [0.8, 1.25] x m for "
    "0 < m <= 0.1 (the first-order law).",
)
def ln_vs_rms(ctx: Context) -> Result:
    s = sizes(ctx)
    g = torch.Generator().manual_seed(ctx.seed)
    z = torch.randn(s["rows"], s["d"], generator=g, dtype=torch.float64)
    z = z - z.mean(-1, keepdim=True)
    z = z / z.pow(2).mean(-1, keepdim=True).sqrt()  # mean 0, population std 1 exactly (to fp64 rounding)
    z = z.to(ctx.device)
    diffs, max_diffs = [], []
    for m in s["offsets"]:
        x = z + m
        d = layer_norm(x, eps=1e-12, backend="torch") - rms_norm(x, eps=1e-12, backend="torch")
        diffs.append(d.abs().mean().item())
        max_diffs.append(d.abs().max().item())
    passed, details = ln_rms_verdict(s["offsets"], diffs)

    plt = require_pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    pos = [(m, v) for m, v in zip(s["offsets"], diffs) if m > 0]
    ax.loglog([m for m, _ in pos], [v for _, v in pos], "o-", label="mean |LN(x) - RMSNorm(x)|")
    ax.loglog([m for m, _ in pos], [m for m, _ in pos], "k--", lw=1, label="mean / std (first order)")
    ax.set_xlabel("row mean / row std")
    ax.set_ylabel("difference")
    ax.set_title(f"LayerNorm vs RMSNorm, d={s['d']}")
    ax.legend()
    f1 = save_figure(fig, ctx, "ln_vs_rms.png")
    return Result(
        verdict=verdict_from(passed),
        metrics={
            "mean_over_std": s["offsets"],
            "mean_abs_diff": diffs,
            "max_abs_diff": max_diffs,
            "at_zero_mean": diffs[0],
            **details,
        },
        figures=[f1],
        summary=f"mean |LN - RMS| = {diffs[0]:.1e} at mean 0, "
        + ", ".join(f"{v:.2g} at mean/std {m:g}" for m, v in zip(s["offsets"], diffs) if m in (0.01, 0.1, 1)),
    )


# ------------------------------------------------------------------------------------- half-precision-stats
def half_precision_verdict(
    *,
    overflow_predicted: Sequence[bool],
    overflow_fp16_acc: Sequence[bool],
    fp32_acc_max_rel_err: float,
    naive_err_at_max_offset: float,
    stable_max_err: float,
    fp16_overflows_at_1e5: bool,
    bf16_overflows_at_1e5: bool,
    roundtrip_err_ratio_bf16_over_fp16: float,
) -> tuple[bool | None, dict]:
    vals = [fp32_acc_max_rel_err, naive_err_at_max_offset, stable_max_err, roundtrip_err_ratio_bf16_over_fp16]
    if any(math.isnan(v) for v in vals):
        return None, {"note": "NaN in a measurement that should be finite"}
    checks = {
        "fp16_accumulation_overflows_exactly_when_d*rms^2_>_65504": list(overflow_predicted) == list(overflow_fp16_acc),
        "fp32_accumulation_never_overflows_(rel_err<1e-3)": fp32_acc_max_rel_err < 1e-3,
        "naive_E[x^2]-E[x]^2_rel_err_>_0.1_at_largest_offset": naive_err_at_max_offset > 0.1,
        "two_pass_welford_chan_rel_err_<_1e-3_at_every_offset": stable_max_err < 1e-3,
        "1e5_overflows_fp16_not_bf16": fp16_overflows_at_1e5 and not bf16_overflows_at_1e5,
        "bf16_roundtrip_error_4x-16x_fp16s": 4 <= roundtrip_err_ratio_bf16_over_fp16 <= 16,
    }
    return all(checks.values()), {"checks": checks}


def _rel_err(est: torch.Tensor, truth: torch.Tensor) -> float:
    """Largest relative error over rows; inf/NaN estimates count as inf."""
    e = ((est.double() - truth) / truth).abs()
    return float("inf") if not torch.isfinite(e).all() else e.max().item()


@experiment(
    "half-precision-stats",
    claim="In fp16, accumulating sum(x^2) overflows (max 65504) unless accumulated in fp32; E[x^2] - E[x]^2 "
    "cancels catastrophically for rows with a large offset while two-pass and Welford do not; bf16 has fp32's "
    "range but 8x coarser precision than fp16.",
    source="the IEEE fp16 and bfloat16 formats (max 65504 vs ~3.4e38; 11 vs 8 significand bits); Micikevicius et "
    "al. 2018, Mixed Precision Training, arXiv:1710.03740 (fp32 accumulation of fp16 reductions); Welford 1962 and "
    "Chan, Golub & LeVeque 1983 (stable one-pass and merged variance)",
    kind="demonstration",
    config={
        "default": {
            "dims": [256, 1024],
            "rms_factors": [0.5, 0.9, 1.1, 2.0],
            "rows": 4,
            "var_d": 256,
            "var_rows": 16,
            "offsets": [0, 1, 10, 100, 1000, 10000],
            "samples": 100000,
        },
        "quick": {
            "dims": [256],
            "rms_factors": [0.5, 2.0],
            "rows": 2,
            "var_d": 128,
            "var_rows": 4,
            "offsets": [0, 100, 10000],
            "samples": 10000,
        },
    },
    criterion="All of: (a) naive stats accumulated in fp16 overflow (inf var) exactly at the rows with d * RMS^2 "
    "> 65504 and accumulated in fp32 never do (rel. error < 1e-3); (b) for fp32 rows = offset + N(0, 1), the "
    "naive fp32 variance's relative error exceeds 0.1 at the largest offset, while two-pass, Welford and "
    "Welford+Chan stay < 1e-3 at every offset; (c) 1e5 is inf in fp16, finite in bf16, and bf16's mean "
    "round-trip relative error on N(0, 1) samples is 4x-16x fp16's (unit roundoff 2^-8 vs 2^-11).",
)
def half_precision_stats(ctx: Context) -> Result:
    s = sizes(ctx)
    g = torch.Generator().manual_seed(ctx.seed)
    dev = ctx.device
    # (a) overflow of the fp16 sum of squares
    ctx.progress("fp16 overflow")
    predicted, overflowed, fp32_err, overflow_rows = [], [], 0.0, []
    for d in s["dims"]:
        threshold = math.sqrt(FP16_MAX / d)  # the RMS at which d * RMS^2 reaches fp16's max
        for f in s["rms_factors"]:
            z = torch.randn(s["rows"], d, generator=g, dtype=torch.float64)
            x = (z / z.pow(2).mean(-1, keepdim=True).sqrt() * threshold * f).to(torch.float16).to(dev)
            sumsq = x.double().pow(2).sum(-1)
            truth_var = x.double().var(-1, unbiased=False)
            predicted.append(bool((sumsq > FP16_MAX).all()))
            var16 = stats_naive(x, torch.float16)[1]
            overflowed.append(bool((~torch.isfinite(var16)).all()))
            fp32_err = max(fp32_err, _rel_err(stats_naive(x, torch.float32)[1], truth_var))
            overflow_rows.append(
                {
                    "d": d,
                    "rms_over_threshold": f,
                    "fp16_acc_var": var16[0].item(),
                    "two_pass_fp16_acc_var": stats_two_pass(x, torch.float16)[1][0].item(),
                    "true_var": truth_var[0].item(),
                }
            )
    # (b) cancellation in E[x^2] - E[x]^2
    ctx.progress("cancellation")
    methods = {
        "naive": stats_naive,
        "two-pass": stats_two_pass,
        "welford": stats_welford,
        "welford+chan": stats_welford_chan,
    }
    errors: dict[str, list[float]] = {k: [] for k in methods}
    for c in s["offsets"]:
        x = (c + torch.randn(s["var_rows"], s["var_d"], generator=g, dtype=torch.float64)).to(torch.float32)
        truth = x.double().var(-1, unbiased=False)  # exact variance of the fp32 values themselves
        for k, fn in methods.items():
            errors[k].append(_rel_err(fn(x.to(dev), torch.float32)[1].cpu(), truth))
    stable = max(max(errors[k]) for k in ("two-pass", "welford", "welford+chan"))
    # (c) bf16 vs fp16
    ctx.progress("bf16 vs fp16")
    big = torch.tensor([1e5])
    samples = torch.randn(s["samples"], generator=g, dtype=torch.float64)
    rt = {}
    for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        rt[name] = ((samples.to(dt).double() - samples) / samples).abs().mean().item()
    ranges = {
        name: {"max": torch.finfo(dt).max, "smallest_normal": torch.finfo(dt).tiny, "eps": torch.finfo(dt).eps}
        for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16))
    }
    fp16_inf = bool(torch.isinf(big.to(torch.float16)).item())
    bf16_inf = bool(torch.isinf(big.to(torch.bfloat16)).item())
    passed, details = half_precision_verdict(
        overflow_predicted=predicted,
        overflow_fp16_acc=overflowed,
        fp32_acc_max_rel_err=fp32_err,
        naive_err_at_max_offset=errors["naive"][-1],
        stable_max_err=stable,
        fp16_overflows_at_1e5=fp16_inf,
        bf16_overflows_at_1e5=bf16_inf,
        roundtrip_err_ratio_bf16_over_fp16=rt["bf16"] / rt["fp16"],
    )

    plt = require_pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for k, marker in zip(methods, "osd^"):
        xs = [max(c, 0.1) for c in s["offsets"]]
        axes[0].loglog(xs, [max(min(e, 1e6), 1e-12) for e in errors[k]], marker=marker, label=k)
    axes[0].set_xlabel("row offset (std 1; 0 plotted at 0.1)")
    axes[0].set_ylabel("relative error of var (fp32 accumulation)")
    axes[0].set_title("E[x^2] - E[x]^2 cancels; two-pass / Welford do not")
    axes[0].legend(fontsize=8)
    labels = [f"d={r['d']}\n{r['rms_over_threshold']:g}x" for r in overflow_rows]
    colors = ["tab:red" if o else "tab:green" for o in overflowed]
    axes[1].bar(range(len(labels)), [r["rms_over_threshold"] ** 2 for r in overflow_rows], color=colors)
    axes[1].axhline(1.0, color="k", ls="--", lw=1, label="d * RMS^2 = 65504")
    axes[1].set_xticks(range(len(labels)), labels, fontsize=8)
    axes[1].set_ylabel("d * RMS^2 / 65504")
    axes[1].set_title("fp16 accumulation: red = var overflowed to inf")
    axes[1].legend(fontsize=8)
    f1 = save_figure(fig, ctx, "half_precision.png")
    return Result(
        verdict=verdict_from(passed),
        metrics={
            "overflow": {
                "predicted": predicted,
                "fp16_accumulation_overflowed": overflowed,
                "fp32_accumulation_max_rel_err": fp32_err,
                "rows": overflow_rows,
            },
            "cancellation": {"offsets": s["offsets"], "rel_err_fp32": errors},
            "formats": {
                **ranges,
                "mean_roundtrip_rel_err": rt,
                "fp16_inf_at_1e5": fp16_inf,
                "bf16_inf_at_1e5": bf16_inf,
            },
            **details,
        },
        figures=[f1],
        summary=f"naive var rel. error at offset {s['offsets'][-1]:g}: {errors['naive'][-1]:.2g} (two-pass/Welford "
        f"<= {stable:.1g}); fp16 overflow predicted {sum(predicted)}/{len(predicted)}, seen "
        f"{sum(overflowed)}/{len(overflowed)}; bf16 round-trip error {rt['bf16'] / rt['fp16']:.1f}x fp16",
    )


# ----------------------------------------------------------------------------------- batchnorm-vs-layernorm
def bn_ln_verdict(
    *,
    bn_padding_change: float,
    ln_padding_change: float,
    bn_batch_change: float,
    ln_batch_change: float,
    bn_train_eval_gap: float,
    ln_train_eval_gap: float,
    bn_single_token_degenerate: bool,
    ln_single_token_change: float,
) -> tuple[bool | None, dict]:
    checks = {
        "padding_changes_bn_output_(>0.1)_not_ln_(<1e-5)": bn_padding_change > 0.1 and ln_padding_change < 1e-5,
        "batch_mates_change_bn_output_(>0.1)_not_ln": bn_batch_change > 0.1 and ln_batch_change < 1e-5,
        "bn_train_eval_gap_>0.05,_ln_none": bn_train_eval_gap > 0.05 and ln_train_eval_gap < 1e-6,
        "single_token_bn_degenerate,_ln_unchanged": bn_single_token_degenerate and ln_single_token_change < 1e-5,
    }
    return all(checks.values()), {"checks": checks}


def _sequences(n: int, length: int, d: int, g: torch.Generator) -> torch.Tensor:
    """(n, length, d) tokens: each sequence has its own offset per feature (sentences differ) plus token noise."""
    return torch.randn(n, 1, d, generator=g) + 0.5 * torch.randn(n, length, d, generator=g)


def _bn(bn: nn.BatchNorm1d, x: torch.Tensor) -> torch.Tensor:
    return bn(x.transpose(1, 2)).transpose(1, 2)  # BatchNorm1d wants (B, C, T); statistics over B and T


@experiment(
    "batchnorm-vs-layernorm",
    claim="BatchNorm's batch statistics break on sequences: padding and batch mates change a sequence's output, "
    "training-mode and eval-mode outputs differ, and a single decoded token has no batch to normalize over; "
    "LayerNorm normalizes each token alone and has none of these problems.",
    source="Ioffe & Szegedy 2015, Batch Normalization, arXiv:1502.03167 (batch statistics, running averages at "
    "inference); Ba, Kiros & Hinton 2016, Layer Normalization, arXiv:1607.06450 (per-example statistics, for "
    "sequences and batch size 1)",
    kind="sanity",
    config={
        "default": {"d": 32, "length": 8, "batch": 4, "pads": [8, 16, 32, 64], "train_batches": 50},
        "quick": {"d": 16, "length": 8, "batch": 4, "pads": [8, 32], "train_batches": 10},
    },
    criterion="For one fixed sequence: max |change| of its normalized tokens when the batch is zero-padded from "
    "its length to the longest pad, and when its 3 batch mates are swapped: BN > 0.1, LN < 1e-5; after the "
    "training batches (momentum 0.1), mean |train-mode - eval-mode output| on a held-out batch: BN > 0.05, LN "
    "< 1e-6; one token alone in training mode: BN raises or outputs all zeros, LN's output equals its batched "
    "output (< 1e-5). Reproduced iff all hold.",
)
def batchnorm_vs_layernorm(ctx: Context) -> Result:
    from addnorm.nn import LayerNorm

    s = sizes(ctx)
    g = torch.Generator().manual_seed(ctx.seed)
    d, n, b = s["d"], s["length"], s["batch"]
    bn = nn.BatchNorm1d(d, affine=False, momentum=0.1).to(ctx.device)
    ln = LayerNorm(d, elementwise_affine=False, backend="torch").to(ctx.device)
    seqs = _sequences(b, n, d, g).to(ctx.device)
    mates2 = _sequences(b - 1, n, d, g).to(ctx.device)
    # padding: the same real tokens, padded with zeros to longer lengths (a long sentence joined the batch)
    ctx.progress("padding")
    pad_bn, pad_ln = [], []
    with torch.no_grad():
        bn.train()
        ref_bn, ref_ln = _bn(bn, seqs)[0], ln(seqs)[0]
        for t in s["pads"]:
            padded = torch.cat([seqs, seqs.new_zeros(b, t - n, d)], dim=1)
            pad_bn.append((_bn(bn, padded)[0, :n] - ref_bn).abs().max().item())
            pad_ln.append((ln(padded)[0, :n] - ref_ln).abs().max().item())
        # batch mates: the first sequence with other companions
        other = torch.cat([seqs[:1], mates2], dim=0)
        mate_bn = (_bn(bn, other)[0] - ref_bn).abs().max().item()
        mate_ln = (ln(other)[0] - ref_ln).abs().max().item()
    # train/eval: running statistics after training batches of variable-length padded sequences
    ctx.progress("train/eval")
    bn = nn.BatchNorm1d(d, affine=False, momentum=0.1).to(ctx.device)
    with torch.no_grad():
        bn.train()
        for _ in range(s["train_batches"]):
            lengths = torch.randint(2, 4 * n, (b,), generator=g)
            batch = torch.zeros(b, int(lengths.max()), d)
            for i, length in enumerate(lengths.tolist()):
                batch[i, :length] = _sequences(1, length, d, g)[0]
            _bn(bn, batch.to(ctx.device))
        held = _sequences(b, n, d, g).to(ctx.device)
        train_out = _bn(bn, held)
        bn.eval()
        eval_out = _bn(bn, held)
        gap_bn = (train_out - eval_out).abs().mean().item()
        ln.train()
        ln_train = ln(held)
        ln.eval()
        gap_ln = (ln_train - ln(held)).abs().mean().item()
    # batch size 1 decoding: one new token alone
    ctx.progress("single token")
    bn.train()
    token = held[:1, -1:]  # (1, 1, d)
    try:
        with torch.no_grad():
            single = _bn(bn, token)
        bn_single = f"output max |y| = {single.abs().max().item():.3g}"
        degenerate = single.abs().max().item() < 1e-6  # x - mean(x) over one value is 0
    except ValueError as err:
        bn_single, degenerate = f"raises ValueError: {err}", True
    with torch.no_grad():
        ln_single = (ln(token)[0, 0] - ln(held)[0, -1]).abs().max().item()
    passed, details = bn_ln_verdict(
        bn_padding_change=pad_bn[-1],
        ln_padding_change=pad_ln[-1],
        bn_batch_change=mate_bn,
        ln_batch_change=mate_ln,
        bn_train_eval_gap=gap_bn,
        ln_train_eval_gap=gap_ln,
        bn_single_token_degenerate=degenerate,
        ln_single_token_change=ln_single,
    )

    plt = require_pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    fracs = [1 - n / t for t in s["pads"]]
    axes[0].plot(fracs, [max(v, 1e-9) for v in pad_bn], "o-", label="BatchNorm")  # 1e-9 stands for "none"
    axes[0].plot(fracs, [max(v, 1e-9) for v in pad_ln], "s-", label="LayerNorm")
    axes[0].set_yscale("log")
    axes[0].set_xlabel("padding fraction of the batch")
    axes[0].set_ylabel("max |change| of a fixed sequence")
    axes[0].set_title("padding leaks into batch statistics (1e-9 = none)")
    axes[0].legend()
    bars = {"padding": (pad_bn[-1], pad_ln[-1]), "batch mates": (mate_bn, mate_ln), "train vs eval": (gap_bn, gap_ln)}
    xs = range(len(bars))
    axes[1].bar([i - 0.2 for i in xs], [max(v[0], 1e-9) for v in bars.values()], 0.4, label="BatchNorm")
    axes[1].bar([i + 0.2 for i in xs], [max(v[1], 1e-9) for v in bars.values()], 0.4, label="LayerNorm")
    axes[1].set_xticks(list(xs), list(bars))
    axes[1].set_yscale("log")
    axes[1].set_title("output change (log; 1e-9 = none)")
    axes[1].legend()
    f1 = save_figure(fig, ctx, "batchnorm_vs_layernorm.png")
    return Result(
        verdict=verdict_from(passed),
        metrics={
            "pad_lengths": s["pads"],
            "padding_change": {"batchnorm": pad_bn, "layernorm": pad_ln},
            "batch_mate_change": {"batchnorm": mate_bn, "layernorm": mate_ln},
            "train_eval_gap": {"batchnorm": gap_bn, "layernorm": gap_ln},
            "single_token": {"batchnorm": bn_single, "layernorm_change": ln_single},
            **details,
        },
        figures=[f1],
        summary=f"BN output of a fixed sequence moves {pad_bn[-1]:.2g} under padding, {mate_bn:.2g} with other batch "
        f"mates, train/eval gap {gap_bn:.2g}; LN: {pad_ln[-1]:.0g}, {mate_ln:.0g}, {gap_ln:.0g}",
    )
