"""Residual add + LayerNorm/RMSNorm: the public functions, the kernel contract, and its torch.library registration.

The contract (every backend implements exactly this):

    residual_out = dropout(x) + residual          # just dropout(x) without a residual; stored in residual_dtype
    out          = norm(residual_out)             # the value normalized is residual_out *as stored*; in out_dtype

with statistics in fp32 (fp64 when x or the residual stream is fp64), ``norm`` LayerNorm or RMSNorm over the last
dimension, weight applied as ``1 + weight`` when ``zero_centered_weight`` (Gemma). residual_dtype defaults to the
residual's dtype, else x's; out_dtype defaults to x's dtype. ``out`` is rounded once to out_dtype, except with
``cast_before_weight`` (the order of Hugging Face's Llama, Mistral and Qwen: ``weight * xhat.to(x.dtype)``): then the
normalized value is rounded to out_dtype first, the weight and bias applied in the statistics dtype, and the result
rounded again. Its backward passes the first rounding straight through (on every backend, torch included: the
gradient ``dout * w`` is not rounded to out_dtype before the norm's backward); dweight sums ``dout * round(xhat)``
(dout arrives in out_dtype, which is how the backward knows it). ``eps=None`` (RMSNorm) is the machine epsilon of
the dtype normalized, residual_dtype.

Kernel backends (``triton``, ``cpu``, ``reference``) are modules with

    forward(x, residual, weight, bias, *, eps, is_rms, dropout_p, seed, residual_dtype, zero_centered_weight,
            store_residual_out, cast_before_weight=False, out_dtype=None, store_stats=True)
            -> (out, residual_out | None, mean | None, rstd | None)
        x, residual: (M, N), last dim contiguous, rows may be strided; residual may be None.
        out: (M, N) in out_dtype (None: x's dtype). residual_out: (M, N) in residual_dtype, only when store_residual_out (otherwise
        residual_out is x itself and the kernel normalizes x). mean (LayerNorm only) and rstd: (M,) in the
        statistics dtype; both None when not store_stats (calls that record no autograd node: nothing will read
        them, and not allocating them saves host time per call). seed: a 0-dim int64 tensor on x's device (None
        without dropout).

    Dropout, the same on every backend (torch included) so that a seed gives bitwise the same residual_out whatever
    the backend or the batch size (auto's size switch): the seed is drawn on x's device by
    :func:`addnorm.ops.contract.draw_seed`; element (i, j) is kept iff the top 24 bits of a 32-bit integer hash of
    (seed, i * N + j) are >= ceil(p * 2^24) (:func:`addnorm.reference.dropout_keep_mask` defines it); kept elements
    are multiplied by 1 / (1 - p) computed in fp64 and rounded to the statistics dtype
    (:func:`addnorm.reference.dropout_scale`), dropped ones are 0.

    backward(dout, dresidual_out, h, weight, mean, rstd, *, is_rms, dropout_p, seed, zero_centered_weight,
             x_dtype, residual_dtype, bias_dtype, cast_before_weight=False)
             -> (dx, dresidual | None, dweight | None, dbias | None)
        h: the normalized input as stored (residual_out, or x). dresidual_out may be None. residual_dtype None
        means no dresidual is wanted (no residual input, or it equals dx: see below); bias_dtype None means no
        bias. The dropout mask is regenerated from the seed, never stored.

Without dropout and with residual_dtype equal to x's dtype, dresidual and dx are the same value rounded the same
way: the backward computes it once and autograd receives the same tensor as both gradients.

The kernel backends run behind two custom ops, ``addnorm::add_norm_fwd`` and ``addnorm::add_norm_bwd``, with
fake implementations and registered autograd, so ``torch.compile(fullgraph=True)`` traces through them without a
graph break. On CUDA tensors compiled graphs run the Triton backend through ``addnorm::triton_add_norm_fwd``/``_bwd``
instead (:mod:`addnorm.ops.triton_ops`): the same arguments and autograd, but triton ops whose kernel launches
Inductor sees. Eager calls use neither: a plain autograd.Function calls the kernels (no dispatcher in the way).
The ``torch`` backend is plain PyTorch: the readable reference, the fallback and the baseline.

What composes with what: every backend works under autocast (the op takes each tensor's dtype as given),
``no_grad``/``inference_mode``, activation checkpointing (the dropout seed comes from torch's generator, which
checkpointing restores) and ``torch.compile``/``torch.export``. The kernel backends' gradients are first order:
differentiating them again raises an error naming ``backend='torch'``, which is differentiable to any order.
``torch.func`` transforms (vmap, grad, jacrev: per-sample gradients) see through plain PyTorch only, so ``auto``
uses the torch backend inside one and a kernel backend asked for by name raises.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

from addnorm.ops.backends import ENV_VAR, kernel_module, resolve_backend, resolve_backend_for_trace
from addnorm.ops.contract import FLOAT_DTYPES, as_dtype, default_rms_eps, draw_seed, stats_dtype, validate
from addnorm.reference import dropout_keep_mask, dropout_scale

__all__ = ["add_layer_norm", "add_rms_norm", "layer_norm", "rms_norm"]

# --------------------------------------------------------------------------------------------------------------
# The torch backend: plain PyTorch, differentiable by autograd, traced natively by torch.compile
# --------------------------------------------------------------------------------------------------------------


def torch_add_norm(
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
):
    cd = stats_dtype(x.dtype, residual_dtype)
    h = as_dtype(x, cd)
    if dropout_p > 0.0:
        # the contract's mask and scaling (addnorm.reference), not F.dropout: the same bits as the kernel backends
        n = x.shape[-1]
        keep = dropout_keep_mask(draw_seed(x.device), x.numel() // n, n, dropout_p, x.device).reshape(x.shape)
        h = torch.where(keep, h * dropout_scale(dropout_p, cd), torch.zeros((), dtype=cd, device=x.device))
    if residual is not None:
        h = h + as_dtype(residual, cd)
    residual_out = as_dtype(h, residual_dtype)  # rounded once; the norm below sees exactly this
    h = as_dtype(residual_out, cd)
    w = None if weight is None else (as_dtype(weight, cd) + 1 if zero_centered_weight else as_dtype(weight, cd))
    b = None if bias is None or is_rms else as_dtype(bias, cd)
    n = (x.shape[-1],)
    if cast_before_weight:
        # Llama's order: round the normalized value to x's dtype, then apply the weight (and bias) and round again
        xhat = F.rms_norm(h, n, None, eps) if is_rms else F.layer_norm(h, n, None, None, eps)
        # the rounding's gradient is the identity, as in the kernels: autograd through .to(out_dtype) would round
        # dout * w to out's dtype before the norm's backward (up to one bf16 ulp more error in dx). xhat + (r -
        # xhat) is r exactly: r is xhat's nearest out_dtype value, so the difference is exact (Sterbenz)
        out = xhat + (xhat.to(out_dtype).to(cd) - xhat).detach()
        if w is not None:
            out = out * w
        if b is not None:
            out = out + b
    elif is_rms:
        out = F.rms_norm(h, n, w, eps)
    else:
        out = F.layer_norm(h, n, w, b, eps)
    return as_dtype(out, out_dtype), residual_out


# --------------------------------------------------------------------------------------------------------------
# Custom ops around the kernel backends
# --------------------------------------------------------------------------------------------------------------


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


def _setup_context(ctx, inputs, output, *, eager: bool = False, bwd_op=None):
    """Saves what the backward needs. ``bwd_op``: the backward op of a compiled graph, called with add_norm_bwd's
    arguments (None: addnorm::add_norm_bwd; the triton ops of addnorm.ops.triton_ops pass their own)."""
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


def _backward(ctx, dout, dres_out, _dmean=None, _drstd=None, _dseed=None):
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


torch.library.register_autograd("addnorm::add_norm_fwd", _backward, setup_context=_setup_context)


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
        _setup_context(ctx, inputs, output, eager=True)
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


def _kernel_add_norm(
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
    compiling=False,
):
    # eps and dropout_p arrive as Python floats (run_add_norm converted them, once)
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
    store = residual is not None or dropout_p > 0 or residual_dtype != x.dtype
    args = (
        x2,
        r2,
        weight,
        bias,
        eps,
        is_rms,
        dropout_p,
        residual_dtype,
        zero_centered_weight,
        store,
        backend,
        cast_before_weight,
        out_dtype,
    )
    if compiling:
        if backend == "triton" and _triton_op_usable(x.device.type):
            # the triton op: Inductor sees (and can graph) the kernels themselves, not an opaque call
            out, res_out = torch.ops.addnorm.triton_add_norm_fwd(*args[:10], *args[11:])[:2]
        else:
            out, res_out = torch.ops.addnorm.add_norm_fwd(*args)[:2]
    elif torch.is_grad_enabled() and _any_requires_grad(x2, r2, weight, bias):
        out, res_out = _eager_apply(x2, r2, weight, bias, args[4:])
    else:  # nothing to differentiate (inference, no_grad): no autograd node, no statistics, straight to the kernel
        out, res_out = _fwd_raw(*args, store_stats=False)[:2]
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


def _triton_op_usable(device_type: str) -> bool:
    """Whether compiled graphs run the Triton backend through the triton ops of :mod:`addnorm.ops.triton_ops`
    (CUDA tensors, compiled kernels) rather than the opaque addnorm::add_norm_fwd (see that module for why)."""
    from addnorm.ops.triton_ops import usable

    return usable(device_type)


# A constant for dynamo, like resolve_backend_for_trace: run once at trace time (it imports the module that
# registers the triton ops), not traced
_triton_op_usable._dynamo_marked_constant = True  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------------------------


def run_add_norm(
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
):
    """What the public functions (and add_norm_multi's fused calls) share: validate, resolve the backend, run the
    torch backend or the kernel route. Arguments positional, in the order of the signature."""
    if is_rms and eps is None:
        eps = default_rms_eps(x, residual, residual_dtype)
    validate(x, residual, weight, bias, eps, dropout_p, residual_dtype)
    eps, dropout_p = float(eps), float(dropout_p)
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be a floating dtype or None, got {out_dtype!r}")
    if residual_dtype is None:
        residual_dtype = residual.dtype if residual is not None else x.dtype
    out_dtype = out_dtype or x.dtype
    compiling = torch.compiler.is_compiling()  # once a call: the kernel route asks again otherwise
    if compiling:
        name = resolve_backend_for_trace(backend, x.device.type)
    else:
        name = resolve_backend(backend, x.device, x.numel())
        if name != "torch" and torch._C._are_functorch_transforms_active():
            name = _backend_under_functorch(backend, name)
    # the cast changes nothing when there is no affine step, or when x's dtype is the statistics dtype
    cast_before_weight = bool(cast_before_weight) and (weight is not None or (bias is not None and not is_rms))
    cast_before_weight = cast_before_weight and out_dtype != stats_dtype(x.dtype, residual_dtype)
    args = (
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
    )
    if name == "torch":
        return torch_add_norm(*args)
    return _kernel_add_norm(*args, name, compiling)


def _backend_under_functorch(backend: str, name: str) -> str:
    """torch.func transforms (vmap, grad, jacrev, functional_call + grad, ...) compose with plain PyTorch only: the
    kernel backends' autograd has no vmap rule and cannot see through functorch's wrapped tensors. auto falls back
    to the torch backend (same contract); a kernel backend asked for by name (or by ADDNORM_BACKEND) is an error."""
    if backend == "auto" and os.environ.get(ENV_VAR, "").strip() in ("", "auto"):
        return "torch"
    asked = f"backend={backend!r}" if backend != "auto" else f"{ENV_VAR}={os.environ[ENV_VAR].strip()!r}"
    raise RuntimeError(
        f"addnorm's {name!r} backend ({asked}) does not support torch.func transforms (vmap, grad, jacrev, ...); "
        f"use backend='torch', or 'auto' with {ENV_VAR} unset (auto uses the torch backend inside a transform)"
    )


def add_layer_norm(
    x: Tensor,
    residual: Tensor | None = None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    dropout_p: float = 0.0,
    residual_dtype: torch.dtype | None = None,
    zero_centered_weight: bool = False,
    cast_before_weight: bool = False,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """``residual_out = dropout(x) + residual``; ``out = LayerNorm(residual_out)``. Returns ``(out, residual_out)``.

    residual_out is stored in ``residual_dtype`` (default: residual's dtype, else x's); out in ``out_dtype`` (default
    x's dtype: e.g. bf16 for the next matmul from an fp32 stream).
    ``dropout_p`` applies whenever it is > 0 (pass 0 in eval). Gradients flow to x, residual, weight and bias.
    ``zero_centered_weight`` scales by ``1 + weight`` (Gemma); ``cast_before_weight`` rounds the normalized value to
    x's dtype before the weight and bias (Hugging Face Llama's order; see the module docstring).
    """
    return run_add_norm(
        x,
        residual,
        weight,
        bias,
        eps,
        False,
        dropout_p,
        residual_dtype,
        zero_centered_weight,
        cast_before_weight,
        out_dtype,
        backend,
    )


def add_rms_norm(
    x: Tensor,
    residual: Tensor | None = None,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    dropout_p: float = 0.0,
    residual_dtype: torch.dtype | None = None,
    zero_centered_weight: bool = False,
    cast_before_weight: bool = False,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """``residual_out = dropout(x) + residual``; ``out = RMSNorm(residual_out)``. Returns ``(out, residual_out)``.

    ``eps=None`` means the machine epsilon of the dtype normalized, residual_out's (``residual_dtype``, else the
    residual's dtype, else x's), as ``torch.nn.functional.rms_norm`` takes its input's. The other options are those
    of :func:`add_layer_norm`.
    """
    return run_add_norm(
        x,
        residual,
        weight,
        None,
        eps,
        True,
        dropout_p,
        residual_dtype,
        zero_centered_weight,
        cast_before_weight,
        out_dtype,
        backend,
    )


def layer_norm(
    x: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    cast_before_weight: bool = False,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> Tensor:
    """LayerNorm over the last dimension, statistics in fp32 (fp64 for fp64 input)."""
    return add_layer_norm(
        x, None, weight, bias, eps, cast_before_weight=cast_before_weight, out_dtype=out_dtype, backend=backend
    )[0]


def rms_norm(
    x: Tensor,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    cast_before_weight: bool = False,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> Tensor:
    """RMSNorm over the last dimension; ``eps=None`` means ``torch.finfo(x.dtype).eps``."""
    return add_rms_norm(
        x, None, weight, eps, cast_before_weight=cast_before_weight, out_dtype=out_dtype, backend=backend
    )[0]
