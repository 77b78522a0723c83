"""The ``triton`` backend of :mod:`addnorm.ops.add_norm`: the kernel contract (``forward``, ``forward_into``,
``backward``, ``unavailable_reason``) and the launchers around the Triton kernels of
:mod:`addnorm.ops.triton.kernels` (the math is written out there), with the block sizes and grids of
:mod:`addnorm.ops.triton.plan` (the layout of the work is described there).

No atomics anywhere, so gradients are bitwise reproducible. Inputs may have strided rows (last-dim stride 1).
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import Tensor

from addnorm.ops.contract import stats_dtype
from addnorm.ops.triton import fast_launch, plan, team_launch
from addnorm.ops.triton.guard_bwd import FIXUP_ROWS, bwd_fixup_kernel, fixup_meta
from addnorm.ops.triton.kernels import (  # the kernels stay reachable here (tests, benchmarks, compiled)
    bwd_row_sums_kernel,
    bwd_rows_kernel,
    bwd_tiles_kernel,
    fwd_looped_kernel,
    fwd_rows_kernel,
    triton,
)
from addnorm.ops.triton.launch_args import _dropout_args, _row_stride, _scratch, _split, _vec

__all__ = ["interpreted", "unavailable_reason", "forward", "forward_into", "backward"]


# --------------------------------------------------------------------------------------------------------------
# Launchers: allocate, launch
# --------------------------------------------------------------------------------------------------------------


def _kernel(kernel, traceable: bool):
    """The kernel to launch: itself, or (traceable) wrapped by ``torch.library.wrap_triton``, which records the launch
    as a node that torch.compile sees into (only inside the triton ops of :mod:`addnorm.ops.triton.compiled`; an
    eager launch through the wrapper costs ~1 ms of dispatch). (benchmarks/bench_overhead.py replaces this function
    to time the Python around the launches with no-op kernels.)"""
    if not traceable:
        return kernel
    from torch.library import wrap_triton

    return wrap_triton(kernel)


def _launch(kernel, grid, args: tuple, meta: dict, traceable: bool) -> None:
    """Launch ``kernel``: eager launches through :mod:`addnorm.ops.triton.fast_launch` (Triton's normal launch the
    first time for each specialization, the compiled kernel called directly after that); traced ones leave out
    ``enable_fp_fusion`` (torch forwards only num_warps-like options; Inductor compiles with its own)."""
    kernel = _kernel(kernel, traceable)
    if not traceable:
        fast_launch.launch(kernel, grid, args, meta)
    else:
        kernel[grid](*args, **{k: v for k, v in meta.items() if k != "enable_fp_fusion"})


def _launcher(traceable: bool):
    """_launch with ``traceable`` bound: how addnorm.ops.triton.team_launch launches the team kernels."""
    return lambda kernel, grid, args, meta: _launch(kernel, grid, args, meta, traceable)


def _fwd_launch(
    x, residual, weight, bias, out, res_out, mean, rstd, eps, dropout_p, seed, is_rms, zc, cast, traceable=False
):
    """forward_into's launch, on x's device, with contiguous weight and bias (both entry points call this
    positionally: the forward runs on every eager call). rstd None: the statistics are not stored (mean must be None
    too)."""
    with _device_guard(x):
        weight, bias = _vec(weight), _vec(bias)
        m, n = x.shape
        eps_hi, eps_lo = _split(eps)
        store_stats = rstd is not None
        if not store_stats:  # the kernels still take their accumulation type from Rstd's element type
            rstd = _scratch(x.device, stats_dtype(x.dtype, res_out.dtype if res_out is not None else x.dtype))
        dummy = rstd  # unused pointer slots (their constexpr flag is off) get any tensor
        args = (
            x,
            residual if residual is not None else dummy,
            weight if weight is not None else dummy,
            bias if bias is not None else dummy,
            out,
            res_out if res_out is not None else dummy,
            mean if mean is not None else dummy,
            rstd,
            x.stride(0),
            _row_stride(residual),
            m,
            n,
            eps_hi,
            eps_lo,
            *_dropout_args(dropout_p, seed, dummy),
        )
        key = (
            m,
            n,
            residual is not None,
            weight is not None,
            bias is not None,
            is_rms,
            zc,
            dropout_p > 0,
            res_out is not None,
            cast,
            store_stats,
        )
        k = team_launch.team_size(n)  # 0 unless the team path is on (opt-in: addnorm.ops.triton.team_launch)
        if k:
            team = (team_launch.wide_tuning(), k, *key)
            config = (
                team_launch.fwd_plan(*team)
                if traceable
                else plan.cached_config(team_launch.fwd_plan, ("team-fwd", *team))
            )
            team_launch.fwd_launch(
                config, args, m, x.device, rstd.dtype, interpreted() or traceable, _launcher(traceable)
            )
            return
        rows, grid, meta = plan.fwd_config(*key) if traceable else plan.cached_config(plan.fwd_config, ("fwd", *key))
        _launch(fwd_rows_kernel if rows else fwd_looped_kernel, grid, args, meta, traceable)


def _bwd_launch(
    dout, dres_out, h, weight, mean, rstd, dx, dres, has_db, dropout_p, seed, is_rms, zc, cast, traceable=False
):
    m, n = h.shape
    acc = rstd.dtype
    dummy = rstd
    dres_out_ = dres_out if dres_out is not None else dummy
    weight_ = weight if weight is not None else dummy
    mean_ = mean if mean is not None else dummy
    dres_ = dres if dres is not None else dummy
    drop = _dropout_args(dropout_p, seed, dummy)
    key = (
        m,
        n,
        h.element_size() <= 2 and dout.element_size() <= 2,
        dres_out is not None,
        weight is not None,
        has_db,
        is_rms,
        zc,
        dropout_p > 0,
        dres is not None,
        cast,
        h.device,
    )
    k = team_launch.team_size(n, backward=True)
    if k:
        team = (team_launch.wide_tuning(), k, *key)
        config = (
            team_launch.bwd_plan(*team) if traceable else plan.cached_config(team_launch.bwd_plan, ("team-bwd", *team))
        )
        tensors = (dout, dres_out_, h, weight_, mean_, rstd, dx, dres_)
        strides = (dout.stride(0), _row_stride(dres_out), h.stride(0))
        dw_part, db_part = team_launch.bwd_launch(
            config, tensors, strides, drop, m, n, h.device, acc, interpreted() or traceable, _launcher(traceable)
        )
    else:
        dw_part, db_part = _bwd_rows_or_looped(
            key, traceable, m, n, acc, dout, dres_out, dres_out_, h, weight_, mean_, rstd, dx, dres_, is_rms, drop
        )
    # the backward's guard (guard_bwd): rows whose g or row sums overflowed, redone after the kernels above
    fix = fixup_meta(n, *key[3:5], is_rms, zc, dropout_p > 0, dres is not None, plan.FP_FUSION)
    if traceable and weight is not None:
        # torch.compile: where Triton's mutation analysis fails (no GPU driver) every argument counts as written,
        # and a weight "written" by two backward kernels in a row is a forward input mutated in the backward, which
        # AOTAutograd's partitioner refuses; the fix-up gets a copy (N elements) to "write" instead
        weight_ = weight_.clone()
    args = (dout, dres_out_, h, weight_, mean_, rstd, dx, dres_)
    args += (dout.stride(0), _row_stride(dres_out), h.stride(0), m, n, *drop)
    _launch(bwd_fixup_kernel, (-(-m // FIXUP_ROWS),), args, fix, traceable)
    return dw_part, db_part


def _bwd_rows_or_looped(key, traceable, m, n, acc, dout, dres_out, dres_out_, h, weight_, mean_, rstd, dx, dres_,
                        is_rms, drop):  # fmt: skip
    """The rows kernel, or the row sums then the tiles: (dw_part, db_part)."""
    chosen = plan.bwd_config(*key) if traceable else plan.cached_config(plan.bwd_config, ("bwd", *key))
    if chosen[0]:
        _, programs, meta = chosen
        dw_part = torch.empty((programs, n), dtype=acc, device=h.device)  # every program writes its whole row
        db_part = torch.empty((programs, n), dtype=acc, device=h.device)
        args = (dout, dres_out_, h, weight_, mean_, rstd, dx, dres_, dw_part, db_part)
        args += (dout.stride(0), _row_stride(dres_out), h.stride(0), m, n, *drop)
        _launch(bwd_rows_kernel, (programs,), args, meta, traceable)
        return dw_part, db_part
    _, tiles, groups, sums, meta = chosen
    c1 = torch.empty(m, dtype=acc, device=h.device)
    c2 = torch.empty(m, dtype=acc, device=h.device) if not is_rms else c1
    # (mean, rstd, sc) per row for the tiles kernel; rows of a multiple of 16 elements keep each one aligned
    stride_eff = -(-m // 16) * 16
    eff = torch.empty((3, stride_eff), dtype=acc, device=h.device)
    _launch(
        bwd_row_sums_kernel,
        (m,),
        (dout, h, weight_, mean_, rstd, c1, c2, eff, dout.stride(0), h.stride(0), stride_eff, n),
        sums,
        traceable,
    )
    mean_, rstd, sc = eff[0], eff[1], eff[2]
    if team_launch.wide_tuning().sized_grids and h.is_cuda and not traceable and not interpreted():
        probe = (dout, dres_out_, h, weight_, mean_, rstd, c1, c2, sc, dx, dres_, c1, c1)
        probe += (dout.stride(0), _row_stride(dres_out), h.stride(0), m, n, *drop)
        resident = team_launch.resident_programs(bwd_tiles_kernel, probe, meta, h.device)
        groups = team_launch.looped_groups(
            tiles, resident, plan.persistent_programs(h.device, plan.tuning().looped_programs_per_sm), m
        )
    dw_part = torch.empty((groups, n), dtype=acc, device=h.device)
    db_part = torch.empty((groups, n), dtype=acc, device=h.device)
    args = (dout, dres_out_, h, weight_, mean_, rstd, c1, c2, sc, dx, dres_, dw_part, db_part)
    args += (dout.stride(0), _row_stride(dres_out), h.stride(0), m, n, *drop)
    _launch(bwd_tiles_kernel, (tiles, groups), args, meta, traceable)
    return dw_part, db_part


# --------------------------------------------------------------------------------------------------------------
# The kernel contract (see addnorm.ops.add_norm)
# --------------------------------------------------------------------------------------------------------------


def _device_guard(t: Tensor):
    """Launch on t's GPU: Triton launches on the current device, which for a model spread over GPUs (device_map)
    is not always the tensors'. A no-op when t is on the current device, or on the CPU. (Takes the tensor, not its
    device: ``is_cuda`` and ``get_device()`` cost less than building a torch.device and reading its type.)"""
    if t.is_cuda:
        index = t.get_device()
        if index != torch.cuda.current_device():
            return torch.cuda.device(index)
    return _NO_GUARD


_NO_GUARD = contextlib.nullcontext()  # reusable, and one fewer object per call


def interpreted() -> bool:
    """Whether the kernels above were built for Triton's interpreter (decided when this module was imported)."""
    return type(fwd_rows_kernel).__name__ == "InterpretedFunction"


def unavailable_reason(device: torch.device) -> str | None:
    """None when the Triton kernels can run on ``device``, else a sentence saying why not."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if triton is None:
        return "triton is not installed: pip install 'addnorm[triton]'"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available (no GPU, or a CPU-only build of torch)"
        if interpreted():
            return None  # the interpreter also runs CUDA tensors, slowly
        return None
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "CPU tensors need TRITON_INTERPRET=1 (Triton's interpreter); use backend='cpu'"
        if not interpreted():
            return (
                "TRITON_INTERPRET=1 was set after addnorm.ops.triton.kernels was imported; set it before "
                "importing addnorm (Triton decides at import) or use backend='cpu'"
            )
        return None
    return f"Triton kernels run on CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), not on {device.type}"


def forward(
    x,
    residual,
    weight,
    bias,
    *,
    eps,
    is_rms,
    dropout_p,
    seed,
    residual_dtype,
    zero_centered_weight,
    store_residual_out,
    cast_before_weight=False,
    out_dtype=None,
    store_stats=True,
    traceable=False,
):
    m, n = x.shape
    device = x.device
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=device)
    res_out = torch.empty((m, n), dtype=residual_dtype, device=device) if store_residual_out else None
    mean = rstd = None
    if store_stats:
        sd = stats_dtype(x.dtype, residual_dtype)
        mean = None if is_rms else torch.empty(m, dtype=sd, device=device)
        rstd = torch.empty(m, dtype=sd, device=device)
    if m > 0:  # forward_into's body, without its keyword call: this runs on every eager call
        _fwd_launch(x, residual, weight, bias, out, res_out, mean, rstd, eps, dropout_p, seed, is_rms,
                    zero_centered_weight, cast_before_weight, traceable)  # fmt: skip
    return out, res_out, mean, rstd


def forward_into(
    out,
    res_out,
    mean,
    rstd,
    x,
    residual,
    weight,
    bias,
    *,
    eps,
    is_rms,
    dropout_p,
    seed,
    zero_centered_weight,
    cast_before_weight=False,
    traceable=False,
):
    """The forward writing into given outputs (contiguous out and res_out; res_out None: normalize x; mean None
    for RMSNorm; mean and rstd None: statistics not stored, the serving case). out may be x and res_out the
    residual (the in-place ops): each element is read before it is written, by the thread that writes it, and out
    is written only after the row's statistics (after all of x was read). ``traceable``: launch through
    ``torch.library.wrap_triton`` (the triton ops of :mod:`addnorm.ops.triton.compiled`)."""
    if x.shape[0] > 0:
        _fwd_launch(x, residual, weight, bias, out, res_out, mean, rstd, eps, dropout_p, seed, is_rms,
                    zero_centered_weight, cast_before_weight, traceable)  # fmt: skip


def backward(
    dout,
    dresidual_out,
    h,
    weight,
    mean,
    rstd,
    *,
    is_rms,
    dropout_p,
    seed,
    zero_centered_weight,
    x_dtype,
    residual_dtype,
    bias_dtype,
    cast_before_weight=False,
    traceable=False,
):
    m, n = h.shape
    # incoming gradients can be broadcast views (stride 0); the kernels want unit stride along the row
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if dresidual_out is not None and dresidual_out.stride(-1) != 1:
        dresidual_out = dresidual_out.contiguous()
    dx = torch.empty((m, n), dtype=x_dtype, device=h.device)
    dres = torch.empty((m, n), dtype=residual_dtype, device=h.device) if residual_dtype is not None else None
    has_db = bias_dtype is not None
    if m == 0:
        dw = torch.zeros(n, dtype=weight.dtype, device=h.device) if weight is not None else None
        db = torch.zeros(n, dtype=bias_dtype, device=h.device) if has_db else None
        return dx, dres, dw, db
    with _device_guard(h):
        dw_part, db_part = _bwd_launch(
            dout,
            dresidual_out,
            h,
            _vec(weight),
            mean,
            rstd,
            dx,
            dres,
            has_db,
            dropout_p,
            seed,
            is_rms,
            zero_centered_weight,
            cast_before_weight,
            traceable,
        )
    # second stage: a fixed-shape sum over the partial rows (no atomics: bitwise reproducible)
    dw = dw_part.sum(dim=0).to(weight.dtype) if weight is not None else None
    db = db_part.sum(dim=0).to(bias_dtype) if has_db else None
    return dx, dres, dw, db
