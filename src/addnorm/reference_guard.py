"""The contract's finite-range guard (:mod:`addnorm.ops.contract`) for the ``reference`` backend.

The oracle of :mod:`addnorm.reference` computes every row with the plain statistics of the contract, in the
statistics dtype: that is what the kernels' ordinary rows are checked against bit for bit, so its formulas stay as
they are. A row they cannot serve (fp32 sums of squares of values near 1e20 overflow, near 1e-23 underflow) is
patched here, after the oracle ran, by the contract's own rule:

- forward: a row whose plain statistics fail :func:`~addnorm.ops.contract.ordinary_rows` (and whose values are
  finite and not all zero) is normalized again from ``h * 2^k`` (k from its max |value|: exact), its moments and
  the normalized value in float64; its saved mean and rstd are the true ones rounded to the statistics dtype;
- backward: a row whose saved statistics fail the test gets its scaled moments again from h (r = 1 / sqrt(var_s)
  when that reproduces the saved rstd, else rstd * 2^-k), and a row whose statistics are ordinary but whose plain
  row sums sum(g), sum(g * xhat) (g = dout * w) come out inf or NaN from finite dout, h and w (the backward overflowed
  the statistics dtype) gets k = 0 and its saved statistics; either way the gradient is computed in float64 in the
  scaled units and multiplied by 2^k last, so a gradient beyond the dtype's range is inf, never NaN.

Every other row keeps the oracle's bits (nothing is patched when no row needs it). The rule is the cpu backend's
(``addnorm.ops.cpu.stats``, ``addnorm.ops.cpu.guard_bwd``), written here again in PyTorch so that the oracle does not
run the code it judges.
"""

from __future__ import annotations

import torch
from torch import Tensor

from addnorm.ops.contract import dropout_keep_mask, dropout_scale, ordinary_rows, row_mean
from addnorm.reference import _affine, _effective_weight

__all__ = ["guard_backward", "guard_forward"]

# eps * 4^k beyond this leaves var_s (< 4 for a row scaled into [1, 2)) nothing to add: r = 2^-k / sqrt(eps) then,
# which also holds where eps * 4^k itself would overflow float64 (fp64 rows, k up to 1075)
_EPS_DOMINATES = 2.0**60


def _pow2_halves(k: Tensor) -> tuple[Tensor, Tensor]:
    """2^k as two float64 factors (shape of k), each in range even where 2^k alone is not (k up to 1075)."""
    one = torch.ones(k.shape, dtype=torch.float64, device=k.device)
    return torch.ldexp(one, k // 2), torch.ldexp(one, k - k // 2)


def _scaled_moments(h: Tensor, is_rms: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(s1, s2, mean_s, var_s) of rows h (finite, not all zero), each (rows, 1): h * s1 * s2 has its max |value| in
    [1, 2) (the contract's guard_scale_exponent), its moments taken in float64 (RMSNorm: mean_s = 0)."""
    hd = h.double()
    a = hd.abs().amax(dim=-1, keepdim=True)
    s1, s2 = _pow2_halves(1 - torch.frexp(a).exponent.to(torch.int64))
    hs = hd * s1 * s2
    mean_s = torch.zeros_like(a) if is_rms else row_mean(hs, keepdim=True)
    var_s = row_mean((hs - mean_s).square(), keepdim=True)
    return s1, s2, mean_s, var_s


def _rescuable(h: Tensor) -> Tensor:
    """Rows the guard may recompute: finite and not all zero (NaN in stays NaN; a zero row with eps = 0 is 0/0 in
    float64 too)."""
    a = h.abs().amax(dim=-1)
    return torch.isfinite(a) & (a > 0)


def guard_forward(
    out: Tensor,
    residual_out: Tensor,
    mean: Tensor | None,
    rstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    *,
    eps: float,
    is_rms: bool,
    zero_centered_weight: bool,
    cast_before_weight: bool,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """(out, mean, rstd) of :func:`addnorm.reference.add_norm_ref` with the rows that fail the guard's test
    recomputed by the scaled float64 pass; the tensors themselves when every row passes."""
    if rstd.device.type == "meta":  # no values to test: shapes and dtypes are the plain pass's
        return out, mean, rstd
    cd = rstd.dtype
    n = residual_out.shape[-1]
    h = residual_out.reshape(-1, n).to(cd)  # the sum as stored, as the oracle normalized it
    m_flat = None if mean is None else mean.reshape(-1)
    rows = (~ordinary_rows(m_flat, rstd.reshape(-1)) & _rescuable(h)).nonzero().squeeze(1)
    if rows.numel() == 0:
        return out, mean, rstd
    s1, s2, mean_s, var_s = _scaled_moments(h[rows], is_rms)
    # eps as the plain pass added it (rounded to the statistics dtype), in the scaled units: eps * 4^k
    eps_c = float(torch.tensor(float(eps), dtype=cd))
    e = eps_c * s1 * s1 * s2 * s2
    big = e > _EPS_DOMINATES
    r = torch.where(
        big, (eps_c**-0.5 if eps_c > 0 else 0.0) / s1 / s2, 1.0 / torch.sqrt(torch.where(big, 1.0, var_s + e))
    )
    hs = h[rows].double() * s1 * s2
    w = _effective_weight(weight, zero_centered_weight, torch.float64)
    b = None if bias is None or is_rms else bias.to(torch.float64)
    y = _affine((hs - mean_s) * r, w, b, out.dtype if cast_before_weight else None)
    # copies written by row (views: a write through a reshape that copied would be lost); the oracle's tensors are
    # fresh, but a caller may hold them
    out, rstd = out.clone(memory_format=torch.contiguous_format), rstd.clone(memory_format=torch.contiguous_format)
    out.view(-1, n)[rows] = y.to(out.dtype)
    rstd.view(-1)[rows] = (r * s1 * s2).squeeze(1).to(cd)
    if mean is not None:
        mean = mean.clone(memory_format=torch.contiguous_format)
        mean.view(-1)[rows] = (mean_s / s1 / s2).squeeze(1).to(cd)
    return out, mean, rstd


def guard_backward(
    grads: tuple[Tensor, Tensor | None, Tensor | None, Tensor | None],
    dout: Tensor,
    dresidual_out: Tensor | None,
    residual_out: Tensor,
    weight: Tensor | None,
    mean: Tensor | None,
    rstd: Tensor,
    *,
    dropout_p: float,
    seed,
    zero_centered_weight: bool,
    cast_before_weight: bool,
    x_dtype: torch.dtype,
    residual_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """(dx, dresidual, dweight, dbias) of :func:`addnorm.reference.add_norm_bwd_ref` (``grads``), with the rows the
    guard rescues (the module's docstring) recomputed in float64; ``grads`` itself when there are none."""
    if rstd.device.type == "meta":
        return grads
    dx, dres, dweight, dbias = grads
    cd = rstd.dtype
    n = dout.shape[-1]
    h = residual_out.reshape(-1, n).to(cd)
    dyf = dout.reshape(-1, n).to(cd)
    rs = rstd.reshape(-1, 1).to(cd)
    mu = None if mean is None else mean.reshape(-1, 1).to(cd)
    w = _effective_weight(weight, zero_centered_weight, cd)
    # the oracle's own plain values (its _norm_bwd, the same ops): its row sums, and dweight's terms
    xhat = (h - mu) * rs if mu is not None else h * rs
    g = dyf * w if w is not None else dyf
    sums_finite = torch.isfinite(row_mean(g)) & torch.isfinite(row_mean(g * xhat))
    inputs_finite = torch.isfinite(dyf).all(dim=-1) & torch.isfinite(h).all(dim=-1)
    if w is not None:
        inputs_finite &= bool(torch.isfinite(w).all())
    ordinary = ordinary_rows(None if mu is None else mu.squeeze(1), rs.squeeze(1))
    scaled = ~ordinary & _rescuable(h)
    overflowed = ordinary & ~sums_finite & inputs_finite
    rows = (scaled | overflowed).nonzero().squeeze(1)
    if rows.numel() == 0:
        return grads
    hr = h[rows]
    # scaled rows: k from their max |value|, mean_s and r from the saved statistics as the forward gave them;
    # overflowed rows: k = 0 (s1 = s2 = 1), the saved statistics as they are
    s1, s2, mean_s, var_s = _scaled_moments(hr, mu is None)
    r = 1.0 / torch.sqrt(var_s)
    saved = rs[rows].double()
    r = torch.where((r * s1 * s2).to(cd).double() == saved, r, saved / s1 / s2)  # eps negligible, else rstd * 2^-k
    plain = overflowed[rows].unsqueeze(1)
    one = torch.ones_like(s1)
    s1, s2 = torch.where(plain, one, s1), torch.where(plain, one, s2)
    r = torch.where(plain, saved, r)
    if mu is not None:
        mean_s = torch.where(plain, mu[rows].double(), mean_s)
    xh = (hr.double() * s1 * s2 - mean_s) * r
    dy = dyf[rows].double()
    w64 = None if weight is None else _effective_weight(weight, zero_centered_weight, torch.float64)
    g64 = dy * w64 if w64 is not None else dy
    mean_g = 0.0 if mu is None else row_mean(g64, keepdim=True)
    dh = r * (g64 - mean_g - xh * row_mean(g64 * xh, keepdim=True)) * s1 * s2  # 2^k last: inf, never NaN
    if dresidual_out is not None:
        dh = dh + dresidual_out.reshape(-1, n)[rows].double()
    if dres is not None:
        dres = dres.clone(memory_format=torch.contiguous_format)  # (may be dx itself: no rounding separates them)
        dres.view(-1, n)[rows] = dh.to(dres.dtype)
    if dropout_p > 0.0:
        keep = dropout_keep_mask(seed, h.shape[0], n, dropout_p, h.device)[rows]
        dh = torch.where(
            keep, dh * dropout_scale(dropout_p, cd), torch.zeros((), dtype=torch.float64, device=dh.device)
        )
    dx = dx.clone(memory_format=torch.contiguous_format)
    dx.view(-1, n)[rows] = dh.to(x_dtype)
    if weight is not None:
        # the oracle's dweight, its terms dout * xhat of these rows taken in float64 (rounded to the statistics
        # dtype, as the sum is); the value the forward rounded xhat to (cast_before_weight) is dout's dtype
        xq = xhat.to(dout.dtype).to(cd) if cast_before_weight else xhat
        xr = xh.to(dout.dtype).double() if cast_before_weight else xh
        terms = dyf * xq
        terms[rows] = (dy * xr).to(cd)
        dweight = terms.sum(dim=0).to(weight.dtype)
    return dx, dres, dweight, dbias
