"""The add + norm contract extended with the features of flash-attention's layer norm: a second branch input,
a per-row scale, a second affine output, RMSNorm with a bias and returned dropout masks.

    branch       = dropout(x * rowscale) + dropout1(x1)     # each with its own mask; rowscale per row of x
    residual_out = branch + residual                       # in residual_dtype, rounded once
    xhat         = norm(residual_out)                      # statistics as in the contract (fp32, fp64 for fp64)
    out          = xhat * w  + b                           # w = 1 + weight with zero_centered_weight
    out1         = xhat * w1 + b1                          # only with weight1; the same statistics

Everything follows :mod:`addnorm.ops.add_norm`'s contract (statistics dtype, one rounding of residual_out and of
each output, ``cast_before_weight``, the dropout keep-function of :mod:`addnorm.ops.contract`), on every backend.

What runs in one fused kernel and what is composed around it (composition is exact under the contract: the
pieces are computed in the statistics dtype and rounded where the contract rounds):

- fused: everything :func:`addnorm.add_layer_norm` / :func:`addnorm.add_rms_norm` take (x, residual, weight,
  bias, dropout without a returned mask).
- composed before the kernel: ``rowscale``, ``x1``, and dropout when a mask is returned or x1/rowscale is
  present. The branch is formed in the statistics dtype (masks drawn with :func:`addnorm.ops.contract.
  dropout_keep_mask` from seeds drawn like the kernels'), then goes through the fused kernel without dropout. This
  costs one (M, N) temporary in the statistics dtype.
- composed after the kernel: ``weight1``/``bias1`` and RMSNorm's ``bias``. The kernel returns xhat (no weight,
  output in the statistics dtype) and the affine steps run in PyTorch; gradients reach x through the kernel's
  backward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from addnorm.ops.add_norm import run_add_norm
from addnorm.ops.contract import (
    as_dtype,
    check_affine,
    check_bools,
    check_float,
    check_like_x,
    default_rms_eps,
    draw_seed,
    dropout_keep_mask,
    dropout_scale,
    stats_dtype,
)

__all__ = ["AddNormOutputs", "add_norm_multi"]


class AddNormOutputs(NamedTuple):
    """What :func:`add_norm_multi` returns; fields that were not asked for are None."""

    out: Tensor
    residual_out: Tensor
    out1: Tensor | None = None
    dropout_mask: Tensor | None = None  # bool, x's shape, True = kept
    dropout_mask1: Tensor | None = None  # x1's mask


def _validate_extra(x, x1, weight1, bias1, rowscale, bias, is_rms) -> None:
    check_float("x", x)
    n = x.shape[-1] if x.dim() else 0
    if x1 is not None:
        check_like_x("x1", x1, x)
    check_affine("weight1", weight1, n, x)
    check_affine("bias1", bias1, n, x)
    if bias1 is not None and weight1 is None:
        raise ValueError("bias1 was given without weight1: the second output needs weight1")
    if rowscale is not None:
        check_float("rowscale", rowscale)
        if rowscale.numel() != x.numel() // max(n, 1) or (rowscale.dim() > 1 and rowscale.shape != x.shape[:-1]):
            raise ValueError(
                f"rowscale must hold one value per row of x: shape {tuple(x.shape[:-1])} or "
                f"({x.numel() // max(n, 1)},), got {tuple(rowscale.shape)}"
            )
        if rowscale.device != x.device:
            raise ValueError(f"rowscale must be on x's device {x.device}, got {rowscale.device}")


def _dropout(h: Tensor, p: float, cd: torch.dtype) -> tuple[Tensor, Tensor]:
    """The contract's dropout of h (already in the statistics dtype): a fresh seed drawn like the kernels', the
    keep-function of addnorm.ops.contract, kept values times dropout_scale. Returns (dropped h, bool keep mask)."""
    n = h.shape[-1]
    keep = dropout_keep_mask(draw_seed(h.device), h.numel() // n, n, p, h.device).reshape(h.shape)
    return torch.where(keep, h * dropout_scale(p, cd), torch.zeros((), dtype=cd, device=h.device)), keep


def _affine(xhat: Tensor, weight, bias, zero_centered_weight, cast_before_weight, out_dtype) -> Tensor:
    """xhat (statistics dtype) -> xhat * w + b rounded once to out_dtype; with cast_before_weight xhat is first
    rounded to out_dtype with a straight-through gradient, as the contract's kernels do."""
    cd = xhat.dtype
    if cast_before_weight and (weight is not None or bias is not None) and out_dtype != cd:
        xhat = xhat + (xhat.to(out_dtype).to(cd) - xhat).detach()
    y = xhat
    if weight is not None:
        w = as_dtype(weight, cd)
        y = y * (w + 1 if zero_centered_weight else w)
    if bias is not None:
        y = y + as_dtype(bias, cd)
    return as_dtype(y, out_dtype)


def add_norm_multi(
    x: Tensor,
    residual: Tensor | None = None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float | None = 1e-5,
    *,
    is_rms: bool = False,
    x1: Tensor | None = None,
    weight1: Tensor | None = None,
    bias1: Tensor | None = None,
    rowscale: Tensor | None = None,
    dropout_p: float = 0.0,
    residual_dtype: torch.dtype | None = None,
    zero_centered_weight: bool = False,
    cast_before_weight: bool = False,
    out_dtype: torch.dtype | None = None,
    return_dropout_mask: bool = False,
    backend: str = "auto",
) -> AddNormOutputs:
    """Add + LayerNorm (``is_rms=False``) or RMSNorm with the extras of the module docstring. Returns
    :class:`AddNormOutputs` ``(out, residual_out, out1, dropout_mask, dropout_mask1)``.

    ``x1``: a second branch added to the stream (the parallel block), with its own dropout mask. ``rowscale``: one
    factor per row of x, applied before dropout (drop-path). ``weight1``/``bias1``: a second output from the same
    statistics. ``bias`` works for RMSNorm too. ``return_dropout_mask``: the bool keep masks (None when
    ``dropout_p`` is 0). ``residual_dtype`` defaults to the residual's dtype, else x's; ``out_dtype`` (both outputs)
    to x's dtype; ``eps=None`` (RMSNorm) to the machine epsilon of residual_dtype. The other options are those of
    :func:`addnorm.add_layer_norm`.
    """
    check_bools(
        ("is_rms", is_rms),
        ("zero_centered_weight", zero_centered_weight),
        ("cast_before_weight", cast_before_weight),
        ("return_dropout_mask", return_dropout_mask),
    )
    _validate_extra(x, x1, weight1, bias1, rowscale, bias, is_rms)
    if is_rms and eps is None:
        eps = default_rms_eps(x, residual, residual_dtype)
    fused = x1 is None and rowscale is None and weight1 is None and not (is_rms and bias is not None)
    if fused and not return_dropout_mask:
        out, res = run_add_norm(
            x,
            residual,
            weight,
            bias,
            eps,
            is_rms,
            dropout_p,
            residual_dtype,
            zero_centered_weight,
            cast_before_weight,
            out_dtype,
            backend,
        )
        return AddNormOutputs(out, res)

    rd = residual_dtype or (residual.dtype if residual is not None else x.dtype)
    od = out_dtype or x.dtype
    cd = stats_dtype(x1.dtype if x1 is not None and x1.dtype == torch.float64 else x.dtype, rd)
    mask = mask1 = None
    branch, kernel_p = x, dropout_p
    compose_branch = x1 is not None or rowscale is not None or (return_dropout_mask and dropout_p > 0)
    if compose_branch:
        if not isinstance(dropout_p, (int, float)) or type(dropout_p) is bool or not 0.0 <= dropout_p < 1.0:
            raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
        branch = as_dtype(x, cd)
        if rowscale is not None:
            branch = branch * as_dtype(rowscale, cd).reshape(*x.shape[:-1], 1)
        if dropout_p > 0:
            branch, mask = _dropout(branch, dropout_p, cd)
        if x1 is not None:
            b1 = as_dtype(x1, cd)
            if dropout_p > 0:
                b1, mask1 = _dropout(b1, dropout_p, cd)
            branch = branch + b1
        kernel_p = 0.0
    if fused:
        out, res = run_add_norm(
            branch,
            residual,
            weight,
            bias,
            eps,
            is_rms,
            kernel_p,
            rd,
            zero_centered_weight,
            cast_before_weight,
            od,
            backend,
        )
        return AddNormOutputs(out, res, None, mask, mask1)
    # xhat from the kernel (no affine step, kept in the statistics dtype), then each affine output composed
    xhat, res = run_add_norm(branch, residual, None, None, eps, is_rms, kernel_p, rd, False, False, cd, backend)
    out = _affine(xhat, weight, bias, zero_centered_weight, cast_before_weight, od)
    out1 = None
    if weight1 is not None:
        out1 = _affine(xhat, weight1, bias1, zero_centered_weight, cast_before_weight, od)
    return AddNormOutputs(out, res, out1, mask, mask1)
