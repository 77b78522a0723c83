"""Init-time lab: the tiny models and helpers the init-time experiments share, and two demonstrations of what
residual connections and norm placement do to signals and gradients at initialization. Tiny models (d = 64).

The paper replications are in ``xiong.py`` (Xiong et al.), ``deepnet.py`` (DeepNet) and ``admin.py`` (Admin); they
use :class:`Stack`, :func:`loglog_slope`, :func:`init_seeds`, :func:`judged` and the statistics over inits
(:func:`column_means`, :func:`flatten`, ...) from here.

The two experiments here are demonstrations (``kind="demonstration"``): they illustrate textbook facts with
figures, and their checks hold by construction or by a margin of many orders of magnitude, so they are not counted
as evidence. Their criteria are still pure ``*_verdict`` functions, fixed before the run and tested on synthetic
numbers: the verdict says whether the demonstration showed what it should.

The blocks are ``addnorm.nn.Residual`` around small local sublayers, because the experiments need control over
details the library's layers do not expose: Xiong et al.'s analysis assumes W_Q = W_K = 0 (uniform attention),
d x d FFN matrices and Xavier init everywhere.

Cost: both demonstrations together ~3 s of CPU at default sizes, ~1 s with --quick (2-core machine, load ~5).

The paper replications repeat a paper's own measurement, scaled down: Xiong et al.'s gradients at initialization
(Theorem 1, Lemma 2, Fig. 3), DeepNet's model update in early training, Admin's output change under a small weight
perturbation. Each rests on 6 inits per lab seed (seeds ``--seed * 1000 + k``, :func:`init_seeds`), paired where
arms are compared (arm A and arm B of init k start from the same seed); its verdict is read from pre-registered
rules (addnorm.lab.evidence.Rule) over one unit per init, by the bootstrap 95% interval of the units' mean, with a
positive control that can fail; the units of several lab seeds pool. The per-init work runs as ``ctx.map`` tasks
(module-level functions of plain arguments returning JSON-able dicts).

Cost, measured with ``time.process_time`` on the project's 2-core machine shared with other jobs (load average
6-8; wall-clock was 3-4x the CPU time): default sizes xiong 10 s, deepnet 72 s, admin 15 s of CPU (97 s);
--quick 4.1 s, 5.7 s, 2.3 s (12 s). DeepNet's short trainings dominate: see the docstring of deepnet_update_size
(``deepnet.py``) for how its window was compressed to stay inside this budget. Admin's branch-share control reads
the unperturbed forward pass it already makes (hooks, no extra pass).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from addnorm.lab.core import Context, Result, experiment, verdict_from
from addnorm.lab.evidence import Rule, evidence, judge_evidence, units
from addnorm.lab.seeds import model_seeds
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

    def __init__(
        self,
        *,
        layers: int,
        d: int = 64,
        d_ff: int = 64,
        heads: int = 1,
        placement: str = "pre",
        uniform_attention: bool = False,
        gain: float = 1.0,
    ):
        super().__init__()
        alpha = beta = None
        if placement == "deepnorm":
            c = deepnorm_coefficients(num_encoder_layers=layers)
            alpha, beta = c.encoder_alpha, c.encoder_beta
        self.subs = nn.ModuleList()
        for _ in range(layers):
            for sub in (Attention(d, heads, uniform=uniform_attention), FFN(d, d_ff)):
                self.subs.append(Residual(sub, d, placement=placement, alpha=alpha, norm_kwargs=NORM_KW))
        self.final = (
            Residual(nn.Identity(), d, placement="post-noskip", norm_kwargs=NORM_KW)
            if placement in ("pre", "sandwich")
            else nn.Identity()
        )
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


def judged(rules: Sequence[Rule], values: dict[str, Sequence], seeds: Sequence[int], lab_seed: int) -> tuple:
    """An experiment's evidence from one value per seed and rule (``values[rule.name][k]`` from ``seeds[k]``), and
    its verdict: (evidence dict, verdict, reason, a table of each rule's estimate and 95% interval for metrics)."""
    ev = evidence(rules, {r.name: units(values[r.name], seeds, lab_seed) for r in rules})
    verdict, reason, judgements = judge_evidence(ev)
    table = {
        j.rule: {"verdict": j.verdict, "estimate": j.estimate, "ci95": [j.low, j.high], "n": j.n, "margin": j.margin}
        for j in judgements
    }
    return ev, verdict, reason, table


def init_seeds(ctx: Context, n: int) -> list[int]:
    """The seeds of an experiment's ``n`` inits: :func:`addnorm.lab.seeds.model_seeds` (seed * 1000 + k), and in a
    second stage the ones it adds (``Context.model_seeds``)."""
    return ctx.model_seeds(n)


def average(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def column_means(rows: Sequence[Sequence[float]]) -> list[float]:
    """Mean over inits (rows) of each column (depth or layer)."""
    return [average(col) for col in zip(*rows)]


def all_finite_positive(values: Sequence[float]) -> bool:
    return all(math.isfinite(v) and v > 0 for v in values)


def flatten(rows: Sequence[Sequence[float]]) -> list[float]:
    return [v for row in rows for v in row]


def require_pyplot():
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
    require_pyplot().close(fig)
    return name


def sizes(ctx: Context) -> dict:
    """The experiment's sizes for this run, from the config it registered (the runner puts it in ctx.config)."""
    key = "quick" if ctx.quick else "default"
    if key not in ctx.config:
        raise ValueError(
            f"ctx.config has no {key!r} sizes: pass the experiment's registered config "
            "(Context(config=EXPERIMENTS[name].config)) or run it through addnorm.lab.runner"
        )
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
    source="the chain rule through L layers: a plain stack multiplies L Jacobians dF/dx, a residual stack L "
    "factors (I + dF/dx) whose product contains the identity; He et al. 2016, Identity Mappings in Deep Residual "
    "Networks, arXiv:1603.05027 (Section 3)",
    kind="demonstration",
    config={
        "default": {"depths": [8, 32, 100], "repeats": 2, "d": 64, "batch": 64},
        "quick": {"depths": [8, 32, 100], "repeats": 1, "d": 32, "batch": 32},
    },
    criterion="ratio = first-layer weight-gradient norm at the deepest stack / at the shallowest (mean over "
    "repeats). Reproduced iff the plain stack's ratio < 1e-3 and the residual stack's ratio > 0.1.",
)
def residual_gradient_flow(ctx: Context) -> Result:
    s = sizes(ctx)
    d, depths = s["d"], s["depths"]
    per_layer: dict[str, dict[int, list[float]]] = {"plain": {}, "residual": {}}
    for kind in per_layer:
        for depth in depths:
            ctx.progress(f"{kind} L={depth}")
            acc = torch.zeros(depth, dtype=torch.float64)
            for r in range(s["repeats"]):
                torch.manual_seed(model_seeds(ctx.seed, r + 1)[r])
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

    plt = require_pyplot()
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
        metrics={
            "first_layer_grad": {k: {str(L): v for L, v in f.items()} for k, f in first.items()},
            "ratio_deepest_over_shallowest": ratio,
            "depths": depths,
            "d": d,
            **details,
        },
        figures=[fig_name],
        summary=f"first-layer gradient, {depths[-1]} vs {depths[0]} layers: plain x{ratio['plain']:.2g}, "
        f"residual x{ratio['residual']:.2g}",
    )


# ------------------------------------------------------------------------------------- residual-stream-growth
def stream_growth_verdict(
    *,
    post_rms: Sequence[float],
    pre_rms: Sequence[float],
    pre_rms_scaled_final: float,
    peri_rms_final: float,
    peri_rms_scaled_final: float,
) -> tuple[bool | None, dict]:
    """Per-layer residual RMS at init (gain 1), plus the final RMS with all weights' init scaled by ``gain``."""
    values = list(post_rms) + list(pre_rms) + [pre_rms_scaled_final, peri_rms_final, peri_rms_scaled_final]
    if not all(math.isfinite(v) and v > 0 for v in values):
        return None, {"note": "non-finite residual RMS"}
    checks = {
        "post_ln_rms_in_[0.9,1.1]_every_layer_(by_construction)": all(0.9 <= v <= 1.1 for v in post_rms),
        "pre_ln_rms_grows_>2x_from_layer_1": pre_rms[-1] > 2 * pre_rms[0],
        "pre_ln_final_rms_changes_>2x_with_init_scale": pre_rms_scaled_final > 2 * pre_rms[-1],
        "peri_ln_final_rms_changes_<10%_with_init_scale_(by_construction)": abs(
            peri_rms_scaled_final / peri_rms_final - 1
        )
        < 0.1,
    }
    return all(checks.values()), {"checks": checks}


@experiment(
    "residual-stream-growth",
    claim="At init the residual stream's RMS stays at 1 in Post-LN (by construction: the stream is a LayerNorm "
    "output), grows with depth in Pre-LN at a rate set by the weights' init scale, and in Sandwich/Peri-LN grows "
    "at a rate set by its output norms alone (by construction: every branch ends in a norm, so it adds a unit-RMS "
    "update whatever the weights).",
    source="Xiong et al. 2020, On Layer Normalization in the Transformer Architecture, arXiv:2002.04745 (Lemma 2; "
    "tested over inits in xiong-init-gradients); Ding et al. 2021, CogView, arXiv:2105.13290 (Sandwich-LN); Kim et "
    "al. 2025, Peri-LN: Revisiting Layer Normalization in the Transformer Architecture, arXiv:2502.02732",
    kind="demonstration",
    config={
        "default": {"layers": 24, "gain": 3.0, "d": 64, "d_ff": 128, "heads": 2, "batch": 8, "seq": 16},
        "quick": {"layers": 12, "gain": 3.0, "d": 64, "d_ff": 128, "heads": 2, "batch": 4, "seq": 8},
    },
    criterion="RMS per token of the stream after each layer, Xavier init (gain 1) and gain 3. Reproduced iff "
    "Post-LN's RMS is in [0.9, 1.1] at every layer, Pre-LN's final RMS is > 2x its layer-1 RMS, Pre-LN's final "
    "RMS grows > 2x when the init gain goes from 1 to 3, and Peri-LN's final RMS changes < 10% with the gain.",
)
def residual_stream_growth(ctx: Context) -> Result:
    s = sizes(ctx)
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
        post_rms=rms["post"][1.0],
        pre_rms=rms["pre"][1.0],
        pre_rms_scaled_final=rms["pre"][g][-1],
        peri_rms_final=rms["sandwich"][1.0][-1],
        peri_rms_scaled_final=rms["sandwich"][g][-1],
    )

    plt = require_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = {"post": "Post-LN", "pre": "Pre-LN", "sandwich": "Sandwich/Peri-LN"}
    for p, color in zip(rms, ("tab:blue", "tab:orange", "tab:green")):
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
        metrics={
            "layers": L,
            "residual_rms": {p: {f"gain_{k:g}": v for k, v in r.items()} for p, r in rms.items()},
            "peri_ln_final_rms_sq_vs_1_plus_2L": [rms["sandwich"][1.0][-1] ** 2, 1 + 2 * L],
            **details,
        },
        figures=[f1],
        summary=f"final RMS at L={L} (gain 1 / gain {g:g}): Post-LN {rms['post'][1.0][-1]:.2f}/"
        f"{rms['post'][g][-1]:.2f}, Pre-LN {rms['pre'][1.0][-1]:.2f}/{rms['pre'][g][-1]:.2f}, "
        f"Peri-LN {rms['sandwich'][1.0][-1]:.2f}/{rms['sandwich'][g][-1]:.2f}",
    )
