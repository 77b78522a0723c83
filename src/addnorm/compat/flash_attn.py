"""flash-attention's Triton layer norm API (``flash_attn.ops.triton.layer_norm``, also vendored by Mamba and
others) served by addnorm's kernels on every backend, GPU and CPU, with no 64 KB row cap. Switching is one
import::

    from addnorm.compat.flash_attn import layer_norm_fn, rms_norm_fn, RMSNorm, LayerNorm

Same names, arguments, defaults and return tuples: ``layer_norm_fn`` returns ``y``, then ``y1`` (with weight1),
then ``residual_out`` (with ``prenorm``), then ``dropout_mask, dropout_mask1`` (with ``return_dropout_mask``).
``residual_out`` is in the residual's dtype, else fp32 with ``residual_in_fp32``, else x's; the outputs are in
``out_dtype`` (default x's). The numerics are addnorm's contract (:mod:`addnorm.ops.add_norm`: fp32 statistics,
one rounding per output), which is at least as accurate as flash-attention's kernel. Dropout masks come from
addnorm's keep-function (:func:`addnorm.ops.contract.dropout_keep_mask`), not Triton's ``tl.rand``: the same
distribution, different bits for a given seed. ``rowscale`` may be given with ``x1`` here (it scales x only).

Which combinations run in one fused kernel and which are composed is in :mod:`addnorm.ops.add_norm_multi`;
``layer_norm_linear_fn`` is :func:`addnorm.ops.add_norm_linear.add_norm_linear`. ``backend=`` (addnorm's) is an
extra keyword argument on every function and module. The flags (``prenorm``, ``residual_in_fp32``,
``zero_centered_weight``, ``is_rms_norm``, ``return_dropout_mask``) are read by truthiness, as flash-attention reads
them (``prenorm=1`` is ``True``), and handed to addnorm's ops, which take Python bools only, as ``bool(flag)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from addnorm.ops.add_norm_linear import add_norm_linear
from addnorm.ops.add_norm_multi import add_norm_multi

__all__ = [
    "layer_norm_fn",
    "rms_norm_fn",
    "layer_norm_ref",
    "rms_norm_ref",
    "layer_norm_linear_fn",
    "LayerNorm",
    "RMSNorm",
]


def _require(ok: bool, message: str) -> None:
    """flash-attention checks its arguments with bare ``assert``s: the same AssertionError here (with a message),
    kept under ``python -O``."""
    if not ok:
        raise AssertionError(message)


def _check_args(x, weight, bias, residual, x1, weight1, bias1, rowscale) -> None:
    """The shape checks of flash-attention's ``LayerNormFn.forward`` and ``_layer_norm_fwd``: residual and x1 of x's
    shape exactly, every weight and bias of shape (N,), rowscale one value per row (any shape of M elements)."""
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    if residual is not None:
        _require(
            residual.shape == x.shape, f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}"
        )
    if x1 is not None:
        _require(x1.shape == x.shape, f"x1 must have x's shape {tuple(x.shape)}, got {tuple(x1.shape)}")
    for t, name in ((weight, "weight"), (bias, "bias"), (weight1, "weight1"), (bias1, "bias1")):
        if t is not None:
            _require(t.shape == (n,), f"{name} must have shape ({n},), got {tuple(t.shape)}")
    if rowscale is not None:
        _require(
            rowscale.numel() == rows, f"rowscale must hold one value per row ({rows}), got {tuple(rowscale.shape)}"
        )


def _into(buffer: Tensor | None, value: Tensor, name: str) -> Tensor:
    """flash-attention's out=/residual_out= buffers: viewed as (rows, N), they must have x's rows and a unit last
    stride; the result is written into the caller's tensor (a differentiable copy) and returned as a view of it in
    x's shape, as flash-attention returns its kernel's output buffer reshaped."""
    if buffer is None:
        return value
    n = value.shape[-1]
    rows = value.numel() // n if n else 0
    _require(
        buffer.dim() > 0 and buffer.shape[-1] == n and buffer.numel() == rows * n,
        f"{name} must have x's shape {tuple(value.shape)} (as rows of {n}), got {tuple(buffer.shape)}",
    )
    _require(buffer.stride(-1) == 1, f"{name} must be contiguous in its last dimension")
    buffer.copy_(value.reshape(buffer.shape))
    return buffer if buffer.shape == value.shape else buffer.view(value.shape)


def layer_norm_fn(
    x,
    weight,
    bias,
    residual=None,
    x1=None,
    weight1=None,
    bias1=None,
    eps=1e-6,
    dropout_p=0.0,
    rowscale=None,
    prenorm=False,
    residual_in_fp32=False,
    zero_centered_weight=False,
    is_rms_norm=False,
    return_dropout_mask=False,
    out_dtype=None,
    out=None,
    residual_out=None,
    *,
    backend="auto",
):
    """flash-attention's ``layer_norm_fn``:
    ``residual_out = dropout(x * rowscale) + dropout(x1) + residual``, ``y = norm(residual_out) * weight + bias``,
    ``y1 = norm(residual_out) * weight1 + bias1``. Returns ``y``, ``(y, y1)``, with ``residual_out`` appended
    when ``prenorm`` and ``(dropout_mask, dropout_mask1)`` appended when ``return_dropout_mask``."""
    _check_args(x, weight, bias, residual, x1, weight1, bias1, rowscale)
    # flash-attention reads the flags by truthiness; addnorm's ops take Python bools only
    prenorm, residual_in_fp32, zero_centered_weight, is_rms_norm, return_dropout_mask = map(
        bool, (prenorm, residual_in_fp32, zero_centered_weight, is_rms_norm, return_dropout_mask)
    )
    residual_dtype = residual.dtype if residual is not None else (torch.float32 if residual_in_fp32 else None)
    r = add_norm_multi(
        x,
        residual,
        weight,
        bias,
        eps,
        is_rms=is_rms_norm,
        x1=x1,
        weight1=weight1,
        bias1=bias1,
        rowscale=rowscale,
        dropout_p=dropout_p,
        residual_dtype=residual_dtype,
        zero_centered_weight=zero_centered_weight,
        out_dtype=out_dtype,
        return_dropout_mask=return_dropout_mask,
        backend=backend,
    )
    y = _into(out, r.out, "out")
    outs = (y,) if weight1 is None else (y, r.out1)
    # flash-attention computes (and writes into a given residual_out buffer) residual_out whenever the sum is not
    # x itself, prenorm or not; otherwise the buffer is left alone
    summed = (
        residual is not None
        or (residual_dtype is not None and residual_dtype != x.dtype)
        or dropout_p > 0.0
        or rowscale is not None
        or x1 is not None
    )
    res = _into(residual_out, r.residual_out, "residual_out") if summed else r.residual_out
    if prenorm:
        outs += (res,)
    if return_dropout_mask:
        outs += (r.dropout_mask, r.dropout_mask1)
    return outs[0] if len(outs) == 1 else outs


def rms_norm_fn(
    x,
    weight,
    bias,
    residual=None,
    x1=None,
    weight1=None,
    bias1=None,
    eps=1e-6,
    dropout_p=0.0,
    rowscale=None,
    prenorm=False,
    residual_in_fp32=False,
    zero_centered_weight=False,
    return_dropout_mask=False,
    out_dtype=None,
    out=None,
    residual_out=None,
    *,
    backend="auto",
):
    """flash-attention's ``rms_norm_fn``: :func:`layer_norm_fn` with RMSNorm (a bias is allowed)."""
    return layer_norm_fn(
        x,
        weight,
        bias,
        residual,
        x1,
        weight1,
        bias1,
        eps,
        dropout_p,
        rowscale,
        prenorm,
        residual_in_fp32,
        zero_centered_weight,
        True,
        return_dropout_mask,
        out_dtype,
        out,
        residual_out,
        backend=backend,
    )


def _norm_ref(
    is_rms,
    x,
    weight,
    bias,
    residual,
    x1,
    weight1,
    bias1,
    eps,
    dropout_p,
    rowscale,
    prenorm,
    zero_centered_weight,
    dropout_mask,
    dropout_mask1,
    upcast,
):
    """flash-attention's plain-PyTorch references, in the input dtype unless ``upcast`` (what its tests compare
    against, with and without upcast)."""
    dtype = x.dtype
    if upcast:
        x, weight = x.float(), weight.float()
        bias, residual, x1, weight1, bias1 = (
            None if t is None else t.float() for t in (bias, residual, x1, weight1, bias1)
        )
    if zero_centered_weight:
        weight = weight + 1.0
        weight1 = weight1 + 1.0 if weight1 is not None else None
    if rowscale is not None:
        x = x * rowscale[..., None]
    if dropout_p > 0.0:
        x = (
            x.masked_fill(~dropout_mask, 0.0) / (1.0 - dropout_p)
            if dropout_mask is not None
            else F.dropout(x, dropout_p)
        )
        if x1 is not None:
            x1 = (
                x1.masked_fill(~dropout_mask1, 0.0) / (1.0 - dropout_p)
                if dropout_mask1 is not None
                else F.dropout(x1, dropout_p)
            )
    if x1 is not None:
        x = x + x1
    if residual is not None:
        x = (x + residual).to(x.dtype)

    def norm(w, b):
        if is_rms:
            rstd = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)
            y = x * rstd * w
            return (y + b if b is not None else y).to(dtype)
        return F.layer_norm(x.to(w.dtype), x.shape[-1:], w, b, eps).to(dtype)

    out = norm(weight, bias)
    if weight1 is None:
        return (out, x) if prenorm else out
    out1 = norm(weight1, bias1)
    return (out, out1, x) if prenorm else (out, out1)


def layer_norm_ref(
    x,
    weight,
    bias,
    residual=None,
    x1=None,
    weight1=None,
    bias1=None,
    eps=1e-6,
    dropout_p=0.0,
    rowscale=None,
    prenorm=False,
    zero_centered_weight=False,
    dropout_mask=None,
    dropout_mask1=None,
    upcast=False,
):
    return _norm_ref(
        False,
        x,
        weight,
        bias,
        residual,
        x1,
        weight1,
        bias1,
        eps,
        dropout_p,
        rowscale,
        prenorm,
        zero_centered_weight,
        dropout_mask,
        dropout_mask1,
        upcast,
    )


def rms_norm_ref(
    x,
    weight,
    bias,
    residual=None,
    x1=None,
    weight1=None,
    bias1=None,
    eps=1e-6,
    dropout_p=0.0,
    rowscale=None,
    prenorm=False,
    zero_centered_weight=False,
    dropout_mask=None,
    dropout_mask1=None,
    upcast=False,
):
    return _norm_ref(
        True,
        x,
        weight,
        bias,
        residual,
        x1,
        weight1,
        bias1,
        eps,
        dropout_p,
        rowscale,
        prenorm,
        zero_centered_weight,
        dropout_mask,
        dropout_mask1,
        upcast,
    )


def layer_norm_linear_fn(
    x,
    norm_weight,
    norm_bias,
    linear_weight,
    linear_bias,
    residual=None,
    eps=1e-6,
    prenorm=False,
    residual_in_fp32=False,
    is_rms_norm=False,
    *,
    backend="auto",
):
    """flash-attention's ``layer_norm_linear_fn``: ``linear(norm(x + residual))``, plus residual_out with
    ``prenorm``; the norm's output is recomputed in the backward, not stored."""
    prenorm, residual_in_fp32, is_rms_norm = bool(prenorm), bool(residual_in_fp32), bool(is_rms_norm)  # truthiness
    residual_dtype = residual.dtype if residual is not None else (torch.float32 if residual_in_fp32 else None)
    if not torch.is_autocast_enabled(x.device.type):
        # as flash-attention: without autocast the linear runs in x's dtype (the norm output's); under autocast
        # add_norm_linear casts to autocast's dtype
        linear_weight = linear_weight.to(x.dtype)
        linear_bias = linear_bias.to(x.dtype) if linear_bias is not None else None
    out, res = add_norm_linear(
        x,
        residual,
        norm_weight,
        norm_bias,
        linear_weight,
        linear_bias,
        eps,
        is_rms=is_rms_norm,
        residual_dtype=residual_dtype,
        backend=backend,
    )
    return (out, res) if prenorm else out


class RMSNorm(nn.Module):
    """flash-attention's ``RMSNorm`` module: ``forward(x, residual=None, prenorm=False, residual_in_fp32=False)``."""

    def __init__(
        self,
        hidden_size,
        eps=1e-5,
        dropout_p=0.0,
        zero_centered_weight=False,
        device=None,
        dtype=None,
        *,
        backend="auto",
    ):
        super().__init__()
        zero_centered_weight = bool(zero_centered_weight)  # flash-attention reads it by truthiness
        self.eps, self.zero_centered_weight, self.backend = eps, zero_centered_weight, backend
        self.drop = nn.Dropout(dropout_p) if dropout_p > 0.0 else None
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        (nn.init.zeros_ if self.zero_centered_weight else nn.init.ones_)(self.weight)

    def forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        return rms_norm_fn(
            x,
            self.weight,
            self.bias,
            residual=residual,
            eps=self.eps,
            dropout_p=self.drop.p if self.drop is not None and self.training else 0.0,
            prenorm=prenorm,
            residual_in_fp32=residual_in_fp32,
            zero_centered_weight=self.zero_centered_weight,
            backend=self.backend,
        )


class LayerNorm(nn.LayerNorm):
    """flash-attention's ``LayerNorm`` module: ``torch.nn.LayerNorm`` whose forward takes
    ``(x, residual=None, prenorm=False, residual_in_fp32=False)``."""

    def __init__(
        self,
        hidden_size,
        eps=1e-5,
        dropout_p=0.0,
        zero_centered_weight=False,
        device=None,
        dtype=None,
        *,
        backend="auto",
    ):
        zero_centered_weight = bool(zero_centered_weight)  # flash-attention reads it by truthiness
        self.zero_centered_weight = zero_centered_weight
        super().__init__(hidden_size, eps=eps, device=device, dtype=dtype)
        self.backend = backend
        self.drop = nn.Dropout(dropout_p) if dropout_p > 0.0 else None

    def reset_parameters(self):
        super().reset_parameters()
        if self.zero_centered_weight and self.elementwise_affine:
            nn.init.zeros_(self.weight)

    def forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        return layer_norm_fn(
            x,
            self.weight,
            self.bias,
            residual=residual,
            eps=self.eps,
            dropout_p=self.drop.p if self.drop is not None and self.training else 0.0,
            prenorm=prenorm,
            residual_in_fp32=residual_in_fp32,
            zero_centered_weight=self.zero_centered_weight,
            backend=self.backend,
        )
