"""Residual add + LayerNorm/RMSNorm: the public functions, and the contract every backend implements.

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

Every finite input is in the contract: a row whose plain statistics overflow or underflow (fp32 sums of squares
of values beyond ~1e19 or below ~1e-23, a subnormal row with eps=0) gets the float64 answer rounded to out_dtype,
on every backend, at the cost of one scalar test per row for all others. The test, on the row's mean and rstd as
computed: ``2^-50 <= rstd <= 2^50`` (fp32 statistics; 2^-400, 2^400 for fp64) and the mean not subnormal; a row
that fails it is recomputed from ``h * 2^k`` (k from the row's max |value|: exact) in float64. Its saved mean and
rstd are the true values rounded to the statistics dtype, rstd possibly inf (eps=0 on a subnormal row: ~1e40) or
subnormal; the backward applies the same test to them and recomputes such a row's scaled statistics from h, so its
gradients are float64's rounded to their dtypes: inf where they lie beyond the range, never NaN where float64 is
finite. Rows holding inf or NaN, and zero rows, keep the plain result (NaN). The rule, its constants and why:
:mod:`addnorm.ops.contract` (``GUARD_LIMITS``, ``guard_scale_exponent``, ``ordinary_rows``).

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
    (seed, i * N + j) are >= ceil(p * 2^24) (:func:`addnorm.ops.contract.dropout_keep_mask` defines it); kept
    elements are multiplied by 1 / (1 - p) computed in fp64 and rounded to the statistics dtype
    (:func:`addnorm.ops.contract.dropout_scale`), dropped ones are 0.

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
autograd.Function calls the kernels (no dispatcher in the way). The ``torch`` backend
(:mod:`addnorm.ops.torch_backend`) is plain PyTorch: the readable one, the fallback and the baseline. What all of
them share (the dropout hash, the row helpers, the dtype rules, the validation) is :mod:`addnorm.ops.contract`.

What composes with what: every backend works under autocast (the op takes each tensor's dtype as given),
``no_grad``/``inference_mode``, activation checkpointing (the dropout seed comes from torch's generator, which
checkpointing restores) and ``torch.compile``/``torch.export``. The kernel backends' gradients are first order:
differentiating them again raises an error naming ``backend='torch'``, which is differentiable to any order.
``torch.func`` transforms (vmap, grad, jacrev: per-sample gradients) see through plain PyTorch only, so ``auto``
uses the torch backend inside one and a kernel backend asked for by name raises.

The bool options (``zero_centered_weight``, ``cast_before_weight``; ``is_rms`` and ``return_dropout_mask`` of
add_norm_multi) must be Python bools, on every op: anything else (``1``, ``"no"``, a tensor, ``numpy.bool_``) is a
TypeError naming the option and the value (:func:`addnorm.ops.contract.check_bools`), not read by truthiness.
"""

from __future__ import annotations

import torch
from torch import Tensor

from addnorm.ops import torch_backend
from addnorm.ops.backends import ENV_VAR, backend_override, resolve_backend, resolve_backend_for_trace
from addnorm.ops.contract import AddNormSpec, check_bools
from addnorm.ops.fast_path import try_add_norm
from addnorm.ops.kernel_ops import kernel_add_norm

__all__ = ["add_layer_norm", "add_rms_norm", "layer_norm", "rms_norm"]


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
    """What the public functions (and add_norm_multi's fused calls) share: validate the call into an
    :class:`~addnorm.ops.contract.AddNormSpec`, resolve the backend, run the torch backend or the kernel route.
    Arguments positional, in the order of the signature. A decode-size call in the common inference case is served
    by the fast path first (:mod:`addnorm.ops.fast_path`: the same bits). The flags are Python bools, checked first
    (every caller: the public functions, add_norm_multi, the nn modules)."""
    if type(zero_centered_weight) is not bool or type(cast_before_weight) is not bool:
        check_bools(("zero_centered_weight", zero_centered_weight), ("cast_before_weight", cast_before_weight))
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
    spec = AddNormSpec.of_call(
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
    compiling = torch.compiler.is_compiling()  # once a call: the kernel route asks again otherwise
    if compiling:
        name = resolve_backend_for_trace(backend, x.device.type)
    else:
        name = resolve_backend(backend, x.device)
        if name != "torch" and torch._C._are_functorch_transforms_active():
            name = _backend_under_functorch(backend, name)
    if name == "torch":
        return torch_backend.add_norm(x, residual, weight, bias, spec)
    return kernel_add_norm(x, residual, weight, bias, spec, name, compiling)


def _backend_under_functorch(backend: str, name: str) -> str:
    """torch.func transforms (vmap, grad, jacrev, functional_call + grad, ...) compose with plain PyTorch only: the
    kernel backends' autograd has no vmap rule and cannot see through functorch's wrapped tensors. auto falls back
    to the torch backend (same contract); a kernel backend asked for by name (or by ADDNORM_BACKEND) is an error."""
    override = backend_override()
    if backend == "auto" and override is None:
        return "torch"
    asked = f"backend={backend!r}" if backend != "auto" else f"{ENV_VAR}={override!r}"
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
