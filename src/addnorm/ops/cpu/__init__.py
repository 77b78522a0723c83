"""The ``cpu`` backend: fused numba kernels, parallel over rows (CPU tensors).

- :mod:`addnorm.ops.cpu.convert`: the numba import, compile flags and dtype conversions (half types as bits).
- :mod:`addnorm.ops.cpu.stats`: the row statistics and the finite-range guard (:func:`~addnorm.ops.cpu.stats.guarded_row_stats`, the
  function every kernel that normalizes a row calls; :func:`~addnorm.ops.cpu.stats.saved_row_scaling` for the backward).
- :mod:`addnorm.ops.cpu.torch_order`: RMSNorm's sum of squares in PyTorch's own order (its rstd is PyTorch's bit for bit).
- :mod:`addnorm.ops.cpu.kernels`: the dropout hash and the forward kernels; the math is written out in its
  docstring.
- :mod:`addnorm.ops.cpu.kernels_bwd`: the backward kernels; :mod:`addnorm.ops.cpu.guard_bwd`: the backward of a
  row the guard rescaled.
- :mod:`addnorm.ops.cpu.launch`: flat numpy views, allocation, the thread count, and the kernel contract
  (``forward``, ``forward_into``, ``backward``, ``unavailable_reason``): the module the backend registry names.
- :mod:`addnorm.ops.cpu.fast_launch`: the decode-size launch by raw addresses (:mod:`addnorm.ops.fast_path`).
- :mod:`addnorm.ops.cpu.quant`: the fused add + norm + FP8/INT8 quantization kernels and their launch.

Importing the package imports none of them (nor numba): the registry imports the backend on first use.
"""
