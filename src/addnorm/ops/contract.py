"""What every backend and op of the add + norm contract shares: the options of one call as a frozen
:class:`AddNormSpec`, the dtype rules (the float dtypes, the statistics dtype, eps=None's default), the dropout
keep-function and seed every backend draws the same way, the row helpers that keep a row's bits independent of the
batch, and the validation that names a bad argument. The contract in words is the docstring of
:mod:`addnorm.ops.add_norm`.

This module sits below every backend and op file, and below the float oracle of :mod:`addnorm.reference` (which
draws its dropout masks here, so that it judges the kernels by the same mask): it imports nothing of addnorm.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "ATEN_GRAIN_SIZE",
    "AddNormSpec",
    "DROPOUT_SEED_OFFSET",
    "FLOAT_DTYPES",
    "GUARD_LIMITS",
    "MACHINE_EPS",
    "MIX_M1",
    "MIX_M2",
    "as_dtype",
    "bump_versions",
    "check_affine",
    "check_float",
    "check_disjoint",
    "check_not_written",
    "check_writable",
    "check_like_x",
    "default_rms_eps",
    "draw_seed",
    "dropout_keep_mask",
    "dropout_scale",
    "dropout_seed_key",
    "dropout_threshold",
    "guard_scale_exponent",
    "lone_wide_row",
    "mix32",
    "ordinary_rows",
    "row_mean",
    "stats_dtype",
    "validate",
]


@dataclass(frozen=True, slots=True)
class AddNormSpec:
    """The options of one add + norm call, validated and with their defaults filled in: what the public functions
    hand to a backend beside the tensors (x, residual, weight, bias). ``residual_dtype`` and ``out_dtype`` are
    dtypes, never None; ``cast_before_weight`` is already dropped where it changes nothing (no affine step, or
    out_dtype the statistics dtype)."""

    eps: float
    is_rms: bool
    dropout_p: float
    residual_dtype: torch.dtype
    zero_centered_weight: bool
    cast_before_weight: bool
    out_dtype: torch.dtype

    @classmethod
    def of_call(
        cls,
        x,
        residual,
        weight,
        bias,
        eps,
        is_rms,
        dropout_p,
        residual_dtype,
        zero_centered_weight,
        cast_before_weight,
        out_dtype,
    ) -> AddNormSpec:
        """Validate one call's arguments (an error names the bad one) and fill in the defaults: eps=None (RMSNorm),
        residual_dtype (the residual's dtype, else x's), out_dtype (x's dtype); cast_before_weight kept only where
        it rounds something."""
        if is_rms and eps is None:
            eps = default_rms_eps(x, residual, residual_dtype)
        validate(x, residual, weight, bias, eps, dropout_p, residual_dtype)
        if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
            raise TypeError(f"out_dtype must be a floating dtype or None, got {out_dtype!r}")
        if residual_dtype is None:
            residual_dtype = residual.dtype if residual is not None else x.dtype
        out_dtype = out_dtype or x.dtype
        # the cast changes nothing when there is no affine step, or when x's dtype is the statistics dtype
        cast = bool(cast_before_weight) and (weight is not None or (bias is not None and not is_rms))
        cast = cast and out_dtype != stats_dtype(x.dtype, residual_dtype)
        return cls(float(eps), is_rms, float(dropout_p), residual_dtype, zero_centered_weight, cast, out_dtype)


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FLOAT_DTYPE_SET = frozenset(FLOAT_DTYPES)  # membership by hash, for tensor dtypes: every call checks 2-4


def stats_dtype(x_dtype: torch.dtype, residual_dtype: torch.dtype) -> torch.dtype:
    """Statistics are fp32 unless x or the residual stream is fp64."""
    return torch.float64 if torch.float64 in (x_dtype, residual_dtype) else torch.float32


def as_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    # Tensor.to with the same dtype returns t, but only after a trip through the dispatcher (~1-2 us on CPU, several
    # times per call): on small tensors that is a visible share of the whole op
    return t if t.dtype == dtype else t.to(dtype)


def default_rms_eps(x, residual, residual_dtype):
    """eps=None: machine epsilon of the dtype being normalized, residual_out's (residual_dtype, else the residual's
    dtype, else x's), as F.rms_norm takes its input's. x's dtype would be wrong for an fp32 residual stream with
    bf16 activations: 2^-7 instead of 1.2e-7. Unusable input is left for validate to name (None stays None)."""
    for dt in (residual_dtype, getattr(residual, "dtype", None), getattr(x, "dtype", None)):
        if dt is not None:
            return MACHINE_EPS.get(dt) if dt in FLOAT_DTYPES else None
    return None


MACHINE_EPS = {dt: torch.finfo(dt).eps for dt in FLOAT_DTYPES}  # torch.finfo() costs ~0.5 us a call


# --------------------------------------------------------------------------------------------------------------
# Rows: a row gets the same bits alone as in a batch of any size (batch invariance: docs/kernels.md)
# --------------------------------------------------------------------------------------------------------------

# ATen's CPU reductions sum a reduction with a single output (one row) of at least GRAIN_SIZE elements in two passes
# split across threads when there is more than one thread; any other row count gets each row summed by one thread
# in one fixed order. So a row of >= 32768 elements alone would get other bits than the same row in a batch: a lone
# row is reduced as one of two identical rows instead.
ATEN_GRAIN_SIZE = 32768


def lone_wide_row(t: Tensor) -> bool:
    """Whether reducing t's last dim hits ATen's split reduction: one row, >= ATEN_GRAIN_SIZE elements, on a CPU
    with more than one intra-op thread. Never under torch.compile, whose generated code is its own (and does not
    promise batch invariance)."""
    return (
        t.numel() == t.shape[-1] >= ATEN_GRAIN_SIZE
        and t.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and torch.get_num_threads() > 1
    )


def row_mean(t: Tensor, keepdim: bool = False) -> Tensor:
    """``t.mean(dim=-1, keepdim=keepdim)``, with the bits a row gets in a batch of any size (see lone_wide_row)."""
    if t.dim() and lone_wide_row(t):
        m = t.reshape(1, -1).expand(2, -1).mean(dim=-1)[:1]
        return m.reshape(*t.shape[:-1], 1) if keepdim else m.reshape(t.shape[:-1])
    return t.mean(dim=-1, keepdim=keepdim)


# --------------------------------------------------------------------------------------------------------------
# The finite-range guard: every finite row gets the float64-correct answer rounded to the output dtype
#
# The plain statistics (fp32: sums of squares of values near 1e20 overflow, of values near 1e-23 underflow) hold for
# ordinary rows only. Every backend computes them as always, then checks one scalar per row on what it computed,
# the row's rstd and (LayerNorm) mean, in the statistics dtype:
#
#   ordinary  iff  RSTD_MIN <= rstd <= RSTD_MAX  and not 0 < |mean| < TINY
#
# (fp32: rstd in [2^-50, 2^50], i.e. var + eps in [2^-100, 2^100], where the squares' underflow and overflow are
# far below fp32 rounding; TINY the smallest normal, below which a mean has lost bits that rstd would magnify.
# NaN fails the test: a non-finite rstd or mean always does.) A row that is not ordinary is recomputed by a second,
# scaled pass: with a = max |h| over the row, h is multiplied by 2^k, k = guard_scale_exponent(a) (a * 2^k in
# [1, 2): exact, a power of two), the moments of the scaled row are taken in float64 (fp32 values and their
# squares are far inside its range), and
#
#   xhat = (h * 2^k - mean_s) * r,   r = rstd * 2^-k = 1 / sqrt(var_s + eps * 4^k)
#
# so no intermediate leaves the range whatever the row's scale. Rows with a non-finite value (or all zero) keep the
# plain pass's result: NaN in, NaN out, and a zero row with eps = 0 is 0/0 in float64 too.
#
# Saved statistics of a recomputed row are its true mean and rstd rounded to the statistics dtype: rstd may round
# to inf (eps = 0 on a subnormal row: rstd ~ 1e40) or to a subnormal. The backward applies the same test to the
# saved values; a row that is not ordinary has its scaled moments recomputed from h (which the backward has) and
# takes r = 1/sqrt(var_s) when that reproduces the saved rstd (eps negligible; an inf rstd means eps = 0), else the
# saved rstd * 2^-k. The gradient is then computed in the scaled units and multiplied by 2^k once, at the end: inf
# exactly where the float64 gradient is beyond the output dtype's range.
# --------------------------------------------------------------------------------------------------------------

# (RSTD_MIN, RSTD_MAX, TINY) per statistics dtype
GUARD_LIMITS = {
    torch.float32: (2.0**-50, 2.0**50, 2.0**-126),
    torch.float64: (2.0**-400, 2.0**400, 2.0**-1022),
}


def guard_scale_exponent(amax: float) -> int:
    """k with amax * 2^k in [1, 2), for a finite amax > 0: the power of two the scaled pass multiplies a row by."""
    return 1 - math.frexp(amax)[1]


def ordinary_rows(mean: Tensor | None, rstd: Tensor) -> Tensor:
    """Which rows the plain statistics serve (the test above), elementwise over rstd's shape; mean None (RMSNorm)
    counts as 0."""
    lo, hi, tiny = GUARD_LIMITS[rstd.dtype]
    ok = (rstd >= lo) & (rstd <= hi)
    if mean is not None:
        am = mean.abs()
        ok &= ~((am > 0) & (am < tiny))
    return ok


# --------------------------------------------------------------------------------------------------------------
# Dropout: one keep-function of (seed, row, column) and one scaling for every backend (torch, reference, cpu,
# triton), so a seed gives bitwise the same residual_out whatever the backend or the batch size. The hash uses only
# 32-bit multiplies, shifts and xors: cheap in Triton (uint32), numba (uint64 masked) and torch (int64 masked).
#
#   mix(z)   = lowbias32 (C. Wellons' integer hash, a bijection of uint32): z ^= z >> 16; z *= 0x7FEB352D;
#              z ^= z >> 15; z *= 0x846CA68B; z ^= z >> 16   (products mod 2^32)
#   idx      = i * N + j (int64)
#   z        = mix(lo32(idx) ^ mix(hi32(idx) ^ mix(seed + 0x9E3779B9)))
#   keep     = (z >> 8) >= ceil(p * 2^24)          (the top 24 bits as u = k / 2^24: keep iff u >= p, exactly)
#   kept     = v * scale,  scale = 1 / (1 - p) computed in fp64 and rounded to the statistics dtype
#
# Below 2^32 elements every element gets a distinct z (mix is a bijection), so no two share a draw.
# --------------------------------------------------------------------------------------------------------------

DROPOUT_SEED_OFFSET = 0x9E3779B9
MIX_M1 = 0x7FEB352D
MIX_M2 = 0x846CA68B
_M32 = 0xFFFFFFFF


def draw_seed(device: torch.device) -> Tensor:
    """The dropout seed of one call: a 0-dim int64 tensor in [0, 2^31 - 1) drawn from ``device``'s generator, so it
    never leaves the device (a captured CUDA graph replays the draw itself, so each replay should get a fresh mask:
    tools/gpu_graph_check.py checks it on a GPU; activation checkpointing restores the generator). Every
    backend draws it this way, which is what makes a seed give the same mask on all of them."""
    return torch.randint(0, 2**31 - 1, (), dtype=torch.int64, device=device)


def mix32(z: int) -> int:
    """lowbias32 on a Python int in [0, 2^32): the scalar form, for tests and host code."""
    z ^= z >> 16
    z = (z * MIX_M1) & _M32
    z ^= z >> 15
    z = (z * MIX_M2) & _M32
    return z ^ (z >> 16)


def dropout_seed_key(seed: int) -> int:
    """mix(seed + DROPOUT_SEED_OFFSET): the per-call key the hash of every element starts from."""
    return mix32((int(seed) + DROPOUT_SEED_OFFSET) & _M32)


def _mix32_t(z: Tensor) -> Tensor:
    """lowbias32 on int64 tensors holding values in [0, 2^32). The second multiplier is used as its negative
    two's-complement twin so that no int64 product overflows; the low 32 bits are the same."""
    z = z ^ (z >> 16)  # a new tensor: the in-place steps below never touch the caller's
    z.mul_(MIX_M1).bitwise_and_(_M32)  # in place: each step of an (M, N) mask otherwise allocates 8 bytes/element
    z.bitwise_xor_(z >> 15)
    z.mul_(MIX_M2 - (1 << 32)).bitwise_and_(_M32)
    return z.bitwise_xor_(z >> 16)


def dropout_threshold(p: float) -> int:
    """The keep threshold on the hash's top 24 bits: u = k / 2^24 >= p iff k >= ceil(p * 2^24) (both exact)."""
    return math.ceil(p * (1 << 24))


def dropout_scale(p: float, dtype: torch.dtype) -> float:
    """The factor kept elements are multiplied by: 1 / (1 - p) in fp64, rounded to ``dtype`` (the statistics
    dtype), returned as a Python float holding exactly that value."""
    s = 1.0 / (1.0 - p)
    return s if dtype == torch.float64 else float(torch.tensor(s, dtype=torch.float32))


def dropout_keep_mask(seed: int | Tensor, rows: int, cols: int, p: float, device: torch.device | str = "cpu") -> Tensor:
    """Boolean keep mask of shape (rows, cols): element (i, j) is kept iff its hash of (seed, i * cols + j) has
    top 24 bits >= p * 2^24 (see the section comment). ``seed`` may be an int or a 0-dim integer tensor (read
    without leaving its device)."""
    if isinstance(seed, Tensor):
        s = _mix32_t((seed.to(torch.int64) + DROPOUT_SEED_OFFSET) & _M32).to(device)
    else:
        s = dropout_seed_key(seed)
    idx = torch.arange(rows * cols, dtype=torch.int64, device=device).reshape(rows, cols)
    if rows * cols <= 1 << 32:
        # every index's hi word is 0, so the inner hash is one value, mix32(s): computed once, not per element
        # (this halves the mask's cost; the composed paths and the torch backend draw their masks here)
        z = _mix32_t(idx ^ (_mix32_t(s) if isinstance(s, Tensor) else mix32(s)))
    else:
        z = _mix32_t((idx & _M32) ^ _mix32_t((idx >> 32) ^ s))
    return (z >> 8) >= dropout_threshold(p)


# --------------------------------------------------------------------------------------------------------------
# Validation: bad input gets an error naming the argument and what was seen
# --------------------------------------------------------------------------------------------------------------


def check_float(name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPE_SET:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")


def check_like_x(name: str, t: Tensor, x: Tensor) -> None:
    """A second stream input (residual, x1): float, x's shape, x's device."""
    check_float(name, t)
    if t.shape != x.shape:
        raise ValueError(f"{name} must have x's shape {tuple(x.shape)}, got {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")


def check_affine(name: str, p: Tensor | None, n: int, x: Tensor) -> None:
    """A weight or bias (None allowed): float, shape (n,), x's device."""
    if p is None:
        return
    check_float(name, p)
    if p.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},) to match x's last dim, got {tuple(p.shape)}")
    if p.device != x.device:
        raise ValueError(f"{name} must be on x's device {x.device}, got {p.device}")


def validate(x, residual, weight, bias, eps, dropout_p, residual_dtype) -> None:
    check_float("x", x)
    if x.dim() < 1:
        raise ValueError(f"x must have at least one dimension (the normalized one), got shape {tuple(x.shape)}")
    n = x.shape[-1]
    if n == 0:
        raise ValueError(f"x's last dimension (the normalized one) must be > 0, got shape {tuple(x.shape)}")
    if residual is not None:
        check_like_x("residual", residual, x)
    check_affine("weight", weight, n, x)
    check_affine("bias", bias, n, x)
    # before eps: eps=None is derived from residual_dtype
    if residual_dtype is not None and residual_dtype not in FLOAT_DTYPES:  # (any value: no hashing)
        raise TypeError(f"residual_dtype must be a floating dtype or None, got {residual_dtype!r}")
    if not _is_real(eps) or type(eps) is bool or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if not _is_real(dropout_p) or type(dropout_p) is bool or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")


def check_bools(*pairs) -> None:
    """Refuse a bool option (``zero_centered_weight``, ``cast_before_weight``, ``is_rms``, ...) that is not a Python
    bool: ``(name, value)`` pairs, checked in order. Read by truthiness, ``"no"``, ``0.5`` or ``torch.tensor(0.)``
    would be taken as an answer; so are ``1``/``0`` and ``numpy.bool_`` refused (numpy's bool is no ``bool``
    subclass), as :mod:`addnorm.ops.norm_add` refuses them: ``bool(flag)`` is the caller's one-word fix. The ops
    test ``type(v) is bool`` inline (tens of nanoseconds) and call this only to raise."""
    for name, v in pairs:
        if type(v) is not bool:
            raise TypeError(f"{name} must be a bool, got {v!r}")


def _is_real(v) -> bool:
    # numbers.Real: numpy scalars too (np.float32 is no float subclass), as torch.nn.functional accepts them; float
    # and int first, since an isinstance check against the ABC costs about a microsecond on every call
    return type(v) is float or type(v) is int or isinstance(v, numbers.Real)


# --------------------------------------------------------------------------------------------------------------
# Memory overlap of two tensors a call writes (in-place forms, out=)
# --------------------------------------------------------------------------------------------------------------


def byte_span(t: Tensor) -> tuple[int, int]:
    """[start, end) of the bytes t's elements lie in, from its first element to one past its last, gaps of a
    strided view included. Addresses, except on the meta device, whose tensors all sit at address 0: there, offsets
    in t's storage."""
    size = t.element_size()
    start = t.storage_offset() * size if t.device.type == "meta" else t.data_ptr()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))  # strides are >= 0 in torch
    return start, start + (last + 1) * size


def check_disjoint(name_a: str, a: Tensor, name_b: str, b: Tensor, why: str) -> None:
    """Refuse a and b when their byte spans intersect: two views of one buffer are fine when their ranges are
    disjoint (a serving workspace: ``buf[0]``, ``buf[1]``). Judged by range, not element by element: views whose
    elements interleave within one range (``buf[:, 0::2]``, ``buf[:, 1::2]``) are refused too, conservatively."""
    if not a.numel() or not b.numel() or a.device != b.device:
        return
    if a.device.type == "meta" and a.untyped_storage()._cdata != b.untyped_storage()._cdata:
        return  # meta tensors have no memory: only views of one storage can overlap
    (a0, a1), (b0, b1) = byte_span(a), byte_span(b)
    if a0 < b1 and b0 < a1:
        base = min(a0, b0)
        raise ValueError(
            f"{name_a} and {name_b} must not overlap in memory ({why}): {name_a} spans bytes [{a0 - base}, "
            f"{a1 - base}) and {name_b} [{b0 - base}, {b1 - base}) of the same memory. Views of one buffer are "
            "accepted when these byte ranges are disjoint; the check compares ranges, not elements, so views "
            f"whose elements interleave (buf[:, 0::2] and buf[:, 1::2]) are refused too: pass a clone of one"
        )


def check_not_written(written: tuple, read: tuple, why: str) -> None:
    """Refuse a read-only tensor (a weight or bias: ``read`` holds (name, tensor or None) pairs) whose bytes overlap
    a tensor the call writes (``written``, the same pairs): the kernels would read it while overwriting it."""
    for rname, r in read:
        if r is not None:
            for wname, w in written:
                check_disjoint(rname, r, wname, w, why)


_inference_mode_enabled = torch.is_inference_mode_enabled


def check_writable(name: str, t: Tensor) -> None:
    """Refuse writing an inference tensor outside inference mode (what PyTorch's own in-place ops refuse), before
    anything is written: the kernels write through data pointers, which PyTorch does not check."""
    if t.is_inference() and not _inference_mode_enabled():
        raise RuntimeError(
            f"{name} is an inference tensor (created under torch.inference_mode()) and this op writes it in place, "
            f"which PyTorch allows only inside inference mode: call it under torch.inference_mode(), or pass "
            f"{name}.clone()"
        )


_increment_version = torch._C._increment_version


def bump_versions(*tensors: Tensor) -> None:
    """Bump the autograd version counter of each tensor a kernel wrote through its data pointer (PyTorch's own
    in-place ops do it themselves), so that a tensor saved for another op's backward and overwritten here gets
    PyTorch's "modified by an inplace operation" error instead of a silently wrong gradient. Eager calls only: a
    custom op declaring ``mutates_args`` bumps them itself. Inference tensors have no counter (skipped by torch)."""
    _increment_version(tensors)  # a tuple: a lone tensor would be iterated row by row
