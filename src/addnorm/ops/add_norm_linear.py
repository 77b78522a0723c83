"""Residual add + norm + linear with the norm's output not kept for the backward:

    residual_out = x + residual;   y = norm(residual_out);   out = y @ linear_weight.T + linear_bias

The forward keeps residual_out (the block needs it anyway), the weights, and not y: the backward recomputes y
from residual_out (statistics included: one more row reduction in exchange for one fewer (M, N) activation per
call), then runs the norm's backward written out in the statistics dtype (no torch.autograd.grad inside the
autograd.Function, so torch.compile(fullgraph=True) traces it). The norm follows :mod:`addnorm.ops.add_norm`'s
contract (it is computed by :func:`addnorm.ops.add_norm_multi.add_norm_multi`, so RMSNorm may have a bias), the
recomputed y is bitwise the forward's (same values, same backend), and no dropout is offered (flash-attention's
``layer_norm_linear_fn`` has none either).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from addnorm.ops.add_norm_multi import add_norm_multi
from addnorm.ops.contract import check_bools, check_float, default_rms_eps, row_mean, stats_dtype

__all__ = ["add_norm_linear"]


class _AddNormLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x,
        residual,
        norm_weight,
        norm_bias,
        linear_weight,
        linear_bias,
        eps,
        is_rms,
        residual_dtype,
        out_dtype,
        zero_centered_weight,
        backend,
    ):
        y, res = add_norm_multi(
            x,
            residual,
            norm_weight,
            norm_bias,
            eps,
            is_rms=is_rms,
            residual_dtype=residual_dtype,
            out_dtype=out_dtype,
            zero_centered_weight=zero_centered_weight,
            backend=backend,
        )[:2]
        out = F.linear(y.to(linear_weight.dtype), linear_weight, linear_bias)
        ctx.save_for_backward(res, norm_weight, norm_bias, linear_weight)  # y is not saved
        ctx.opts = (
            eps,
            is_rms,
            out_dtype,
            zero_centered_weight,
            backend,
            x.dtype,
            None if residual is None else residual.dtype,
            linear_bias is not None,
            stats_dtype(x.dtype, res.dtype),
        )
        if res is x:  # nothing was added or rounded: residual_out is x itself; autograd needs its own tensor
            res = x.view_as(x)
        return out, res

    @staticmethod
    def backward(ctx, dout, dres):
        res, nw, nb, lw = ctx.saved_tensors
        eps, is_rms, od, zc, backend, x_dtype, r_dtype, has_lb, cd = ctx.opts
        h = res.to(cd)  # exact upcast: the same value the forward normalized
        y = add_norm_multi(
            h,
            None,
            nw,
            nb,
            eps,
            is_rms=is_rms,
            residual_dtype=cd,
            out_dtype=od,
            zero_centered_weight=zc,
            backend=backend,
        ).out
        d2 = dout.reshape(-1, dout.shape[-1])
        y2 = y.to(lw.dtype).reshape(-1, y.shape[-1])
        dlw = (d2.t() @ y2).to(lw.dtype) if ctx.needs_input_grad[4] else None
        dlb = d2.sum(0).to(lw.dtype) if has_lb and ctx.needs_input_grad[5] else None
        dy = (dout @ lw).to(od).to(cd)  # the gradient reaching y, in y's dtype, as autograd would deliver it
        # The norm's backward written out (not torch.autograd.grad through the op, which torch.compile cannot
        # trace inside an autograd.Function): statistics recomputed in cd from h, then the usual formulas
        # dh = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * w (LayerNorm; RMSNorm drops mean(g)).
        if is_rms:
            rstd = torch.rsqrt(row_mean(h.square(), keepdim=True) + eps)
            xhat = h * rstd
        else:
            centered = h - row_mean(h, keepdim=True)
            rstd = torch.rsqrt(row_mean(centered.square(), keepdim=True) + eps)
            xhat = centered * rstd
        g = dy if nw is None else dy * (nw.to(cd) + 1 if zc else nw.to(cd))
        dh = g - xhat * row_mean(g * xhat, keepdim=True)
        if not is_rms:
            dh = dh - row_mean(g, keepdim=True)
        dh = dh * rstd
        rows = tuple(range(dy.dim() - 1))
        dnw = (dy * xhat).sum(rows).to(nw.dtype) if nw is not None else None
        dnb = dy.sum(rows).to(nb.dtype) if nb is not None else None
        if dres is not None:
            dh = dh + dres.to(dh.dtype)
        dx = dh.to(x_dtype)
        dr = dh.to(r_dtype) if r_dtype is not None else None
        return dx, dr, dnw, dnb, dlw, dlb, None, None, None, None, None, None


def add_norm_linear(
    x: Tensor,
    residual: Tensor | None,
    norm_weight: Tensor | None,
    norm_bias: Tensor | None,
    linear_weight: Tensor,
    linear_bias: Tensor | None = None,
    eps: float | None = 1e-5,
    *,
    is_rms: bool = False,
    residual_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
    zero_centered_weight: bool = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """``(linear(norm(x + residual)), x + residual)`` with the norm's output recomputed in the backward instead of
    stored. ``out_dtype`` is the norm output's dtype (default x's); the linear runs in linear_weight's dtype (cast
    it first for mixed precision). Under autocast, norm output and linear weight take autocast's dtype."""
    check_bools(("is_rms", is_rms), ("zero_centered_weight", zero_centered_weight))
    check_float("linear_weight", linear_weight)
    if linear_weight.dim() != 2 or linear_weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"linear_weight must have shape (out_features, {x.shape[-1]}), got {tuple(linear_weight.shape)}"
        )
    if linear_bias is not None:
        check_float("linear_bias", linear_bias)
        if tuple(linear_bias.shape) != (linear_weight.shape[0],):
            raise ValueError(f"linear_bias must have shape ({linear_weight.shape[0]},), got {tuple(linear_bias.shape)}")
    if is_rms and eps is None:
        eps = default_rms_eps(x, residual, residual_dtype)
    if torch.is_autocast_enabled(x.device.type):
        dt = torch.get_autocast_dtype(x.device.type)
        out_dtype = dt
        linear_weight = linear_weight.to(dt)  # differentiable: the gradient reaches the fp32 weight
        linear_bias = linear_bias.to(dt) if linear_bias is not None else None
    with torch.autocast(x.device.type, enabled=False):
        return _AddNormLinear.apply(
            x,
            residual,
            norm_weight,
            norm_bias,
            linear_weight,
            linear_bias,
            eps,
            is_rms,
            residual_dtype,
            out_dtype or x.dtype,
            zero_centered_weight,
            backend,
        )
