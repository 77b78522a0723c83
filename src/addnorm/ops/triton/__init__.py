"""The ``triton`` backend: fused Triton kernels (CUDA GPUs; CPU tensors only under ``TRITON_INTERPRET=1``).

- :mod:`addnorm.ops.triton.kernels`: the ``@triton.jit`` kernels, where the math is written out; the device
  functions every kernel file shares are in :mod:`addnorm.ops.triton.elementwise` (``round_to``, ``load_weight``,
  ``dropout``, ...) and :mod:`addnorm.ops.triton.row_stats` (``rsqrt``, and the guard and scaled pass that keep
  the statistics right for every finite row).
- :mod:`addnorm.ops.triton.plan`: block sizes, warps and grids for one shape, within the limits of the
  ``Tuning`` in force (:func:`~addnorm.ops.triton.plan.tuning`).
- :mod:`addnorm.ops.triton.launch`: the launchers and the kernel contract around them (``forward``,
  ``forward_into``, ``backward``, ``unavailable_reason``): the module the backend registry names; the kernels'
  scalar arguments (eps and dropout's scale in fp32 parts, row strides, the statistics' scratch) come from
  :mod:`addnorm.ops.triton.launch_args`.
- :mod:`addnorm.ops.triton.team_kernels` and :mod:`addnorm.ops.triton.team_launch`: wide rows shared by a team
  of programs (opt-in), their kernels and their launch.
- :mod:`addnorm.ops.triton.fast_launch`: bound launches: after a first launch per specialization the launchers call
  the compiled kernel directly, without Triton's per-call binding (``ADDNORM_TRITON_FAST_LAUNCH=0`` turns it off).
- :mod:`addnorm.ops.triton.compiled`: the kernels as ``torch.library.triton_op``s, which compiled graphs call on
  CUDA tensors so that Inductor sees the kernel launches.
- :mod:`addnorm.ops.triton.quant`: the fused add + norm + FP8/INT8 quantization kernels and their launch.

Importing the package imports none of them (nor triton): the registry imports the backend on first use.
"""
