"""Drop-in replacements for other libraries' norm APIs, served by addnorm's kernels on every backend:

- :mod:`addnorm.compat.flash_attn`: flash-attention's ``flash_attn.ops.triton.layer_norm``;
- :mod:`addnorm.compat.liger`: Liger-Kernel's fused add + RMSNorm.
- :mod:`addnorm.compat.flashinfer`: ``flashinfer.norm`` (RMSNorm, fused add, Gemma, LayerNorm, FP8 quant);
- :mod:`addnorm.compat.vllm`: ``vllm._custom_ops``' norm and quantization functions, and (:mod:`addnorm.compat.vllm_ops`)
  its ``torch.ops._C`` norm and quant ops as ``torch.ops.addnorm_vllm``.

Switching is one import; docs/compat.md says what is fused and what is composed.
"""
