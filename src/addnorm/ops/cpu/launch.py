"""The ``cpu`` backend of :mod:`addnorm.ops.add_norm`: the kernel contract (``forward``, ``forward_into``,
``backward``, ``unavailable_reason``) around the numba kernels of :mod:`addnorm.ops.cpu.kernels` (forward; the math
is written out there) and :mod:`addnorm.ops.cpu.kernels_bwd` (backward): flat numpy views of the tensors,
allocation, dtype handling, the thread count.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import numpy as np
import torch

from addnorm.ops.contract import dropout_scale, dropout_seed_key, dropout_threshold, stats_dtype
from addnorm.ops.cpu import fast_launch  # noqa: F401  (the decode launch: addnorm.ops.fast_path reaches it here)
from addnorm.ops.cpu.kernels import IMPORT_ERROR, fwd_parallel, fwd_serial, numba
from addnorm.ops.cpu.kernels_bwd import bwd_cols_parallel, bwd_parallel, bwd_serial

__all__ = ["unavailable_reason", "forward", "backward", "forward_into"]


def _dropout_args(seed, p: float, sd: torch.dtype) -> tuple[int, int, float]:
    """(the seed's key mix32(seed + offset), keep threshold, scale) as plain Python numbers."""
    return dropout_seed_key(seed), dropout_threshold(p), dropout_scale(p, sd)


# --------------------------------------------------------------------------------------------------------------
# Launchers: flat numpy views, allocation, dtype handling, thread count
# --------------------------------------------------------------------------------------------------------------

# Below this many elements (e.g. 64 rows of 4096) a call runs on the calling thread: waking the thread pool costs
# ~10 us on an idle machine and whole scheduler ticks on a busy one, more than a few hundred KB of work takes.
PARALLEL_MIN_ELEMENTS = 1 << 18
# Column block of the backward's column split (few rows): enough work per task to pay for its scheduling.
COLS_BLOCK_MIN = 512
# Rows per dweight/dbias chunk (at least) and the most chunks; the chunking depends on M only (determinism).
_CHUNK_ROWS = 32
_MAX_CHUNKS = 64

# bf16/fp16 have no numpy/numba float type: the kernels see their bits (uint16 = bf16, int16 = fp16).
_BITS_VIEW = {torch.bfloat16: torch.uint16, torch.float16: torch.int16}

_state = threading.local()  # the thread count last given to numba on this thread (numba's setting is per thread)
_parallel_lock = threading.Lock()  # numba's workqueue layer aborts on concurrent parallel launches; omp/tbb don't
# GNU OpenMP (numba's usual threading layer here, as torch's) does not survive fork(): a child that launches a
# parallel region after its parent did is terminated by numba. Such children (DataLoader workers, fork-based
# multiprocessing) run the serial kernels instead.
_pool = {"started": False, "forked": False}


def _after_fork_in_child() -> None:
    _pool["forked"] = _pool["started"]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def use_parallel(elements: int) -> bool:
    if elements < PARALLEL_MIN_ELEMENTS or _pool["forked"] or _threads() < 2:
        return False
    _pool["started"] = True
    return True


def _threads() -> int:
    """torch's thread count (capped by numba's pool), applied to numba only when it changed: setting costs ~us."""
    torch_threads = torch.get_num_threads()
    want = max(1, min(torch_threads, numba.config.NUMBA_NUM_THREADS))
    if getattr(_state, "threads", None) != want:
        numba.set_num_threads(want)
        _state.threads = want
        # starting numba's OpenMP pool resets the process-wide OpenMP thread count, which torch shares: put
        # torch's setting back (otherwise torch.set_num_threads(1) silently became 2 after the first call)
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
    return want


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_madvise = _libc_madvise()
_MADV_HUGEPAGE = 14
_HUGE_PAGE = 1 << 21
_HUGE_MIN_BYTES = 1 << 23


def _empty(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty, with large outputs hinted to be backed by 2 MB pages before anything touches them.

    A fresh 128 MB output otherwise takes 32K page faults, each zeroing 4 KB: on a VM that costs several times the
    kernel itself. The hint (what torch does for every allocation under THP_MEM_ALLOC_ENABLE=1) covers only the
    whole huge pages inside this tensor; it is advice, so a failure changes nothing.
    """
    t = torch.empty(shape, dtype=dtype)
    if _madvise is None or shape[0] * shape[1] * dtype.itemsize < _HUGE_MIN_BYTES:
        return t  # (decided from the shape: a decode step's outputs skip the arithmetic below)
    nbytes = t.numel() * t.element_size()
    if nbytes >= _HUGE_MIN_BYTES:
        start = (t.data_ptr() + _HUGE_PAGE - 1) & -_HUGE_PAGE
        end = (t.data_ptr() + nbytes) & -_HUGE_PAGE
        if end > start:
            _madvise(start, end - start, _MADV_HUGEPAGE)
    return t


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor as a numpy array sharing its memory, half types as their bits."""
    bits = _BITS_VIEW.get(t.dtype)
    return (t if bits is None else t.view(bits)).numpy()


def row_view(t: torch.Tensor) -> tuple[np.ndarray, int]:
    """(flat numpy view spanning the rows of 2-D ``t``, row stride), without copying row-strided input."""
    m, n = t.shape
    rs, cs = t.stride()
    if cs != 1:
        t, rs = t.contiguous(), n
    if t.requires_grad:
        t = t.detach()
    if rs == n or m == 1:
        return as_numpy(t).reshape(-1), n
    return as_numpy(t.as_strided(((m - 1) * rs + n,), (1,))), rs


def _vector(t: torch.Tensor | None, dtype: torch.dtype, plus_one: bool, dummy: np.ndarray) -> np.ndarray:
    if t is None:
        return dummy
    if t.requires_grad:
        t = t.detach()
    if t.dtype != dtype:  # (skipping no-op calls: each costs a dispatcher round trip, visible at decode sizes)
        t = t.to(dtype)
    if plus_one:
        t = t + 1  # zero-centered weight: the stored parameter is w - 1
    return (t if t.is_contiguous() else t.contiguous()).numpy()


# Statistics nobody reads (inference calls) go to scratch kept per thread and reused while M and the dtype repeat, as
# they do call after call of a decode step: no allocation per call. Per thread because the kernels release the GIL
# (two threads may run them at once); only the kernels write it, and nothing reads it.
_scratch_state = threading.local()


def _scratch(m: int, dtype: torch.dtype, is_rms: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    key = (m, dtype)
    cached = getattr(_scratch_state, "buffers", None)
    if cached is None or cached[0] != key:
        cached = (key, torch.empty(m, dtype=dtype), torch.empty(m, dtype=dtype))
        _scratch_state.buffers = cached
    return cached[1], (None if is_rms else cached[2])


def unavailable_reason(device: torch.device | str) -> str | None:
    """None when the numba kernels can run on ``device``, else why not."""
    if IMPORT_ERROR is not None:
        return IMPORT_ERROR
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type  # called on every op
    if kind != "cpu":
        return f"the cpu backend runs on CPU tensors; got {kind}"
    return None


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
):
    """Kernel contract forward (see :mod:`addnorm.ops.add_norm`): (out, residual_out | None, mean | None,
    rstd | None)."""
    m, n = x.shape
    sd = stats_dtype(x.dtype, residual_dtype)
    out = _empty((m, n), out_dtype or x.dtype)
    res_out = _empty((m, n), residual_dtype) if store_residual_out else None
    mean = None if is_rms or not store_stats else torch.empty(m, dtype=sd)
    rstd = torch.empty(m, dtype=sd) if store_stats else None
    if m > 0:
        forward_into(
            out,
            res_out,
            mean,
            rstd,
            x,
            residual,
            weight,
            bias,
            eps=eps,
            is_rms=is_rms,
            dropout_p=dropout_p,
            seed=seed,
            zero_centered_weight=zero_centered_weight,
            cast_before_weight=cast_before_weight,
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
):
    """The forward kernel writing into given outputs (out and res_out contiguous; res_out None: normalize x; mean
    None for RMSNorm; mean and rstd None: statistics not kept). ``forward`` allocates and calls this; benchmarks
    call it to time the kernel without the cost of faulting in fresh output pages."""
    m, n = x.shape
    if rstd is None:  # the numba kernels write the (M,) statistics row by row: give them scratch
        rstd, mean = _scratch(m, stats_dtype(x.dtype, (res_out if res_out is not None else x).dtype), is_rms)
    sd = rstd.dtype
    X, sx = row_view(x)
    store = res_out is not None
    if store:
        H, sh = as_numpy(res_out).reshape(-1), n
    else:
        H, sh = X, sx  # nothing stored: the kernel normalizes x
    R, sr = H, sh  # placeholder of a type the kernel is compiled for anyway
    if residual is not None:
        if residual.dtype not in ((res_out if store else x).dtype, sd):
            residual = residual.to(sd)  # exact (or the float oracle's own rounding of an fp64 residual)
        R, sr = row_view(residual)
    Rstd = rstd.numpy()
    Mean = Rstd if is_rms else mean.numpy()
    W = _vector(weight, sd, zero_centered_weight, Rstd)
    B = _vector(bias, sd, False, Rstd)
    dropout = dropout_p > 0.0
    seed_key, threshold, scale = _dropout_args(seed, dropout_p, sd) if dropout else (0, 0, 1.0)
    args = (
        X,
        sx,
        R,
        sr,
        W,
        B,
        as_numpy(out).reshape(-1),
        H,
        sh,
        Mean,
        Rstd,
        m,
        n,
        residual is not None,
        weight is not None,
        bias is not None and not is_rms,
        store,
        is_rms,
        dropout,
        seed_key,
        threshold,
        scale,
        float(eps),
        bool(cast_before_weight),
    )
    if use_parallel(m * n):
        with _parallel_lock:
            fwd_parallel(*args)
    else:
        fwd_serial(*args)


def _chunks(m: int) -> int:
    return max(1, min(_MAX_CHUNKS, m // _CHUNK_ROWS))


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
):
    """Kernel contract backward: (dx, dresidual | None, dweight | None, dbias | None)."""
    m, n = dout.shape
    sd = rstd.dtype
    dx = _empty((m, n), x_dtype)
    dres = _empty((m, n), residual_dtype) if residual_dtype is not None else None
    chunks = _chunks(m)
    dw = torch.zeros(n, dtype=sd) if weight is not None else None
    db = torch.zeros(n, dtype=sd) if bias_dtype is not None else None
    if m > 0:
        DY, sdy = row_view(dout)
        H, sh = row_view(h)
        DRO, sdro = (H, sh) if dresidual_out is None else row_view(dresidual_out)
        Rstd = as_numpy(rstd.detach().contiguous())
        Mean = Rstd if mean is None else as_numpy(mean.detach().to(sd).contiguous())
        W = _vector(weight, sd, zero_centered_weight, Rstd)
        DX = as_numpy(dx).reshape(-1)
        DRes = H if dres is None else as_numpy(dres).reshape(-1)
        dwp = torch.zeros((chunks, n), dtype=sd) if dw is not None else None
        dbp = torch.zeros((chunks, n), dtype=sd) if db is not None else None
        DWp, DW = (Rstd, Rstd) if dw is None else (dwp.numpy().reshape(-1), dw.numpy())
        DBp, DB = (Rstd, Rstd) if db is None else (dbp.numpy().reshape(-1), db.numpy())
        dropout = dropout_p > 0.0
        seed_key, threshold, scale = _dropout_args(seed, dropout_p, sd) if dropout else (0, 0, 1.0)
        args = (
            chunks,
            m,
            DY,
            sdy,
            DRO,
            sdro,
            H,
            sh,
            W,
            Mean,
            Rstd,
            DX,
            DRes,
            DWp,
            DBp,
            DW,
            DB,
            n,
            dresidual_out is not None,
            weight is not None,
            dres is not None,
            db is not None,
            is_rms,
            dropout,
            seed_key,
            threshold,
            scale,
            bool(cast_before_weight),
        )
        if chunks > 1 and use_parallel(m * n):
            with _parallel_lock:
                bwd_parallel(*args)
        elif use_parallel(m * n):  # too few rows to split: split the columns
            block = max(COLS_BLOCK_MIN, -(-n // (4 * _threads())))
            sg, sgx = np.empty(m, Rstd.dtype), np.empty(m, Rstd.dtype)
            ks, params = np.empty(m, np.int64), np.empty(4 * m, np.float64)  # the guard's rescaled rows
            with _parallel_lock:
                # (args[2:13]: DY .. DRes; args[15:]: DW, DB and the flags)
                bwd_cols_parallel(block, m, *args[2:13], sg, sgx, ks, params, *args[15:])
        else:
            bwd_serial(*args)
    dweight = dw.to(weight.dtype) if dw is not None else None
    dbias = db.to(bias_dtype) if db is not None else None
    return dx, dres, dweight, dbias
