"""The ``triton`` backend of :mod:`addnorm.ops.add_norm`: block sizes, launch plans and the kernel contract around
the Triton kernels of :mod:`addnorm.ops.triton.kernels` (the math is written out there).

Layout of the work:
- rows path (N <= ``TUNING.max_fwd_block_n`` / ``max_bwd_block_n``, RMSNorm's backward on 2-byte types up to
  ``max_bwd_block_n_rms_16bit``): a program holds BLOCK_M whole rows in
  registers (BLOCK_M > 1 for small N, e.g. QK-norm's N = 128); the backward is persistent: a bounded set of
  programs (about 2x the SM count) walks the rows and keeps its dw/db partial sums in registers.
- looped path (wider rows): the forward loops over column tiles twice (stats + residual_out, then normalize);
  the backward first reduces the two row sums, then a 2-D grid (column tiles x row groups) computes dx/dresidual
  and accumulates the dw/db partials of its tile in registers.
No atomics anywhere, so gradients are bitwise reproducible. Inputs may have strided rows (last-dim stride 1).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import struct
from dataclasses import dataclass

import torch
from torch import Tensor

from addnorm.ops.contract import stats_dtype
from addnorm.ops.triton.kernels import (  # the kernels stay reachable here (tests, benchmarks, compiled)
    _bwd_row_sums_kernel,
    _bwd_rows_kernel,
    _bwd_tiles_kernel,
    _fwd_looped_kernel,
    _fwd_rows_kernel,
    triton,
)
from addnorm.reference import dropout_threshold

__all__ = ["Tuning", "TUNING", "unavailable_reason", "forward", "forward_into", "backward"]


@dataclass(kw_only=True, frozen=True)  # frozen: the launchers cache configurations per TUNING object
class Tuning:
    """Block-size limits of the launchers. Tests shrink them to reach the looped path at small N;
    ``benchmarks/tune_triton.py`` sweeps them on a GPU."""

    max_fwd_block_n: int = 16384  # widest row (elements) the forward keeps in registers
    max_bwd_block_n: int = 8192  # the backward holds more live tensors per element (h, dy, xhat, g, dw, db)
    # RMSNorm's backward with 2-byte h and dout (bf16/fp16 residual_out and out) keeps rows up to this wide in one
    # pass (no separate row-sums pass): it has no mean term, and at N = 16384 with 16 warps (32 elements a thread,
    # wide_bwd_elems_per_thread) sm_90 compiles it to 128 registers and no spills (benchmarks/sm90_static.py); with
    # 32 warps a thread gets at most 64 registers and spills 16 bytes. An fp32 residual stream spills 148 bytes at
    # 16384 even with 16 warps, fp32 x 44, LayerNorm 336: they keep max_bwd_block_n.
    max_bwd_block_n_rms_16bit: int = 16384
    wide_bwd_elems_per_thread: int = 32  # the backward's rows kernel on rows wider than max_bwd_block_n
    loop_block_n: int = 4096  # column tile of the looped path
    rows_block_elems: int = 4096  # small N: pack rows into a program until it holds about this many elements
    interpreter_programs: int = 4  # persistent programs in Triton's interpreter (CPU): few, each is slow
    # persistent backward programs per SM: each walks its rows one block at a time, so more programs per SM mean
    # more loads in flight (latency hiding) but more (programs, N) dw/db partial rows to reduce afterwards
    # H200, device time (benchmarks/results/gpu/tune.txt): 2 beats 4 by 1.08-1.11x at N = 1024-16384 (rows path)
    # and loses by 0.88x at 65536 (looped); a first sweep that timed host overhead too had favoured 4
    programs_per_sm: int = 2
    # the looped backward's (row groups x column tiles) grid: in the same sweep 4 per SM (3246 GB/s) beat 2 (2852),
    # 1 (3073) and 8 (3197) at N = 65536, and the full table's fwd+bwd there fell from 77% to 71% of copy bandwidth
    # when programs_per_sm went from 4 to 2 for every path
    looped_programs_per_sm: int = 4
    elems_per_thread: int = 8  # sets the warp count: one 16-byte load of a 2-byte type per thread (see _warps)
    # the backward's rows kernel reloads the weight for each row block (an L1/L2 hit) instead of holding it in
    # registers once a program holds more elements than this: at BLOCK_N = 16384 that cuts RMSNorm's spills for
    # sm_90 from 76 to 12 bytes a thread (benchmarks/sm90_static.py), letting max_bwd_block_n = 16384 be tried
    reload_weight_above: int = 8192


TUNING = Tuning()


# --------------------------------------------------------------------------------------------------------------
# Launchers: pick block sizes, allocate, launch
# --------------------------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    # not triton.cdiv: in Triton 3.9 that is a constexpr function whose Python call costs more than the arithmetic
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _f32(v: float) -> float:
    """v rounded to the nearest fp32 value (ties to even), as a Python float. Plain Python, not a torch.tensor
    round trip: the launchers also run on fake tensors (torch.compile traces them through the triton ops of
    :mod:`addnorm.ops.triton.compiled`), where a tensor's value cannot be read back."""
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:  # beyond fp32's range: inf, as a torch.float32 conversion gives
        return math.copysign(math.inf, v)


@functools.lru_cache(maxsize=64)  # a model uses a few eps values: the split is paid once each, not per call
def _split(v: float) -> tuple[float, float]:
    """A double as two fp32-representable floats whose sum recovers it to ~2^-48 (Triton passes floats as fp32)."""
    hi = _f32(v)
    return hi, _f32(v - hi)


def _dropout_args(p: float, seed: Tensor | None, dummy: Tensor) -> tuple:
    """(Seed, keep threshold, scale in three fp32 parts) for the kernels; the seed stays a device tensor."""
    if not p > 0:
        return dummy, 0, 1.0, 0.0, 0.0
    return (seed, *_dropout_scalars(p))


@functools.lru_cache(maxsize=64)
def _dropout_scalars(p: float) -> tuple[int, float, float, float]:
    s = 1.0 / (1.0 - p)  # the fp64 scale; fp32 statistics use its rounding (hi), fp64 the exact sum of the parts
    hi = _f32(s)
    mid = _f32(s - hi)
    lo = _f32(s - hi - mid)
    return dropout_threshold(p), hi, mid, lo


def _warps(elems: int, per_thread: int | None = None) -> int:
    # 8 elements per thread (one 16-byte load of a 2-byte type), 4 to 32 warps. More per thread costs registers:
    # compiled for sm_90, the dw/db accumulators of the backward spill at 16 elements per thread, and the register
    # count (hence occupancy) roughly halves with each halving of elements per thread. The exception: the RMSNorm
    # backward's widest rows (Tuning.max_bwd_block_n_rms_16bit), where 32 warps cap a thread at 64 registers.
    return min(32, max(4, _pow2(elems) // (32 * (per_thread or TUNING.elems_per_thread))))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(device: torch.device, per_sm: int) -> int:
    """Size of a persistent backward grid: ``per_sm`` programs per SM, a handful in the interpreter."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return per_sm * _sm_count(index)
    return TUNING.interpreter_programs


def _rows_blocks(m: int, n: int, max_block_n: int) -> tuple[int, int] | None:
    """(BLOCK_M, BLOCK_N) for the rows path, or None when a row is too wide for registers (looped path)."""
    block_n = _pow2(n)
    if block_n > max_block_n:
        return None
    block_m = max(1, min(TUNING.rows_block_elems // block_n, _pow2(m)))
    return block_m, block_n


def _loop_block(max_block_n: int) -> int:
    return _pow2(min(TUNING.loop_block_n, max_block_n))


def _row_stride(t: Tensor | None) -> int:
    return t.stride(0) if t is not None else 0


def _vec(t: Tensor | None) -> Tensor | None:
    return t.contiguous() if t is not None else None


def _kernel(kernel, traceable: bool):
    """The kernel to launch: itself, or (traceable) wrapped by ``torch.library.wrap_triton``, which records the launch
    as a node that torch.compile sees into (only inside the triton ops of :mod:`addnorm.ops.triton.compiled`; an
    eager launch through the wrapper costs ~1 ms of dispatch)."""
    if not traceable:
        return kernel
    from torch.library import wrap_triton

    return wrap_triton(kernel)


def _fwd_config(
    m, n, has_residual, has_weight, has_bias, is_rms, zc, has_dropout, store_residual_out, cast, store_stats
):
    """(rows path?, grid, constexprs and launch options) of the forward for one shape and flag set. The kernel is
    named by a flag, not held: the cache below would otherwise keep a kernel object that a test has replaced."""
    meta = dict(
        HAS_RESIDUAL=has_residual,
        HAS_WEIGHT=has_weight,
        HAS_BIAS=has_bias,
        IS_RMS=is_rms,
        ZERO_CENTERED=zc,
        HAS_DROPOUT=has_dropout,
        STORE_RESIDUAL_OUT=store_residual_out,
        CAST_BEFORE_WEIGHT=cast,
        STORE_STATS=store_stats,
    )
    blocks = _rows_blocks(m, n, TUNING.max_fwd_block_n)
    if blocks is not None:
        block_m, block_n = blocks
        return (
            True,
            (_cdiv(m, block_m),),
            dict(meta, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=_warps(block_m * block_n)),
        )
    block_n = _loop_block(TUNING.max_fwd_block_n)
    return False, (m,), dict(meta, BLOCK_N=block_n, num_warps=_warps(block_n))


# Eager launches look their configuration up here instead of recomputing block sizes, warps and the flag dict on
# every call (a few microseconds of Python per call, which a decode step on a GPU pays in full). Keyed on the
# shape and flags; valid for one TUNING object (Tuning is frozen: tests and tune_triton.py replace it, so a new
# object empties the cache). Traced launches (torch.compile: the shape may be symbolic) compute it afresh.
_configs: dict = {}
_configs_tuning: list = [None]
_CONFIGS_MAX = 1024  # distinct (shape, flags) keys kept: decode batch sizes vary, a model has few widths


def _cached_config(make, key):
    if _configs_tuning[0] is not TUNING:
        _configs.clear()
        _configs_tuning[0] = TUNING
    config = _configs.get(key)
    if config is None:
        if len(_configs) >= _CONFIGS_MAX:
            _configs.clear()
        config = _configs[key] = make(*key[1:])
    return config


def _fwd_launch(
    x, residual, weight, bias, out, res_out, mean, rstd, eps, dropout_p, seed, is_rms, zc, cast, traceable=False
):
    """rstd None: the statistics are not stored (mean must be None too)."""
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
    rows, grid, meta = _fwd_config(*key) if traceable else _cached_config(_fwd_config, ("fwd", *key))
    _kernel(_fwd_rows_kernel if rows else _fwd_looped_kernel, traceable)[grid](*args, **meta)


_scratch_tensors: dict = {}


def _scratch(device: torch.device, dtype: torch.dtype) -> Tensor:
    """A persistent one-element tensor passed for statistics a call does not store (the kernels never write it):
    under inference nothing reads mean and rstd, and allocating them costs host time on every call (~2 us each on
    a CPU; a decode step is host-bound). Persistent, so a captured CUDA graph may hold it. Not for traced calls:
    torch.compile traces on fake tensors, and those store the statistics anyway."""
    key = (device, dtype)
    t = _scratch_tensors.get(key)
    if t is None:
        t = _scratch_tensors[key] = torch.empty(1, dtype=dtype, device=device)
    return t


def _bwd_config(m, n, narrow, has_dres_out, has_weight, has_db, is_rms, zc, has_dropout, store_dres, cast, device):
    """The backward's launch plan for one shape, flag set and device: (True, programs, constexprs and options) for
    the rows kernel, or (False, tiles, groups, the row-sums kernel's, the tiles kernel's) for the looped path.
    ``narrow``: h and dout are 2-byte types (the RMSNorm backward keeps wider rows in one pass then)."""
    flags = dict(
        HAS_DRES_OUT=has_dres_out,
        HAS_WEIGHT=has_weight,
        HAS_DB=has_db,
        IS_RMS=is_rms,
        ZERO_CENTERED=zc,
        HAS_DROPOUT=has_dropout,
        STORE_DRES=store_dres,
        CAST_BEFORE_WEIGHT=cast,
    )
    max_block_n = TUNING.max_bwd_block_n
    if is_rms and narrow:
        max_block_n = max(max_block_n, TUNING.max_bwd_block_n_rms_16bit)
    blocks = _rows_blocks(m, n, max_block_n)
    if blocks is not None:
        block_m, block_n = blocks
        elems = block_m * block_n
        warps = _warps(elems, TUNING.wide_bwd_elems_per_thread if block_n > TUNING.max_bwd_block_n else None)
        programs = min(_programs(device, TUNING.programs_per_sm), _cdiv(m, block_m))
        return (
            True,
            programs,
            dict(flags, RELOAD_W=elems > TUNING.reload_weight_above, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps),
        )
    block_n = _loop_block(TUNING.max_bwd_block_n)
    tiles = _cdiv(n, block_n)
    groups = max(1, min(m, _cdiv(_programs(device, TUNING.looped_programs_per_sm), tiles)))
    sums = dict(HAS_WEIGHT=has_weight, IS_RMS=is_rms, ZERO_CENTERED=zc, BLOCK_N=block_n, num_warps=_warps(block_n))
    return False, tiles, groups, sums, dict(flags, BLOCK_N=block_n, num_warps=_warps(block_n))


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
    plan = _bwd_config(*key) if traceable else _cached_config(_bwd_config, ("bwd", *key))
    if plan[0]:
        _, programs, meta = plan
        dw_part = torch.empty((programs, n), dtype=acc, device=h.device)  # every program writes its whole row
        db_part = torch.empty((programs, n), dtype=acc, device=h.device)
        _kernel(_bwd_rows_kernel, traceable)[(programs,)](
            dout,
            dres_out_,
            h,
            weight_,
            mean_,
            rstd,
            dx,
            dres_,
            dw_part,
            db_part,
            dout.stride(0),
            _row_stride(dres_out),
            h.stride(0),
            m,
            n,
            *drop,
            **meta,
        )
    else:
        _, tiles, groups, sums, meta = plan
        c1 = torch.empty(m, dtype=acc, device=h.device)
        c2 = torch.empty(m, dtype=acc, device=h.device) if not is_rms else c1
        _kernel(_bwd_row_sums_kernel, traceable)[(m,)](
            dout,
            h,
            weight_,
            mean_,
            rstd,
            c1,
            c2,
            dout.stride(0),
            h.stride(0),
            n,
            **sums,
        )
        dw_part = torch.empty((groups, n), dtype=acc, device=h.device)
        db_part = torch.empty((groups, n), dtype=acc, device=h.device)
        _kernel(_bwd_tiles_kernel, traceable)[(tiles, groups)](
            dout,
            dres_out_,
            h,
            weight_,
            mean_,
            rstd,
            c1,
            c2,
            dx,
            dres_,
            dw_part,
            db_part,
            dout.stride(0),
            _row_stride(dres_out),
            h.stride(0),
            m,
            n,
            *drop,
            **meta,
        )
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


def _interpreted() -> bool:
    """Whether the kernels above were built for Triton's interpreter (decided when this module was imported)."""
    return type(_fwd_rows_kernel).__name__ == "InterpretedFunction"


def unavailable_reason(device: torch.device) -> str | None:
    """None when the Triton kernels can run on ``device``, else a sentence saying why not."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if triton is None:
        return "triton is not installed: pip install 'addnorm[triton]'"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available (no GPU, or a CPU-only build of torch)"
        if _interpreted():
            return None  # the interpreter also runs CUDA tensors, slowly
        return None
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "CPU tensors need TRITON_INTERPRET=1 (Triton's interpreter); use backend='cpu'"
        if not _interpreted():
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
        with _device_guard(x):
            _fwd_launch(
                x,
                residual,
                _vec(weight),
                _vec(bias),
                out,
                res_out,
                mean,
                rstd,
                eps,
                dropout_p,
                seed,
                is_rms,
                zero_centered_weight,
                cast_before_weight,
                traceable,
            )
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
        with _device_guard(x):
            _fwd_launch(
                x,
                residual,
                _vec(weight),
                _vec(bias),
                out,
                res_out,
                mean,
                rstd,
                eps,
                dropout_p,
                seed,
                is_rms,
                zero_centered_weight,
                cast_before_weight,
                traceable,
            )


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
