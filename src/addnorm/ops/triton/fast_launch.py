"""Bound launches of the Triton kernels: after a first normal launch of a kernel for one specialization, later
launches call the compiled kernel that launch returned, without Triton's per-call binding.

Why. ``kernel[grid](*args, **meta)`` runs Triton's ``JITFunction.run`` on every call: it binds and specializes every
argument, builds a cache-key string from them and the options, re-checks each global the kernel reads, asks the
driver for the device and stream, and only then calls the compiled kernel's launcher. On an H200 under Triton 3.6
that took 29-30 us a call (benchmarks/results/gpu/README.md) where eager's add + RMSNorm takes 16-23 us: at decode
sizes the device is done long before the host.

Why it is the same launch. The compiled kernel depends only on what Triton specializes on, and the key here holds
all of it:
- the kernel and its launch plan ``meta`` (the constexprs and options such as num_warps and enable_fp_fusion): the
  entry holds ``meta`` and is used only for that very object, so a plan rebuilt after a Tuning change is a new key;
- the current device (Triton keeps a kernel cache per device) and Triton's debug / instrumentation knobs, which
  ``JITFunction.run`` adds to the options;
- per argument, what Triton's ``native_specialize_impl`` derives from it: a tensor's dtype and whether its address
  is a multiple of 16; an integer equal to 1 (compiled as a constant), else its type (i32, i64 or u64 by range) and
  whether it is divisible by 16; a float is always fp32 and never specialized; None is a constant.
What ``CompiledKernel.run`` then receives is what ``JITFunction.run`` passes it: the grid padded to three dimensions,
the current stream, the kernel's function handle and packed metadata, the launch metadata and the enter and exit
hooks, then every parameter's value in signature order (constexprs included). Bound launches run only while no launch
hook is installed and pass None for those three: the normal launch passes the empty hook chains and launch metadata
that only a hook would read.

Versions (``TRITON_VERSIONS``): 3.6 and 3.9, whose ``runtime/jit.py`` (``JITFunction.run``,
``create_function_from_signature``), ``compiler/compiler.py`` (``CompiledKernel.run``, ``launch_metadata``) and
``backends/compiler.py`` (``get_int_specialization``, ``get_tensor_specialization``) were read; the native rule was
checked value by value against ``_spec`` (tests/ops/test_triton_fast_launch.py). Other versions launch normally.

Checked. The first time a key is used, the normal launch runs, then the bound one on the same arguments restored to
their values before it; every tensor argument must come out bitwise equal, else the key keeps the normal launch and
a warning says so. Not checked nor cached (a normal launch) while a CUDA graph is captured, or when the tensors are
too large to copy twice (``VERIFY_MAX_BYTES``): a later, smaller call of the key does it.

Off: ``ADDNORM_TRITON_FAST_LAUNCH=0`` (read at import; :func:`refresh` reads it again), a Triton version not on the
list, a kernel that is not a ``JITFunction`` (Triton's interpreter under ``TRITON_INTERPRET=1``, where there is no
compiled kernel; test doubles), a launch hook installed (a profiler reads the launch metadata) or a pre-run hook.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch
from torch import Tensor

try:
    import triton
    from triton import knobs
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction
except ImportError:  # the backend reports triton missing; here every launch is simply a normal one
    triton = knobs = driver = JITFunction = None

__all__ = ["ENV", "TRITON_VERSIONS", "VERIFY_MAX_BYTES", "launch", "refresh", "unavailable_reason"]

ENV = "ADDNORM_TRITON_FAST_LAUNCH"
TRITON_VERSIONS = ("3.6.", "3.9.")
VERIFY_MAX_BYTES = 256 << 20  # the first-use check copies every tensor argument twice
_MAX_KEYS = 4096  # a model has few shapes and flag sets; past this the cache starts over

_I32, _I64, _U64 = 1 << 31, 1 << 63, 1 << 64
_UNKNOWN = object()  # an argument this module does not know how Triton specializes: launch normally


@functools.cache
def unavailable_reason() -> str | None:
    """None when launches may be bound, else why not (kernels that are not compiled, e.g. interpreted, never are).
    Decided when this module is imported and remembered; :func:`refresh` decides again."""
    if triton is None:
        return "triton is not installed"
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    # the binding reads Triton's own launch code, which changes between versions: only those read are bound
    if not triton.__version__.startswith(TRITON_VERSIONS):
        return f"Triton {triton.__version__} is not one of the versions read ({', '.join(TRITON_VERSIONS)}x)"
    return None


unavailable_reason()


def refresh() -> str | None:
    """Re-read the switch (``ADDNORM_TRITON_FAST_LAUNCH``) and the version check; forget every bound launch."""
    unavailable_reason.cache_clear()
    _bound.clear()
    return unavailable_reason()


def _spec(a):
    """What Triton's native_specialize_impl keys on for one non-constexpr argument (3.6 and 3.9; module docstring)."""
    t = a.__class__
    if t is float:
        return "f"
    if t is int:
        if a == 1:
            return "one"
        kind = 0 if -_I32 <= a < _I32 else 2 if -_I64 <= a < _I64 else 4 if 0 <= a < _U64 else None
        return _UNKNOWN if kind is None else kind + (a % 16 == 0)
    if t is bool:
        return "b"
    if a is None:
        return None
    if isinstance(a, Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    return _UNKNOWN


def _specs(args: tuple) -> tuple:
    """_spec of every argument; the common cases inline (this runs on every launch: one call, not one per argument)."""
    out = []
    for a in args:
        t = a.__class__
        if t is Tensor:
            out.append((a.dtype, a.data_ptr() % 16 == 0))
        elif t is float:
            out.append("f")
        elif t is int and a != 1 and -_I32 <= a < _I32:
            out.append(a % 16 == 0)
        else:
            out.append(_spec(a))
    return tuple(out)


def _hooked(hook) -> bool:
    """Whether a launch hook is installed (a profiler's): Triton 3.6 and 3.9 hold them in HookChains, empty unless
    one is added; anything else that is not None counts as a hook."""
    return hook is not None and bool(getattr(hook, "calls", True))


class _Bound:
    """A compiled kernel's launcher and what it is called with besides the arguments. ``run`` None: the key keeps
    the normal launch (its first-use check failed, or the kernel's parameters are of a kind not bound here)."""

    __slots__ = ("kernel", "meta", "run", "function", "packed", "tail")

    def __init__(self, kernel, meta, compiled=None, tail=()):
        self.kernel, self.meta = kernel, meta  # held: their ids are in the key, and stay unique while held
        self.run = compiled.run if compiled is not None else None
        self.function = compiled.function if compiled is not None else None
        self.packed = compiled.packed_metadata if compiled is not None else None
        self.tail = tail  # the values of the parameters after the positional arguments, in signature order


_bound: dict = {}


def _call(bound: _Bound, grid, stream, args) -> None:
    """The launch JITFunction.run ends with, for a kernel already compiled (Triton 3.6 and 3.9 alike)."""
    n = len(grid)
    bound.run(
        grid[0],
        grid[1] if n > 1 else 1,
        grid[2] if n > 2 else 1,
        stream,
        bound.function,
        bound.packed,
        None,  # the launch metadata and the enter and exit hooks: only hooks read the metadata, and bound launches
        None,  # run only while no hook is installed (_hooked), so the launcher is spared calling empty hook chains
        None,
        *args,
        *bound.tail,
    )


def launch(kernel, grid, args: tuple, meta: dict) -> None:
    """``kernel[grid](*args, **meta)``, bound after the first launch when the module docstring's conditions hold."""
    if (
        unavailable_reason() is not None
        or kernel.__class__ is not JITFunction
        or kernel.pre_run_hooks
        or _hooked(knobs.runtime.launch_enter_hook)
        or _hooked(knobs.runtime.launch_exit_hook)
        or getattr(knobs.runtime, "add_stages_inspection_hook", None) is not None  # 3.9: a key part of its own
    ):
        kernel[grid](*args, **meta)
        return
    active = driver.active
    device = active.get_current_device()
    key = (
        id(kernel),  # ids, not the objects (a JITFunction hashes its source hash): the entry holds both
        id(meta),
        device,
        knobs.runtime.debug,
        knobs.compilation.instrumentation_mode,
        getattr(knobs.compilation, "fpsan_homomorphic_casts", None),  # 3.9 adds it to the options
        _specs(args),
    )
    bound = _bound.get(key)
    if bound is not None and bound.meta is meta and bound.kernel is kernel:
        if bound.run is not None:
            _call(bound, grid, active.get_current_stream(device), args)
        else:
            kernel[grid](*args, **meta)
        return
    _first_launch(kernel, grid, args, meta, device, key)


def _tail(kernel, args: tuple, meta: dict):
    """The parameters after ``args`` as JITFunction.run binds them (from meta, else their defaults), or None when the
    kernel has a parameter whose specialization ``_spec`` does not model (annotated, or not specialized)."""
    params = kernel.params
    for p in params[: len(args)]:
        if p.is_constexpr or p.do_not_specialize or p.do_not_specialize_on_alignment or p.annotation or p.name in meta:
            return None
    tail = []
    for p in params[len(args) :]:
        if not p.is_constexpr or (p.name not in meta and not p.has_default):
            return None
        tail.append(meta[p.name] if p.name in meta else p.default)
    return tuple(tail)


def _bits(t: Tensor) -> Tensor:
    """t's elements as integers of the same width: a bitwise comparison that NaN does not defeat."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _first_launch(kernel, grid, args, meta, device, key) -> None:
    """The normal launch; then, when it can be checked here, the bound launch checked against it and cached."""
    if len(_bound) >= _MAX_KEYS:
        _bound.clear()
    tail = _tail(kernel, args, meta)
    unknown = any(part is _UNKNOWN for part in key[-1])
    if tail is None or unknown:
        kernel[grid](*args, **meta)
        if not unknown:  # an _UNKNOWN part would make every such call a new key: do not fill the cache with them
            _bound[key] = _Bound(kernel, meta)
        return
    tensors = list({id(a): a for a in args if isinstance(a, Tensor)}.values())
    too_big = 2 * sum(t.numel() * t.element_size() for t in tensors) > VERIFY_MAX_BYTES
    if too_big or (any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing()):
        kernel[grid](*args, **meta)  # checked (and bound) on a later call of this key
        return
    # inference mode: the outputs may be inference tensors while this call is outside it (the kernels write them
    # either way; copy_ would refuse), and nothing here is for autograd to see
    with torch.inference_mode():
        before = [t.clone() for t in tensors]
        compiled = kernel[grid](*args, **meta)
        if compiled is None or hasattr(compiled, "result") or getattr(compiled, "function", None) is None:
            return  # not a loaded CompiledKernel (an asynchronous compile, a hook that skipped it): stay normal
        after = [t.clone() for t in tensors]
        # put back only what the normal launch wrote: an input may be a broadcast view (stride 0), which cannot be
        # written, and another op's saved tensor, whose version must not change
        written = [i for i, (b, a) in enumerate(zip(before, after)) if not torch.equal(_bits(b), _bits(a))]
        for i in written:
            tensors[i].copy_(before[i])
        bound = _Bound(kernel, meta, compiled, tail)
        _call(bound, grid, driver.active.get_current_stream(device), args)
        differ = [i for i, (t, a) in enumerate(zip(tensors, after)) if not torch.equal(_bits(t), _bits(a))]
        if not differ:
            _bound[key] = bound
            return
        for i in differ:
            tensors[i].copy_(after[i])  # the normal launch's results stand
    _bound[key] = _Bound(kernel, meta)
    warnings.warn(
        f"addnorm: the bound launch of {kernel.fn.__name__} differed from Triton's normal launch on first use; this "
        f"specialization keeps the normal launch (Triton {triton.__version__}; {ENV}=0 turns bound launches off)",
        RuntimeWarning,
        stacklevel=3,
    )
