"""Init-time experiments: what residual connections and norm placement do to signals and gradients before (and in
the first steps of) training. Tiny models (d = 64), CPU-sized.

Every experiment fixes its criterion in a pure ``*_verdict`` function below, written before the run, so the
verdict can be tested on synthetic numbers and cannot be tuned after looking at the data.

The blocks are ``addnorm.nn.Residual`` around small local sublayers, because the experiments need control over
details the library's layers do not expose: Xiong et al.'s analysis assumes W_Q = W_K = 0 (uniform attention),
d x d FFN matrices and Xavier init everywhere.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor, nn

from addnorm.lab.core import Context, Result, experiment, verdict_from
from addnorm.nn import Residual, deepnorm_coefficients

NORM_KW = {"backend": "torch"}  # plain PyTorch: the lowest per-call overhead on these tiny tensors


# ------------------------------------------------------------------------------------------------ tiny models
class Attention(nn.Module):
    """Multi-head self-attention without biases; ``uniform=True`` is W_Q = W_K = 0: every query attends to all
    positions equally, so the output is W_O W_V mean_j(x_j) (Xiong et al.'s assumption)."""

    def __init__(self, d: int, heads: int = 1, *, uniform: bool = False):
        super().__init__()
        if d % heads:
            raise ValueError(f"d ({d}) must be divisible by heads ({heads})")
        self.heads, self.uniform = heads, uniform
        self.q = None if uniform else nn.Linear(d, d, bias=False)
        self.k = None if uniform else nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, d)
        if self.uniform:
            return self.o(self.v(x).mean(dim=1, keepdim=True).expand_as(x))
        b, t, d = x.shape
        split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731 - (B, H, T, dh)
        y = nn.functional.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        return self.o(y.transpose(1, 2).reshape(b, t, d))

    def scaled_weights(self) -> list[Tensor]:
        """DeepNorm's beta applies to V and O, never Q and K."""
        return [self.v.weight, self.o.weight]


class FFN(nn.Module):
    """W2 ReLU(W1 x), no biases."""

    def __init__(self, d: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Linear(d, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(torch.relu(self.w1(x)))

    def scaled_weights(self) -> list[Tensor]:
        return [self.w1.weight, self.w2.weight]


class Stack(nn.Module):
    """L layers of (attention, FFN), each wrapped in ``Residual(placement)``; a final norm for pre and sandwich
    (their stream is never normalized otherwise). ``forward`` returns the output and the residual stream after
    every layer."""

    def __init__(self, *, layers: int, d: int = 64, d_ff: int = 64, heads: int = 1, placement: str = "pre",
                 uniform_attention: bool = False, gain: float = 1.0):  # fmt: skip
        super().__init__()
        alpha = beta = None
        if placement == "deepnorm":
            c = deepnorm_coefficients(num_encoder_layers=layers)
            alpha, beta = c.encoder_alpha, c.encoder_beta
        self.subs = nn.ModuleList()
        for _ in range(layers):
            for sub in (Attention(d, heads, uniform=uniform_attention), FFN(d, d_ff)):
                self.subs.append(Residual(sub, d, placement=placement, alpha=alpha, norm_kwargs=NORM_KW))
        self.final = Residual(nn.Identity(), d, placement="post-noskip", norm_kwargs=NORM_KW) if placement in (
            "pre", "sandwich") else nn.Identity()  # fmt: skip
        # Xavier everywhere (what the analyses assume); DeepNorm scales V, O and the FFN by beta.
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_normal_(m.weight, gain=gain)
        if beta is not None:
            with torch.no_grad():
                for r in self.subs:
                    for w in r.sublayer.scaled_weights():
                        w.mul_(beta)

    def ffn_out_weights(self) -> list[Tensor]:
        return [r.sublayer.w2.weight for r in self.subs if isinstance(r.sublayer, FFN)]

    def forward(self, x: Tensor) -> tuple[Tensor, list[Tensor]]:
        streams = []
        for i, r in enumerate(self.subs):
            x = r(x)
            if i % 2 == 1:
                streams.append(x)
        return self.final(x), streams


def _rms(x: Tensor) -> float:
    """Root mean square per token, averaged over tokens."""
    return x.pow(2).mean(-1).sqrt().mean().item()


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log(y) against log(x)."""
    lx = torch.tensor([math.log(v) for v in xs], dtype=torch.float64)
    ly = torch.tensor([math.log(v) for v in ys], dtype=torch.float64)
    lx, ly = lx - lx.mean(), ly - ly.mean()
    return float((lx * ly).sum() / (lx * lx).sum())


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("the lab's figures need matplotlib: pip install 'addnorm[lab]'") from err
    return plt


def save_figure(fig, ctx: Context, name: str) -> str:
    fig.tight_layout()
    fig.savefig(ctx.figure_path(name), dpi=90)
    _plt().close(fig)
    return name


def _sizes(ctx: Context) -> dict:
    """The experiment's sizes for this run, from the config it registered (the runner puts it in ctx.config)."""
    key = "quick" if ctx.quick else "default"
    if key not in ctx.config:
        raise ValueError(f"ctx.config has no {key!r} sizes: pass the experiment's registered config "
                         "(Context(config=EXPERIMENTS[name].config)) or run it through addnorm.lab.runner")  # fmt: skip
    return ctx.config[key]


# ------------------------------------------------------------------------------------ residual-gradient-flow
def gradient_flow_verdict(plain_ratio: float, residual_ratio: float) -> tuple[bool | None, dict]:
    """``*_ratio`` = first-layer gradient norm at the deepest stack / at the shallowest. Reproduced when the plain
    stack's collapses below 1e-3 while the residual stack's stays above 0.1 (the gradient still arrives)."""
    if not all(math.isfinite(v) for v in (plain_ratio, residual_ratio)):
        return None, {"note": "non-finite gradient ratio"}
    checks = {"plain_ratio_<_1e-3": plain_ratio < 1e-3, "residual_ratio_>_0.1": residual_ratio > 0.1}
    return all(checks.values()), {"checks": checks}


@experiment(
    "residual-gradient-flow",
    claim="Without residual connections the gradient reaching the first layer shrinks exponentially with depth; "
    "with x + F(x) an identity path carries it to the first layer at 100 layers too.",
    source="seed 000, sections 1-2 (chain rule through L layers; (I + dF/dx) products contain the identity)",
    config={"default": {"depths": [8, 32, 100], "repeats": 2, "d": 64, "batch": 64},
            "quick": {"depths": [8, 32, 100], "repeats": 1, "d": 32, "batch": 32}},  # fmt: skip
    criterion="ratio = first-layer weight-gradient norm at the deepest stack / at the shallowest (mean over "
    "repeats). Reproduced iff the plain stack's ratio < 1e-3 and the residual stack's ratio > 0.1.",
)
def residual_gradient_flow(ctx: Context) -> Result:
    s = _sizes(ctx)
    d, depths = s["d"], s["depths"]
    per_layer: dict[str, dict[int, list[float]]] = {"plain": {}, "residual": {}}
    for kind in per_layer:
        for depth in depths:
            ctx.progress(f"{kind} L={depth}")
            acc = torch.zeros(depth, dtype=torch.float64)
            for r in range(s["repeats"]):
                torch.manual_seed(ctx.seed * 1000 + r)
                # each layer: tanh(W x + b) with torch's default Linear init (what a user gets without care)
                # float64: the plain stack's gradient falls below fp32's range (it would read as exactly 0)
                layers = [nn.Linear(d, d).to(ctx.device, torch.float64) for _ in range(depth)]
                x = torch.randn(s["batch"], d, device=ctx.device, dtype=torch.float64)
                probe = torch.randn(d, device=ctx.device, dtype=torch.float64) / math.sqrt(d)
                for lin in layers:
                    y = torch.tanh(lin(x))
                    x = x + y if kind == "residual" else y
                # a linear read-out: dLoss/dx_L has the same size at every depth, so ratios isolate propagation
                (x @ probe).mean().backward()
                acc += torch.tensor([lin.weight.grad.norm().item() for lin in layers], dtype=torch.float64)
            per_layer[kind][depth] = (acc / s["repeats"]).tolist()
    first = {k: {L: v[L][0] for L in depths} for k, v in per_layer.items()}
    ratio = {k: first[k][depths[-1]] / first[k][depths[0]] for k in first}
    passed, details = gradient_flow_verdict(ratio["plain"], ratio["residual"])

    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, kind in zip(axes, ("plain", "residual")):
        for depth in depths:
            ax.semilogy(range(1, depth + 1), per_layer[kind][depth], label=f"L={depth}")
        ax.set_title(f"{kind}: x = {'tanh(Wx+b)' if kind == 'plain' else 'x + tanh(Wx+b)'}")
        ax.set_xlabel("layer")
        ax.legend()
    axes[0].set_ylabel("||dLoss/dW_l||")
    fig_name = save_figure(fig, ctx, "per_layer_grad.png")
    return Result(
        verdict=verdict_from(passed),
        metrics={"first_layer_grad": {k: {str(L): v for L, v in f.items()} for k, f in first.items()},
                 "ratio_deepest_over_shallowest": ratio, "depths": depths, "d": d, **details},  # fmt: skip
        figures=[fig_name],
        summary=f"first-layer gradient, {depths[-1]} vs {depths[0]} layers: plain x{ratio['plain']:.2g}, "
        f"residual x{ratio['residual']:.2g}",
    )


# -------------------------------------------------------------------------------------- xiong-init-gradients
def xiong_verdict(*, depths: Sequence[int], pre_last: Sequence[float], post_last: Sequence[float],
                  pre_ratio: Sequence[float], post_ratio: Sequence[float],
                  pre_norm_in_bounds: bool) -> tuple[bool | None, dict]:  # fmt: skip
    """The four checks of Xiong et al. at init; ``*_last`` = last-layer FFN W2 gradient norm per depth,
    ``*_ratio`` = last-layer / first-layer gradient norm per depth."""
    values = list(pre_last) + list(post_last) + list(pre_ratio) + list(post_ratio)
    if not all(math.isfinite(v) and v > 0 for v in values):
        return None, {"note": "non-finite or zero gradients"}
    pre_slope, post_slope = loglog_slope(depths, pre_last), loglog_slope(depths, post_last)
    checks = {
        "pre_ln_last_grad_slope_in_[-0.75,-0.25]": -0.75 <= pre_slope <= -0.25,
        "post_ln_last_grad_slope_in_[-0.25,0.25]": -0.25 <= post_slope <= 0.25,
        "post_ln_grad_rises_with_layer": post_ratio[0] > 1 and post_ratio[-1] > post_ratio[0],
        "pre_ln_flat_across_layers": all(0.5 <= r <= 2 for r in pre_ratio),
        "pre_ln_stream_in_lemma2_bounds": bool(pre_norm_in_bounds),
    }
    return all(checks.values()), {"checks": checks, "pre_ln_slope": pre_slope, "post_ln_slope": post_slope}


def lemma2_in_bounds(sq_norm_over_d: Sequence[float], slack: float = 0.1) -> bool:
    """Pre-LN: ||x_l||^2 / d within [(1 + l/2)(1 - slack), (1 + 3l/2)(1 + slack)] for l = 1..L (x_0 has 1)."""
    return all((1 + l / 2) * (1 - slack) <= v <= (1 + 1.5 * l) * (1 + slack)
               for l, v in enumerate(sq_norm_over_d, start=1))  # fmt: skip


@experiment(
    "xiong-init-gradients",
    claim="At initialization the last FFN layer's gradient is independent of depth for Post-LN and decays like "
    "L^(-1/2) for Pre-LN; Post-LN's per-layer gradients grow toward the output, Pre-LN's are flat; the Pre-LN "
    "residual stream satisfies (1 + l/2) d <= E||x_l||^2 <= (1 + 3l/2) d.",
    source="Xiong et al. 2020, Lemma 2, Theorem 1, Fig. 3; seed 000 exercises 2-3",
    config={"default": {"depths": [6, 12, 24, 48], "repeats": 2, "d": 64, "batch": 8, "seq": 16, "vocab": 64},
            "quick": {"depths": [6, 12, 24], "repeats": 1, "d": 64, "batch": 4, "seq": 16, "vocab": 64},
            "assumptions": "one head, W_Q = W_K = 0, d x d FFN with ReLU, Xavier normal, no biases"},  # fmt: skip
    criterion="All of: Pre-LN log-log slope of the last-layer FFN W2 gradient vs L in [-0.75, -0.25]; Post-LN "
    "slope in [-0.25, 0.25]; Post-LN last/first-layer gradient ratio > 1 at the smallest L and larger at the "
    "largest L; Pre-LN last/first ratio in [0.5, 2] at every L; Pre-LN ||x_l||^2/d inside Lemma 2's bounds "
    "(10% slack for sampling) at every layer and depth. Gradients averaged over repeats.",
)
def xiong_init_gradients(ctx: Context) -> Result:
    s = _sizes(ctx)
    d, depths = s["d"], s["depths"]
    grads: dict[str, dict[int, list[float]]] = {"post": {}, "pre": {}}
    sq_norms: dict[int, list[float]] = {}
    for placement in grads:
        for depth in depths:
            ctx.progress(f"{placement}-LN L={depth}")
            acc = torch.zeros(depth, dtype=torch.float64)
            sq = torch.zeros(depth, dtype=torch.float64)
            for r in range(s["repeats"]):
                torch.manual_seed(ctx.seed * 1000 + r)
                model = Stack(layers=depth, d=d, d_ff=d, placement=placement, uniform_attention=True).to(ctx.device)
                head = nn.Linear(d, s["vocab"], bias=False).to(ctx.device)
                nn.init.xavier_normal_(head.weight)
                x0 = torch.randn(s["batch"], s["seq"], d, device=ctx.device)  # E||x_0||^2 = d
                target = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), device=ctx.device)
                out, streams = model(x0)
                loss = nn.functional.cross_entropy(head(out).flatten(0, 1), target.flatten())
                loss.backward()
                acc += torch.tensor([w.grad.norm().item() for w in model.ffn_out_weights()], dtype=torch.float64)
                sq += torch.tensor([z.pow(2).sum(-1).mean().item() / d for z in streams], dtype=torch.float64)
            grads[placement][depth] = (acc / s["repeats"]).tolist()
            if placement == "pre":
                sq_norms[depth] = (sq / s["repeats"]).tolist()
    last = {p: [grads[p][L][-1] for L in depths] for p in grads}
    ratio = {p: [grads[p][L][-1] / grads[p][L][0] for L in depths] for p in grads}
    in_bounds = all(lemma2_in_bounds(sq_norms[L]) for L in depths)
    passed, details = xiong_verdict(depths=depths, pre_last=last["pre"], post_last=last["post"],
                                    pre_ratio=ratio["pre"], post_ratio=ratio["post"],
                                    pre_norm_in_bounds=in_bounds)  # fmt: skip

    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, p in zip(axes, ("post", "pre")):
        for L in depths:
            ax.plot([i / L for i in range(1, L + 1)], grads[p][L], label=f"L={L}")
        ax.set_yscale("log")
        ax.set_title(f"{p.capitalize()}-LN: FFN W2 gradient by layer")
        ax.set_xlabel("layer / L")
        ax.legend()
    axes[0].set_ylabel("||dLoss/dW2_l||")
    f1 = save_figure(fig, ctx, "per_layer_grad.png")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for p, marker in (("post", "o"), ("pre", "s")):
        axes[0].loglog(depths, last[p], marker=marker, label=f"{p.capitalize()}-LN")
    ref = [last["pre"][0] * math.sqrt(depths[0] / L) for L in depths]
    axes[0].loglog(depths, ref, "k--", lw=1, label="~L^(-1/2)")
    axes[0].set_xlabel("layers L")
    axes[0].set_ylabel("last-layer ||dLoss/dW2||")
    axes[0].set_title("last-layer gradient vs depth")
    axes[0].legend()
    L = depths[-1]
    ls = list(range(1, L + 1))
    axes[1].fill_between(ls, [1 + l / 2 for l in ls], [1 + 1.5 * l for l in ls], alpha=0.2, label="Lemma 2 bounds")
    axes[1].plot(ls, sq_norms[L], label=f"Pre-LN, L={L}")
    axes[1].set_xlabel("layer l")
    axes[1].set_ylabel("||x_l||^2 / d")
    axes[1].set_title("Pre-LN residual stream")
    axes[1].legend()
    f2 = save_figure(fig, ctx, "depth_scaling.png")
    return Result(
        verdict=verdict_from(passed),
        metrics={"depths": depths, "last_layer_grad": last, "last_over_first_layer_grad": ratio,
                 "pre_ln_sq_norm_over_d_at_last_layer": {str(L): sq_norms[L][-1] for L in depths},
                 "lemma2_bounds_at_last_layer": {str(L): [1 + L / 2, 1 + 1.5 * L] for L in depths}, **details},
        figures=[f1, f2],
        summary=f"last-layer gradient slope vs L: Pre-LN {details.get('pre_ln_slope', float('nan')):.2f} "
        f"(theory -0.5), Post-LN {details.get('post_ln_slope', float('nan')):.2f} (theory 0); "
        f"Post-LN last/first x{ratio['post'][-1]:.2g} at L={depths[-1]}",
    )


# -------------------------------------------------------------------------------------- deepnet-update-size
def update_size_verdict(depths: Sequence[int], post_peak: Sequence[float],
                        deepnorm_peak: Sequence[float]) -> tuple[bool | None, dict]:  # fmt: skip
    """``*_peak`` = largest relative model update over the first steps, per depth."""
    if not all(math.isfinite(v) for v in list(post_peak) + list(deepnorm_peak)):
        return None, {"note": "non-finite update (diverged)"}
    checks = {
        "post_ln_update_grows_with_depth": post_peak[-1] > post_peak[0],
        "deepnorm_below_post_ln_at_max_depth": deepnorm_peak[-1] < post_peak[-1],
        "deepnorm_flat_across_depth_(max/min<2)": max(deepnorm_peak) < 2 * min(deepnorm_peak),
    }
    return all(checks.values()), {"checks": checks}


@experiment(
    "deepnet-update-size",
    claim="In the first Adam steps Post-LN's model update ||F(x, theta_t) - F(x, theta_0)|| is large and grows "
    "with depth, while DeepNorm keeps it small and about the same at every depth.",
    source="Wang et al. 2022 (DeepNet), instability analysis; stability.md small experiment 3",
    config={"default": {"depths": [6, 12, 24], "steps": 20, "d": 64, "d_ff": 128, "heads": 2, "batch": 8,
                        "seq": 16, "vocab": 32, "lr": 1e-3},
            "quick": {"depths": [4, 8], "steps": 8, "d": 64, "d_ff": 128, "heads": 2, "batch": 4, "seq": 8,
                      "vocab": 32, "lr": 1e-3}},  # fmt: skip
    criterion="peak = max over the first steps of RMS(F_t - F_0)/RMS(F_0) on a fixed probe batch (F: the "
    "normalized final hidden states). Reproduced iff Post-LN's peak at the largest depth exceeds its peak at the "
    "smallest, DeepNorm's peak at the largest depth is below Post-LN's, and DeepNorm's peaks differ by less than "
    "2x across depths. Adam (0.9, 0.98), constant lr 1e-3, no warmup.",
)
def deepnet_update_size(ctx: Context) -> Result:
    s = _sizes(ctx)
    depths = s["depths"]
    curves: dict[str, dict[int, list[float]]] = {"post": {}, "pre": {}, "deepnorm": {}}
    for placement in curves:
        for depth in depths:
            ctx.progress(f"{placement} L={depth}")
            torch.manual_seed(ctx.seed)
            dev = ctx.device
            embed = nn.Embedding(s["vocab"], s["d"]).to(dev)  # N(0, 1) rows: unit-RMS tokens
            model = Stack(layers=depth, d=s["d"], d_ff=s["d_ff"], heads=s["heads"], placement=placement).to(dev)
            head = nn.Linear(s["d"], s["vocab"], bias=False).to(dev)
            perm = torch.randperm(s["vocab"], device=dev)  # the task: map every token to perm[token]
            probe = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), device=dev)
            params = list(embed.parameters()) + list(model.parameters()) + list(head.parameters())
            opt = torch.optim.Adam(params, lr=s["lr"], betas=(0.9, 0.98))
            with torch.no_grad():
                f0 = model(embed(probe))[0]
            scale = f0.pow(2).mean().sqrt()
            updates = []
            for _ in range(s["steps"]):
                tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), device=dev)
                logits = head(model(embed(tokens))[0])
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), perm[tokens].flatten())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                with torch.no_grad():
                    updates.append(((model(embed(probe))[0] - f0).pow(2).mean().sqrt() / scale).item())
            curves[placement][depth] = updates
    peak = {p: [max(curves[p][L]) for L in depths] for p in curves}
    passed, details = update_size_verdict(depths, peak["post"], peak["deepnorm"])

    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5), sharey=True)
    for ax, p in zip(axes, curves):
        for L in depths:
            ax.plot(range(1, s["steps"] + 1), curves[p][L], label=f"L={L}")
        ax.set_title({"post": "Post-LN", "pre": "Pre-LN", "deepnorm": "DeepNorm"}[p])
        ax.set_xlabel("Adam step")
        ax.legend()
    axes[0].set_ylabel("RMS(F_t - F_0) / RMS(F_0)")
    f1 = save_figure(fig, ctx, "model_update.png")
    return Result(
        verdict=verdict_from(passed),
        metrics={"depths": depths, "peak_relative_update": peak,
                 "final_relative_update": {p: [curves[p][L][-1] for L in depths] for p in curves}, **details},
        figures=[f1],
        summary="peak relative update by depth " + "; ".join(
            f"{p}: " + "/".join(f"{v:.2g}" for v in peak[p]) for p in peak),  # fmt: skip
    )


# -------------------------------------------------------------------------------------- admin-output-change
def output_change_verdict(depths: Sequence[int], post_change: Sequence[float],
                          pre_change: Sequence[float]) -> tuple[bool | None, dict]:  # fmt: skip
    """``*_change`` = mean squared output change after a small weight perturbation, per depth."""
    if not all(math.isfinite(v) and v > 0 for v in list(post_change) + list(pre_change)):
        return None, {"note": "non-finite or zero change"}
    post_slope, pre_slope = loglog_slope(depths, post_change), loglog_slope(depths, pre_change)
    checks = {
        "post_ln_slope_>=_0.7_(about_linear)": post_slope >= 0.7,
        "pre_ln_slope_<=_0.6_(about_log)": pre_slope <= 0.6,
        "post_ln_grows_faster": post_slope > pre_slope,
    }
    return all(checks.values()), {"checks": checks, "post_ln_slope": post_slope, "pre_ln_slope": pre_slope}


@experiment(
    "admin-output-change",
    claim="A small random perturbation of the weights changes a Post-LN model's output about linearly in its "
    "depth N, a Pre-LN model's only about like log N (Post-LN depends heavily on its residual branches).",
    source="Liu et al. 2020 (Admin), output change analysis; stability.md small experiment 5",
    config={"default": {"depths": [6, 12, 24, 48], "inits": 1, "draws": 4, "eps": 0.01, "d": 64, "d_ff": 128,
                        "heads": 2, "batch": 8, "seq": 16},
            "quick": {"depths": [6, 12, 24], "inits": 1, "draws": 2, "eps": 0.01, "d": 64, "d_ff": 128,
                      "heads": 2, "batch": 4, "seq": 8}},  # fmt: skip
    criterion="change(N) = mean ||F(x; W + dW) - F(x; W)||^2 / mean ||F(x; W)||^2 with dW = eps * std(W) * "
    "N(0, 1) on every weight matrix, averaged over inits and draws. Reproduced iff the log-log slope of change "
    "vs N is >= 0.7 for Post-LN (about linear), <= 0.6 for Pre-LN (log N from 6 to 48 has slope ~0.4) and "
    "Post-LN's slope is the larger.",
)
def admin_output_change(ctx: Context) -> Result:
    s = _sizes(ctx)
    depths = s["depths"]
    change: dict[str, list[float]] = {"post": [], "pre": []}
    for placement in change:
        for depth in depths:
            ctx.progress(f"{placement}-LN N={depth}")
            vals = []
            for i in range(s["inits"]):
                torch.manual_seed(ctx.seed * 1000 + i)
                model = Stack(layers=depth, d=s["d"], d_ff=s["d_ff"], heads=s["heads"], placement=placement)
                model = model.to(ctx.device)
                x = torch.randn(s["batch"], s["seq"], s["d"], device=ctx.device)
                weights = [p for p in model.parameters() if p.dim() == 2]
                with torch.no_grad():
                    f = model(x)[0]
                    base = [w.clone() for w in weights]
                    for _ in range(s["draws"]):
                        for w, w0 in zip(weights, base):
                            w.copy_(w0 + s["eps"] * w0.std() * torch.randn_like(w0))
                        vals.append(((model(x)[0] - f).pow(2).mean() / f.pow(2).mean()).item())
                    for w, w0 in zip(weights, base):
                        w.copy_(w0)
            change[placement].append(sum(vals) / len(vals))
    passed, details = output_change_verdict(depths, change["post"], change["pre"])

    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for p, marker in (("post", "o"), ("pre", "s")):
        ax.loglog(depths, change[p], marker=marker, label=f"{p.capitalize()}-LN")
    ax.loglog(depths, [change["post"][0] * L / depths[0] for L in depths], "k--", lw=1, label="~N")
    ax.loglog(depths, [change["pre"][0] * math.log(L) / math.log(depths[0]) for L in depths], "k:", lw=1,
              label="~log N")  # fmt: skip
    ax.set_xlabel("layers N")
    ax.set_ylabel("relative output change")
    ax.set_title(f"output change after a {s['eps']:.0%} weight perturbation")
    ax.legend()
    f1 = save_figure(fig, ctx, "output_change.png")
    return Result(
        verdict=verdict_from(passed),
        metrics={"depths": depths, "relative_output_change": change, **details},
        figures=[f1],
        summary=f"log-log slope of output change vs N: Post-LN {details.get('post_ln_slope', float('nan')):.2f} "
        f"(linear: 1), Pre-LN {details.get('pre_ln_slope', float('nan')):.2f} (log N: ~0.4)",
    )


# ------------------------------------------------------------------------------------- residual-stream-growth
def stream_growth_verdict(*, post_rms: Sequence[float], pre_rms: Sequence[float], pre_rms_scaled_final: float,
                          peri_rms_final: float, peri_rms_scaled_final: float) -> tuple[bool | None, dict]:  # fmt: skip
    """Per-layer residual RMS at init (gain 1), plus the final RMS with all weights' init scaled by ``gain``."""
    values = list(post_rms) + list(pre_rms) + [pre_rms_scaled_final, peri_rms_final, peri_rms_scaled_final]
    if not all(math.isfinite(v) and v > 0 for v in values):
        return None, {"note": "non-finite residual RMS"}
    checks = {
        "post_ln_rms_in_[0.9,1.1]_every_layer": all(0.9 <= v <= 1.1 for v in post_rms),
        "pre_ln_rms_grows_>2x_from_layer_1": pre_rms[-1] > 2 * pre_rms[0],
        "pre_ln_final_rms_changes_>2x_with_init_scale": pre_rms_scaled_final > 2 * pre_rms[-1],
        "peri_ln_final_rms_changes_<10%_with_init_scale": abs(peri_rms_scaled_final / peri_rms_final - 1) < 0.1,
    }
    return all(checks.values()), {"checks": checks}


@experiment(
    "residual-stream-growth",
    claim="At init the residual stream's RMS stays at 1 in Post-LN (normalized after every add), grows with depth "
    "in Pre-LN at a rate set by the weights' init scale, and in Sandwich/Peri-LN grows at a rate set by its "
    "output norms alone (every branch adds a unit-RMS update whatever the weights).",
    source="Xiong et al. 2020 Lemma 2; Peri-LN / Sandwich-LN (stability.md, newer placements); "
    "seed 003 section 4.4",
    config={"default": {"layers": 24, "gain": 3.0, "d": 64, "d_ff": 128, "heads": 2, "batch": 8, "seq": 16},
            "quick": {"layers": 12, "gain": 3.0, "d": 64, "d_ff": 128, "heads": 2, "batch": 4, "seq": 8}},
    criterion="RMS per token of the stream after each layer, Xavier init (gain 1) and gain 3. Reproduced iff "
    "Post-LN's RMS is in [0.9, 1.1] at every layer, Pre-LN's final RMS is > 2x its layer-1 RMS, Pre-LN's final "
    "RMS grows > 2x when the init gain goes from 1 to 3, and Peri-LN's final RMS changes < 10% with the gain.",
)
def residual_stream_growth(ctx: Context) -> Result:
    s = _sizes(ctx)
    L = s["layers"]
    rms: dict[str, dict[float, list[float]]] = {}
    for placement in ("post", "pre", "sandwich"):
        rms[placement] = {}
        for gain in (1.0, s["gain"]):
            ctx.progress(f"{placement} gain={gain}")
            torch.manual_seed(ctx.seed)
            model = Stack(layers=L, d=s["d"], d_ff=s["d_ff"], heads=s["heads"], placement=placement, gain=gain)
            x = torch.randn(s["batch"], s["seq"], s["d"], device=ctx.device)
            with torch.no_grad():
                streams = model.to(ctx.device)(x)[1]
            rms[placement][gain] = [_rms(z) for z in streams]
    g = s["gain"]
    passed, details = stream_growth_verdict(
        post_rms=rms["post"][1.0], pre_rms=rms["pre"][1.0], pre_rms_scaled_final=rms["pre"][g][-1],
        peri_rms_final=rms["sandwich"][1.0][-1], peri_rms_scaled_final=rms["sandwich"][g][-1],
    )  # fmt: skip

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = {"post": "Post-LN", "pre": "Pre-LN", "sandwich": "Sandwich/Peri-LN"}
    for (p, color) in zip(rms, ("tab:blue", "tab:orange", "tab:green")):
        ax.plot(range(1, L + 1), rms[p][1.0], color=color, label=f"{names[p]}, Xavier")
        ax.plot(range(1, L + 1), rms[p][g], color=color, ls="--", label=f"{names[p]}, gain {g:g}")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("residual stream RMS")
    ax.set_title("residual stream at init")
    ax.legend(fontsize=8)
    f1 = save_figure(fig, ctx, "residual_rms.png")
    return Result(
        verdict=verdict_from(passed),
        metrics={"layers": L, "residual_rms": {p: {f"gain_{k:g}": v for k, v in r.items()} for p, r in rms.items()},
                 "peri_ln_final_rms_sq_vs_1_plus_2L": [rms["sandwich"][1.0][-1] ** 2, 1 + 2 * L], **details},
        figures=[f1],
        summary=f"final RMS at L={L} (gain 1 / gain {g:g}): Post-LN {rms['post'][1.0][-1]:.2f}/"
        f"{rms['post'][g][-1]:.2f}, Pre-LN {rms['pre'][1.0][-1]:.2f}/{rms['pre'][g][-1]:.2f}, "
        f"Peri-LN {rms['sandwich'][1.0][-1]:.2f}/{rms['sandwich'][g][-1]:.2f}",
    )
