"""In-place residual add + norm for serving, the convention of inference engines (vLLM's ``fused_add_rms_norm``):

    residual <- x + residual            # in residual's dtype (the residual stream)
    x        <- norm(residual)          # in x's dtype; the value normalized is residual as stored

Nothing is allocated on the ``triton`` backend for contiguous x and residual (the kernels write into them and
store no statistics; the ``cpu`` backend's kernels need (M,) scratch for those). The ``torch`` and ``reference``
backends, and inputs the kernels cannot write, compute out of place and copy back. Inference only: no dropout,
no autograd (a tensor that requires grad is an error). Under ``torch.compile`` the kernel backends run as the
custom op ``addnorm::add_norm_``, which declares that it mutates x and residual, so ``fullgraph=True`` traces
through it (the Triton backend on CUDA tensors as the triton op ``addnorm::triton_add_norm_``, whose kernels
Inductor sees: :mod:`addnorm.ops.triton.compiled`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from addnorm.ops import torch_backend
from addnorm.ops.backends import compiled_ops_usable, kernel_module, resolve_backend, resolve_backend_for_trace
from addnorm.ops.contract import (
    AddNormSpec,
    bump_versions,
    check_bools,
    check_disjoint,
    check_not_written,
    check_writable,
    default_rms_eps,
    stats_dtype,
    validate,
)
from addnorm.ops.fast_path import try_add_norm_

__all__ = ["add_layer_norm_", "add_rms_norm_"]


def _check_inplace(x, residual, weight, bias) -> None:
    if residual is None:
        raise ValueError("residual must be a tensor: the in-place op writes x + residual into it")
    for name, t in (("x", x), ("residual", residual)):
        if t.requires_grad:
            raise RuntimeError(
                f"{name} requires grad: add_rms_norm_/add_layer_norm_ overwrite x and residual and record no "
                "gradient (inference only); use add_rms_norm/add_layer_norm to train"
            )
    if torch.is_grad_enabled():
        for name, t in (("weight", weight), ("bias", bias)):
            if t is not None and t.requires_grad:
                raise RuntimeError(
                    f"{name} requires grad and grad mode is on: the in-place ops record no gradient; call them "
                    "under torch.no_grad() or torch.inference_mode() (or use add_rms_norm/add_layer_norm to train)"
                )
    # everything is checked before anything is written: a refusal leaves both tensors as they were
    if torch.compiler.is_compiling():
        # dynamo cannot read storage pointers, and an exception raised while tracing reaches a fullgraph=True
        # caller as "Unsupported: Observed exception": the one tensor passed twice is refused by an op of the
        # graph instead, which raises eager's ValueError when the compiled code runs, before anything is written
        if x is residual:
            torch.ops.addnorm.refuse_aliased_(x)
        return
    if x is residual:
        raise ValueError(_ALIASED)
    for name, t in (("x", x), ("residual", residual)):
        check_writable(name, t)
        # an expanded (stride-0) view: writing it would store several results in one element
        if t.numel() > 1 and torch._debug_has_internal_overlap(t) == 1:
            raise ValueError(
                f"{name} has elements that share memory (an expanded or stride-0 view, shape {tuple(t.shape)}, "
                f"strides {t.stride()}): it cannot be written in place; pass {name}.clone()"
            )
    # two views of one buffer (a serving workspace) are fine when their bytes are disjoint
    check_disjoint("x", x, "residual", residual, "both are written")
    # a weight or bias inside x's or residual's bytes would be read while the kernels overwrite it
    check_not_written(
        (("x", x), ("residual", residual)), (("weight", weight), ("bias", bias)), "it is read while they are written"
    )


_ALIASED = "x and residual must not share memory: both are written"


@torch.library.custom_op("addnorm::refuse_aliased_", mutates_args=("x",))
def _refuse_aliased(x: Tensor) -> None:
    """What a compiled graph runs in place of an in-place op given one tensor as x and residual. Declared as
    mutating x so that nothing reading x is ordered before it, and so that it is not removed as dead code."""
    raise ValueError(_ALIASED)


@_refuse_aliased.register_fake
def _(x):
    return None


def _writable_rows(t: Tensor) -> Tensor | None:
    """t as (M, N) rows written in place, or None when the kernels cannot write it directly (not contiguous)."""
    return t.view(-1, t.shape[-1]) if t.is_contiguous() else None


def _inplace_run(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    is_rms: bool,
    zero_centered_weight: bool,
    cast_before_weight: bool,
    backend: str,
) -> bool:
    """Write the result; True when a kernel wrote x and residual through their data pointers (PyTorch's version
    counters not bumped), False when PyTorch's own in-place ops did (add_, copy_: bumped)."""
    if (
        backend == "torch"
        and is_rms
        and not zero_centered_weight
        and x.dtype is residual.dtype
        and (weight is None or weight.dtype is x.dtype)
    ):
        # one dtype (decode): residual += x, then x = RMSNorm(residual) with the torch backend's one-dtype ops,
        # whose bits are the out-of-place call's; written in place, nothing but the norm's result allocated
        residual.add_(x)
        x.copy_(torch_backend.rms_norm_one_dtype(residual, None, weight, eps, cast_before_weight)[0])
        return False
    x2, r2 = _writable_rows(x), _writable_rows(residual)
    if backend in ("torch", "reference") or x2 is None or r2 is None:
        # out of place, then copied back: the torch/reference backends, and inputs the kernels cannot write
        if backend == "torch":
            spec = AddNormSpec(eps, is_rms, 0.0, residual.dtype, zero_centered_weight, cast_before_weight, x.dtype)
            out, res = torch_backend.add_norm(x, residual, weight, bias, spec)
        else:
            n = x.shape[-1]
            out, res, _, _ = kernel_module(backend).forward(
                x.reshape(-1, n),
                residual.reshape(-1, n),
                weight,
                bias,
                eps=eps,
                is_rms=is_rms,
                dropout_p=0.0,
                seed=None,
                residual_dtype=residual.dtype,
                zero_centered_weight=zero_centered_weight,
                store_residual_out=True,
                cast_before_weight=cast_before_weight,
                out_dtype=x.dtype,
                store_stats=False,
            )
        residual.copy_(res.view(residual.shape))
        x.copy_(out.view(x.shape))
        return False
    kernel_module(backend).forward_into(
        x2,
        r2,
        None,
        None,
        x2,
        r2,
        weight,
        bias,
        eps=eps,
        is_rms=is_rms,
        dropout_p=0.0,
        seed=None,
        zero_centered_weight=zero_centered_weight,
        cast_before_weight=cast_before_weight,
    )
    return True


def _inplace_impl(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    is_rms: bool,
    zero_centered_weight: bool,
    cast_before_weight: bool,
    backend: str,
) -> None:
    """The custom op's body: the op's ADInplaceOrView kernel bumps the version counters of x and residual itself
    (it declares mutates_args), so nothing is bumped here."""
    _inplace_run(x, residual, weight, bias, eps, is_rms, zero_centered_weight, cast_before_weight, backend)


_add_norm_inplace = torch.library.custom_op("addnorm::add_norm_", _inplace_impl, mutates_args=("x", "residual"))


@_add_norm_inplace.register_fake
def _(x, residual, weight, bias, eps, is_rms, zero_centered_weight, cast_before_weight, backend):
    return None


def _add_norm_(x, residual, weight, bias, eps, is_rms, zero_centered_weight, cast_before_weight, backend):
    if type(zero_centered_weight) is not bool or type(cast_before_weight) is not bool:
        check_bools(("zero_centered_weight", zero_centered_weight), ("cast_before_weight", cast_before_weight))
    # a decode-size call in the common case: the fast path (addnorm.ops.fast_path), which refuses anything unusual
    if try_add_norm_(x, residual, weight, bias, eps, is_rms, zero_centered_weight, cast_before_weight, backend):
        return x, residual
    if is_rms and eps is None:
        eps = default_rms_eps(x, residual, None)
    validate(x, residual, weight, bias, eps, 0.0, None)
    _check_inplace(x, residual, weight, bias)
    if bias is not None and is_rms:
        bias = None
    # the cast changes nothing when there is no affine step, or when x's dtype is the statistics dtype
    cast = cast_before_weight and (weight is not None or bias is not None)
    cast = cast and x.dtype != stats_dtype(x.dtype, residual.dtype)
    args = (x, residual, weight, bias, float(eps), is_rms, zero_centered_weight, cast)
    if torch.compiler.is_compiling():
        if x is residual:
            # _check_inplace put the refusing op in the graph: it raises when the graph runs, so nothing after it
            # would run; tracing the norm on one tensor as both operands only gives Inductor an aliased graph
            return x, residual
        name = resolve_backend_for_trace(backend, x.device.type)
        if name == "torch":
            _inplace_impl(*args, name)  # plain PyTorch: traced as it is
        elif compiled_ops_usable(name, x.device.type):
            # the backend's own op (addnorm::triton_add_norm_, a triton op): Inductor sees the kernels
            getattr(torch.ops.addnorm, f"{name}_add_norm_")(*args)
        else:
            torch.ops.addnorm.add_norm_(*args, name)
    else:
        # eager calls skip the custom op's dispatch (~100 us on CPU, more than a small kernel takes)
        if _inplace_run(*args, resolve_backend(backend, x.device)):
            bump_versions(x, residual)  # as add_/copy_ would: a saved copy of either is now stale
    return x, residual


def add_rms_norm_(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    zero_centered_weight: bool = False,
    cast_before_weight: bool = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """In place: ``residual += x`` (in residual's dtype), then ``x = RMSNorm(residual)`` (in x's dtype). Returns
    ``(x, residual)``. ``eps=None`` means the machine epsilon of residual's dtype (the dtype normalized). Inference
    only; see :mod:`addnorm.ops.add_norm_inplace`."""
    return _add_norm_(x, residual, weight, None, eps, True, zero_centered_weight, cast_before_weight, backend)


def add_layer_norm_(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    zero_centered_weight: bool = False,
    cast_before_weight: bool = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """In place: ``residual += x`` (in residual's dtype), then ``x = LayerNorm(residual)`` (in x's dtype). Returns
    ``(x, residual)``. Inference only; see :mod:`addnorm.ops.add_norm_inplace`."""
    return _add_norm_(x, residual, weight, bias, eps, False, zero_centered_weight, cast_before_weight, backend)
