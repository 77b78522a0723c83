"""The kernel backends behind ``torch.library``: the custom ops ``addnorm::add_norm_fwd``/``add_norm_bwd`` with
their fake implementations and registered autograd (what compiled graphs call), the plain autograd.Function that
eager calls use instead (no dispatcher in the way), and :func:`kernel_add_norm`, which routes one call to either.

What the kernel backends compute, and what these ops promise, is the contract of :mod:`addnorm.ops.add_norm`. A
backend with ops of its own for compiled graphs (``KernelBackend.compiled_module`` in :mod:`addnorm.ops.backends`)
reuses :func:`setup_context` and :func:`backward` for their autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor

from addnorm.ops.backends import compiled_ops_usable, kernel_module
from addnorm.ops.contract import AddNormSpec, draw_seed, stats_dtype

__all__ = ["backward", "kernel_add_norm", "setup_context"]


def _unaliased(outputs, inputs):
    """Custom ops may not return inputs, or one tensor twice. A backend that returns, say, the same tensor as dx
    and dresidual (possible when no rounding separates them) gets one of them copied here; absent outputs (None)
    become fresh empty tensors."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, Tensor) and t.numel()}
    result = []
    for t in outputs:
        if t is None:
            t = torch.empty(0, device=inputs[0].device)
        elif t.numel() == 0:
            t = torch.empty_like(t)  # empty tensors may share a null storage: give each its own
        else:
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                t = t.clone()
                ptr = t.untyped_storage().data_ptr()
            seen.add(ptr)
        result.append(t)
    return tuple(result)


def _fwd_raw(
    x,
    residual,
    weight,
    bias,
    eps,
    is_rms,
    dropout_p,
    residual_dtype,
    zero_centered_weight,
    store_residual_out,
    backend,
    cast_before_weight=False,
    out_dtype=None,
    store_stats=True,
):
    """The kernel forward: (out, residual_out | None, mean | None, rstd, seed | None). The seed is drawn here, on
    x's device from its generator (:func:`draw_seed`), so the op stays traceable, CUDA inputs keep every tensor on
    the GPU (graph-safe), and the backward can regenerate the dropout mask."""
    seed = draw_seed(x.device) if dropout_p > 0 else None
    out, res_out, mean, rstd = kernel_module(backend).forward(
        x,
        residual,
        weight,
        bias,
        eps=eps,
        is_rms=is_rms,
        dropout_p=dropout_p,
        seed=seed,
        residual_dtype=residual_dtype,
        zero_centered_weight=zero_centered_weight,
        store_residual_out=store_residual_out,
        cast_before_weight=cast_before_weight,
        out_dtype=out_dtype,
        store_stats=store_stats,
    )
    return out, res_out, mean, rstd, seed


def _fwd_impl(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    is_rms: bool,
    dropout_p: float,
    residual_dtype: torch.dtype,
    zero_centered_weight: bool,
    store_residual_out: bool,
    backend: str,
    cast_before_weight: bool = False,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (out, residual_out or empty, mean or empty, rstd, seed or empty): :func:`_fwd_raw`'s results as a
    custom op may return them."""
    out, res_out, mean, rstd, seed = _fwd_raw(
        x,
        residual,
        weight,
        bias,
        eps,
        is_rms,
        dropout_p,
        residual_dtype,
        zero_centered_weight,
        store_residual_out,
        backend,
        cast_before_weight,
        out_dtype,
    )
    outputs = (out, res_out, mean if mean is not None else x.new_empty(0, dtype=rstd.dtype), rstd)
    seed_out = seed if seed is not None else x.new_empty(0, dtype=torch.int64)
    return (*_unaliased(outputs, (x, residual, weight, bias)), seed_out)


_add_norm_fwd = torch.library.custom_op("addnorm::add_norm_fwd", _fwd_impl, mutates_args=())


@_add_norm_fwd.register_fake
def _(
    x,
    residual,
    weight,
    bias,
    eps,
    is_rms,
    dropout_p,
    residual_dtype,
    zero_centered_weight,
    store_residual_out,
    backend,
    cast_before_weight=False,
    out_dtype=None,
):
    m, n = x.shape
    sd = stats_dtype(x.dtype, residual_dtype)
    return (
        x.new_empty((m, n), dtype=out_dtype or x.dtype),
        x.new_empty((m, n), dtype=residual_dtype) if store_residual_out else x.new_empty(0),
        x.new_empty(0 if is_rms else m, dtype=sd),
        x.new_empty(m, dtype=sd),
        x.new_empty(() if dropout_p > 0 else (0,), dtype=torch.int64),
    )


def _bwd_impl(
    dout: Tensor,
    dresidual_out: Tensor | None,
    h: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    seed: Tensor,
    is_rms: bool,
    dropout_p: float,
    zero_centered_weight: bool,
    x_dtype: torch.dtype,
    residual_dtype: torch.dtype | None,
    bias_dtype: torch.dtype | None,
    backend: str,
    cast_before_weight: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (dx, dresidual, dweight, dbias), an empty tensor standing for each absent gradient."""
    dx, dres, dw, db = kernel_module(backend).backward(
        dout,
        dresidual_out,
        h,
        weight,
        None if is_rms else mean,
        rstd,
        is_rms=is_rms,
        dropout_p=dropout_p,
        seed=seed if dropout_p > 0 else None,
        zero_centered_weight=zero_centered_weight,
        x_dtype=x_dtype,
        residual_dtype=residual_dtype,
        bias_dtype=bias_dtype,
        cast_before_weight=cast_before_weight,
    )
    return _unaliased((dx, dres, dw, db), (dout, dresidual_out, h, weight, mean, rstd))


_add_norm_bwd = torch.library.custom_op("addnorm::add_norm_bwd", _bwd_impl, mutates_args=())


@_add_norm_bwd.register_fake
def _(
    dout,
    dresidual_out,
    h,
    weight,
    mean,
    rstd,
    seed,
    is_rms,
    dropout_p,
    zero_centered_weight,
    x_dtype,
    residual_dtype,
    bias_dtype,
    backend,
    cast_before_weight=False,
):
    n = dout.shape[-1]
    return (
        dout.new_empty(dout.shape, dtype=x_dtype),
        dout.new_empty(dout.shape, dtype=residual_dtype) if residual_dtype is not None else dout.new_empty(0),
        dout.new_empty(n, dtype=weight.dtype) if weight is not None else dout.new_empty(0),
        dout.new_empty(n, dtype=bias_dtype) if bias_dtype is not None else dout.new_empty(0),
    )


def setup_context(ctx, inputs, output, *, eager: bool = False, bwd_op=None):
    """Saves what the backward needs. ``bwd_op``: the backward op of a compiled graph, called with add_norm_bwd's
    arguments (None: addnorm::add_norm_bwd; the triton ops of addnorm.ops.triton.compiled pass their own)."""
    x, residual, weight, bias, eps, is_rms, dropout_p, residual_dtype, zc, store, backend, *rest = inputs
    cbw = bool(rest and rest[0])  # the op's last arguments have defaults: called positionally, they may be absent
    out, res_out, mean, rstd, seed = output
    ctx.save_for_backward(res_out if store else x, weight, mean, rstd, seed)
    ctx.opts = (
        is_rms,
        dropout_p,
        zc,
        cbw,
        x.dtype,
        residual.dtype if residual is not None else None,
        bias.dtype if bias is not None else None,
        backend,
    )
    ctx.has_residual_out = store
    ctx.out_dtype = out.dtype
    ctx.eager = eager
    ctx.bwd_op = bwd_op
    if not eager:
        ctx.mark_non_differentiable(mean, rstd, seed)


def backward(ctx, dout, dres_out, _dmean=None, _drstd=None, _dseed=None):
    return _backward_saved(ctx, ctx.saved_tensors, dout, dres_out)


def _backward_saved(ctx, saved, dout, dres_out):
    # saved: ctx.saved_tensors, read once by the caller (non-reentrant activation checkpointing allows one read)
    h, weight, mean, rstd, seed = saved
    is_rms, dropout_p, zc, cbw, x_dtype, residual_dtype, bias_dtype, backend = ctx.opts
    if dout is None:
        dout = torch.zeros(h.shape, dtype=ctx.out_dtype, device=h.device)
    if not ctx.has_residual_out or (dres_out is not None and dres_out.numel() == 0):
        dres_out = None
    # Without dropout and with residual_dtype == x's dtype, dresidual and dx are the same rounding of the same
    # value: the kernel writes it once (as dx) and autograd gets that tensor for both (25% fewer backward bytes).
    # The custom op cannot return one tensor twice, so the sharing happens here, at the autograd level.
    shared = residual_dtype == x_dtype and dropout_p == 0
    bwd = _bwd_impl if ctx.eager else ctx.bwd_op or torch.ops.addnorm.add_norm_bwd
    dx, dres, dw, db = bwd(
        dout,
        dres_out,
        h,
        weight,
        mean,
        rstd,
        seed,
        is_rms,
        dropout_p,
        zc,
        x_dtype,
        None if shared else residual_dtype,
        bias_dtype,
        backend,
        cbw,
    )
    return (
        dx,
        dx if shared else dres if residual_dtype is not None else None,
        dw if weight is not None else None,
        db if bias_dtype is not None else None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
    )


torch.library.register_autograd("addnorm::add_norm_fwd", backward, setup_context=setup_context)


class _NoSecondDerivative(torch.autograd.Function):
    """Passes the kernel backward's gradients through and raises if anything differentiates them again.

    The kernel backwards are first-order only. With ``create_graph=True`` their results would otherwise come back
    either with no graph ("does not require grad") or, for the reference backend's torch code, with a partial graph
    that silently gives a wrong second derivative. This makes the failure an error that says what to do."""

    @staticmethod
    def forward(ctx, backend, grads, *depends_on):
        # depends_on: the tensors with a graph that the gradients are a function of; taking them as inputs is what
        # links this node into the graph (the gradients themselves were computed without one)
        ctx.backend = backend
        return tuple(None if g is None else g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(
            f"addnorm's {ctx.backend!r} backend has no second derivative (double backward, create_graph=True: "
            "gradient penalties, Hessian-vector products); pass backend='torch' (plain PyTorch, differentiable "
            "to any order) to the op or module"
        )


class _EagerAddNorm(torch.autograd.Function):
    """The same forward/backward as the custom ops, for eager mode. The custom-op dispatch costs ~150 us a call
    on CPU (several times a small kernel), so eager code calls the implementations through this plain
    autograd.Function; compiled graphs use the registered ops."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, opts):
        # the options arrive as one tuple: apply() inspects every argument for tensors, so 5 cost less than 13
        inputs = (x, residual, weight, bias, *opts)
        output = _fwd_raw(*inputs)  # None for absent outputs: an autograd.Function needs no placeholders
        setup_context(ctx, inputs, output, eager=True)
        return output[0], output[1]

    @staticmethod
    def backward(ctx, dout, dres_out):
        # grad mode is on here only under create_graph=True; the kernels never build a graph of their own
        saved = ctx.saved_tensors  # once: torch.utils.checkpoint(use_reentrant=False) refuses a second unpack
        with torch.no_grad():
            grads = _backward_saved(ctx, saved, dout, dres_out)[:4]
        depends_on = [t for t in (dout, dres_out, *saved[:2]) if t is not None and t.requires_grad]
        if torch.is_grad_enabled() and depends_on:
            grads = _NoSecondDerivative.apply(ctx.opts[-1], grads, *depends_on)
        return (*grads, None)


# autograd.Function.apply without its Python wrapper, which binds default arguments (this forward has none) and
# unwraps dead functorch wrappers (run_add_norm never reaches a kernel backend under a functorch transform): ~3 us a
# call. The wrapper's path where this private attribute is missing.
_eager_apply = getattr(super(torch.autograd.Function, _EagerAddNorm), "apply", _EagerAddNorm.apply)


def kernel_add_norm(x, residual, weight, bias, spec: AddNormSpec, backend: str, compiling: bool = False):
    """One call on kernel backend ``backend`` with a validated spec: (..., N) inputs as (M, N) rows, then the custom
    op (compiling), the eager autograd.Function (something to differentiate) or the kernel forward alone. Returns
    (out, residual_out)."""
    shape = x.shape
    n = shape[-1]
    # (..., N) -> (M, N) without a copy when the leading dims allow it; rows may stay strided
    x2 = x if x.dim() == 2 else x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2 = None
    if residual is not None:
        r2 = residual if residual.dim() == 2 else residual.reshape(-1, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
    # with nothing to add and nothing to round, residual_out *is* x: skip writing a copy of it
    store = residual is not None or spec.dropout_p > 0 or spec.residual_dtype != x.dtype
    # the custom ops' flat arguments (a schema takes no dataclass), in their order
    opts = (
        spec.eps,
        spec.is_rms,
        spec.dropout_p,
        spec.residual_dtype,
        spec.zero_centered_weight,
        store,
        backend,
        spec.cast_before_weight,
        spec.out_dtype,
    )
    if compiling:
        if compiled_ops_usable(backend, x.device.type):
            # the backend's own op (addnorm::triton_add_norm_fwd): Inductor sees (and can graph) the kernels
            # themselves, not an opaque call (its arguments: add_norm_fwd's less ``backend``)
            op = getattr(torch.ops.addnorm, f"{backend}_add_norm_fwd")
            out, res_out = op(x2, r2, weight, bias, *opts[:6], *opts[7:])[:2]
        else:
            out, res_out = torch.ops.addnorm.add_norm_fwd(x2, r2, weight, bias, *opts)[:2]
    elif torch.is_grad_enabled() and _any_requires_grad(x2, r2, weight, bias):
        out, res_out = _eager_apply(x2, r2, weight, bias, opts)
    else:  # nothing to differentiate (inference, no_grad): no autograd node, no statistics, straight to the kernel
        out, res_out = _fwd_raw(x2, r2, weight, bias, *opts, store_stats=False)[:2]
    if x.dim() != 2:
        out = out.reshape(shape)
        res_out = res_out.reshape(shape) if store else None
    return out, (res_out if store else x)


def _any_requires_grad(x, residual, weight, bias) -> bool:
    # spelled out: a generator over the four costs about a microsecond more, on every call
    return (
        x.requires_grad
        or (residual is not None and residual.requires_grad)
        or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
    )
