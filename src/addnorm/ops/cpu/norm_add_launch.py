"""The ``cpu`` backend of the fused norm-then-add ops (:mod:`addnorm.ops.norm_add`): the fused kernel contract
(``forward``, ``forward_into``, ``backward``; :mod:`addnorm.ops.norm_add_ops` states it) around the numba kernels
of :mod:`addnorm.ops.cpu.norm_add_kernels`: flat numpy views, allocation, the effective weights, the thread count.
"""

from __future__ import annotations

import numpy as np
import torch

from addnorm.ops.contract import stats_dtype
from addnorm.ops.cpu import bf16_pairs as P
from addnorm.ops.cpu import norm_add_kernels as K
from addnorm.ops.cpu.launch import _empty, _parallel_lock, as_numpy, row_view, unavailable_reason, use_parallel

__all__ = ["backward", "forward", "forward_into", "unavailable_reason"]

# Rows per dweight/dbias chunk (at least) and the most chunks: the chunking depends on M only (determinism).
_CHUNK_ROWS = 32
_MAX_CHUNKS = 64


def _vector(t: torch.Tensor | None, sd: torch.dtype, plus_one: bool) -> np.ndarray | None:
    """A weight or bias as the kernels read it: contiguous, in the statistics dtype, 1 + w when zero-centered."""
    if t is None:
        return None
    t = t.detach().to(sd)
    if plus_one:
        t = t + 1  # the stored parameter is w - 1
    return t.contiguous().numpy()


def _flags(opts: dict, has_norm2, w1, b1, w2, b2) -> tuple:
    return (
        bool(opts["is_rms1"]),
        w1 is not None,
        b1 is not None,
        bool(opts["cast1"]),
        bool(has_norm2),
        bool(opts["is_rms2"]),
        w2 is not None,
        b2 is not None,
        bool(opts["cast2"]),
    )


def forward(y, residual, w1, b1, w2, b2, *, h_dtype, has_norm2, **opts):
    """(h, out2 | None, stats (4, M)) for (M, N) rows y and residual (last dim contiguous, rows may be strided)."""
    m, n = y.shape
    sd = stats_dtype(y.dtype, h_dtype)
    h = _empty((m, n), h_dtype)
    out2 = _empty((m, n), h_dtype) if has_norm2 else None
    stats = torch.zeros((4, m), dtype=sd)  # rows a call does not use (no N2) stay 0: a deterministic output
    forward_into(h, out2, stats, y, residual, w1, b1, w2, b2, has_norm2=has_norm2, **opts)
    return h, out2, stats


def forward_into(h, out2, stats, y, residual, w1, b1, w2, b2, *, has_norm2, **opts):
    """The forward writing into given outputs: h (M, N) rows (may be residual itself: in place), out2 (may be y
    itself, or None without N2), stats (4, M) in the statistics dtype (mean1, rstd1, mean2, rstd2)."""
    m, n = y.shape
    if m == 0:
        return
    sd = stats.dtype
    Y, sy = row_view(y)
    R, sr = row_view(residual)
    in_place = h is residual
    H, sh = (R, sr) if in_place else row_view(h)
    O2, so2 = (Y, sy) if out2 is None else row_view(out2)
    S = stats.numpy().reshape(-1)
    dummy = S[:1]
    W1, B1 = _vector(w1, sd, opts["zc1"]), _vector(b1, sd, False)
    W2, B2 = _vector(w2, sd, opts["zc2"]), _vector(b2, sd, False)
    args = (
        Y, sy, R, sr, H, sh, O2, so2,
        dummy if W1 is None else W1, dummy if B1 is None else B1,
        dummy if W2 is None else W2, dummy if B2 is None else B2,
        S, m, n, _flags(opts, has_norm2, w1, b1, w2, b2), in_place, float(opts["eps1"]), float(opts["eps2"]),
    )  # fmt: skip
    kernels = K
    if m * n >= P.MIN_ELEMENTS and _all_bf16(y, residual, h, out2) and sd == torch.float32:
        D = P.split_pairs(n, (W1, B1, W2, B2))
        if not np.isnan(D).any():  # (a NaN weight or bias: the general kernels, bf16_words.via_bf16 says why)
            kernels = P  # bf16 pairs (bf16_pairs.py): the same bits, the elementwise passes two values a word
            fin2 = all(v is None or bool(np.isfinite(v).all()) for v in (W2, B2))  # (an inf weight * 0: a NaN)
            args = (*args[:12], D, *args[12:], P.PREFETCH_ROWS, fin2)
    if use_parallel(m * n):
        with _parallel_lock:
            kernels.fwd_parallel(*args)
    else:
        kernels.fwd_serial(*args)


def _all_bf16(*tensors) -> bool:
    return all(t is None or t.dtype == torch.bfloat16 for t in tensors)


def backward(dh, dout2, y, h, w1, w2, stats, *, b1_dtype, b2_dtype, residual_dtype, has_norm2, **opts):
    """(dy, dresidual | None, dw1, db1, dw2, db2) (None where absent). dh: gradient of h (None: zero); dout2:
    gradient of out2 (None: zero); b1_dtype, b2_dtype: the biases' dtypes (None: no bias). residual_dtype None: no
    dresidual wanted (the caller uses dh itself)."""
    m, n = y.shape
    sd = stats.dtype
    has_b1, has_b2 = b1_dtype is not None, b2_dtype is not None
    dy = _empty((m, n), y.dtype)
    dres = _empty((m, n), residual_dtype) if residual_dtype is not None else None
    flags = _flags(opts, has_norm2, w1, has_b1 or None, w2, has_b2 or None)
    chunks = max(1, min(_MAX_CHUNKS, m // _CHUNK_ROWS))
    red = torch.zeros((4, n), dtype=sd)
    if m > 0:
        Y, sy = row_view(y)
        H, sh = row_view(h) if has_norm2 else (Y, sy)
        DH, sdh = row_view(dh) if dh is not None else (Y, sy)
        DO2, sdo2 = row_view(dout2) if (has_norm2 and dout2 is not None) else (Y, sy)
        S = stats.numpy().reshape(-1)
        W1, W2 = _vector(w1, sd, opts["zc1"]), _vector(w2, sd, opts["zc2"])
        part = np.zeros(4 * chunks * n, dtype=S.dtype)
        grads = (dh is not None, has_norm2 and dout2 is not None, dres is not None)
        args = (
            chunks, m, DH, sdh, DO2, sdo2, Y, sy, H, sh,
            S[:1] if W1 is None else W1, S[:1] if W2 is None else W2, S,
            as_numpy(dy).reshape(-1), as_numpy(dy if dres is None else dres).reshape(-1),
            part, red.numpy().reshape(-1), n, flags, grads,
        )  # fmt: skip
        if chunks > 1 and use_parallel(m * n):
            with _parallel_lock:
                K.bwd_parallel(*args)
        else:
            K.bwd_serial(*args)
    dw1 = red[0].to(w1.dtype, copy=True) if w1 is not None else None
    db1 = red[1].to(b1_dtype, copy=True) if has_b1 else None
    dw2 = red[2].to(w2.dtype, copy=True) if (has_norm2 and w2 is not None) else None
    db2 = red[3].to(b2_dtype, copy=True) if (has_norm2 and has_b2) else None
    return dy, dres, dw1, db1, dw2, db2
