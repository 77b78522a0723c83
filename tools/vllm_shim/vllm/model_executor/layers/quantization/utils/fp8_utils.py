"""vLLM's ``per_token_group_quant_fp8`` (``vllm/model_executor/layers/quantization/utils/fp8_utils.py``, a Triton
kernel there), written in PyTorch from its semantics: per group of ``group_size`` consecutive elements of a row,
``scale = max(amax, eps) / 448`` and ``q = fp8(clamp(x / scale, -448, 448))``; scales of shape
(..., hidden // group_size), float32."""

import torch


def per_token_group_quant_fp8(
    x, group_size, eps=1e-10, dtype=None, column_major_scales=False, out_q=None, use_ue8m0=False, **_
):
    if use_ue8m0:
        raise NotImplementedError("use_ue8m0 (power-of-two scales): not served by the shim")
    dtype = dtype or torch.float8_e4m3fn
    fmax = torch.finfo(dtype).max
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    s = torch.clamp(g.abs().amax(-1, keepdim=True), min=eps) / fmax
    q = (g / s).clamp(-fmax, fmax).to(dtype).reshape(x.shape)
    s = s.squeeze(-1)
    if column_major_scales:
        s = s.transpose(-1, -2).contiguous().transpose(-1, -2)
    return q, s
