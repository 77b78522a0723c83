"""Residual add + LayerNorm/RMSNorm: the public functions, the kernel contract, and the plain-PyTorch backend.

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
    the backend: the seed is drawn on x's device by
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

The kernel backends run behind two custom ops, ``addnorm::add_norm_fwd`` and ``addnorm::add_norm_bwd``
(:mod:`addnorm.ops.kernel_ops`), with fake implementations and registered autograd, so
``torch.compile(fullgraph=True)`` traces through them without a graph break. On CUDA tensors compiled graphs run the
Triton backend through ``addnorm::triton_add_norm_fwd``/``_bwd`` instead (:mod:`addnorm.ops.triton.compiled`): the
same arguments and autograd, but triton ops whose kernel launches Inductor sees. Eager calls use neither: a plain
autograd.Function calls the kernels (no dispatcher in the way). The ``torch`` backend is plain PyTorch: the readable
one, the fallback and the baseline.

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

from addnorm.ops.backends import ENV_VAR, resolve_backend, resolve_backend_for_trace
from addnorm.ops.contract import FLOAT_DTYPES, as_dtype, default_rms_eps, draw_seed, stats_dtype, validate
from addnorm.ops.decode import batch_invariant_rms_norm, torch_rms_norm_one_dtype, try_add_norm
from addnorm.ops.kernel_ops import kernel_add_norm
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
    """The torch backend: (out, residual_out), with run_add_norm's arguments less ``backend``."""
    if (
        is_rms
        and dropout_p == 0.0
        and not zero_centered_weight
        and x.dtype is residual_dtype
        and out_dtype is residual_dtype
        and (residual is None or residual.dtype is residual_dtype)
        and (weight is None or weight.dtype is residual_dtype)
        and not (torch.is_grad_enabled() and _any_requires_grad(x, residual, weight))
    ):
        return torch_rms_norm_one_dtype(x, residual, weight, eps, cast_before_weight)
    return torch_add_norm_general(
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


def _any_requires_grad(x, residual, weight) -> bool:
    return (
        x.requires_grad
        or (residual is not None and residual.requires_grad)
        or (weight is not None and weight.requires_grad)
    )


def torch_add_norm_general(
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
    """The torch backend written out in the statistics dtype: every case, differentiable."""
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
    torch backend or the kernel route. Arguments positional, in the order of the signature. A decode-size call in
    the common inference case is served by the fast path first (:mod:`addnorm.ops.decode`: the same bits)."""
    fast = try_add_norm(
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
    if fast is not None:
        return fast
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
        name = resolve_backend(backend, x.device)
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
    return kernel_add_norm(*args, name, compiling)


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
