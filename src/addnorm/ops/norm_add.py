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

__all__ = ["norm_add"]

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
