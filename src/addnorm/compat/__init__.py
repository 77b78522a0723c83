"""Drop-in replacements for other libraries' norm APIs, served by addnorm's kernels on every backend:

- :mod:`addnorm.compat.flash_attn`: flash-attention's ``flash_attn.ops.triton.layer_norm``;
- :mod:`addnorm.compat.liger`: Liger-Kernel's fused add + RMSNorm.

Switching is one import; docs/compat.md says what is fused and what is composed.
"""
