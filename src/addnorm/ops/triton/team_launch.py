"""Wide rows: when a row is shared by a team of programs (:mod:`addnorm.ops.triton.team_kernels`), how many, how
they are launched, and how many programs an SM holds (the grids of persistent kernels are sized from it).

The team path is opt-in until a GPU run has measured it: ``ADDNORM_TRITON_TEAM=1`` (read at import, :func:`refresh`
reads it again) or ``set_wide_tuning(WideTuning(enabled=True))``; tests force a team size with
``WideTuning(team=K)``. With it on, rows wider than the forward's rows path (``Tuning.max_fwd_block_n``) are
split into K = ceil(N / chunk) chunks in the forward, ceil(N / bwd_chunk) in the backward.

What a row's bits depend on: K, CHUNK and the warp count come from N (and the Tuning) only, never from M or the
device's size, so a row normalizes to the same bits in any batch and at any position. Across K the statistics are
combined from different partials: the outputs agree within the contract's tolerance, not bit for bit (residual_out,
a plain rounded sum, is bitwise the same for every K).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field

import torch

from addnorm.ops.triton import plan
from addnorm.ops.triton.team_kernels import (
    bwd_finish_kernel,
    bwd_partials_kernel,
    bwd_team_kernel,
    fwd_finish_kernel,
    fwd_partials_kernel,
    fwd_team_kernel,
)

__all__ = [
    "ENV",
    "ENV_SIZED_GRIDS",
    "SMLimits",
    "WideTuning",
    "chunk_of",
    "looped_groups",
    "programs_per_sm",
    "refresh",
    "resident_programs",
    "set_wide_tuning",
    "team_size",
    "wide_tuning",
]

ENV = "ADDNORM_TRITON_TEAM"
ENV_SIZED_GRIDS = "ADDNORM_TRITON_SIZED_GRIDS"


def _env_enabled() -> bool:
    return os.environ.get(ENV) == "1"


def _env_sized_grids() -> bool:
    return os.environ.get(ENV_SIZED_GRIDS) == "1"


@dataclass(kw_only=True, frozen=True)  # frozen: plans are cached per WideTuning object
class WideTuning:
    enabled: bool = field(default_factory=_env_enabled)  # off by default: no GPU has measured the team kernels yet
    team: int = 0  # > 0: every row of any width goes through teams of this many programs (tests: K = 1 ... 8)
    chunk: int = 8192  # columns a program holds when K is chosen from N: the rows path's proven width at 32 warps
    # the backward holds more per element (h, dy, xhat, g, w and the dw/db sums): at 8192 columns a program sm_90
    # spills 40-88 bytes a thread with 32 warps (64 registers at most) and 32-80 with 16 (tools/sm90_static.py);
    # 4096 at 16 warps (8 elements a thread) does not
    bwd_chunk: int = 4096
    max_team: int = 64  # a team never has more programs than this (N = 262144 takes 32 at chunk 8192)
    # GPU: the two-kernel fallback instead of the team kernel (the interpreter always takes it: its programs run
    # one after another, so a spin-wait would never end). Tests compare the two bit for bit on a GPU.
    fallback: bool = False
    # the looped backward's row groups in whole waves of what the GPU holds of the compiled tiles kernel (from its
    # registers, looped_groups) instead of Tuning.looped_programs_per_sm per SM; opt-in until measured
    # (ADDNORM_TRITON_SIZED_GRIDS=1)
    sized_grids: bool = field(default_factory=_env_sized_grids)

    def __post_init__(self):
        for name in ("team", "chunk", "bwd_chunk", "max_team"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "team" else 1):
                raise ValueError(f"WideTuning.{name} must be an integer >= {0 if name == 'team' else 1}, got {v!r}")
        for name in ("chunk", "bwd_chunk"):
            v = getattr(self, name)
            if v & (v - 1):
                raise ValueError(f"WideTuning.{name} must be a power of two, got {v}")


class _InForce:
    """The WideTuning the launchers use: read through wide_tuning(), replaced through set_wide_tuning() only."""

    tuning = WideTuning()


def wide_tuning() -> WideTuning:
    """The WideTuning in force (the environment's at import, unless replaced)."""
    return _InForce.tuning


def set_wide_tuning(tuning: WideTuning) -> WideTuning:
    """Put ``tuning`` in force; returns the one it replaces, to put back. Plans are cached per WideTuning object,
    so the next launch plans afresh."""
    if not isinstance(tuning, WideTuning):
        raise TypeError(f"tuning must be a WideTuning, got {type(tuning).__name__}")
    previous, _InForce.tuning = _InForce.tuning, tuning
    return previous


def refresh() -> WideTuning:
    """Read ``ADDNORM_TRITON_TEAM`` and ``ADDNORM_TRITON_SIZED_GRIDS`` again (read when this module is imported) into
    the tuning in force, its other fields kept; returns the new tuning."""
    tuning = dataclasses.replace(wide_tuning(), enabled=_env_enabled(), sized_grids=_env_sized_grids())
    set_wide_tuning(tuning)
    return tuning


def team_size(n: int, backward: bool = False, wide: WideTuning | None = None) -> int:
    """K, the programs sharing a row of n elements in the forward (or the backward); 0: no team (the rows or looped
    path). From n and the tunings only."""
    wide = wide or wide_tuning()
    if wide.team:
        return wide.team
    if not wide.enabled or n <= plan.tuning().max_fwd_block_n:
        return 0
    return min(wide.max_team, -(-n // (wide.bwd_chunk if backward else wide.chunk)))


def chunk_of(n: int, k: int) -> int:
    """Columns per program: the power of two that lets k of them cover n."""
    return plan.pow2(-(-n // k))


# --------------------------------------------------------------------------------------------------------------
# Occupancy: how many programs of a compiled kernel an SM holds
# --------------------------------------------------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class SMLimits:
    """Per-SM limits (Hopper, sm_90, by default)."""

    registers: int = 65536
    threads: int = 2048
    blocks: int = 32
    shared_bytes: int = 228 * 1024
    register_unit: int = 8  # a thread's registers are allocated in multiples of this (256 per warp)


SM90 = SMLimits()


def programs_per_sm(registers: int, num_warps: int, shared_bytes: int = 0, limits: SMLimits = SM90) -> int:
    """Programs (thread blocks) of a kernel compiled to ``registers`` per thread, ``num_warps`` warps and
    ``shared_bytes`` of shared memory that one SM holds at once: the least of what registers, threads, blocks and
    shared memory allow. 0: the kernel cannot run at all."""
    threads = 32 * num_warps
    unit = limits.register_unit
    per_block = -(-registers // unit) * unit * threads
    by_regs = limits.registers // per_block if per_block else limits.blocks
    by_smem = limits.shared_bytes // shared_bytes if shared_bytes else limits.blocks
    return max(0, min(by_regs, limits.threads // threads, limits.blocks, by_smem))


@functools.cache
def _device_limits(index: int) -> tuple[int, SMLimits]:
    p = torch.cuda.get_device_properties(index)
    limits = SMLimits(
        registers=getattr(p, "regs_per_multiprocessor", SM90.registers),
        threads=getattr(p, "max_threads_per_multi_processor", SM90.threads),
        shared_bytes=getattr(p, "shared_memory_per_multiprocessor", SM90.shared_bytes),
    )
    return p.multi_processor_count, limits


_resident: dict = {}


def resident_programs(kernel, args: tuple, meta: dict, device: torch.device) -> int:
    """How many programs of ``kernel`` (compiled for these arguments and ``meta``) the whole GPU holds at once,
    from the compiled kernel's registers and shared memory: the size of a grid whose programs all run together.
    Compiles the kernel (Triton's warmup) the first time for each plan; cached by the plan's identity."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (kernel, id(meta), index)
    hit = _resident.get(key)
    if hit is not None and hit[0] is meta:
        return hit[1]
    compiled = kernel.warmup(*args, grid=(1,), **meta)
    compiled._init_handles()  # loads the module: n_regs is the driver's count
    sms, limits = _device_limits(index)
    n = sms * programs_per_sm(compiled.n_regs, compiled.metadata.num_warps, compiled.metadata.shared, limits)
    _resident[key] = (meta, n)
    return n


def looped_groups(tiles: int, resident: int, target: int, m: int) -> int:
    """Row groups of the looped backward's (column tiles x row groups) grid: the whole waves of the ``resident``
    programs the GPU holds at once that fit in ``target`` programs (at least one wave), and never more groups than
    rows. The fixed rule (``target`` / tiles groups, rounded up) assumed 4 programs per
    SM where the compiled kernel fits 2: at N = 262144, 64 tiles x 9 groups = 576 programs run as 3 waves of 264;
    here 64 x 8 = 512, two."""
    waves = max(1, target // resident)
    return max(1, min(m, waves * resident // tiles))


# --------------------------------------------------------------------------------------------------------------
# Launch plans and launchers (launch.py calls these with its own argument tuples and launch function)
# --------------------------------------------------------------------------------------------------------------


def _team_meta(base: dict, k: int, chunk: int) -> dict:
    meta = {key: v for key, v in base.items() if key not in ("BLOCK_M", "BLOCK_N", "RELOAD_W", "num_warps")}
    return dict(meta, K=k, CHUNK=chunk, num_warps=plan.warp_count(chunk))


def fwd_plan(wide, k, m, n, *flags):
    """(K, CHUNK, the fallback's constexprs and options, the team kernel's): the forward's flags with the team's
    block size. ``wide`` only keys the plan cache (a new WideTuning, a new plan)."""
    chunk = chunk_of(n, k)
    meta = _team_meta(plan.fwd_config(m, n, *flags)[2], k, chunk)
    return k, chunk, meta, dict(meta, launch_cooperative_grid=True)  # all resident, or the launch fails


def bwd_plan(wide, k, m, n, narrow, *flags):
    """(K, CHUNK, the finish kernel's constexprs and options, the team kernel's, the partials kernel's)."""
    chunk = chunk_of(n, k)
    config = plan.bwd_config(m, n, narrow, *flags)
    meta = _team_meta(config[2] if config[0] else config[4], k, chunk)
    has_weight, is_rms, zc = flags[1], flags[3], flags[4]
    sums = dict(
        HAS_WEIGHT=has_weight,
        IS_RMS=is_rms,
        ZERO_CENTERED=zc,
        K=k,
        CHUNK=chunk,
        num_warps=plan.warp_count(chunk),
        enable_fp_fusion=plan.FP_FUSION,
    )
    return k, chunk, meta, dict(meta, launch_cooperative_grid=True), sums


def _use_team_kernel(device: torch.device, two_kernels: bool) -> bool:
    """The team kernel, or the fallback's two kernels: those in Triton's interpreter, under torch.compile (traced
    launches: the grid is sized from a compiled kernel, which fake tensors cannot give) and when asked for."""
    return device.type == "cuda" and not two_kernels and not wide_tuning().fallback


def fwd_launch(config, args: tuple, m: int, device, acc, two_kernels: bool, run) -> None:
    """Launch the team forward on ``args`` (fwd_rows_kernel's argument tuple), with ``run(kernel, grid, args,
    meta)`` (launch.py's launch); ``two_kernels``: the fallback (see _use_team_kernel). On a GPU with too few
    resident programs for one team, the fallback runs too."""
    k, _, meta, team_meta = config
    if _use_team_kernel(device, two_kernels):
        flags = torch.zeros(1, dtype=torch.int32, device=device)  # placeholder for the occupancy query
        ws = torch.empty(2 * 3 * k, dtype=acc, device=device)
        teams = min(m, resident_programs(fwd_team_kernel, (*args, ws, flags), team_meta, device) // k)
        if teams >= 1:
            flags = torch.zeros((teams, 2), dtype=torch.int32, device=device)
            ws = torch.empty((teams, 2, k, 3), dtype=acc, device=device)
            run(fwd_team_kernel, (teams * k,), (*args, ws, flags), team_meta)
            return
    ws = torch.empty((m, k, 3), dtype=acc, device=device)
    run(fwd_partials_kernel, (m, k), (*args, ws), meta)
    run(fwd_finish_kernel, (m, k), (*args, ws), meta)


def bwd_launch(config, tensors: tuple, strides: tuple, drop: tuple, m: int, n: int, device, acc, two_kernels, run):
    """The team backward: ``tensors`` = (dout, dres_out, h, weight, mean, rstd, dx, dres) with placeholders for
    what is absent, ``strides`` = (dout, dres_out, h), ``drop`` the dropout arguments. Returns (dw_part, db_part)."""
    k, _, meta, team_meta, sums = config
    dout, dres_out, h, weight, mean, rstd, dx, dres = tensors
    head = (dout, dres_out, h, weight, mean, rstd, dx, dres)
    tail = (*strides, m, n, *drop)
    if _use_team_kernel(device, two_kernels):
        flags = torch.zeros(1, dtype=torch.int32, device=device)
        ws = torch.empty(2 * 2 * k, dtype=acc, device=device)
        probe = (*head, ws, ws, *tail, ws, flags)
        teams = min(m, resident_programs(bwd_team_kernel, probe, team_meta, device) // k)
        if teams >= 1:
            flags = torch.zeros((teams, 2), dtype=torch.int32, device=device)
            ws = torch.empty((teams, 2, k, 2), dtype=acc, device=device)
            dw_part = torch.empty((teams, n), dtype=acc, device=device)  # every team writes its whole row
            db_part = torch.empty((teams, n), dtype=acc, device=device)
            args = (*head, dw_part, db_part, *tail, ws, flags)
            run(bwd_team_kernel, (teams * k,), args, team_meta)
            return dw_part, db_part
    ws = torch.empty((m, k, 2), dtype=acc, device=device)
    run(bwd_partials_kernel, (m, k), (dout, h, weight, mean, rstd, strides[0], strides[2], n, ws), sums)
    groups = max(1, min(m, -(-plan.persistent_programs(device, plan.tuning().looped_programs_per_sm) // k)))
    dw_part = torch.empty((groups, n), dtype=acc, device=device)
    db_part = torch.empty((groups, n), dtype=acc, device=device)
    run(bwd_finish_kernel, (k, groups), (*head, dw_part, db_part, *tail, ws), meta)
    return dw_part, db_part
