"""vLLM's ``per_token_group_quant_int8`` (``vllm/model_executor/layers/quantization/utils/int8_utils.py``, a Triton
kernel there), written in PyTorch from its semantics: per group, ``scale = max(amax, eps) / 127`` and
``q = clamp(x / scale, -128, 127)`` converted to int8 the way Triton converts a float: toward zero."""

import torch


def per_token_group_quant_int8(x, group_size, eps=1e-10, dtype=torch.int8):
    info = torch.iinfo(dtype)
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    s = torch.clamp(g.abs().amax(-1, keepdim=True), min=eps) / info.max
    q = (g / s).clamp(info.min, info.max).trunc().to(dtype).reshape(x.shape)
    return q, s.squeeze(-1)
