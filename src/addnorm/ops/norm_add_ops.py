"""The fused norm-then-add kernels (:mod:`addnorm.ops.norm_add`) behind ``torch.library``: the custom ops
``addnorm::norm_add_fwd``, ``addnorm::norm_add_bwd`` and ``addnorm::norm_add_`` (in place) with fake
implementations and registered autograd (what compiled graphs call), the plain autograd.Function eager calls use
instead (no dispatcher in the way), and :func:`kernel_norm_add`, which routes one call to either.

A fused kernel backend is a module (:data:`FUSED_MODULES`; :data:`MAX_N` the widest row its kernels take, wider
rows compose the unfused kernels) with

    forward(y, residual, w1, b1, w2, b2, *, h_dtype, has_norm2, eps1, eps2, is_rms1, is_rms2, zc1, zc2, cast1,
            cast2) -> (h, out2 | None, stats)
        y, residual: (M, N), last dim contiguous, rows may be strided. h: (M, N) in h_dtype (torch's promotion of
        y's and the residual's dtypes); out2 = N2(h) in h_dtype (None without N2); stats: (4, M) mean1, rstd1,
        mean2, rstd2 in the statistics dtype (fp32, fp64 for fp64; the mean rows unused by RMSNorm, the last two
        without N2). w*, b*: as given (the kernel applies 1 + w when zc*); cast* as the public ops resolve them.
    forward_into(h, out2, stats, y, residual, w1, b1, w2, b2, *, has_norm2, ...): into given outputs; h may be
        residual itself and out2 y itself (in place).
    backward(dh, dout2, y, h, w1, w2, stats, *, b1_dtype, b2_dtype, residual_dtype, has_norm2, ...)
        -> (dy, dresidual | None, dw1, db1, dw2, db2)
        dh, dout2: the gradients of h and out2 (None: zero). residual_dtype None: no dresidual is written (without
        N2 it is dh itself, which autograd receives directly).

The backward passes both roundings of the forward straight through (N1's output to y's dtype, the sum to h's):
the gradient reaching h is rounded only where it is stored.
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch import Tensor

from addnorm.ops.contract import stats_dtype
from addnorm.ops.kernel_ops import _NoSecondDerivative as NoSecondDerivative

__all__ = ["FUSED_MODULES", "MAX_N", "fits", "fused_module", "kernel_norm_add", "kernel_norm_add_"]

FUSED_MODULES = {"cpu": "addnorm.ops.cpu.norm_add_launch", "triton": "addnorm.ops.triton.norm_add_launch"}
# The widest row each backend's fused kernels take (None: any). Triton keeps a row in registers: the chain's
# backward holds about six row-sized values, and the unfused backward already keeps one-pass rows to 8192 for fp32
# and LayerNorm (16 warps spill above, per benchmarks/results/README.md); wider rows compose the unfused kernels,
# which loop over a row.
MAX_N: dict[str, int | None] = {"cpu": None, "triton": 8192}


def fits(backend: str, n: int) -> bool:
    """Whether ``backend`` has a fused kernel for rows of n elements (plain Python: torch.compile traces it)."""
    if backend not in FUSED_MODULES:
        return False
    limit = MAX_N[backend]
    return limit is None or n <= limit


# the options of one call, flat (a schema takes no dataclass), in the custom ops' order after the tensors
_OPTS = ("eps1", "eps2", "is_rms1", "is_rms2", "zc1", "zc2", "cast1", "cast2", "has_norm2")


@functools.cache
def fused_module(backend: str):
    """The fused kernel module of ``backend`` (imported once)."""
    return importlib.import_module(FUSED_MODULES[backend])


def _kw(opts: tuple) -> dict:
    return dict(zip(_OPTS, opts, strict=True))


# --------------------------------------------------------------------------------------------------------------
# Forward and backward as custom ops
# --------------------------------------------------------------------------------------------------------------


def _fwd_impl(
    y: Tensor,
    residual: Tensor,
    w1: Tensor | None,
    b1: Tensor | None,
    w2: Tensor | None,
    b2: Tensor | None,
    eps1: float,
    eps2: float,
    is_rms1: bool,
    is_rms2: bool,
    zc1: bool,
    zc2: bool,
    cast1: bool,
    cast2: bool,
    has_norm2: bool,
    h_dtype: torch.dtype,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(h, out2 or empty, stats)."""
    opts = _kw((eps1, eps2, is_rms1, is_rms2, zc1, zc2, cast1, cast2, has_norm2))
    h, out2, stats = fused_module(backend).forward(y, residual, w1, b1, w2, b2, h_dtype=h_dtype, **opts)
    return h, (out2 if out2 is not None else y.new_empty(0, dtype=h_dtype)), stats


_norm_add_fwd = torch.library.custom_op("addnorm::norm_add_fwd", _fwd_impl, mutates_args=())


@_norm_add_fwd.register_fake
def _(y, residual, w1, b1, w2, b2, eps1, eps2, is_rms1, is_rms2, zc1, zc2, cast1, cast2, has_norm2, h_dtype, backend):
    m, n = y.shape
    return (
        y.new_empty((m, n), dtype=h_dtype),
        y.new_empty((m, n) if has_norm2 else (0,), dtype=h_dtype),
        y.new_empty((4, m), dtype=stats_dtype(y.dtype, h_dtype)),
    )


def _bwd_impl(
    dh: Tensor | None,
    dout2: Tensor | None,
    y: Tensor,
    h: Tensor,
    w1: Tensor | None,
    w2: Tensor | None,
    stats: Tensor,
    b1_dtype: torch.dtype | None,
    b2_dtype: torch.dtype | None,
    residual_dtype: torch.dtype | None,
    eps1: float,
    eps2: float,
    is_rms1: bool,
    is_rms2: bool,
    zc1: bool,
    zc2: bool,
    cast1: bool,
    cast2: bool,
    has_norm2: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dy, dresidual, dw1, db1, dw2, db2), an empty tensor standing for each absent gradient."""
    opts = _kw((eps1, eps2, is_rms1, is_rms2, zc1, zc2, cast1, cast2, has_norm2))
    grads = fused_module(backend).backward(
        dh, dout2, y, h, w1, w2, stats, b1_dtype=b1_dtype, b2_dtype=b2_dtype, residual_dtype=residual_dtype, **opts
    )
    # absent gradients as empty tensors, each its own (a custom op may return no tensor twice)
    return tuple(g if g is not None else torch.empty(0, device=y.device) for g in grads)


_norm_add_bwd = torch.library.custom_op("addnorm::norm_add_bwd", _bwd_impl, mutates_args=())


@_norm_add_bwd.register_fake
def _(dh, dout2, y, h, w1, w2, stats, b1_dtype, b2_dtype, residual_dtype, *rest):
    has_norm2 = rest[8]
    n = y.shape[-1]

    def vec(dtype, on=True):
        return y.new_empty(n, dtype=dtype) if on and dtype is not None else y.new_empty(0)

    return (
        y.new_empty(y.shape, dtype=y.dtype),
        y.new_empty(y.shape, dtype=residual_dtype) if residual_dtype is not None else y.new_empty(0),
        vec(w1.dtype if w1 is not None else None),
        vec(b1_dtype),
        vec(w2.dtype if w2 is not None else None, has_norm2),
        vec(b2_dtype, has_norm2),
    )


# --------------------------------------------------------------------------------------------------------------
# Autograd: registered on the forward op (compiled graphs), and an autograd.Function for eager calls
# --------------------------------------------------------------------------------------------------------------


def _setup(ctx, y, residual, w1, b1, w2, b2, opts, h, stats, eager):
    has_norm2 = opts[8]
    ctx.save_for_backward(y, h if has_norm2 else None, w1, w2, stats)
    ctx.opts = opts
    ctx.dtypes = (residual.dtype, h.dtype, b1.dtype if b1 is not None else None, b2.dtype if b2 is not None else None)
    ctx.eager = eager


def _backward(ctx, saved, dh, dout2):
    y, h, w1, w2, stats = saved
    opts, backend = ctx.opts[:-2], ctx.opts[-1]
    has_norm2 = opts[8]
    residual_dtype, h_dtype, b1_dtype, b2_dtype = ctx.dtypes
    if dout2 is not None and dout2.numel() == 0:
        dout2 = None
    # a gradient may arrive expanded (the backward of a sum: stride 0): the kernels read rows with unit stride
    dh = dh if dh is None or dh.stride(-1) == 1 else dh.contiguous()
    dout2 = dout2 if dout2 is None or dout2.stride(-1) == 1 else dout2.contiguous()
    if dh is None and (dout2 is None or not has_norm2):
        return (None,) * 6  # nothing flowed back
    # without N2 and with the residual in h's dtype, dresidual is dh itself: the kernel writes no copy of it
    shared = not has_norm2 and residual_dtype == h_dtype
    bwd = _bwd_impl if ctx.eager else torch.ops.addnorm.norm_add_bwd
    dy, dres, dw1, db1, dw2, db2 = bwd(
        dh, dout2, y, h if h is not None else y, w1, w2, stats,
        b1_dtype, b2_dtype, None if shared else residual_dtype, *opts, backend,
    )  # fmt: skip
    if shared:
        dres = dh
    return (
        dy,
        dres,
        dw1 if w1 is not None else None,
        db1 if b1_dtype is not None else None,
        dw2 if (w2 is not None and has_norm2) else None,
        db2 if (b2_dtype is not None and has_norm2) else None,
    )


def _setup_context(ctx, inputs, output):
    y, residual, w1, b1, w2, b2, *opts = inputs
    h, _, stats = output
    _setup(ctx, y, residual, w1, b1, w2, b2, tuple(opts), h, stats, eager=False)
    ctx.mark_non_differentiable(stats)


def _registered_backward(ctx, dh, dout2, _dstats):
    return (*_backward(ctx, ctx.saved_tensors, dh, dout2), *(None,) * 11)


torch.library.register_autograd("addnorm::norm_add_fwd", _registered_backward, setup_context=_setup_context)


class _EagerNormAdd(torch.autograd.Function):
    """The same forward/backward as the custom ops, for eager mode (the custom-op dispatch costs ~100 us a call on
    CPU, more than a decode-size kernel). First order only, as the unfused kernel backends."""

    @staticmethod
    def forward(ctx, y, residual, w1, b1, w2, b2, opts):
        h, out2, stats = _fwd_impl(y, residual, w1, b1, w2, b2, *opts)
        _setup(ctx, y, residual, w1, b1, w2, b2, opts, h, stats, eager=True)
        return h, out2

    @staticmethod
    def backward(ctx, dh, dout2):
        saved = ctx.saved_tensors  # once: non-reentrant activation checkpointing allows one unpack
        with torch.no_grad():
            grads = _backward(ctx, saved, dh, dout2)
        # grad mode is on here only under create_graph=True: differentiating these gradients again raises
        depends_on = [t for t in (dh, dout2, *saved) if t is not None and t.requires_grad]
        if torch.is_grad_enabled() and depends_on:
            grads = NoSecondDerivative.apply(ctx.opts[-1], grads, *depends_on)
        return (*grads, None)


def kernel_norm_add(y, residual, w1, b1, w2, b2, opts: tuple, compiling: bool) -> tuple[Tensor, Tensor | None]:
    """One call on a fused kernel backend: (..., N) inputs as (M, N) rows, then the custom op (compiling), the
    eager autograd.Function (something to differentiate) or the kernel forward alone. ``opts``: the custom op's
    options after the tensors (eps1 ... has_norm2, h_dtype, backend). Returns (h, out2 | None)."""
    shape, n = y.shape, y.shape[-1]
    y2, r2 = _rows(y, n), _rows(residual, n)
    has_norm2 = opts[8]
    if compiling:
        h, out2, _ = torch.ops.addnorm.norm_add_fwd(y2, r2, w1, b1, w2, b2, *opts)
    elif torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (y, residual, w1, b1, w2, b2)):
        h, out2 = _EagerNormAdd.apply(y2, r2, w1, b1, w2, b2, opts)
    else:  # nothing to differentiate: no autograd node
        h, out2, _ = fused_module(opts[-1]).forward(y2, r2, w1, b1, w2, b2, h_dtype=opts[-2], **_kw(opts[:-2]))
    return h.reshape(shape), (out2.reshape(shape) if has_norm2 else None)


def _rows(t: Tensor, n: int) -> Tensor:
    # (..., N) -> (M, N) without a copy when the leading dims allow it; rows may stay strided
    t2 = t if t.dim() == 2 else t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


# --------------------------------------------------------------------------------------------------------------
# In place (serving): residual <- h, and y <- N2(h) with N2
# --------------------------------------------------------------------------------------------------------------


def _writable_rows(t: Tensor) -> Tensor | None:
    """t as (M, N) rows the kernels write in place (last dim contiguous), or None."""
    if t.stride(-1) != 1 and t.numel() > 1:
        return None
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:  # leading dims that do not merge into one row stride
        return None


def _inplace_impl(
    y: Tensor,
    residual: Tensor,
    w1: Tensor | None,
    b1: Tensor | None,
    w2: Tensor | None,
    b2: Tensor | None,
    eps1: float,
    eps2: float,
    is_rms1: bool,
    is_rms2: bool,
    zc1: bool,
    zc2: bool,
    cast1: bool,
    cast2: bool,
    has_norm2: bool,
    backend: str,
) -> None:
    opts = _kw((eps1, eps2, is_rms1, is_rms2, zc1, zc2, cast1, cast2, has_norm2))
    mod = fused_module(backend)
    y2, r2 = _writable_rows(y), _writable_rows(residual)
    if y2 is None or r2 is None:  # rows the kernels cannot write: out of place, copied back
        n = y.shape[-1]
        h, out2, _ = mod.forward(_rows(y, n), _rows(residual, n), w1, b1, w2, b2, h_dtype=residual.dtype, **opts)
        residual.copy_(h.view(residual.shape))
        if has_norm2:
            y.copy_(out2.view(y.shape))
        return
    stats = torch.empty((4, y2.shape[0]), dtype=stats_dtype(y.dtype, residual.dtype), device=y.device)
    mod.forward_into(r2, y2 if has_norm2 else None, stats, y2, r2, w1, b1, w2, b2, **opts)


_norm_add_inplace = torch.library.custom_op("addnorm::norm_add_", _inplace_impl, mutates_args=("y", "residual"))


@_norm_add_inplace.register_fake
def _(y, residual, w1, b1, w2, b2, eps1, eps2, is_rms1, is_rms2, zc1, zc2, cast1, cast2, has_norm2, backend):
    return None


def kernel_norm_add_(y, residual, w1, b1, w2, b2, opts: tuple, compiling: bool) -> None:
    """In place on a fused kernel backend (checked by the caller): ``opts`` as :func:`kernel_norm_add`'s less
    h_dtype (it is the residual's)."""
    if compiling:
        torch.ops.addnorm.norm_add_(y, residual, w1, b1, w2, b2, *opts)
    else:
        _inplace_impl(y, residual, w1, b1, w2, b2, *opts)
