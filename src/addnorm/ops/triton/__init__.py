"""The ``triton`` backend: fused Triton kernels (CUDA GPUs; CPU tensors only under ``TRITON_INTERPRET=1``).

- :mod:`addnorm.ops.triton.kernels`: the ``@triton.jit`` kernels, where the math is written out.
- :mod:`addnorm.ops.triton.launch`: block sizes, launch plans and the launchers, and the kernel contract around
  them (``forward``, ``forward_into``, ``backward``, ``unavailable_reason``): the module the backend registry names.
- :mod:`addnorm.ops.triton.fast_launch`: bound launches: after a first launch per specialization the launchers call
  the compiled kernel directly, without Triton's per-call binding (``ADDNORM_TRITON_FAST_LAUNCH=0`` turns it off).
- :mod:`addnorm.ops.triton.compiled`: the kernels as ``torch.library.triton_op``s, which compiled graphs call on
  CUDA tensors so that Inductor sees the kernel launches.

Importing the package imports none of them (nor triton): the registry imports the backend on first use.
"""
