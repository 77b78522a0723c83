"""Benchmark fused residual add + RMSNorm/LayerNorm: addnorm's Triton kernels against the usual alternatives.

    python benchmarks/bench_add_norm.py                       # CUDA: every provider importable here, all modes
    python benchmarks/bench_add_norm.py --device cpu --quick  # smoke run on CPU (eager and compiled PyTorch)

Speed is reported as effective bandwidth: the bytes the operation must move at minimum (counted by hand in
``count_bytes``) divided by the time, and as a fraction of the copy bandwidth of the same device, measured in the
same run with a large device-to-device copy. The table goes to stdout; CSV and JSON (device, versions, date) go to
``--out``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib
import inspect
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("fwd", "bwd", "fwd+bwd")
ALL_SIZES = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
QUICK_SIZES = (512, 2048)
PROVIDERS = ("addnorm", "eager", "compile", "liger", "apex", "flash_attn", "quack")


@dataclass(kw_only=True)
class BenchConfig:
    device: str = "cuda"
    dtype: str = "bf16"
    norm: str = "rms"  # rms | layer
    sizes: tuple[int, ...] = ALL_SIZES
    modes: tuple[str, ...] = MODES
    providers: tuple[str, ...] = PROVIDERS
    elements: int = 1 << 26  # M * N held about constant: M = elements // N
    warmup: int = 5
    reps: int = 30
    out: str = "benchmarks/results"
    quick: bool = False


@dataclass(kw_only=True)
class Row:
    provider: str
    mode: str
    m: int
    n: int
    dtype: str
    norm: str
    ms: float | None = None
    bytes: int = 0
    gbps: float | None = None
    frac_copy: float | None = None
    max_err: float | None = None  # largest |output - fp32 eager| over out and residual_out: a wrong kernel shows here
    note: str = ""


# --------------------------------------------------------------------------------------------------------------
# Napkin math: the bytes each mode must move at minimum
# --------------------------------------------------------------------------------------------------------------


def count_bytes(provider: str, mode: str, m: int, n: int, dtype: torch.dtype, norm: str) -> int:
    """Minimum bytes moved by add + norm with a residual, weight (and bias for LayerNorm), per mode.

    Every provider is charged the same minimum, so GB/s compares like with like ("effective" bandwidth): a
    provider that moves more than the minimum (eager PyTorch writes and rereads the sum, Apex adds outside the
    kernel) shows it as lower GB/s. ``provider`` is accepted so an honest exception could be made here, and none is.

    forward:  read x, residual (2 MN s); read weight (+bias) (N s each); write out, residual_out (2 MN s);
              write rstd (+mean) (4 M each, fp32)                                     ~ 4 MN s
    backward: read dout, dresidual_out, residual_out (3 MN s); read weight; read rstd (+mean);
              write dx (MN s), which is also dresidual; write dweight (+dbias) (N s each)   ~ 4 MN s
              (dx and dresidual are the same values when x and residual share a dtype and there is no dropout, as
              in this benchmark: one write, returned for both, as eager autograd does for h = x + r too. Until
              2026-12-01 this counted 5 MN s, two writes, which overstated backward GB/s by up to 5/4 and
              fwd+bwd by 9/8 in the tables measured before; see benchmarks/results/README.md.)
              (fp32 partial rows of the two-stage reduction are ~ 2 x SMs x N x 4: ignored, they vanish for big M)
    fwd+bwd:  the sum                                                                 ~ 8 MN s
    For bf16 at M N = 2^26: forward 512 MiB, backward 512 MiB.
    """
    del provider  # same minimum for every provider, see the docstring
    s = torch.empty((), dtype=dtype).element_size()
    params = 1 if norm == "rms" else 2  # weight, plus bias for LayerNorm
    stats = 1 if norm == "rms" else 2  # rstd, plus mean
    fwd = 2 * m * n * s + params * n * s + 2 * m * n * s + stats * 4 * m
    bwd = 3 * m * n * s + params * n * s + stats * 4 * m + m * n * s + params * n * s
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


# --------------------------------------------------------------------------------------------------------------
# Providers: each returns f(x, residual, weight, bias) -> (out, residual_out), or raises ImportError
# --------------------------------------------------------------------------------------------------------------
#
# Every provider computes out = norm(x + residual) * w (+ b) and residual_out = x + residual with the benchmark's
# own eps, w and b, so the `max err` column compares like with like and backward reaches x, residual, w (and b).
# The third-party ones are called through their functional entry points, which take the weight as an argument, rather
# than through their nn.Modules, which would bring a ones-initialised weight of their own. The APIs below were read
# from the projects' sources (versions in the comments); `_accepts` adapts to keyword arguments that come and go
# between releases, and a release that lacks what the fused add needs raises ImportError, which becomes a "not
# available" row rather than a crash of the run.


def _eager(norm: str, eps: float) -> Callable:
    def f(x, r, w, b):
        h = x + r
        if norm == "rms":
            return F.rms_norm(h, (h.shape[-1],), w, eps), h
        return F.layer_norm(h, (h.shape[-1],), w, b, eps), h

    return f


def _accepts(fn: Callable, *names: str) -> bool:
    """Whether ``fn`` takes every keyword in ``names`` (False when the signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return all(n in params for n in names)


_COMPILED: dict[tuple[str, float], Callable] = {}


def _liger(norm: str, eps: float) -> Callable:
    # Liger-Kernel 0.8.5 (liger_kernel/transformers/functional.py, ops/fused_add_rms_norm.py):
    #   liger_fused_add_rms_norm(X, R, W, eps, offset=0.0, casting_mode="llama", in_place=True) -> (Y, S), S = X + R
    #   liger_layer_norm(X, W, B, eps) -> Y   (no fused add for LayerNorm: the add runs outside, as in eager)
    # in_place=True (the functional's default) writes dX into the incoming dY buffer; the benchmark reuses one dout
    # across repetitions, so it is turned off (the module LigerFusedAddRMSNorm defaults to False too).
    # Liger's kernels hold a whole row in one block: N > 65536 raises RuntimeError (a "failed" row, not a bug here).
    if norm == "layer":
        from liger_kernel.transformers.functional import liger_layer_norm

        def liger_ln(x, r, w, b):
            h = x + r
            return liger_layer_norm(h, w, b, eps), h

        return liger_ln
    functional = importlib.import_module("liger_kernel.transformers.functional")
    liger_fused_add_rms_norm = getattr(functional, "liger_fused_add_rms_norm", None)
    if liger_fused_add_rms_norm is None:  # releases before the fused add + RMSNorm
        raise ImportError("liger_kernel has no liger_fused_add_rms_norm: Liger-Kernel too old for a fused add")
    kw = {"in_place": False} if _accepts(liger_fused_add_rms_norm, "in_place") else {}
    return lambda x, r, w, b: liger_fused_add_rms_norm(x, r, w, eps, **kw)


def _apex(norm: str, eps: float, n: int) -> Callable:
    # NVIDIA Apex (apex/normalization/fused_layer_norm.py):
    #   fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False) -> out
    #   fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6, memory_efficient=False) -> out
    # (FusedRMSNorm / FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False) are
    # modules around these holding their own weight.) Apex has no fused residual add: the add runs outside its kernel.
    # The kernels live in the compiled extension fused_layer_norm_cuda, which a Python-only install of apex lacks; it
    # is imported here so that case is "not available" instead of a failure at the first call.
    from apex.normalization.fused_layer_norm import fused_layer_norm_affine, fused_rms_norm_affine

    importlib.import_module("fused_layer_norm_cuda")
    shape = [n]  # a list: the custom-op schema of newer apex declares normalized_shape as int[]

    def apex_norm(x, r, w, b):
        h = x + r
        if norm == "rms":
            return fused_rms_norm_affine(h, w, shape, eps), h
        return fused_layer_norm_affine(h, w, b, shape, eps), h

    return apex_norm


def _flash_attn(norm: str, eps: float) -> Callable:
    # flash-attention 2.8.3 (flash_attn/ops/triton/layer_norm.py):
    #   layer_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
    #                 rowscale=None, prenorm=False, residual_in_fp32=False, is_rms_norm=False, ...)
    #   rms_norm_fn(...): the same without is_rms_norm
    # With a residual and prenorm=True it returns (out, residual_out), residual_out in the residual's dtype
    # (residual_in_fp32 only matters when no residual is passed). One block per row: N * element size must stay
    # under 64 KB (bf16: N <= 32768), beyond that it raises RuntimeError.
    from flash_attn.ops.triton.layer_norm import layer_norm_fn, rms_norm_fn

    fn = rms_norm_fn if norm == "rms" else layer_norm_fn
    if not _accepts(fn, "residual", "prenorm"):
        raise ImportError("flash_attn's layer_norm_fn/rms_norm_fn take no residual/prenorm: flash-attn too old")
    return lambda x, r, w, b: fn(x, w, b, residual=r, eps=eps, prenorm=True)


def _quack(norm: str, eps: float) -> Callable:
    # QuACK 0.6.5 (quack/rmsnorm.py):
    #   rmsnorm(x, weight=None, bias=None, residual=None, out_dtype=None, residual_dtype=None, eps=1e-6,
    #           prenorm=False, weight_offset=0.0)
    # With a residual it returns out alone unless prenorm=True, then (out, residual_out). Releases with a residual
    # argument take fp32, fp16 or bf16 weights; the first releases (rmsnorm(x, weight, eps), no residual) asserted an
    # fp32 weight and cannot fuse the add, so they are reported as not available. quack.fused_add_rmsnorm (an older
    # file, gone from 0.6.5) returned no residual_out and wanted an fp32 weight: not used.
    if norm != "rms":
        raise ImportError("QuACK benchmarked for RMSNorm only")
    from quack.rmsnorm import rmsnorm

    if not _accepts(rmsnorm, "residual", "prenorm"):
        raise ImportError("quack.rmsnorm.rmsnorm takes no residual/prenorm: QuACK too old for a fused add")
    return lambda x, r, w, b: rmsnorm(x, w, residual=r, eps=eps, prenorm=True)


def make_provider(name: str, norm: str, eps: float, n: int, dtype: torch.dtype, device: str) -> Callable:
    del dtype, device  # every provider takes the benchmark's tensors as they are
    if name == "eager":
        return _eager(norm, eps)
    if name == "compile":
        # One compiled function per (norm, eps), reused across sizes and compiled with dynamic shapes from the first
        # call. Left static, dynamo compiles the first size, recompiles dynamic at the second, and does both again for
        # the training graph: 4 Inductor compiles per run instead of 2 (one no_grad graph for fwd rows, one training
        # graph for bwd and fwd+bwd rows; TORCH_LOGS=recompiles on a CPU run shows 3 recompiles against 1). On the
        # GPU each compile also builds its Triton kernels, seconds apiece, out of gpu_check.sh's 150 s.
        if (norm, eps) not in _COMPILED:
            _COMPILED[norm, eps] = torch.compile(_eager(norm, eps), dynamic=True)
        return _COMPILED[norm, eps]
    if name == "addnorm":
        from addnorm import add_layer_norm, add_rms_norm

        if norm == "rms":
            return lambda x, r, w, b: add_rms_norm(x, r, w, eps, backend="triton")
        return lambda x, r, w, b: add_layer_norm(x, r, w, b, eps, backend="triton")
    if name == "liger":
        return _liger(norm, eps)
    if name == "apex":
        return _apex(norm, eps, n)
    if name == "flash_attn":
        return _flash_attn(norm, eps)
    if name == "quack":
        return _quack(norm, eps)
    raise ValueError(f"unknown provider {name!r}; choose from {', '.join(PROVIDERS)}")


# --------------------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# Cycles of GPU busy-wait queued before each timed call: about 2 ms at the H200's 1.98 GHz, longer than any
# provider's host-side work per call (Python, dispatch, launch: 15-100 us, benchmarks/results/gpu/overhead.txt).
# Without it the start event fires on an idle GPU while the host is still launching, and the row measures host
# overhead plus kernels: the first H200 table did (addnorm's forward kernel ran 131 us in the profiler,
# benchmarks/results/gpu/profile.txt, but its row said 204 us). Per-call host overhead has its own table
# (bench_overhead.py).
GPU_SLEEP_CYCLES = 4_000_000


def time_ms(fn: Callable[[], object], device: str, warmup: int, reps: int, setup: Callable | None = None) -> float:
    """Median milliseconds of ``fn`` (CUDA events on GPU, perf_counter on CPU); ``setup`` runs untimed before each
    call (the backward-only mode builds a fresh graph there, so nothing needs ``retain_graph``). On a GPU the time
    is the device's: a busy-wait queued ahead of the start event lets the host enqueue the whole call first."""
    setup = setup or (lambda: None)
    for _ in range(warmup):
        setup()
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        setup()
        _sync(device)
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(GPU_SLEEP_CYCLES)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _grads(outputs, leaves: dict, dout: torch.Tensor, dres: torch.Tensor) -> None:
    """The backward, with the gradients of every leaf returned rather than accumulated into ``.grad``: x and the
    residual get the same gradient (dresidual is dx), and accumulating one tensor into two leaves' ``.grad`` costs
    a full device-to-device copy (62 us of ~365 at 2^26 bf16 elements on the H200, for every provider alike,
    benchmarks/results/gpu/profile.txt) that no training step pays (its x and residual are not leaves). A provider
    that detaches the residual or trains a weight of its own fails the row: its backward would do less work."""
    grads = torch.autograd.grad(outputs, list(leaves.values()), (dout, dres), allow_unused=True)
    missing = [name for name, g in zip(leaves, grads) if g is None]
    if missing:
        raise RuntimeError(f"backward left no gradient on {', '.join(missing)}")


def copy_bandwidth(device: str, nbytes: int, warmup: int, reps: int) -> float:
    """GB/s of a large device-to-device copy (read + write counted): the practical ceiling for these kernels."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, warmup, reps)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _pair(result: object, m: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A provider's result as (out, residual_out); TypeError naming how it breaks that convention (a provider that
    returns out alone would otherwise be unpacked row by row, silently so when M == 2)."""
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        got = type(result).__name__
        if isinstance(result, (tuple, list)):
            got += f" of {len(result)}"
        raise TypeError(f"provider returned {got}, expected (out, residual_out)")
    for what, t in zip(("out", "residual_out"), result):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (m, n):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"provider's {what} is {shape}, expected a tensor of shape {(m, n)}")
    return result[0], result[1]


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).abs().max()) if a.numel() else 0.0


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else ""


def bench_one(provider: str, mode: str, m: int, n: int, cfg: BenchConfig, copy_gbps: float) -> Row:
    dtype = DTYPES[cfg.dtype]
    dev = cfg.device
    eps = 1e-6 if cfg.norm == "rms" else 1e-5
    row = Row(provider=provider, mode=mode, m=m, n=n, dtype=cfg.dtype, norm=cfg.norm)
    try:
        fn = make_provider(provider, cfg.norm, eps, n, dtype, dev)
    except ImportError as e:
        row.note = f"not available: {_first_line(e)}"[:200]
        return row
    except Exception as e:  # noqa: BLE001 - a broken install (ABI or Triton mismatch) must not end the run either
        row.note = f"setup failed: {type(e).__name__}: {_first_line(e)}"[:200]
        return row
    x = torch.randn(m, n, device=dev, dtype=dtype, requires_grad=mode != "fwd")
    r = torch.randn(m, n, device=dev, dtype=dtype, requires_grad=mode != "fwd")
    w = torch.randn(n, device=dev, dtype=dtype, requires_grad=mode != "fwd")
    b = torch.randn(n, device=dev, dtype=dtype, requires_grad=mode != "fwd") if cfg.norm == "layer" else None
    leaves = {"x": x, "residual": r, "weight": w, "bias": b}
    leaves = {k: t for k, t in leaves.items() if t is not None}
    dout, dres = torch.randn(m, n, device=dev, dtype=dtype), torch.randn(m, n, device=dev, dtype=dtype)
    try:
        # The first call, untimed, in the row's grad mode (it also compiles what needs compiling): checks the return
        # convention and compares both outputs with an fp32 eager computation on the same inputs.
        with torch.set_grad_enabled(mode != "fwd"):
            out, res = _pair(fn(x, r, w, b), m, n)
        with torch.no_grad():
            ref_out, ref_res = _eager(cfg.norm, eps)(x.float(), r.float(), w.float(), None if b is None else b.float())
            row.max_err = max(_max_abs_diff(out, ref_out), _max_abs_diff(res, ref_res))
        del out, res, ref_out, ref_res
        if mode == "fwd":
            with torch.no_grad():
                ms = time_ms(lambda: fn(x, r, w, b), dev, cfg.warmup, cfg.reps)
        elif mode == "bwd":
            graph = {}

            def forward_untimed():
                graph["outputs"] = fn(x, r, w, b)

            def bwd():
                _grads(graph.pop("outputs"), leaves, dout, dres)

            ms = time_ms(bwd, dev, cfg.warmup, cfg.reps, setup=forward_untimed)
        else:

            def fwd_bwd():
                _grads(fn(x, r, w, b), leaves, dout, dres)

            ms = time_ms(fwd_bwd, dev, cfg.warmup, cfg.reps)
    except Exception as e:  # noqa: BLE001 - one provider failing must not lose the rest of the table
        row.note = f"failed: {type(e).__name__}: {_first_line(e)}"[:200]
        return row
    row.ms = ms
    row.bytes = count_bytes(provider, mode, m, n, dtype, cfg.norm)
    row.gbps = row.bytes / (ms * 1e-3) / 1e9
    row.frac_copy = row.gbps / copy_gbps
    return row


# --------------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------------


def _versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("triton", "addnorm", "liger_kernel", "apex", "flash_attn", "quack"):
        try:
            out[mod] = getattr(importlib.import_module(mod), "__version__", "installed")
        except Exception:  # noqa: BLE001 - any failure means "not usable here"
            out[mod] = None
    return out


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default bf16 (fp32 with --device cpu)")
    p.add_argument("--norm", default="rms", choices=("rms", "layer"))
    p.add_argument("--sizes", default=None, help=f"comma-separated hidden sizes N (default {ALL_SIZES})")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of fwd,bwd,fwd+bwd")
    p.add_argument("--providers", default=None, help=f"comma-separated subset of {','.join(PROVIDERS)}")
    p.add_argument("--elements", type=int, default=None, help="M * N per tensor (default 2^26; 2^15 with --quick)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results", help="directory for CSV/JSON")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few reps; eager and compile only on CPU")
    a = p.parse_args(argv)
    on_cpu = a.device == "cpu"
    if a.quick:
        default_providers = ("eager", "compile") if on_cpu else PROVIDERS
        sizes, elements, reps, warmup = QUICK_SIZES, 1 << 15, 5, 2
    else:
        default_providers = ("eager", "compile") if on_cpu else PROVIDERS
        sizes, elements, reps, warmup = ALL_SIZES, 1 << 26, a.reps, a.warmup
    cfg = BenchConfig(
        device=a.device,
        dtype=a.dtype or ("fp32" if on_cpu else "bf16"),
        norm=a.norm,
        sizes=tuple(int(s) for s in a.sizes.split(",")) if a.sizes else sizes,
        modes=tuple(a.modes.split(",")),
        providers=tuple(a.providers.split(",")) if a.providers else default_providers,
        elements=a.elements or elements,
        warmup=warmup,
        reps=reps,
        out=a.out,
        quick=a.quick,
    )
    for mode in cfg.modes:
        if mode not in MODES:
            p.error(f"--modes: unknown mode {mode!r}; choose from {', '.join(MODES)}")
    for prov in cfg.providers:
        if prov not in PROVIDERS:
            p.error(f"--providers: unknown provider {prov!r}; choose from {', '.join(PROVIDERS)}")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; use --device cpu --quick")
    return cfg


def run(cfg: BenchConfig, checkpoint: Callable[[list[Row], dict], object] | None = None) -> tuple[list[Row], dict]:
    """Benchmark every (N, mode, provider); ``checkpoint(rows, meta)`` runs after each N, so a run cut short by
    a time limit still leaves its finished rows on disk."""
    if cfg.device == "cpu" and cfg.quick:
        torch.set_num_threads(1)  # a smoke run on a shared CPU: idle spinning threads would dominate tiny ops
    copy_bytes = (1 << 30) if cfg.device.startswith("cuda") else (1 << 26)
    copy_gbps = copy_bandwidth(cfg.device, copy_bytes, cfg.warmup, max(cfg.reps, 10))
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if cfg.device.startswith("cuda") else platform.processor() or "cpu",
        "copy_gbps": copy_gbps,
        "copy_bytes": copy_bytes,
        "versions": _versions(),
        "config": asdict(cfg),
    }
    print(f"# {meta['device']}: device-to-device copy {copy_gbps:.0f} GB/s; {cfg.norm} norm, {cfg.dtype}")
    print(f"{'provider':<11}{'mode':<9}{'M':>8}{'N':>8}{'ms':>10}{'GB/s':>9}{'copy%':>7}{'max err':>10}  note")
    rows = []
    for n in cfg.sizes:
        m = max(1, cfg.elements // n)
        for mode in cfg.modes:
            for prov in cfg.providers:
                row = bench_one(prov, mode, m, n, cfg, copy_gbps)
                rows.append(row)
                ms = f"{row.ms:10.4f}" if row.ms is not None else f"{'-':>10}"
                gb = f"{row.gbps:9.1f}" if row.gbps is not None else f"{'-':>9}"
                fr = f"{100 * row.frac_copy:6.1f}%" if row.frac_copy is not None else f"{'-':>7}"
                err = f"{row.max_err:10.2e}" if row.max_err is not None else f"{'':>10}"
                print(f"{prov:<11}{mode:<9}{m:>8}{n:>8}{ms}{gb}{fr}{err}  {row.note}", flush=True)
            if cfg.device.startswith("cuda"):
                torch.cuda.empty_cache()
        if checkpoint is not None:
            checkpoint(rows, meta)
    return rows, meta


def write(rows: list[Row], meta: dict, out: str) -> Path:
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    stem = f"add_{meta['config']['norm']}_norm_{meta['config']['dtype']}_{meta['config']['device'].split(':')[0]}"
    with open(d / f"{stem}.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(asdict(rows[0]).keys()) if rows else ["provider"])
        writer.writeheader()
        for row in rows:
            writer.writerow(asdict(row))
    with open(d / f"{stem}.json", "w") as fh:
        json.dump({**meta, "rows": [asdict(r) for r in rows]}, fh, indent=2)
    return d / stem


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    rows, meta = run(cfg, checkpoint=lambda rows, meta: write(rows, meta, cfg.out))
    path = write(rows, meta, cfg.out)
    print(f"# wrote {path}.csv and {path}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
