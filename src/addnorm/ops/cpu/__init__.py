"""The ``cpu`` backend: fused numba kernels, parallel over rows (CPU tensors).

- :mod:`addnorm.ops.cpu.kernels`: the register-level helpers both directions share (half types as bits, the
  dropout hash, the row sums) and the forward kernels; the math is written out in its docstring.
- :mod:`addnorm.ops.cpu.kernels_bwd`: the backward kernels.
- :mod:`addnorm.ops.cpu.launch`: flat numpy views, allocation, the thread count, and the kernel contract
  (``forward``, ``forward_into``, ``backward``, ``unavailable_reason``): the module the backend registry names.
- :mod:`addnorm.ops.cpu.fast_launch`: the decode-size launch by raw addresses (:mod:`addnorm.ops.fast_path`).
- :mod:`addnorm.ops.cpu.quant`: the fused add + norm + FP8/INT8 quantization kernels and their launch.

Importing the package imports none of them (nor numba): the registry imports the backend on first use.
"""
