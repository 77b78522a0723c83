"""The ``cpu`` backend's decode-size launch: one numba call taking raw addresses, for the calls where the host's
Python, not memory, sets the time (a decode step: a few rows of a few thousand).

The general launch (:func:`addnorm.ops.cpu.launch.forward_into`) makes a numpy view of every tensor (a bf16
tensor needs a view as uint16 first), converts the weight to the statistics dtype and passes 24 arguments through
numba's dispatcher, which types each array: about 20 us of host time around a kernel that runs a 4096-wide bf16 row
in 4. This launch covers the common inference case only:

    x, residual, out, residual_out: (M, N) contiguous, one dtype (bf16, fp16 or fp32); weight and bias (N,)
    contiguous in that dtype (the weight zero-centered or not); no dropout; M * N below the parallel threshold
    (the serial kernel)

and passes integers: the data pointers, M, N, a flag word and eps. Each entry point (one per dtype: numba types
the element type at compile time) turns the addresses into arrays with ``numba.carray`` and runs the same serial
kernel the general launch runs (:func:`addnorm.ops.cpu.kernels.fwd_serial`), so the bits are the same
(tests/ops/test_decode_fast_path.py checks them against the general launch). The weight is read as stored: a half
value widens to fp32 exactly, which is what the general launch's conversion does ahead of the kernel. A
zero-centered weight (ZC) is the one exception: the kernel reads 1 + w, which the general launch computes in fp32
as ``weight.to(fp32) + 1`` (rounded once), so this launch computes the same fp32 sum into scratch first. Callers
(:mod:`addnorm.ops.fast_path`) check that the tensors fit; anything else takes the general launch.
"""

from __future__ import annotations

import numpy as np
import torch

from addnorm.ops.cpu.kernels import IMPORT_ERROR, JIT, fwd_serial, load, njit

__all__ = ["CAST", "DTYPES", "HAS_B", "HAS_RES", "HAS_W", "IN_PLACE", "IS_RMS", "STORE", "ZC", "forward_ptr"]

# the flag word's bits (one integer argument instead of seven booleans: numba's dispatcher types each argument).
# IN_PLACE: out is x and residual_out is the residual (see _run). ZC: the weight is zero-centered (read as 1 + w).
HAS_RES, HAS_W, HAS_B, STORE, IS_RMS, CAST, IN_PLACE, ZC = 1, 2, 4, 8, 16, 32, 64, 128

if IMPORT_ERROR is None:
    from numba import carray, types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def _address(typingctx, value):
        """An integer address (torch's data_ptr()) as the void pointer numba.carray takes."""
        if not isinstance(value, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], cgutils.voidptr_t)

        return types.voidptr(value), codegen

else:  # numba missing: the module imports, nothing here is called (unavailable_reason says why)
    carray = _address = None


@njit(inline="always")
def plus_one(W, n):
    """1 + w as fp32 scratch: the general launch's ``weight.to(fp32) + 1``, the exact widening then one fp32 add
    (rounded to nearest, as torch's), so the kernel reads the same values."""
    Wk = np.empty(n, np.float32)
    one = np.float32(1.0)
    for j in range(n):
        Wk[j] = load(W, j) + one
    return Wk


@njit(inline="always")
def _launch(X, R, W, B, Out, H, m, n, flags, eps):
    # two calls, not one with a chosen array: the fp32 scratch and a half weight's bits are different numba types
    if flags & ZC != 0:
        _run(X, R, plus_one(W, n), B, Out, H, m, n, flags, eps)
    else:
        _run(X, R, W, B, Out, H, m, n, flags, eps)


@njit(inline="always")
def _run(X, R, W, B, Out, H, m, n, flags, eps):
    # the statistics nobody reads (inference) go to scratch allocated here: fp32 for every dtype served
    stats = np.empty(2 * m, np.float32)
    # In place, residual_out is the residual: a row loop reading R and writing R is one LLVM cannot prove free of
    # overlap, so it runs unvectorized (5x slower at 8 x 4096 bf16). The sums go to scratch, copied back after.
    in_place = flags & IN_PLACE != 0
    Hk = np.empty_like(H) if in_place else H
    fwd_serial(
        X,
        n,
        R,
        n,
        W,
        B,
        Out,
        Hk,
        n,
        stats[:m],
        stats[m:],
        m,
        n,
        flags & HAS_RES != 0,
        flags & HAS_W != 0,
        flags & HAS_B != 0,
        flags & STORE != 0,
        flags & IS_RMS != 0,
        False,
        0,
        0,
        1.0,
        eps,
        flags & CAST != 0,
    )
    if in_place:
        for k in range(m * n):  # (a plain loop vectorizes; numba's slice assignment checks overlap and copies twice)
            H[k] = Hk[k]


@njit(inline="always")
def at(p, size, dtype):
    """The ``size`` elements of ``dtype`` at address p (an integer: torch's data_ptr()), as a numba array."""
    return carray(_address(p), size, dtype)


@njit(inline="always")
def _fwd(dt, px, pr, pw, pb, pout, ph, m, n, flags, eps):
    size = m * n
    _launch(at(px, size, dt), at(pr, size, dt), at(pw, n, dt), at(pb, n, dt), at(pout, size, dt), at(ph, size, dt), m, n, flags, eps)  # fmt: skip


# One entry point per storage type (bf16 as uint16 bits, fp16 as int16 bits, fp32): carray's element type is a
# compile-time constant. Arguments: the addresses of x, residual, weight, bias, out and residual_out (an absent one:
# any address of the same type, never read), then M, N, the flag word and eps.
@njit(**JIT)
def _fwd_bf16(px, pr, pw, pb, pout, ph, m, n, flags, eps):
    _fwd(np.uint16, px, pr, pw, pb, pout, ph, m, n, flags, eps)


@njit(**JIT)
def _fwd_f16(px, pr, pw, pb, pout, ph, m, n, flags, eps):
    _fwd(np.int16, px, pr, pw, pb, pout, ph, m, n, flags, eps)


@njit(**JIT)
def _fwd_f32(px, pr, pw, pb, pout, ph, m, n, flags, eps):
    _fwd(np.float32, px, pr, pw, pb, pout, ph, m, n, flags, eps)


DTYPES = {torch.bfloat16: _fwd_bf16, torch.float16: _fwd_f16, torch.float32: _fwd_f32}


def forward_ptr(x, residual, weight, bias, out, res_out, m: int, n: int, flags: int, eps: float) -> None:
    """Runs the serial forward kernel on the given tensors (see the module docstring for what they must be; the
    caller checks it). residual, weight, bias: None when absent (their flag clear); res_out: None to normalize x
    itself (STORE clear). In place: out is x and res_out is residual."""
    px = x.data_ptr()
    DTYPES[x.dtype](
        px,
        px if residual is None else residual.data_ptr(),
        px if weight is None else weight.data_ptr(),
        px if bias is None else bias.data_ptr(),
        out.data_ptr(),
        px if res_out is None else res_out.data_ptr(),
        m,
        n,
        flags,
        eps,
    )
