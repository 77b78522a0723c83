"""The ``torch`` backend: the add + norm contract (:mod:`addnorm.ops.add_norm`) in plain PyTorch. The readable one,
the fallback where no kernel backend runs and the baseline of the benchmarks; differentiable by autograd to any
order, traced natively by torch.compile, seen through by torch.func transforms.

Unlike the kernel backends it needs no custom op around it: :func:`add_norm` takes the tensors and the call's
:class:`~addnorm.ops.contract.AddNormSpec` and returns ``(out, residual_out)`` with the autograd graph attached.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from addnorm.ops.contract import (
    AddNormSpec,
    as_dtype,
    draw_seed,
    dropout_keep_mask,
    dropout_scale,
    lone_wide_row,
    stats_dtype,
)

__all__ = ["add_norm", "add_norm_general", "batch_invariant_rms_norm", "rms_norm_one_dtype", "unavailable_reason"]


def unavailable_reason(device: torch.device) -> str | None:
    return None  # plain PyTorch runs wherever torch does


def add_norm(x: Tensor, residual, weight, bias, spec: AddNormSpec) -> tuple[Tensor, Tensor]:
    """(out, residual_out) of one call: the one-dtype RMSNorm shortcut when it gives the contract's bits and nothing
    is differentiated, else :func:`add_norm_general`."""
    dt = spec.residual_dtype
    if (
        spec.is_rms
        and spec.dropout_p == 0.0
        and not spec.zero_centered_weight
        and x.dtype is dt
        and spec.out_dtype is dt
        and (residual is None or residual.dtype is dt)
        and (weight is None or weight.dtype is dt)
        and not (torch.is_grad_enabled() and _any_requires_grad(x, residual, weight))
    ):
        return rms_norm_one_dtype(x, residual, weight, spec.eps, spec.cast_before_weight)
    return add_norm_general(x, residual, weight, bias, spec)


def _any_requires_grad(x, residual, weight) -> bool:
    return (
        x.requires_grad
        or (residual is not None and residual.requires_grad)
        or (weight is not None and weight.requires_grad)
    )


def add_norm_general(x: Tensor, residual, weight, bias, spec: AddNormSpec) -> tuple[Tensor, Tensor]:
    """The contract written out in the statistics dtype: every case, differentiable."""
    eps, is_rms, out_dtype = spec.eps, spec.is_rms, spec.out_dtype
    cd = stats_dtype(x.dtype, spec.residual_dtype)
    h = as_dtype(x, cd)
    if spec.dropout_p > 0.0:
        # the contract's mask and scaling, not F.dropout: the same bits as the kernel backends
        n, p = x.shape[-1], spec.dropout_p
        keep = dropout_keep_mask(draw_seed(x.device), x.numel() // n, n, p, x.device).reshape(x.shape)
        h = torch.where(keep, h * dropout_scale(p, cd), torch.zeros((), dtype=cd, device=x.device))
    if residual is not None:
        h = h + as_dtype(residual, cd)
    residual_out = as_dtype(h, spec.residual_dtype)  # rounded once; the norm below sees exactly this
    h = as_dtype(residual_out, cd)
    w = None if weight is None else as_dtype(weight, cd)
    if w is not None and spec.zero_centered_weight:
        w = w + 1
    b = None if bias is None or is_rms else as_dtype(bias, cd)
    n = (x.shape[-1],)
    if spec.cast_before_weight:
        # Llama's order: round the normalized value to x's dtype, then apply the weight (and bias) and round again
        xhat = batch_invariant_rms_norm(h, n, None, eps) if is_rms else F.layer_norm(h, n, None, None, eps)
        # the rounding's gradient is the identity, as in the kernels: autograd through .to(out_dtype) would round
        # dout * w to out's dtype before the norm's backward (up to one bf16 ulp more error in dx). xhat + (r -
        # xhat) is r exactly: r is xhat's nearest out_dtype value, so the difference is exact (Sterbenz)
        out = xhat + (xhat.to(out_dtype).to(cd) - xhat).detach()
        if w is not None:
            out = out * w
        if b is not None:
            out = out + b
    elif is_rms:
        out = batch_invariant_rms_norm(h, n, w, eps)
    else:
        out = F.layer_norm(h, n, w, b, eps)
    return as_dtype(out, out_dtype), residual_out


def rms_norm_one_dtype(x, residual, weight, eps, cast_before_weight):
    """RMSNorm when x, the residual, the weight and both outputs share one dtype and nothing is differentiated
    (decode): the two ops eager code runs, which give the contract's bits. ``x + residual`` in a half dtype is the
    fp32 sum rounded once, and F.rms_norm on a half tensor computes in fp32 and rounds once, as
    :func:`add_norm_general` does explicitly (tests/ops/test_fast_path.py checks both bit for bit over awkward
    shapes). Not for gradients: autograd through the half-dtype ops rounds intermediate values the contract's
    backward does not."""
    h = x if residual is None else x + residual
    n = (x.shape[-1],)
    if cast_before_weight:  # (only a half dtype gets here: the cast is dropped when x's dtype is the statistics one)
        out = batch_invariant_rms_norm(h, n, None, eps)
        return (out if weight is None else out * weight), h
    return batch_invariant_rms_norm(h, n, weight, eps), h


def batch_invariant_rms_norm(h, n, weight, eps):
    """F.rms_norm, with the bits a row gets in a batch of any size: ATen would sum a lone row of >= 32K elements in
    two passes split across threads, so it is normalized as one of two identical rows (contract.lone_wide_row).
    LayerNorm needs no such care: ATen's LayerNorm kernel reduces each row in one thread whatever the row count."""
    if lone_wide_row(h):
        return F.rms_norm(h.reshape(1, -1).expand(2, -1), n, weight, eps)[:1].reshape(h.shape)
    return F.rms_norm(h, n, weight, eps)
