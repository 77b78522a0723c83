"""Launch plans of the ``triton`` backend: the block sizes, warp counts and grids that the launchers of
:mod:`addnorm.ops.triton.launch` use for one shape and flag set, within the limits of :class:`Tuning`.

Layout of the work:
- rows path (N <= ``tuning().max_fwd_block_n`` / ``max_bwd_block_n``, RMSNorm's backward on 2-byte types up to
  ``max_bwd_block_n_rms_16bit``): a program holds BLOCK_M whole rows in
  registers (BLOCK_M > 1 for small N, e.g. QK-norm's N = 128); the backward is persistent: a bounded set of
  programs (about 2x the SM count) walks the rows and keeps its dw/db partial sums in registers.
- looped path (wider rows): the forward loops over column tiles twice (stats + residual_out, then normalize);
  the backward first reduces the two row sums, then a 2-D grid (column tiles x row groups) computes dx/dresidual
  and accumulates the dw/db partials of its tile in registers.
No atomics anywhere, so gradients are bitwise reproducible. Inputs may have strided rows (last-dim stride 1).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from addnorm.ops.contract import DROPOUT_SEED_OFFSET

__all__ = ["Tuning", "bwd_config", "cached_config", "fwd_config", "set_tuning", "tuning"]


@dataclass(kw_only=True, frozen=True)  # frozen: the launchers cache configurations per Tuning object
class Tuning:
    """Block-size limits of the launchers. Tests shrink them to reach the looped path at small N;
    ``tools/tune_triton.py`` sweeps them on a GPU."""

    max_fwd_block_n: int = 16384  # widest row (elements) the forward keeps in registers
    max_bwd_block_n: int = 8192  # the backward holds more live tensors per element (h, dy, xhat, g, dw, db)
    # RMSNorm's backward with 2-byte h and dout (bf16/fp16 residual_out and out) keeps rows up to this wide in one
    # pass (no separate row-sums pass): it has no mean term, and at N = 16384 with 16 warps (32 elements a thread,
    # wide_bwd_elems_per_thread) sm_90 compiles it to 128 registers and no spills (tools/sm90_static.py); with
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
    elems_per_thread: int = 8  # sets the warp count: one 16-byte load of a 2-byte type per thread (see warp_count)
    # the backward's rows kernel reloads the weight for each row block (an L1/L2 hit) instead of holding it in
    # registers once a program holds more elements than this: at BLOCK_N = 16384 that cuts RMSNorm's spills for
    # sm_90 from 76 to 12 bytes a thread (tools/sm90_static.py), letting max_bwd_block_n = 16384 be tried
    reload_weight_above: int = 8192


class _InForce:
    """The Tuning the launchers plan with: read through tuning(), replaced through set_tuning() only."""

    tuning = Tuning()


def tuning() -> Tuning:
    """The Tuning in force (the defaults above, unless replaced)."""
    return _InForce.tuning


def set_tuning(new: Tuning) -> Tuning:
    """Put ``new`` in force; returns the one it replaces, to put back (tests shrink the limits, tune_triton.py sweeps
    them). The cached configurations belong to one Tuning object, so the next launch plans afresh."""
    if not isinstance(new, Tuning):
        raise TypeError(f"tuning must be a Tuning, got {type(new).__name__}")
    previous, _InForce.tuning = _InForce.tuning, new
    return previous


# Triton's FP fusion (a * b + c as one fma), pinned rather than left to Triton's default: enabled by default up to
# Triton 3.9 (what every measured and tested result of these kernels was produced with), disabled by default from
# 3.10, which would change output bits. Eager launches pass it; under torch.compile Inductor compiles the kernels
# with its own options (torch's wrap_triton forwards only num_warps/num_stages-like launch options).
FP_FUSION = True


# --------------------------------------------------------------------------------------------------------------
# Plans: block sizes, warps, grids
# --------------------------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    # not triton.cdiv: in Triton 3.9 that is a constexpr function whose Python call costs more than the arithmetic
    return -(-a // b)


def pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def warp_count(elems: int, per_thread: int | None = None) -> int:
    # 8 elements per thread (one 16-byte load of a 2-byte type), 4 to 32 warps. More per thread costs registers:
    # compiled for sm_90, the dw/db accumulators of the backward spill at 16 elements per thread, and the register
    # count (hence occupancy) roughly halves with each halving of elements per thread. The exception: the RMSNorm
    # backward's widest rows (Tuning.max_bwd_block_n_rms_16bit), where 32 warps cap a thread at 64 registers.
    return min(32, max(4, pow2(elems) // (32 * (per_thread or tuning().elems_per_thread))))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_programs(device: torch.device, per_sm: int) -> int:
    """Size of a persistent backward grid: ``per_sm`` programs per SM, a handful in the interpreter."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return per_sm * _sm_count(index)
    return tuning().interpreter_programs


def _rows_blocks(n: int, max_block_n: int) -> tuple[int, int] | None:
    """(BLOCK_M, BLOCK_N) for the rows path, or None when a row is too wide for registers (looped path).

    From N alone, never from M: BLOCK_M * BLOCK_N sets the warp count, and the warp count (with BLOCK_M) sets how a
    row's elements are spread over threads and warps, hence the tree tl.sum adds them in. A plan that shrank
    BLOCK_M for a batch of 1 would give a row other bits alone than in a batch (batch invariance,
    docs/kernels.md); a small batch pays for the masked rows of its one program instead."""
    block_n = pow2(n)
    if block_n > max_block_n:
        return None
    return max(1, tuning().rows_block_elems // block_n), block_n


def _loop_block(max_block_n: int) -> int:
    return pow2(min(tuning().loop_block_n, max_block_n))


def fwd_config(
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
        SEED_OFFSET=DROPOUT_SEED_OFFSET,
        enable_fp_fusion=FP_FUSION,
    )
    blocks = _rows_blocks(n, tuning().max_fwd_block_n)
    if blocks is not None:
        block_m, block_n = blocks
        return (
            True,
            (_cdiv(m, block_m),),
            dict(meta, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warp_count(block_m * block_n)),
        )
    block_n = _loop_block(tuning().max_fwd_block_n)
    return False, (m,), dict(meta, BLOCK_N=block_n, num_warps=warp_count(block_n))


def bwd_config(m, n, narrow, has_dres_out, has_weight, has_db, is_rms, zc, has_dropout, store_dres, cast, device):
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
        SEED_OFFSET=DROPOUT_SEED_OFFSET,
        enable_fp_fusion=FP_FUSION,
    )
    max_block_n = tuning().max_bwd_block_n
    if is_rms and narrow:
        max_block_n = max(max_block_n, tuning().max_bwd_block_n_rms_16bit)
    blocks = _rows_blocks(n, max_block_n)
    if blocks is not None:
        block_m, block_n = blocks
        elems = block_m * block_n
        warps = warp_count(elems, tuning().wide_bwd_elems_per_thread if block_n > tuning().max_bwd_block_n else None)
        programs = min(persistent_programs(device, tuning().programs_per_sm), _cdiv(m, block_m))
        return (
            True,
            programs,
            dict(
                flags, RELOAD_W=elems > tuning().reload_weight_above, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps
            ),
        )
    block_n = _loop_block(tuning().max_bwd_block_n)
    tiles = _cdiv(n, block_n)
    groups = max(1, min(m, _cdiv(persistent_programs(device, tuning().looped_programs_per_sm), tiles)))
    sums = dict(
        HAS_WEIGHT=has_weight,
        IS_RMS=is_rms,
        ZERO_CENTERED=zc,
        BLOCK_N=block_n,
        num_warps=warp_count(block_n),
        enable_fp_fusion=FP_FUSION,
    )
    return False, tiles, groups, sums, dict(flags, BLOCK_N=block_n, num_warps=warp_count(block_n))


# Eager launches look their configuration up here instead of recomputing block sizes, warps and the flag dict on
# every call (a few microseconds of Python per call, which a decode step on a GPU pays in full). Keyed on the
# shape and flags; valid for one Tuning object (Tuning is frozen: tests and tune_triton.py replace it, so a new
# object empties the cache). Traced launches (torch.compile: the shape may be symbolic) compute it afresh.
_configs: dict = {}

_configs_tuning: list = [None]

_CONFIGS_MAX = 1024  # distinct (shape, flags) keys kept: decode batch sizes vary, a model has few widths

# One dict object per distinct set of constexprs and options, shared by every shape that launches with it: the bound
# launches of addnorm.ops.triton.fast_launch key on the plan's identity, so prefills of many lengths (one plan key
# each) share a few bound launches instead of each paying a first-use check.
_metas: dict = {}


def _interned(config: tuple) -> tuple:
    return tuple(_metas.setdefault(tuple(c.items()), c) if isinstance(c, dict) else c for c in config)


def cached_config(make, key):
    if _configs_tuning[0] is not tuning():
        _configs.clear()
        _metas.clear()
        _configs_tuning[0] = tuning()
    config = _configs.get(key)
    if config is None:
        if len(_configs) >= _CONFIGS_MAX:
            _configs.clear()
            _metas.clear()
        config = _configs[key] = _interned(make(*key[1:]))
    return config
