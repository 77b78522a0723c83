"""Norm-then-add: ``residual + Norm(y)``, the norm on a branch's output (OLMo 2, OLMo 3, EXAONE 4; "post-branch" or
Peri-LN-style layers ``x + Norm(F(x))``).

    out = residual + norm(y)        # norm(y) rounded to y's dtype first, then the add in torch's promoted dtype

``norm`` is LayerNorm or RMSNorm over the last dimension with the contract of :mod:`addnorm.ops.add_norm`
(statistics in fp32, fp64 for fp64 input; ``zero_centered_weight`` scales by ``1 + weight``; ``cast_before_weight``
rounds the normalized value to y's dtype before the weight). The two roundings are Hugging Face's: its layers
compute ``hidden_states = residual + self.post_attention_layernorm(hidden_states)``, the norm returning y's dtype.

Not a fused kernel: no backend has one yet. Every backend runs its own norm kernel (``add_rms_norm`` /
``add_layer_norm`` without a residual) and then one PyTorch add, so this costs what the unfused pair costs; it is
here so that models written with the norm on the branch's output call one op whose contract a fused kernel can take
over later. Gradients flow to y, residual, weight and bias through the norm's own backward and the add.
"""

from __future__ import annotations

from torch import Tensor

from addnorm.ops.add_norm import add_layer_norm, add_rms_norm

__all__ = ["norm_add", "norm_add_norm"]

_NORMS = ("rms", "layer")


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
    if norm not in _NORMS:
        raise ValueError(f"norm must be one of {_NORMS}, got {norm!r}")
    if not isinstance(residual, Tensor):
        raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
    if not isinstance(y, Tensor):
        raise TypeError(f"y must be a torch.Tensor, got {type(y).__name__}")
    if residual.shape != y.shape:
        raise ValueError(f"residual must have y's shape {tuple(y.shape)}, got {tuple(residual.shape)}")
    if residual.device != y.device:
        raise ValueError(f"residual must be on y's device {y.device}, got {residual.device}")
    if not residual.is_floating_point():
        raise TypeError(f"residual must be a floating tensor, got {residual.dtype}")
    options = dict(zero_centered_weight=zero_centered_weight, cast_before_weight=cast_before_weight, backend=backend)
    if norm == "rms":
        if bias is not None:
            raise ValueError("bias must be None with norm='rms' (RMSNorm has no bias)")
        out, _ = add_rms_norm(y, None, weight, eps, **options)
    else:
        out, _ = add_layer_norm(y, None, weight, bias, 1e-5 if eps is None else eps, **options)
    return residual + out


def _pair(value, name: str) -> tuple:
    """One option for both norms of :func:`norm_add_norm`, or a pair (first norm's, second norm's)."""
    if isinstance(value, tuple):
        if len(value) != 2:
            raise ValueError(f"{name} must be a bool or a pair of bools, got a tuple of {len(value)}")
        return value
    return value, value


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
    :func:`norm_add`, per norm. Gradients flow to y, residual, both weights and both biases, from both outputs.
    """
    norm2 = norm if norm2 is None else norm2
    if norm2 not in _NORMS:
        raise ValueError(f"norm2 must be one of {_NORMS}, got {norm2!r}")
    zcw1, zcw2 = _pair(zero_centered_weight, "zero_centered_weight")
    cbw1, cbw2 = _pair(cast_before_weight, "cast_before_weight")
    h = norm_add(
        y, residual, weight1, bias1, eps1,
        norm=norm, zero_centered_weight=zcw1, cast_before_weight=cbw1, backend=backend,
    )  # fmt: skip
    options = dict(zero_centered_weight=zcw2, cast_before_weight=cbw2, backend=backend)
    if norm2 == "rms":
        if bias2 is not None:
            raise ValueError("bias2 must be None with norm2='rms' (RMSNorm has no bias)")
        out, _ = add_rms_norm(h, None, weight2, eps2, **options)
    else:
        out, _ = add_layer_norm(h, None, weight2, bias2, 1e-5 if eps2 is None else eps2, **options)
    return out, h
