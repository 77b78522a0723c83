"""Reference numerics for LayerNorm and RMSNorm: the oracle every kernel is tested against.

Over the last dimension of a row h (length N), with statistics in ``acc`` precision
(fp32 for fp16/bf16/fp32 inputs, fp64 for fp64):

    LayerNorm:  mean = sum(h) / N,   var = sum((h - mean)^2) / N,   rstd = 1 / sqrt(var + eps)
                y = (h - mean) * rstd * w + b
    RMSNorm:    rstd = 1 / sqrt(sum(h^2) / N + eps)
                y = h * rstd * w

``w`` is replaced by ``1 + w`` when ``zero_centered_weight`` (Gemma). ``y`` is computed in ``acc`` precision
and rounded once to the output dtype. With ``cast_before_weight`` (the cast order of Llama, Mistral and Qwen in
Hugging Face: ``weight * xhat.to(dtype)``) the normalized value is rounded to the output dtype *before* the weight
and bias are applied, then the affine result is rounded again; its gradient passes that first rounding straight
through, and dw sums ``dy * round(xhat)``.

The backward passes are written out (not autograd) so they can check kernels independently. With
``xhat = (h - mean) * rstd`` (``h * rstd`` for RMSNorm), ``g = dy * w`` and means taken over the row:

    LayerNorm:  dh = rstd * (g - mean(g) - xhat * mean(g * xhat))
    RMSNorm:    dh = rstd * (g - xhat * mean(g * xhat))
    dw = sum over rows of dy * xhat,    db = sum over rows of dy

The second half of the file holds the statistics variants the seeds discuss (naive E[x^2] - E[x]^2,
two-pass, Welford with Chan's merge), each evaluated in a chosen accumulation dtype with a rounding after
every operation, so fp16 overflow and catastrophic cancellation can be shown rather than described.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# the contract's definitions the oracle must share with the kernels: the dropout keep-function and its scaling
# (a different mask could not judge theirs), and the row mean that gives a row the same bits alone as in a batch
from addnorm.ops.contract import dropout_keep_mask, dropout_scale, row_mean

__all__ = [
    "acc_dtype",
    "layer_norm_ref",
    "layer_norm_bwd_ref",
    "rms_norm_ref",
    "rms_norm_bwd_ref",
    "add_norm_ref",
    "add_norm_bwd_ref",
    "Stats",
    "stats_naive",
    "stats_two_pass",
    "stats_welford",
    "chan_merge",
    "stats_welford_chan",
]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics are accumulated in for inputs of ``dtype``: fp64 stays fp64, all else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _effective_weight(weight: Tensor | None, zero_centered_weight: bool, dtype: torch.dtype) -> Tensor | None:
    if weight is None:
        return None
    w = weight.to(dtype)
    return w + 1 if zero_centered_weight else w


def _affine(xhat: Tensor, w: Tensor | None, b: Tensor | None, cast_to: torch.dtype | None) -> Tensor:
    """``xhat * w + b`` in xhat's dtype; with ``cast_to``, xhat is first rounded to that dtype (Llama's order)."""
    if cast_to is not None and (w is not None or b is not None):
        xhat = xhat.to(cast_to).to(xhat.dtype)
    if w is not None:
        xhat = xhat * w
    if b is not None:
        xhat = xhat + b
    return xhat


# --------------------------------------------------------------------------------------------------------------
# Forward and backward oracles
# --------------------------------------------------------------------------------------------------------------


def layer_norm_ref(
    x: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    zero_centered_weight: bool = False,
    compute_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    cast_before_weight: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm over the last dim. Returns ``(y, mean, rstd)``; y in ``out_dtype`` (default x's dtype), rounded
    once from the compute dtype (twice with ``cast_before_weight``); stats in the compute dtype."""
    cd = compute_dtype or acc_dtype(x.dtype)
    od = out_dtype or x.dtype
    h = x.to(cd)
    mean = row_mean(h)
    # two-pass variance: no E[x^2] - E[x]^2 cancellation
    var = row_mean((h - mean.unsqueeze(-1)).square())
    rstd = torch.rsqrt(var + eps)
    xhat = (h - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    w = _effective_weight(weight, zero_centered_weight, cd)
    y = _affine(xhat, w, None if bias is None else bias.to(cd), od if cast_before_weight else None)
    return y.to(od), mean, rstd


def rms_norm_ref(
    x: Tensor,
    weight: Tensor | None = None,
    eps: float | None = None,
    zero_centered_weight: bool = False,
    compute_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    cast_before_weight: bool = False,
) -> tuple[Tensor, Tensor]:
    """RMSNorm over the last dim. Returns ``(y, rstd)``, y in ``out_dtype`` (default x's dtype).
    ``eps=None`` means ``torch.finfo(x.dtype).eps``."""
    cd = compute_dtype or acc_dtype(x.dtype)
    od = out_dtype or x.dtype
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    h = x.to(cd)
    rstd = torch.rsqrt(row_mean(h.square()) + eps)
    xhat = h * rstd.unsqueeze(-1)
    y = _affine(xhat, _effective_weight(weight, zero_centered_weight, cd), None, od if cast_before_weight else None)
    return y.to(od), rstd


def _norm_bwd(
    dy: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor | None,
    rstd: Tensor,
    zero_centered_weight: bool,
    compute_dtype: torch.dtype,
    cast_to: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None, Tensor]:
    # cast_to: the forward rounded xhat to this dtype before the weight (cast_before_weight); dw sees that value
    cd = compute_dtype
    h = x.to(cd)
    rs = rstd.to(cd).unsqueeze(-1)
    xhat = (h - mean.to(cd).unsqueeze(-1)) * rs if mean is not None else h * rs
    dyf = dy.to(cd)
    w = _effective_weight(weight, zero_centered_weight, cd)
    g = dyf * w if w is not None else dyf
    proj = row_mean(g * xhat, keepdim=True)
    if mean is not None:
        dh = rs * (g - row_mean(g, keepdim=True) - xhat * proj)
    else:
        dh = rs * (g - xhat * proj)
    flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731 - rows of any leading shape
    xq = xhat.to(cast_to).to(cd) if cast_to is not None else xhat
    dw = flat(dyf * xq).sum(dim=0) if weight is not None else None
    db = flat(dyf).sum(dim=0)
    return dh, dw, db


def layer_norm_bwd_ref(
    dy: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    zero_centered_weight: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Gradients of LayerNorm: ``(dx, dweight, dbias)`` in the compute dtype (the caller casts)."""
    return _norm_bwd(dy, x, weight, mean, rstd, zero_centered_weight, compute_dtype or acc_dtype(x.dtype))


def rms_norm_bwd_ref(
    dy: Tensor,
    x: Tensor,
    weight: Tensor | None,
    rstd: Tensor,
    zero_centered_weight: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Gradients of RMSNorm: ``(dx, dweight)`` in the compute dtype (the caller casts)."""
    dh, dw, _ = _norm_bwd(dy, x, weight, None, rstd, zero_centered_weight, compute_dtype or acc_dtype(x.dtype))
    return dh, dw


# --------------------------------------------------------------------------------------------------------------
# The whole add + norm contract, forward and backward, on 2-D (M, N) inputs
# --------------------------------------------------------------------------------------------------------------


def add_norm_ref(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    *,
    eps: float,
    is_rms: bool,
    dropout_p: float = 0.0,
    seed: int = 0,
    residual_dtype: torch.dtype | None = None,
    zero_centered_weight: bool = False,
    cast_before_weight: bool = False,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """``residual_out = dropout(x) + residual`` stored in residual_dtype; ``out = norm(residual_out)`` in out_dtype
    (default x's dtype).

    Returns ``(out, residual_out, mean, rstd)`` (mean is None for RMSNorm). This is the kernel contract, also
    used as the explicit oracle for the kernel backends.
    """
    rd = residual_dtype or (residual.dtype if residual is not None else x.dtype)
    cd = torch.float64 if torch.float64 in (rd, x.dtype) else torch.float32
    h = x.to(cd)
    if dropout_p > 0.0:
        keep = dropout_keep_mask(seed, x.shape[0], x.shape[-1], dropout_p, x.device)
        h = torch.where(keep, h * dropout_scale(dropout_p, cd), torch.zeros((), dtype=cd, device=x.device))
    if residual is not None:
        h = h + residual.to(cd)
    residual_out = h.to(rd)  # the value normalized is the sum exactly as stored
    # y is rounded once, from the compute dtype straight to out_dtype (not through the residual dtype)
    od = out_dtype or x.dtype
    if is_rms:
        y, rstd = rms_norm_ref(
            residual_out,
            weight,
            eps,
            zero_centered_weight,
            compute_dtype=cd,
            out_dtype=od,
            cast_before_weight=cast_before_weight,
        )
        mean = None
    else:
        y, mean, rstd = layer_norm_ref(
            residual_out,
            weight,
            bias,
            eps,
            zero_centered_weight,
            compute_dtype=cd,
            out_dtype=od,
            cast_before_weight=cast_before_weight,
        )
    return y, residual_out, mean, rstd


def add_norm_bwd_ref(
    dout: Tensor,
    dresidual_out: Tensor | None,
    residual_out: Tensor,
    weight: Tensor | None,
    mean: Tensor | None,
    rstd: Tensor,
    *,
    bias_dtype: torch.dtype | None,
    dropout_p: float = 0.0,
    seed: int = 0,
    zero_centered_weight: bool = False,
    cast_before_weight: bool = False,
    x_dtype: torch.dtype,
    residual_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Backward of :func:`add_norm_ref`: ``(dx, dresidual, dweight, dbias)``.

    ``dh = dnorm + dresidual_out``; ``dresidual = dh`` in residual_dtype (None when there was no residual);
    ``dx = dh * keep * dropout_scale(p)`` in x_dtype; dweight in the weight's dtype, dbias in ``bias_dtype`` (None when
    there is no bias).
    """
    cd = mean.dtype if mean is not None else rstd.dtype
    # dout arrives in out's dtype: the dtype the forward rounded xhat to with cast_before_weight
    dh, dw, db = _norm_bwd(
        dout, residual_out, weight, mean, rstd, zero_centered_weight, cd, dout.dtype if cast_before_weight else None
    )
    if dresidual_out is not None:
        dh = dh + dresidual_out.to(cd)
    dres = dh.to(residual_dtype) if residual_dtype is not None else None
    dx = dh
    if dropout_p > 0.0:
        keep = dropout_keep_mask(seed, dout.shape[0], dout.shape[-1], dropout_p, dout.device)
        dx = torch.where(keep, dh * dropout_scale(dropout_p, cd), torch.zeros((), dtype=cd, device=dh.device))
    dweight = dw.to(weight.dtype) if weight is not None else None
    dbias = db.to(bias_dtype) if bias_dtype is not None else None
    return dx.to(x_dtype), dres, dweight, dbias


# --------------------------------------------------------------------------------------------------------------
# Statistics variants in a chosen accumulation dtype. Each arithmetic step rounds to ``dtype`` (elementwise
# torch ops on fp16/bf16 round their result), which is what a kernel accumulating in that dtype does.
# Rows are processed in parallel; the loop runs over the N elements of a row, as a naive kernel would.
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Stats:
    """Per-row statistics: element count, mean and M2 = sum((x - mean)^2); ``var = M2 / count``."""

    count: Tensor
    mean: Tensor
    m2: Tensor

    @property
    def var(self) -> Tensor:
        return self.m2 / self.count


def _check_2d(x: Tensor) -> Tensor:
    if x.dim() < 1:
        raise ValueError(f"x must have at least one dimension, got shape {tuple(x.shape)}")
    return x.reshape(-1, x.shape[-1])


def stats_naive(x: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """One pass accumulating sum(x) and sum(x^2) in ``dtype``; var = E[x^2] - E[x]^2 (cancels, can overflow)."""
    rows = _check_2d(x).to(dtype)
    s = torch.zeros(rows.shape[0], dtype=dtype, device=x.device)
    sq = torch.zeros_like(s)
    for j in range(rows.shape[1]):
        v = rows[:, j]
        s = s + v
        sq = sq + v * v
    n = rows.shape[1]
    mean = s / n
    var = sq / n - mean * mean
    return mean.reshape(x.shape[:-1]), var.reshape(x.shape[:-1])


def stats_two_pass(x: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Mean first, then sum((x - mean)^2), both accumulated in ``dtype``."""
    rows = _check_2d(x).to(dtype)
    s = torch.zeros(rows.shape[0], dtype=dtype, device=x.device)
    for j in range(rows.shape[1]):
        s = s + rows[:, j]
    mean = s / rows.shape[1]
    m2 = torch.zeros_like(s)
    for j in range(rows.shape[1]):
        d = rows[:, j] - mean
        m2 = m2 + d * d
    var = m2 / rows.shape[1]
    return mean.reshape(x.shape[:-1]), var.reshape(x.shape[:-1])


def _welford_rows(rows: Tensor, dtype: torch.dtype) -> Stats:
    n = torch.zeros(rows.shape[0], dtype=dtype, device=rows.device)
    mean = torch.zeros_like(n)
    m2 = torch.zeros_like(n)
    for j in range(rows.shape[1]):
        v = rows[:, j]
        n = n + 1
        delta = v - mean
        mean = mean + delta / n
        m2 = m2 + delta * (v - mean)
    return Stats(n, mean, m2)


def stats_welford(x: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Welford's single-pass update in ``dtype``: no E[x^2] - E[x]^2 cancellation."""
    st = _welford_rows(_check_2d(x).to(dtype), dtype)
    return st.mean.reshape(x.shape[:-1]), st.var.reshape(x.shape[:-1])


def chan_merge(a: Stats, b: Stats) -> Stats:
    """Chan et al.'s parallel merge of two partial Welford states (how threads/blocks combine on a GPU)."""
    n = a.count + b.count
    delta = b.mean - a.mean
    # guard empty partials: a 0/0 would otherwise poison the merge
    frac = torch.where(n > 0, b.count / torch.where(n > 0, n, torch.ones_like(n)), torch.zeros_like(n))
    mean = a.mean + delta * frac
    m2 = a.m2 + b.m2 + delta * delta * a.count * frac
    return Stats(n, mean, m2)


def stats_welford_chan(x: Tensor, dtype: torch.dtype = torch.float32, chunks: int = 8) -> tuple[Tensor, Tensor]:
    """Split each row into ``chunks`` pieces, Welford each, then merge the partials pairwise with Chan."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    rows = _check_2d(x).to(dtype)
    parts = [_welford_rows(p, dtype) for p in torch.tensor_split(rows, min(chunks, max(rows.shape[1], 1)), dim=1)]
    while len(parts) > 1:  # tree reduction, as a block reduce does
        merged = [chan_merge(parts[i], parts[i + 1]) for i in range(0, len(parts) - 1, 2)]
        if len(parts) % 2:
            merged.append(parts[-1])
        parts = merged
    st = parts[0]
    return st.mean.reshape(x.shape[:-1]), st.var.reshape(x.shape[:-1])
