"""The ``triton`` backend of the fused norm-then-add ops (:mod:`addnorm.ops.norm_add`): the fused kernel contract
(``forward``, ``forward_into``, ``backward``; :mod:`addnorm.ops.norm_add_ops` states it) around the kernels
of :mod:`addnorm.ops.triton.norm_add_kernels`: block sizes, allocation, the launch.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from addnorm.ops.contract import stats_dtype
from addnorm.ops.triton import norm_add_guard as G
from addnorm.ops.triton import norm_add_kernels as K
from addnorm.ops.triton.launch import interpreted, unavailable_reason

__all__ = ["backward", "forward", "forward_into", "unavailable_reason"]


def _blocks(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps), from N alone: a row's bits must not depend on M (batch invariance)."""
    block_n = 1 << max(0, (n - 1).bit_length())
    block_m = max(1, min(16, 2048 // block_n))
    return block_m, block_n, max(1, min(16, block_m * block_n // 512))


def _eps_pair(eps: float) -> tuple[float, float]:
    hi = float(np.float32(eps))
    return hi, float(np.float32(eps - hi))


def _guard(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _const(opts: dict, w1, b1, w2, b2) -> dict:
    return dict(
        IS_RMS1=bool(opts["is_rms1"]), HAS_W1=w1 is not None, HAS_B1=b1 is not None, ZC1=bool(opts["zc1"]),
        CAST1=bool(opts["cast1"]), IS_RMS2=bool(opts["is_rms2"]), HAS_W2=w2 is not None, HAS_B2=b2 is not None,
        ZC2=bool(opts["zc2"]), CAST2=bool(opts["cast2"]),
    )  # fmt: skip


def forward(y, residual, w1, b1, w2, b2, *, h_dtype, has_norm2, **opts):
    """(h, out2 | None, stats (4, M))."""
    m, n = y.shape
    h = torch.empty((m, n), dtype=h_dtype, device=y.device)
    out2 = torch.empty((m, n), dtype=h_dtype, device=y.device) if has_norm2 else None
    stats = torch.zeros((4, m), dtype=stats_dtype(y.dtype, h_dtype), device=y.device)  # unused rows: 0
    forward_into(h, out2, stats, y, residual, w1, b1, w2, b2, has_norm2=has_norm2, **opts)
    return h, out2, stats


def forward_into(h, out2, stats, y, residual, w1, b1, w2, b2, *, has_norm2, **opts):
    """Into given outputs: h may be residual itself, out2 y itself (in place: each program reads its rows whole
    before it writes them)."""
    m, n = y.shape
    if m == 0:
        return
    block_m, block_n, warps = _blocks(n)
    dummy = stats
    o2 = out2 if out2 is not None else h
    with _guard(y):
        K.norm_add_fwd_kernel[(triton_cdiv(m, block_m),)](
            y, residual,
            w1 if w1 is not None else dummy, b1 if b1 is not None else dummy,
            w2 if w2 is not None else dummy, b2 if b2 is not None else dummy,
            h, o2, stats,
            y.stride(0), residual.stride(0), h.stride(0), o2.stride(0), m, n,
            *_eps_pair(opts["eps1"]), *_eps_pair(opts["eps2"]),
            HAS_NORM2=bool(has_norm2), **_const(opts, w1, b1, w2, b2),
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
        )  # fmt: skip


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _programs(m: int, block_m: int, device: torch.device) -> int:
    """Programs of the backward (each sums its rows' dweight in a fixed order): from M and the device only."""
    blocks = triton_cdiv(m, block_m)
    if device.type != "cuda" or interpreted():
        return max(1, min(blocks, 2))
    return max(1, min(blocks, 4 * torch.cuda.get_device_properties(device).multi_processor_count))


def backward(dh, dout2, y, h, w1, w2, stats, *, b1_dtype, b2_dtype, residual_dtype, has_norm2, **opts):
    """(dy, dresidual | None, dw1, db1, dw2, db2), None where absent."""
    m, n = y.shape
    has_do2 = has_norm2 and dout2 is not None
    dy = torch.empty((m, n), dtype=y.dtype, device=y.device)
    dres = torch.empty((m, n), dtype=residual_dtype, device=y.device) if residual_dtype is not None else None
    block_m, block_n, warps = _blocks(n)
    programs = _programs(m, block_m, y.device)
    part = torch.zeros((4, programs, n), dtype=stats.dtype, device=y.device)
    has_b2 = has_norm2 and b2_dtype is not None
    const = _const(opts, w1, b1_dtype, w2 if has_norm2 else None, b2_dtype if has_norm2 else None)
    if m > 0:
        tensors = (
            dh if dh is not None else y, dout2 if has_do2 else y, y, h if has_do2 else y,
            w1 if w1 is not None else stats, w2 if w2 is not None else stats, stats, dy,
            dres if dres is not None else dy, part,
            dh.stride(0) if dh is not None else 0, dout2.stride(0) if has_do2 else 0, y.stride(0),
            h.stride(0) if has_do2 else 0, m, n,
        )  # fmt: skip
        grads = dict(HAS_DH=dh is not None, HAS_DO2=has_do2, STORE_DRES=dres is not None)
        with _guard(y):
            K.norm_add_bwd_kernel[(programs,)](*tensors, **grads, **const, BLOCK_M=block_m, BLOCK_N=block_n,
                                               num_warps=warps)  # fmt: skip
            # the backward's guard (norm_add_guard): rows whose g or row sums overflowed, redone after it
            fix = {k: v for k, v in const.items() if k not in ("HAS_B2", "CAST2")}
            G.norm_add_fixup_kernel[(programs,)](*tensors, **grads, **fix, BLOCK_M=block_m,
                                                 TILE=min(block_n, 1024), num_warps=4)  # fmt: skip
    red = part.sum(1)
    return (
        dy,
        dres,
        red[0].to(w1.dtype, copy=True) if w1 is not None else None,
        red[1].to(b1_dtype, copy=True) if b1_dtype is not None else None,
        red[2].to(w2.dtype, copy=True) if (has_norm2 and w2 is not None) else None,
        red[3].to(b2_dtype, copy=True) if has_b2 else None,
    )
