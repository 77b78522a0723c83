"""vLLM's ``RMSNorm`` layer (``vllm/model_executor/layers/layernorm.py``, vllm-project/vllm at 00cba797), as its
kernel tests use it:

- ``forward_native(x, residual=None)``: the plain-PyTorch reference: ``h = x`` (plus ``residual``, both in float32;
  ``residual`` then becomes ``h`` rounded to x's dtype), ``y = h * rsqrt(mean(h^2) + eps)`` rounded to x's dtype,
  times the weight in x's dtype; returns ``y`` or ``(y, residual)``;
- calling the layer runs vLLM's CUDA path, which here is ``vllm._custom_ops`` = ``addnorm.compat.vllm``:
  ``fused_add_rms_norm(x, residual, weight, eps)`` in place, returning ``(x, residual)``, else
  ``rms_norm(out, x, weight, eps)`` into a new ``out``.
"""

import torch
from torch import nn

from vllm import _custom_ops as ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6, var_hidden_size=None, has_weight=True, dtype=None):
        super().__init__()
        if var_hidden_size not in (None, hidden_size):
            raise NotImplementedError("var_hidden_size: not served by the shim")
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.has_weight = has_weight
        weight = torch.ones(hidden_size, dtype=dtype) if dtype is not None else torch.ones(hidden_size)
        self.weight = nn.Parameter(weight) if has_weight else weight

    def forward_native(self, x, residual=None):
        dtype = x.dtype
        h = x.to(torch.float32)
        if residual is not None:
            h = h + residual.to(torch.float32)
            residual = h.to(dtype)
        if h.shape[-1] != self.hidden_size:
            raise ValueError(f"Expected hidden_size to be {self.hidden_size}, but found: {h.shape[-1]}")
        y = (h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + self.variance_epsilon)).to(dtype)
        if self.has_weight:
            y = y * self.weight
        return y if residual is None else (y, residual)

    def forward(self, x, residual=None):
        if residual is not None:
            ops.fused_add_rms_norm(x, residual, self.weight.data, self.variance_epsilon)
            return x, residual
        out = torch.empty_like(x)
        ops.rms_norm(out, x, self.weight.data, self.variance_epsilon)
        return out
