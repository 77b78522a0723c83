"""Drop-in replacements for other libraries' norm APIs, served by addnorm's kernels on every backend:

- :mod:`addnorm.compat.flash_attn`: flash-attention's ``flash_attn.ops.triton.layer_norm``;
- :mod:`addnorm.compat.liger`: Liger-Kernel's fused add + RMSNorm.
- :mod:`addnorm.compat.flashinfer`: ``flashinfer.norm`` (RMSNorm, fused add, Gemma, LayerNorm, FP8 quant);
- :mod:`addnorm.compat.vllm`: vLLM's norm custom ops (fused add, static and per-token FP8/INT8 quant).

Switching is one import; docs/compat.md says what is fused and what is composed.
"""
