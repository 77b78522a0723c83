"""Norm-then-add: ``residual + Norm(y)``, the norm on a branch's output (OLMo 2, OLMo 3, EXAONE 4; "post-branch" or
Peri-LN-style layers ``x + Norm(F(x))``), and the sandwich chain that follows it with the next sublayer's pre-norm
(Gemma 2/3). The contract:

    h    = residual + norm1(y)      # norm1(y) rounded to y's dtype first, then the add in torch's promoted dtype
    out2 = norm2(h)                 # norm_add_norm only: h as stored, the result in h's dtype

``norm1``/``norm2`` are LayerNorm or RMSNorm over the last dimension with the contract of
:mod:`addnorm.ops.add_norm` (statistics in fp32, fp64 for fp64 input; ``zero_centered_weight`` scales by
``1 + weight``; ``cast_before_weight`` rounds the normalized value to its input's dtype before the weight). The two
roundings are Hugging Face's: its layers compute ``hidden_states = residual + self.post_attention_layernorm(
hidden_states)``, the norm returning y's dtype.

A fused kernel on the ``cpu`` and ``triton`` backends (:mod:`addnorm.ops.norm_add_ops`, the kernels in
``ops/cpu/norm_add_kernels.py`` and ``ops/triton/norm_add_kernels.py``): one pass per row reads y and the residual
and writes h (three row transfers, where the unfused norm then add moves five), and with norm2 also N2(h) (four,
where the unfused chain moves seven). The ``torch`` backend is the same contract written as the composition of
plain-PyTorch norms and the add (the readable one, the baseline), and so is the ``reference`` backend with its own
norms; a call whose two statistics dtypes differ (an fp64 residual under a lower-precision y), or whose rows are
wider than the backend's fused kernels take (Triton: 8192, ``norm_add_ops.MAX_N``), takes the composition. The forward gives the composition's bits on the cpu and torch backends. Gradients flow
to y, residual, the weights and the biases, from both outputs; the kernels' backward passes both roundings
straight through (the gradient reaching h is rounded only where it is stored). Both norms follow the contract's
finite-range guard (:mod:`addnorm.ops.contract`): a row of y or h whose plain statistics overflow or underflow is
normalized by the scaled pass, forward and backward, so every finite input gets the float64 answer rounded.

In place (serving): :func:`norm_add_` writes h into the residual, :func:`norm_add_norm_` also writes N2(h) into y
(the refusals of :mod:`addnorm.ops.add_norm_inplace`: no autograd, no aliasing, nothing written before a refusal).
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from addnorm.ops.add_norm import add_layer_norm, add_rms_norm
from addnorm.ops.backends import resolve_backend, resolve_backend_for_trace
from addnorm.ops.contract import (
    MACHINE_EPS,
    bump_versions,
    check_bools,
    check_disjoint,
    check_float,
    check_not_written,
    check_writable,
    stats_dtype,
)
from addnorm.ops.norm_add_fast import try_norm_add, try_norm_add_
from addnorm.ops.norm_add_ops import fits, kernel_norm_add, kernel_norm_add_

__all__ = ["norm_add", "norm_add_", "norm_add_norm", "norm_add_norm_"]

_NORMS = ("rms", "layer")


def _pair(value, name: str) -> tuple:
    """One option for both norms of :func:`norm_add_norm`, or a pair (first norm's, second norm's)."""
    if isinstance(value, tuple):
        if len(value) != 2:
            raise ValueError(f"{name} must be a bool or a pair of bools, got a tuple of {len(value)}")
        pair = value
    else:
        pair = value, value
    for v in pair:
        if not isinstance(v, bool):  # a flag read by truthiness would take 0.5 or "no" as True
            raise TypeError(f"{name} must be a bool or a pair of bools, got {value!r}")
    return pair


def _check_affine(name: str, p: Tensor | None, y: Tensor) -> None:
    if p is None:
        return
    check_float(name, p)
    n = y.shape[-1]
    if p.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},) to match y's last dim, got {tuple(p.shape)}")
    if p.device != y.device:
        raise ValueError(f"{name} must be on y's device {y.device}, got {p.device}")


def _eps(eps, is_rms: bool, dtype: torch.dtype, name: str) -> float:
    if eps is None:
        return MACHINE_EPS[dtype] if is_rms else 1e-5  # RMSNorm: the machine epsilon of the dtype normalized
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{name} must be a finite number >= 0 or None, got {eps!r}")
    return float(eps)


def _plan(y, residual, w1, b1, w2, b2, eps1, eps2, norm1, norm2, zc, cbw, has_norm2, names) -> tuple:
    """Validate one call (errors name the argument: ``names`` are weight, bias, eps of each norm) and resolve its
    options into the custom ops' order: (eps1, eps2, is_rms1, is_rms2, zc1, zc2, cast1, cast2, has_norm2,
    h_dtype)."""
    if norm1 not in _NORMS:
        raise ValueError(f"norm must be one of {_NORMS}, got {norm1!r}")
    if norm2 not in _NORMS:
        raise ValueError(f"norm2 must be one of {_NORMS}, got {norm2!r}")
    if not isinstance(residual, Tensor):
        raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
    check_float("y", y)
    if y.dim() < 1 or y.shape[-1] == 0:
        raise ValueError(f"y must have a last dimension (the normalized one) > 0, got shape {tuple(y.shape)}")
    if residual.shape != y.shape:
        raise ValueError(f"residual must have y's shape {tuple(y.shape)}, got {tuple(residual.shape)}")
    if residual.device != y.device:
        raise ValueError(f"residual must be on y's device {y.device}, got {residual.device}")
    if not residual.is_floating_point():
        raise TypeError(f"residual must be a floating tensor, got {residual.dtype}")
    check_float("residual", residual)
    for first, (name, t), is_rms in zip(
        (True, False), ((names[1], b1), (names[4], b2)), (norm1 == "rms", norm2 == "rms"), strict=True
    ):
        # by position, not identity: one tensor passed as both biases is named as the argument that is wrong
        if t is not None and is_rms and (first or has_norm2):
            norm_arg = "norm" if first else "norm2"
            raise ValueError(f"{name} must be None with {norm_arg}='rms' (RMSNorm has no bias)")
    for name, t in zip(names[:2] + names[3:5], (w1, b1, w2, b2), strict=True):
        _check_affine(name, t, y)
    h_dtype = torch.promote_types(y.dtype, residual.dtype)
    (zc1, zc2), (cbw1, cbw2) = zc, cbw
    is_rms1, is_rms2 = norm1 == "rms", norm2 == "rms"
    e1 = _eps(eps1, is_rms1, y.dtype, names[2])
    e2 = _eps(eps2, is_rms2, h_dtype, names[5]) if has_norm2 else 0.0
    # the cast changes nothing without an affine step, or when the norm's input dtype is the statistics dtype
    cast1 = bool(cbw1) and (w1 is not None or b1 is not None) and y.dtype != stats_dtype(y.dtype, y.dtype)
    cast2 = bool(cbw2) and (w2 is not None or b2 is not None) and h_dtype != stats_dtype(h_dtype, h_dtype)
    return (e1, e2, is_rms1, is_rms2, bool(zc1), bool(zc2), cast1, cast2 and has_norm2, has_norm2, h_dtype)


def _backend(backend: str, y: Tensor, opts: tuple) -> tuple[str, bool, bool]:
    """(backend name, compiling, fused): fused when the backend has a fused kernel for rows this wide and both
    norms share one statistics dtype (an fp64 residual under a lower-precision y does not)."""
    compiling = torch.compiler.is_compiling()
    name = resolve_backend_for_trace(backend, y.device.type) if compiling else resolve_backend(backend, y.device)
    if not compiling and torch._C._are_functorch_transforms_active():
        return backend, compiling, False  # the composition's norms choose (torch for auto) or refuse
    h_dtype = opts[-1]
    fused = fits(name, y.shape[-1]) and stats_dtype(y.dtype, y.dtype) == stats_dtype(h_dtype, h_dtype)
    return name, compiling, fused


def _norm(x, w, b, eps, is_rms, zc, cbw, backend):
    if is_rms:
        return add_rms_norm(x, None, w, eps, zero_centered_weight=zc, cast_before_weight=cbw, backend=backend)[0]
    return add_layer_norm(x, None, w, b, eps, zero_centered_weight=zc, cast_before_weight=cbw, backend=backend)[0]


def _composed(y, residual, w1, b1, w2, b2, opts, backend) -> tuple[Tensor, Tensor | None]:
    """The contract as its composition, (h, out2 | None): the backend's own norm, then PyTorch's add (and the second
    norm). What the torch and reference backends run: on ``torch`` it is plain PyTorch throughout."""
    e1, e2, is_rms1, is_rms2, zc1, zc2, cast1, cast2, has_norm2, _ = opts
    h = residual + _norm(y, w1, b1, e1, is_rms1, zc1, cast1, backend)
    return h, (_norm(h, w2, b2, e2, is_rms2, zc2, cast2, backend) if has_norm2 else None)


def _run(y, residual, w1, b1, w2, b2, opts, backend) -> tuple[Tensor, Tensor | None]:
    name, compiling, fused = _backend(backend, y, opts)
    if not fused:
        return _composed(y, residual, w1, b1, w2, b2, opts, name)
    return kernel_norm_add(y, residual, w1, b1, w2, b2, (*opts, name), compiling)


_NAMES1 = ("weight", "bias", "eps", "weight2", "bias2", "eps2")
_NAMES2 = ("weight1", "bias1", "eps1", "weight2", "bias2", "eps2")


def _single(weight, bias, eps, norm, zero_centered_weight, cast_before_weight) -> tuple:
    """One norm's arguments (norm_add, norm_add_) in the chain's layout, the absent second norm filled in:
    (weight1, bias1, weight2, bias2), (eps1, eps2), (norm, norm2), zc pair, cast pair."""
    check_bools(("zero_centered_weight", zero_centered_weight), ("cast_before_weight", cast_before_weight))
    pairs = (zero_centered_weight, False), (cast_before_weight, False)
    return (weight, bias, None, None), (eps, None), (norm, "rms"), *pairs


def _chain(norm, norm2, zero_centered_weight, cast_before_weight) -> tuple:
    """The chain's per-norm options (norm_add_norm, norm_add_norm_): (norm, norm2), zc pair, cast pair."""
    norms = (norm, norm if norm2 is None else norm2)
    zc = _pair(zero_centered_weight, "zero_centered_weight")
    return norms, zc, _pair(cast_before_weight, "cast_before_weight")


def norm_add(
    y: Tensor,
    residual: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float | None = None,
    *,
    norm: str = "rms",
    zero_centered_weight: bool = False,
    cast_before_weight: bool = False,
    backend: str = "auto",
) -> Tensor:
    """``residual + Norm(y)`` (see the module docstring). ``norm`` is ``"rms"`` (``eps=None``: the machine epsilon
    of y's dtype; ``bias`` must be None) or ``"layer"`` (``eps=None``: 1e-5). ``residual`` has y's shape and device;
    the result has torch's promoted dtype of residual and y."""
    params, eps, norms, zc, cbw = _single(weight, bias, eps, norm, zero_centered_weight, cast_before_weight)
    fast = try_norm_add(y, residual, params, *eps, norms, zc, cbw, False, backend)
    if fast is not None:  # a decode-size inference call (addnorm.ops.norm_add_fast): the same kernel and bits
        return fast[0]
    opts = _plan(y, residual, *params, *eps, *norms, zc, cbw, False, _NAMES1)
    return _run(y, residual, *params, opts, backend)[0]


def norm_add_norm(
    y: Tensor,
    residual: Tensor,
    weight1: Tensor | None = None,
    weight2: Tensor | None = None,
    bias1: Tensor | None = None,
    bias2: Tensor | None = None,
    eps1: float | None = None,
    eps2: float | None = None,
    *,
    norm: str = "rms",
    norm2: str | None = None,
    zero_centered_weight: bool | tuple[bool, bool] = False,
    cast_before_weight: bool | tuple[bool, bool] = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """The sandwich chain (Gemma 2/3): ``h = residual + N1(y)``, returns ``(N2(h), h)``.

    ``N1`` is the post-norm on a branch's output, ``N2`` the next sublayer's pre-norm; ``h`` is
    :func:`norm_add`'s result (its roundings and dtype) and ``N2(h)`` is in h's dtype, as Hugging Face's layers
    compute ``residual = residual + post_norm(y); y = pre_norm(residual)``. ``norm`` is the first norm's kind
    (``"rms"`` or ``"layer"``), ``norm2`` the second's (None: the same); ``zero_centered_weight`` and
    ``cast_before_weight`` are one bool for both norms or a pair (first, second); eps and bias as in
    :func:`norm_add`, per norm (eps2=None with RMSNorm: the machine epsilon of h's dtype). Gradients flow to y,
    residual, both weights and both biases, from both outputs.
    """
    params = (weight1, bias1, weight2, bias2)
    norms, zc, cbw = _chain(norm, norm2, zero_centered_weight, cast_before_weight)
    fast = try_norm_add(y, residual, params, eps1, eps2, norms, zc, cbw, True, backend)
    if fast is not None:
        return fast[1], fast[0]
    opts = _plan(y, residual, *params, eps1, eps2, *norms, zc, cbw, True, _NAMES2)
    h, out2 = _run(y, residual, *params, opts, backend)
    return out2, h


# --------------------------------------------------------------------------------------------------------------
# In place (serving)
# --------------------------------------------------------------------------------------------------------------


def _check_inplace(y, residual, weights, has_norm2, fn: str) -> None:
    """Everything checked before anything is written: a refusal leaves both tensors as they were."""
    for name, t in (("y", y), ("residual", residual)):
        if t.requires_grad:
            raise RuntimeError(
                f"{name} requires grad: {fn} overwrites its inputs and records no gradient (inference only); use "
                f"{fn.rstrip('_')} to train"
            )
    if torch.is_grad_enabled():
        for name, t in weights:
            if t is not None and t.requires_grad:
                raise RuntimeError(
                    f"{name} requires grad and grad mode is on: {fn} records no gradient; call it under "
                    f"torch.no_grad() or torch.inference_mode() (or use {fn.rstrip('_')} to train)"
                )
    h_dtype = torch.promote_types(y.dtype, residual.dtype)
    if residual.dtype != h_dtype:
        raise TypeError(
            f"residual ({residual.dtype}) cannot hold h = residual + norm(y), whose dtype is {h_dtype}: pass a "
            f"residual of dtype {h_dtype}, or use {fn.rstrip('_')}"
        )
    if has_norm2 and y.dtype != h_dtype:
        raise TypeError(f"y ({y.dtype}) cannot hold N2(h), whose dtype is {h_dtype}: y and residual must share a dtype")
    if torch.compiler.is_compiling():
        return  # dynamo cannot read storage pointers (the eager checks below need them)
    written = (("y", y), ("residual", residual)) if has_norm2 else (("residual", residual),)
    for name, t in written:
        check_writable(name, t)
        if t.numel() > 1 and torch._debug_has_internal_overlap(t) == 1:
            raise ValueError(
                f"{name} has elements that share memory (an expanded or stride-0 view, shape {tuple(t.shape)}, "
                f"strides {t.stride()}): it cannot be written in place; pass {name}.clone()"
            )
    if y is residual:
        raise ValueError("y and residual must not share memory: residual is written while y is read")
    check_disjoint("y", y, "residual", residual, "residual is written while y is read")
    # a weight or bias inside written memory would be read while the kernel overwrites it
    check_not_written(written, weights, "it is read while that is written")


def _run_(y, residual, w1, b1, w2, b2, opts, backend) -> None:
    name, compiling, fused = _backend(backend, y, opts)
    if fused:
        kernel_norm_add_(y, residual, w1, b1, w2, b2, (*opts[:-1], name), compiling)
        if not compiling:  # (the custom op a compiled graph calls bumps them itself: it declares mutates_args)
            # written through pointers (or by copy_, which bumped them already: one more is harmless)
            bump_versions(y, residual) if opts[8] else bump_versions(residual)
        return
    with torch.no_grad():  # out of place, then copied back
        h, out2 = _composed(y, residual, w1, b1, w2, b2, opts, name)
    residual.copy_(h)
    if out2 is not None:
        y.copy_(out2)


def norm_add_(
    y: Tensor,
    residual: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float | None = None,
    *,
    norm: str = "rms",
    zero_centered_weight: bool = False,
    cast_before_weight: bool = False,
    backend: str = "auto",
) -> Tensor:
    """In place: ``residual += Norm(y)`` with :func:`norm_add`'s roundings (residual must have the sum's dtype).
    Returns residual. Inference only: nothing is recorded for autograd."""
    params, eps, norms, zc, cbw = _single(weight, bias, eps, norm, zero_centered_weight, cast_before_weight)
    if try_norm_add_(y, residual, params, *eps, norms, zc, cbw, False, backend):
        return residual
    opts = _plan(y, residual, *params, *eps, *norms, zc, cbw, False, _NAMES1)
    _check_inplace(y, residual, (("weight", weight), ("bias", bias)), False, "norm_add_")
    _run_(y, residual, *params, opts, backend)
    return residual


def norm_add_norm_(
    y: Tensor,
    residual: Tensor,
    weight1: Tensor | None = None,
    weight2: Tensor | None = None,
    bias1: Tensor | None = None,
    bias2: Tensor | None = None,
    eps1: float | None = None,
    eps2: float | None = None,
    *,
    norm: str = "rms",
    norm2: str | None = None,
    zero_centered_weight: bool | tuple[bool, bool] = False,
    cast_before_weight: bool | tuple[bool, bool] = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """In place: ``residual += N1(y)``, then ``y = N2(residual)`` (y and residual share one dtype). Returns
    ``(y, residual)``: :func:`norm_add_norm`'s ``(N2(h), h)``, written where its inputs were. Inference only."""
    params = (weight1, bias1, weight2, bias2)
    norms, zc, cbw = _chain(norm, norm2, zero_centered_weight, cast_before_weight)
    if try_norm_add_(y, residual, params, eps1, eps2, norms, zc, cbw, True, backend):
        return y, residual
    opts = _plan(y, residual, *params, eps1, eps2, *norms, zc, cbw, True, _NAMES2)
    _check_inplace(y, residual, tuple(zip(_NAMES2[:2] + _NAMES2[3:5], params, strict=True)), True, "norm_add_norm_")
    _run_(y, residual, *params, opts, backend)
    return y, residual
