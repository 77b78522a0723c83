"""The ``cpu`` backend: fused numba kernels, parallel over rows (CPU tensors).

- :mod:`addnorm.ops.cpu.launch`: allocation, thread count and the kernel contract (``forward``, ``forward_into``,
  ``backward``, ``unavailable_reason``): the module the backend registry names.

Importing the package imports none of them (nor numba): the registry imports the backend on first use.
"""
