"""Tolerances as data, and a float64 oracle check that every backend's tests share.

Each tolerance carries its reason. Outputs are compared against a float64 oracle fed the *same* low-precision
inputs, so the error allowed is the kernel's own: fp32 statistics plus one rounding of the result to the output
dtype. Reduced gradients (dweight, dbias) sum over M rows in another order than the oracle; their error grows
like sqrt(M) ulps, so their absolute tolerance is scaled by sqrt(M).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from addnorm.ops.contract import stats_dtype


@dataclass(frozen=True)
class Tol:
    atol: float
    rtol: float
    why: str


# Keyed by the dtype of the tensor being compared.
TOLERANCES: dict[torch.dtype, Tol] = {
    torch.float64: Tol(1e-9, 1e-9, "fp64 everywhere; only the order of summation differs from the oracle"),
    torch.float32: Tol(2e-5, 2e-5, "fp32 statistics: a few ulps from rsqrt and N-term sums (~N * 2^-24 worst case)"),
    torch.float16: Tol(2e-3, 4e-3, "one rounding to fp16 (2^-11 relative) after fp32 math, plus fp32 error"),
    torch.bfloat16: Tol(1.6e-2, 1.6e-2, "one rounding to bf16 (2^-8 relative) after fp32 math, plus fp32 error"),
}

# Gradients go through more arithmetic (two row reductions) than the forward: allow a few times more.
GRAD_FACTOR = 4.0


def tol(dtype: torch.dtype, *, grad: bool = False, reduced_rows: int = 1) -> tuple[float, float]:
    """(atol, rtol) for a tensor of ``dtype``; ``reduced_rows`` > 1 for sums over rows (dweight, dbias)."""
    t = TOLERANCES[dtype]
    f = GRAD_FACTOR if grad else 1.0
    return t.atol * f * math.sqrt(max(reduced_rows, 1)), t.rtol * f


def assert_close(
    actual: Tensor,
    expected: Tensor,
    what: str,
    *,
    grad: bool = False,
    reduced_rows: int = 1,
    dtype: torch.dtype | None = None,
) -> None:
    """Compare ``actual`` (any dtype) against a float64 ``expected`` with the tolerance of actual's dtype (or of
    ``dtype``, when a lower precision took part, e.g. an fp32 residual stream between fp64 tensors).

    Gradients are compared relative to the tensor's largest magnitude, since a gradient element near zero carries
    the absolute error of its larger neighbours.
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    atol, rtol = tol(dtype or actual.dtype, grad=grad, reduced_rows=reduced_rows)
    if grad and expected.numel():
        atol *= max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def _straight_through_round(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t rounded to ``dtype`` (kept in fp64), with the identity as gradient."""
    return t + (t.detach().to(dtype).double() - t.detach())


def oracle(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    *,
    eps: float,
    is_rms: bool,
    residual_dtype: torch.dtype | None = None,
    zero_centered_weight: bool = False,
    cast_before_weight: bool = False,
    out_dtype: torch.dtype | None = None,
    keep: Tensor | None = None,
    dropout_p: float = 0.0,
    dout: Tensor | None = None,
    dresidual_out: Tensor | None = None,
) -> dict[str, Tensor | None]:
    """Float64 results of the add + norm contract: out, residual_out and, when ``dout`` is given, every gradient.

    ``residual_out`` is rounded to ``residual_dtype`` exactly as the contract stores it, then normalized in fp64.
    ``keep`` is the dropout keep mask (boolean, x's shape) when ``dropout_p`` > 0. With ``cast_before_weight`` the
    normalized value is rounded to out's dtype (``out_dtype``, default x's) before the weight and bias, its gradient
    passing straight through.
    """
    rd = residual_dtype or (residual.dtype if residual is not None else x.dtype)
    leaves = {
        k: v.detach().double().requires_grad_(True)
        for k, v in (("x", x), ("residual", residual), ("weight", weight), ("bias", bias))
        if v is not None
    }
    h = leaves["x"]
    if dropout_p > 0:
        h = torch.where(keep, h / (1 - dropout_p), torch.zeros((), dtype=torch.float64))
    if residual is not None:
        h = h + leaves["residual"]
    # round to the stored dtype, but let the gradient pass straight through (the rounding is not differentiated)
    res_out = _straight_through_round(h, rd)
    w = leaves.get("weight")
    b = leaves.get("bias")
    if w is not None and zero_centered_weight:
        w = w + 1
    n = (x.shape[-1],)
    if is_rms:
        xhat = torch.nn.functional.rms_norm(res_out, n, None, eps)
    else:
        xhat = torch.nn.functional.layer_norm(res_out, n, None, None, eps)
    if cast_before_weight and (w is not None or b is not None):
        xhat = _straight_through_round(xhat, out_dtype or x.dtype)
    out = xhat
    if w is not None:
        out = out * w
    if b is not None:
        out = out + b
    result: dict[str, Tensor | None] = {"out": out.detach(), "residual_out": res_out.detach()}
    if dout is not None:
        total = (out * dout.double()).sum()
        if dresidual_out is not None:
            total = total + (res_out * dresidual_out.double()).sum()
        total.backward()
        for k, v in leaves.items():
            result["d" + k] = v.grad
    return result


__all__ = ["Tol", "TOLERANCES", "tol", "assert_close", "oracle", "stats_dtype"]
