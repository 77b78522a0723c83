"""The ``torch`` backend: the add + norm contract (:mod:`addnorm.ops.add_norm`) in plain PyTorch. The readable one,
the fallback where no kernel backend runs and the baseline of the benchmarks; differentiable by autograd to any
order, traced natively by torch.compile, seen through by torch.func transforms.

Unlike the kernel backends it needs no custom op around it: :func:`add_norm` takes the tensors and the call's
:class:`~addnorm.ops.contract.AddNormSpec` and returns ``(out, residual_out)`` with the autograd graph attached.

The finite-range guard (:mod:`addnorm.ops.contract`): the norms run as ATen's ops that also return the row
statistics (``native_layer_norm``, ``_fused_rms_norm``: the kernels behind F.layer_norm and F.rms_norm, the same
bits), the guard's test reads them (eagerly on the host, in the fewest ops: :func:`_all_ordinary`), and only a call
with a row that fails it runs the scaled float64 pass for those rows, differentiably (:func:`scaled_norm`). Compiled
graphs cannot branch on a value, nor can torch.func transforms: there the scaled pass runs for every row and a
``where`` picks. The backward is ATen's: a row whose statistics are ordinary but whose ``dout * w`` or row sums
overflow fp32 is not rescued here (the cpu and Triton kernels rescue it, Triton's with its fix-up kernels; an eager
check costs two gradient hooks and a read of dh, 15-25 us a call at decode: benchmarks/results/finite_guard.md).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from addnorm.ops.contract import (
    GUARD_LIMITS,
    AddNormSpec,
    as_dtype,
    draw_seed,
    dropout_keep_mask,
    dropout_scale,
    lone_wide_row,
    ordinary_rows,
    stats_dtype,
)

__all__ = [
    "add_norm",
    "add_norm_general",
    "batch_invariant_rms_norm",
    "guard_rows",
    "rms_norm_one_dtype",
    "scaled_norm",
    "unavailable_reason",
]


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
    cast_to = out_dtype if spec.cast_before_weight else None

    def norm(h):
        n = (h.shape[-1],)
        if cast_to is None:
            return _norm_stats(h, n, w, b, eps, is_rms)
        # Llama's order: round the normalized value to x's dtype, then apply the weight (and bias) and round again
        xhat, mean, rstd = _norm_stats(h, n, None, None, eps, is_rms)
        return _affine(xhat, w, b, cast_to), mean, rstd

    out = guard_rows(norm, h, w, b, eps, is_rms, cast_to)
    return as_dtype(out, out_dtype), residual_out


def _affine(xhat, w, b, cast_to):
    if cast_to is not None and (w is not None or b is not None):
        # the rounding's gradient is the identity, as in the kernels: autograd through .to(out_dtype) would round
        # dout * w to out's dtype before the norm's backward (up to one bf16 ulp more error in dx). xhat + (r -
        # xhat) is r exactly: r is xhat's nearest out_dtype value, so the difference is exact (Sterbenz)
        xhat = xhat + (xhat.to(cast_to).to(xhat.dtype) - xhat).detach()
    if w is not None:
        xhat = xhat * w
    if b is not None:
        xhat = xhat + b
    return xhat


def _norm_stats(h, n, w, b, eps, is_rms):
    """(out, mean | None, rstd) of the plain norm: ATen's kernels that F.layer_norm and F.rms_norm run (the rms one
    as its overload, .default: the op packet's own dispatch in Python costs ~1-3 us a call at decode, and
    torch._fused_rms_norm is not traced by torch.compile)."""
    if not is_rms:
        return torch.native_layer_norm(h, n, w, b, eps)
    if lone_wide_row(h):  # (see batch_invariant_rms_norm)
        out, rstd = torch.ops.aten._fused_rms_norm.default(h.reshape(1, -1).expand(2, -1), n, w, eps)
        return out[:1].reshape(h.shape), None, rstd[:1].reshape(*h.shape[:-1], 1)
    out, rstd = torch.ops.aten._fused_rms_norm.default(h, n, w, eps)
    return out, None, rstd


def guard_rows(norm, h, w, b, eps, is_rms, cast_to):
    """``norm(h)`` (a function returning (out, mean | None, rstd) of the plain computation), with the rows that fail
    the guard's test recomputed by :func:`scaled_norm`."""
    out, mean, rstd = norm(h)
    # compiled graphs and torch.func transforms cannot branch on a value: _rescue's branch-free form. Eagerly the
    # plain out stands when every row passes the test, or on meta tensors (no values: shapes and dtypes are its)
    if not (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()) and (
        rstd.is_meta or _all_ordinary(mean, rstd)
    ):
        return out
    return _rescue(norm, h, out, mean, rstd, w, b, eps, is_rms, cast_to)


def _rescue(norm, h, out, mean, rstd, w, b, eps, is_rms, cast_to):
    """out with the rows that fail the test recomputed by :func:`scaled_norm`. The plain norm of such a row is run
    again on a harmless stand-in row, so that no inf or NaN of its own backward reaches the gradient."""
    compiling = torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
    if h.device.type == "meta":
        return out
    a = h.detach().abs().amax(dim=-1, keepdim=True)
    rescue = ~ordinary_rows(mean, rstd) & torch.isfinite(a) & (a > 0)  # non-finite and zero rows stay as they are
    if not compiling and not bool(rescue.any()):
        return out
    standin = (torch.arange(h.shape[-1], device=h.device) % 2 * 2 - 1).to(h.dtype)  # +-1: mean 0, var 1
    plain = norm(torch.where(rescue, standin, h))[0]
    fixed = scaled_norm(torch.where(rescue, h, standin), w, b, eps, is_rms, cast_to)
    return torch.where(rescue, fixed.to(plain.dtype), plain)


# Up to this many rows the statistics themselves are read to the host (one copy each) and tested in Python: on a
# CPU that is cheaper than the reductions (~1-2.5 us against ~3-11 us at 8 rows: benchmarks/results/finite_guard.md)
_HOST_TEST_ROWS = 16


def _all_ordinary(mean, rstd, one_read=None) -> bool:
    """ordinary_rows(mean, rstd).all(), in as few ops and host reads as possible: every eager call pays it (a decode
    step too). ``one_read`` (default: off the CPU, where each read of a device tensor waits for the device) reads
    the host once in all; on a CPU a read is a copy, cheaper than the op that would join two."""
    lo, hi, tiny = GUARD_LIMITS[rstd.dtype]
    m = rstd.numel()
    if one_read is None:
        one_read = not rstd.is_cpu
    if m == 1 and (mean is None or not one_read):
        # one row (decode): read the values, no list (a NaN fails the first test)
        return lo <= rstd.item() <= hi and (mean is None or not 0 < abs(mean.item()) < tiny)
    if m > _HOST_TEST_ROWS:
        return _all_ordinary_reduced(mean, rstd, lo, hi, tiny, one_read)
    if rstd.dim() != 2:  # (..., 1): the rows as (M, 1), read as [[v], ...]
        rstd = rstd.reshape(-1, 1)
        mean = None if mean is None else mean.reshape(-1, 1)
    if mean is None:
        for (r,) in rstd.tolist():
            if not lo <= r <= hi:
                return False
        return True
    if one_read:
        pairs = torch.cat((rstd, mean), dim=1).tolist()
    else:
        pairs = [(r, u) for (r,), (u,) in zip(rstd.tolist(), mean.tolist())]
    for r, u in pairs:
        if not lo <= r <= hi or 0 < abs(u) < tiny:  # (a subnormal mean fails, 0 is exact)
            return False
    return True


def _all_ordinary_reduced(mean, rstd, lo, hi, tiny, one_read) -> bool:
    """_all_ordinary for many rows: rstd's least and largest value (NaN propagates into both, and fails the test),
    and the least |mean|; only when that is 0 (a zero-mean row, exact) the least nonzero |mean| in one more pass."""
    least, most = torch.aminmax(rstd)
    parts = [least, most] if mean is None else [least, most, mean.abs().amin()]
    values = torch.stack(parts).tolist() if one_read else [t.item() for t in parts]
    if not (lo <= values[0] and values[1] <= hi):
        return False
    if mean is None or not values[2] < tiny:
        return True
    if values[2] != 0:
        return False
    am = mean.abs()
    return not torch.where(am == 0, math.inf, am).amin().item() < tiny


def scaled_norm(h, w, b, eps, is_rms, cast_to=None) -> Tensor:
    """The guard's scaled pass in plain PyTorch, differentiable: each row of h (finite, not all zero) multiplied by
    2^k, k from its max |value| (exact), its moments and the normalized value in float64, eps rounded to the
    statistics dtype as the plain norm takes it. Returns the float64 result (the caller rounds it)."""
    hd = h.double()
    a = hd.detach().abs().amax(dim=-1, keepdim=True)
    k = 1 - torch.frexp(a).exponent.to(torch.int64)
    one = torch.ones_like(a)
    s1, s2 = torch.ldexp(one, k // 2), torch.ldexp(one, k - k // 2)  # 2^k in two factors: each in range
    hs = hd * s1 * s2
    d = hs if is_rms else hs - hs.mean(dim=-1, keepdim=True)
    var_s = d.square().mean(dim=-1, keepdim=True)
    eps_c = float(eps) if h.dtype == torch.float64 else float(torch.tensor(eps, dtype=torch.float32))
    e = eps_c * s1 * s1 * s2 * s2
    # eps * 4^k beyond 2^60 leaves var_s (< 4) nothing to add: r = 2^-k / sqrt(eps) (float64 could overflow e)
    big = e > 2.0**60
    r = torch.where(big, (eps_c**-0.5 if eps_c > 0 else 0.0) / s1 / s2, torch.rsqrt(torch.where(big, 1.0, var_s + e)))
    wd = None if w is None else w.double()
    bd = None if b is None else b.double()
    return _affine(d * r, wd, bd, cast_to)


def rms_norm_one_dtype(x, residual, weight, eps, cast_before_weight):
    """RMSNorm when x, the residual, the weight and both outputs share one dtype and nothing is differentiated
    (decode): the two ops eager code runs, which give the contract's bits. ``x + residual`` in a half dtype is the
    fp32 sum rounded once, and F.rms_norm on a half tensor computes in fp32 and rounds once, as
    :func:`add_norm_general` does explicitly (tests/ops/test_fast_path.py checks both bit for bit over awkward
    shapes). Not for gradients: autograd through the half-dtype ops rounds intermediate values the contract's
    backward does not."""
    h = x if residual is None else x + residual
    n = (x.shape[-1],)
    cast_to = h.dtype if cast_before_weight else None

    def norm(h):
        if cast_before_weight:  # (only a half dtype gets here: the cast is dropped when x's dtype is the stats one)
            out, _, rstd = _norm_stats(h, n, None, None, eps, True)
            return (out if weight is None else out * weight), None, rstd
        return _norm_stats(h, n, weight, None, eps, True)

    return guard_rows(norm, h, weight, None, eps, True, cast_to), h


def batch_invariant_rms_norm(h, n, weight, eps):
    """F.rms_norm, with the bits a row gets in a batch of any size: ATen would sum a lone row of >= 32K elements in
    two passes split across threads, so it is normalized as one of two identical rows (contract.lone_wide_row).
    LayerNorm needs no such care: ATen's LayerNorm kernel reduces each row in one thread whatever the row count."""
    if lone_wide_row(h):
        return F.rms_norm(h.reshape(1, -1).expand(2, -1), n, weight, eps)[:1].reshape(h.shape)
    return F.rms_norm(h, n, weight, eps)
