"""The decode-size launch of the fused norm-then-add kernels: one numba call taking raw addresses, for calls where
the host's Python, not memory, sets the time (a few rows of a few thousand), as :mod:`addnorm.ops.cpu.fast_launch`
does for the add + norm ops. The common inference case only:

    y, residual, h, out2: (M, N) contiguous, one dtype (bf16, fp16 or fp32); weights and biases (N,) contiguous in
    that dtype (a weight zero-centered or not); M * N below the parallel threshold (the serial kernel)

Each entry point (one per dtype: numba types the element type at compile time) turns the addresses into arrays and
runs the serial kernel the general launch runs (:func:`addnorm.ops.cpu.norm_add_kernels.fwd_serial`), the weights
read as stored (a half value widens to fp32 exactly: the general launch's conversion gives the same values), so the
bits are the general launch's. A zero-centered weight is read as 1 + w, which the general launch computes as
``weight.to(fp32) + 1``: this launch computes the same fp32 sums into scratch (:func:`~addnorm.ops.cpu.fast_launch.
plus_one`), and then widens the other weight too (exactly), so the kernel sees fp32 weights in both or neither.
The caller (:mod:`addnorm.ops.norm_add_fast`) checks that the tensors fit.
"""

from __future__ import annotations

import numpy as np
import torch

from addnorm.ops.cpu.fast_launch import at, plus_one
from addnorm.ops.cpu.kernels import JIT, load, njit
from addnorm.ops.cpu.norm_add_kernels import fwd_serial

__all__ = ["DTYPES", "IN_PLACE", "ZC1", "ZC2", "forward_ptr"]

# the flag word: bit k is the kernels' flag k (is_rms1, has_w1, has_b1, cast1, has_norm2, is_rms2, has_w2, has_b2,
# cast2), then IN_PLACE (h is the residual, out2 is y) and ZC1, ZC2 (weight1, weight2 zero-centered: 1 + w)
IN_PLACE, ZC1, ZC2 = 1 << 9, 1 << 10, 1 << 11
_HAS_W1, _HAS_W2 = 1 << 1, 1 << 6


@njit(inline="always")
def _fp32_weight(W, n, present, zc):
    """The weight as fp32 scratch: 1 + w when zero-centered, else w widened (exact); absent: a placeholder."""
    if not present:
        return np.empty(1, np.float32)
    if zc:
        return plus_one(W, n)
    Wk = np.empty(n, np.float32)
    for j in range(n):
        Wk[j] = load(W, j)
    return Wk


@njit(inline="always")
def _launch(Y, R, H, O2, W1, B1, W2, B2, m, n, flags, eps1, eps2):
    # two calls, not one with chosen arrays: fp32 scratch and a half weight's bits are different numba types
    if flags & (ZC1 | ZC2) != 0:
        W1k = _fp32_weight(W1, n, flags & _HAS_W1 != 0, flags & ZC1 != 0)
        W2k = _fp32_weight(W2, n, flags & _HAS_W2 != 0, flags & ZC2 != 0)
        _run(Y, R, H, O2, W1k, B1, W2k, B2, m, n, flags, eps1, eps2)
    else:
        _run(Y, R, H, O2, W1, B1, W2, B2, m, n, flags, eps1, eps2)


@njit(inline="always")
def _run(Y, R, H, O2, W1, B1, W2, B2, m, n, flags, eps1, eps2):
    stats = np.empty(4 * m, np.float32)  # the statistics nobody reads (inference)
    bits = (
        flags & 1 != 0, flags & 2 != 0, flags & 4 != 0, flags & 8 != 0, flags & 16 != 0,
        flags & 32 != 0, flags & 64 != 0, flags & 128 != 0, flags & 256 != 0,
    )  # fmt: skip
    in_place = flags & IN_PLACE != 0
    fwd_serial(Y, n, R, n, R if in_place else H, n, O2, n, W1, B1, W2, B2, stats, m, n, bits, in_place, eps1, eps2)


@njit(inline="always")
def _fwd(dt, py, pr, ph, po2, pw1, pb1, pw2, pb2, m, n, flags, eps1, eps2):
    size = m * n
    Y, R, H, O2 = at(py, size, dt), at(pr, size, dt), at(ph, size, dt), at(po2, size, dt)
    _launch(Y, R, H, O2, at(pw1, n, dt), at(pb1, n, dt), at(pw2, n, dt), at(pb2, n, dt), m, n, flags, eps1, eps2)


# One entry point per storage type (bf16 as uint16 bits, fp16 as int16 bits, fp32): carray's element type is a
# compile-time constant. Arguments: the addresses of y, residual, h, out2, w1, b1, w2, b2 (an absent one: any
# address, never read), then M, N, the flag word and the two eps.
@njit(**JIT)
def _fwd_bf16(py, pr, ph, po2, pw1, pb1, pw2, pb2, m, n, flags, eps1, eps2):
    _fwd(np.uint16, py, pr, ph, po2, pw1, pb1, pw2, pb2, m, n, flags, eps1, eps2)


@njit(**JIT)
def _fwd_f16(py, pr, ph, po2, pw1, pb1, pw2, pb2, m, n, flags, eps1, eps2):
    _fwd(np.int16, py, pr, ph, po2, pw1, pb1, pw2, pb2, m, n, flags, eps1, eps2)


@njit(**JIT)
def _fwd_f32(py, pr, ph, po2, pw1, pb1, pw2, pb2, m, n, flags, eps1, eps2):
    _fwd(np.float32, py, pr, ph, po2, pw1, pb1, pw2, pb2, m, n, flags, eps1, eps2)


DTYPES = {torch.bfloat16: _fwd_bf16, torch.float16: _fwd_f16, torch.float32: _fwd_f32}


def forward_ptr(y, residual, h, out2, w1, b1, w2, b2, m: int, n: int, flags: int, eps1: float, eps2: float) -> None:
    """The serial fused forward on the given tensors (absent ones None: their flags clear). In place (IN_PLACE):
    h is the residual and out2 is y."""
    py = y.data_ptr()
    DTYPES[y.dtype](
        py,
        residual.data_ptr(),
        h.data_ptr(),
        py if out2 is None else out2.data_ptr(),
        py if w1 is None else w1.data_ptr(),
        py if b1 is None else b1.data_ptr(),
        py if w2 is None else w2.data_ptr(),
        py if b2 is None else b2.data_ptr(),
        m,
        n,
        flags,
        eps1,
        eps2,
    )
