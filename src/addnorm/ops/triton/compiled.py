"""The Triton backend as ``torch.library.triton_op``s, so compiled graphs see its kernels instead of an opaque call.

``addnorm::add_norm_fwd``/``add_norm_bwd`` are ``custom_op``s: torch.compile keeps each as one opaque call that
Inductor cannot look into. ``addnorm::triton_add_norm_fwd``/``triton_add_norm_bwd`` run the same launchers with every
kernel launch wrapped by ``torch.library.wrap_triton``: AOTAutograd decomposes the op into its allocations and
``triton_kernel_wrapper_functional`` nodes, and Inductor schedules those kernels with the rest of the graph (and can
capture them in its CUDA graphs). Arguments, results and autograd are add_norm_fwd's/add_norm_bwd's (less
``backend``); ``addnorm::triton_add_norm_`` is the in-place serving op ``addnorm::add_norm_`` likewise. Compiled
graphs with ``backend="triton"`` on CUDA tensors use these ops; eager calls keep the plain autograd.Function of
:mod:`addnorm.ops.kernel_ops` and the direct kernel call of :mod:`addnorm.ops.add_norm_inplace` (no dispatch at all).

Why CUDA only (torch 2.13, triton 3.9). A triton_op registers its implementation as its own fake kernel (it must be
traceable on fake tensors), and under ``TRITON_INTERPRET=1`` ``wrap_triton`` returns the interpreted kernel
unwrapped (torch/_library/triton.py: "TRITON_INTERPRET=1 makes @triton.jit return InterpretedFunction"), so tracing
runs Triton's interpreter on FakeTensors; the interpreter copies its arguments through their storages' data
pointers, which a FakeTensor does not have ("Cannot access data pointer of Tensor (e.g. FakeTensor ...)"). Compiled
graphs on CPU tensors in the interpreter therefore keep the opaque add_norm_fwd; tests/ops/test_triton_ops.py checks
both routes (this one on a GPU), and tools/gpu_graph_check.py checks it under Inductor and CUDA graphs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from addnorm.ops.contract import draw_seed, stats_dtype
from addnorm.ops.kernel_ops import backward, setup_context
from addnorm.ops.triton import launch
from addnorm.ops.triton.guard_bwd import bwd_fixup_kernel
from addnorm.ops.triton.kernels import (
    bwd_row_sums_kernel,
    bwd_rows_kernel,
    bwd_tiles_kernel,
    fwd_looped_kernel,
    fwd_rows_kernel,
)

__all__ = ["usable"]


def usable(device_type: str) -> bool:
    """Whether compiled graphs on ``device_type`` tensors can run the triton ops: CUDA, kernels not interpreted."""
    return device_type == "cuda" and launch.triton is not None and not launch.interpreted()


def _fwd(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    is_rms: bool,
    dropout_p: float,
    residual_dtype: torch.dtype,
    zero_centered_weight: bool,
    store_residual_out: bool,
    cast_before_weight: bool = False,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """add_norm_fwd on the Triton kernels: (out, residual_out or empty, mean or empty, rstd, seed or empty). Fresh
    outputs only (a custom op may not alias its inputs): the launchers allocate every result."""
    seed = draw_seed(x.device) if dropout_p > 0 else None
    out, res_out, mean, rstd = launch.forward(
        x,
        residual,
        weight,
        bias,
        eps=eps,
        is_rms=is_rms,
        dropout_p=dropout_p,
        seed=seed,
        residual_dtype=residual_dtype,
        zero_centered_weight=zero_centered_weight,
        store_residual_out=store_residual_out,
        cast_before_weight=cast_before_weight,
        out_dtype=out_dtype,
        traceable=True,
    )
    return (
        out,
        res_out if res_out is not None else x.new_empty(0),
        mean if mean is not None else x.new_empty(0, dtype=rstd.dtype),
        rstd,
        seed if seed is not None else x.new_empty(0, dtype=torch.int64),
    )


def _bwd(
    dout: Tensor,
    dresidual_out: Tensor | None,
    h: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    seed: Tensor,
    is_rms: bool,
    dropout_p: float,
    zero_centered_weight: bool,
    x_dtype: torch.dtype,
    residual_dtype: torch.dtype | None,
    bias_dtype: torch.dtype | None,
    cast_before_weight: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """add_norm_bwd on the Triton kernels: (dx, dresidual, dweight, dbias), an empty tensor for each absent one."""
    grads = launch.backward(
        dout,
        dresidual_out,
        h,
        weight,
        None if is_rms else mean,
        rstd,
        is_rms=is_rms,
        dropout_p=dropout_p,
        seed=seed if dropout_p > 0 else None,
        zero_centered_weight=zero_centered_weight,
        x_dtype=x_dtype,
        residual_dtype=residual_dtype,
        bias_dtype=bias_dtype,
        cast_before_weight=cast_before_weight,
        traceable=True,
    )
    return tuple(g if g is not None else dout.new_empty(0) for g in grads)  # type: ignore[return-value]


def _inplace(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    is_rms: bool,
    zero_centered_weight: bool,
    cast_before_weight: bool,
) -> None:
    """addnorm::add_norm_ on the Triton kernels (the serving ops of addnorm.ops.add_norm_inplace): residual <- x +
    residual, x <- norm(residual), written in place; inputs the kernels cannot write (not contiguous) are computed
    out of place and copied back."""
    n = x.shape[-1]
    opts = dict(
        eps=eps,
        dropout_p=0.0,
        seed=None,
        zero_centered_weight=zero_centered_weight,
        cast_before_weight=cast_before_weight,
        traceable=True,
    )
    if x.is_contiguous() and residual.is_contiguous():
        x2, r2 = x.view(-1, n), residual.view(-1, n)
        sd = stats_dtype(x.dtype, residual.dtype)
        rstd = torch.empty(x2.shape[0], dtype=sd, device=x.device)
        mean = None if is_rms else torch.empty(x2.shape[0], dtype=sd, device=x.device)
        launch.forward_into(x2, r2, mean, rstd, x2, r2, weight, bias, is_rms=is_rms, **opts)
        return
    out, res, _, _ = launch.forward(
        x.reshape(-1, n),
        residual.reshape(-1, n),
        weight,
        bias,
        is_rms=is_rms,
        residual_dtype=residual.dtype,
        store_residual_out=True,
        out_dtype=x.dtype,
        **opts,
    )
    residual.copy_(res.view(residual.shape))
    x.copy_(out.view(x.shape))


_fwd_op = torch.library.triton_op("addnorm::triton_add_norm_fwd", _fwd, mutates_args=())
_bwd_op = torch.library.triton_op("addnorm::triton_add_norm_bwd", _bwd, mutates_args=())
_inplace_op = torch.library.triton_op("addnorm::triton_add_norm_", _inplace, mutates_args=("x", "residual"))


def _bwd_call(
    dout,
    dres_out,
    h,
    weight,
    mean,
    rstd,
    seed,
    is_rms,
    dropout_p,
    zc,
    x_dtype,
    residual_dtype,
    bias_dtype,
    backend,
    cast_before_weight,
):
    """add_norm_bwd's arguments (the shared autograd code passes them) to triton_add_norm_bwd, which has no backend."""
    return torch.ops.addnorm.triton_add_norm_bwd(
        dout,
        dres_out,
        h,
        weight,
        mean,
        rstd,
        seed,
        is_rms,
        dropout_p,
        zc,
        x_dtype,
        residual_dtype,
        bias_dtype,
        cast_before_weight,
    )


def _setup(ctx, inputs, output):
    # add_norm_fwd's inputs have `backend` after store_residual_out: the shared code reads them in that layout
    setup_context(ctx, (*inputs[:10], "triton", *inputs[10:]), output, bwd_op=_bwd_call)


def _backward_triton(ctx, *grads):
    return backward(ctx, *grads)[:12]  # add_norm_fwd has 13 inputs; the 12 here lack `backend` (its grad is None)


_fwd_op.register_autograd(_backward_triton, setup_context=_setup)

# The AOTAutograd cache keys a compiled graph on the source of the kernels its triton ops launch, which torch finds
# by reading the op's source (best effort: it does not follow the launchers' indirection and finds none here). Name
# them, so that editing a kernel invalidates cached graphs; a private table, hence the guard.
_table = getattr(getattr(torch._library, "triton", None), "triton_ops_to_kernels", None)
if isinstance(_table, dict):
    _table["addnorm::triton_add_norm_fwd"] = [fwd_rows_kernel, fwd_looped_kernel]
    _table["addnorm::triton_add_norm_bwd"] = [bwd_rows_kernel, bwd_row_sums_kernel, bwd_tiles_kernel, bwd_fixup_kernel]
    _table["addnorm::triton_add_norm_"] = [fwd_rows_kernel, fwd_looped_kernel]
