"""Backend registry: which implementations of the add + norm contract exist, which run here, and why not.

Backends:
- ``torch``: plain PyTorch (:mod:`addnorm.ops.torch_backend`: the fallback and the baseline; always available,
  traced natively by torch.compile).
- ``reference``: the explicit float oracle of :mod:`addnorm.reference` run through the kernel contract and the
  registered custom ops (:mod:`addnorm.reference_backend`, outside ``ops/``: nothing under ``ops/`` imports the
  oracle that judges it); slow, available everywhere, used to test the plumbing every kernel backend shares.
- ``triton``: fused Triton kernels (CUDA GPUs; on CPU tensors only under ``TRITON_INTERPRET=1``).
- ``cpu``: fused numba kernels, parallel over rows (CPU tensors).

A kernel backend is a module with ``unavailable_reason(device) -> str | None`` plus ``forward`` and ``backward``
functions that follow the contract documented in :mod:`addnorm.ops.add_norm`. Compiled graphs call a kernel backend
through the opaque custom ops of :mod:`addnorm.ops.kernel_ops`, unless the backend registers ops of its own whose
kernels the compiler sees (``KernelBackend.compiled_module``: the Triton backend's triton ops on CUDA tensors).

``backend="auto"`` picks the best available backend for the tensor's device; ``ADDNORM_BACKEND`` overrides it
(:func:`backend_override` is its one reader).
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from types import ModuleType

import torch

BACKEND_NAMES = ("auto", "torch", "reference", "triton", "cpu")
ENV_VAR = "ADDNORM_BACKEND"


@dataclass(frozen=True)
class KernelBackend:
    name: str
    module: str  # import path of the kernel module, imported on first use
    install_hint: str  # what a user needs to make it available
    # Import path of a module that registers the backend's kernels as ops for compiled graphs,
    # addnorm::<name>_add_norm_fwd/_bwd (add_norm_fwd's/_bwd's arguments less ``backend``) and addnorm::<name>_add_norm_
    # (add_norm_'s less ``backend``), and says with ``usable(device_type)`` where they can be traced. None: compiled
    # graphs call the opaque addnorm::add_norm_fwd/_bwd/add_norm_ only.
    compiled_module: str | None = None


KERNEL_BACKENDS: dict[str, KernelBackend] = {
    "reference": KernelBackend("reference", "addnorm.reference_backend", "nothing (always available)"),
    "triton": KernelBackend(
        "triton",
        "addnorm.ops.triton.launch",
        "a CUDA GPU and `pip install 'addnorm[triton]'` (or TRITON_INTERPRET=1 to run the kernels on CPU tensors)",
        compiled_module="addnorm.ops.triton.compiled",
    ),
    "cpu": KernelBackend("cpu", "addnorm.ops.cpu.launch", "`pip install numba` (a core dependency of addnorm)"),
}

# auto's order of preference per device type. The choice depends on the device, what is installed and the
# ADDNORM_BACKEND override, never on the tensor's size: backends round their fp32 sums in different orders, so a
# switch on the row count would give a row different bits in a batch of 4 and in a batch of 64 (batch invariance,
# docs/kernels.md).
AUTO_ORDER = {"cuda": ("triton",), "cpu": ("cpu",)}


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run here; the message says why and what to install."""


def backend_override() -> str | None:
    """The backend ``ADDNORM_BACKEND`` names for ``backend="auto"`` (stripped, not yet checked), or None when it is
    unset, empty or "auto". The one reader of the variable; it is read on every call, never remembered.

    Every decode step asks, so the lookup goes to os.environ's own table (what os.environ reads and writes,
    monkeypatch.setenv included) with the key encoded once: ~0.05 us, where os.environ.get encodes the key and
    decodes the value each time (~0.6 us)."""
    value = _ENV_TABLE.get(_ENV_KEY) if _ENV_TABLE is not None else os.environ.get(ENV_VAR)
    if not value:
        return None
    value = (os.environ.decodevalue(value) if isinstance(value, bytes) else value).strip()
    return value if value not in ("", "auto") else None


_ENV_TABLE = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(ENV_VAR) if _ENV_TABLE is not None else None


@functools.cache
def _import_backend(name: str) -> ModuleType | ImportError:
    """The kernel module of backend ``name``, or the ImportError it raised: both remembered (a failed import is not
    retried on every call, which would also make torch.compile trace importlib on each resolve)."""
    try:
        return importlib.import_module(KERNEL_BACKENDS[name].module)
    except ImportError as e:
        return e


def kernel_module(name: str) -> ModuleType:
    """Import (once) and return the kernel module of backend ``name``; re-raises a remembered ImportError."""
    mod = _import_backend(name)
    if isinstance(mod, ImportError):
        raise mod
    return mod


def forget() -> None:
    """Forget the imported kernel modules and every resolved name, as a fresh process would start (for tests that
    change KERNEL_BACKENDS or what is installed)."""
    _import_backend.cache_clear()
    _resolve_remembered.cache_clear()
    _cpu_remembered.cache_clear()


def compiled_ops_usable(name: str, device_type: str) -> bool:
    """Whether compiled graphs on ``device_type`` tensors run kernel backend ``name`` through its own ops
    (``KernelBackend.compiled_module``) rather than the opaque addnorm::add_norm_fwd. Imports that module the first
    time, which registers the ops."""
    spec = KERNEL_BACKENDS.get(name)
    if spec is None or spec.compiled_module is None:
        return False
    return importlib.import_module(spec.compiled_module).usable(device_type)


# A constant for dynamo, like resolve_backend_for_trace below: run once at trace time (it imports the module that
# registers the ops), not traced
compiled_ops_usable._dynamo_marked_constant = True  # type: ignore[attr-defined]


def unavailable_reason(name: str, device: torch.device | str = "cpu") -> str | None:
    """None if backend ``name`` can run on ``device``, else a sentence saying why not."""
    if not isinstance(device, torch.device):  # (every op call comes here: torch.device() is not free)
        device = torch.device(device)
    if name == "torch":
        return None
    if name not in KERNEL_BACKENDS:
        return f"unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}"
    try:
        mod = kernel_module(name)
    except ImportError as e:
        return f"cannot import {KERNEL_BACKENDS[name].module}: {e}; needs {KERNEL_BACKENDS[name].install_hint}"
    return mod.unavailable_reason(device)


def resolve_backend_for_trace(backend: str, device_type: str) -> str:
    """:func:`resolve_backend` as a constant for torch.compile: dynamo runs it once at trace time instead of
    tracing imports and environment lookups (the choice is fixed for the compiled graph)."""
    return resolve_backend(backend, torch.device(device_type))


# What torch.compiler.assume_constant_result does; set directly because that decorator imports torch._dynamo,
# which would add ~2 s to `import addnorm`. tests/ops/test_functional.py compiles through this path.
resolve_backend_for_trace._dynamo_marked_constant = True  # type: ignore[attr-defined]


def resolve_backend(backend: str, device: torch.device) -> str:
    """Turn a user's ``backend=`` argument into the name of a backend that runs on ``device``. The answer does not
    depend on the input's shape (batch invariance: docs/kernels.md)."""
    if not isinstance(backend, str) or backend not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {backend!r}")
    if backend == "auto" and backend_override() is not None:  # an override is read on every call: not remembered
        return _resolve(backend, device)
    return _resolve_remembered(backend, device)


def resolve_cpu_backend(backend: str) -> str:
    """:func:`resolve_backend` for CPU tensors, as the fast path asks on every decode-size call: the same answer and
    errors, remembered per argument alone (no device to hash: ~0.15 us a call instead of ~0.3)."""
    if type(backend) is not str or backend_override() is not None:  # (a bad value meets resolve_backend's error)
        return resolve_backend(backend, _CPU)
    return _cpu_remembered(backend)


_CPU = torch.device("cpu")


@functools.cache
def _cpu_remembered(backend: str) -> str:
    return resolve_backend(backend, _CPU)  # raises for a bad or unavailable backend: not remembered


@functools.cache
def _resolve_remembered(backend: str, device: torch.device) -> str:
    """A backend that resolved once stays resolvable: what decides it (an importable module, CUDA present, Triton's
    interpreter chosen at import) does not change in a running process, and the availability checks cost
    microseconds that every call of a decode step pays. Failures raise, so they are not remembered (each call says
    why again); :func:`forget` starts over. One consequence: once the triton backend resolved for CPU tensors (its
    kernels interpreted), unsetting TRITON_INTERPRET afterwards does not take it away (those kernels still run)."""
    return _resolve(backend, device)


def _resolve(backend: str, device: torch.device) -> str:
    if backend == "auto":
        env = backend_override()
        if env is not None:
            if env not in BACKEND_NAMES:
                raise ValueError(f"{ENV_VAR} must be one of {BACKEND_NAMES}, got {env!r}")
            backend = env
        else:
            for name in AUTO_ORDER.get(device.type, ()):
                if unavailable_reason(name, device) is None:
                    return name
            return "torch"
    reason = unavailable_reason(backend, device)
    if reason is not None:
        raise BackendUnavailableError(f"backend {backend!r} is not available on {device}: {reason}")
    return backend


def available_backends(device: torch.device | str = "cpu") -> dict[str, str | None]:
    """Every backend with None (usable on ``device``) or the reason it is not."""
    return {name: unavailable_reason(name, device) for name in BACKEND_NAMES if name != "auto"}
