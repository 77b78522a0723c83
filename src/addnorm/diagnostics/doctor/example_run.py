"""The doctor's example run: one forward (hooks record what each block and norm received) and one backward.

The checks in :mod:`~addnorm.diagnostics.doctor.norm_checks` and :mod:`~addnorm.diagnostics.doctor.block_checks`
re-run copies of single modules on the inputs recorded here; a failing forward or backward, or a non-finite value,
is a finding.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from addnorm.diagnostics.anomaly import NonFiniteSentinel
from addnorm.diagnostics.blocks import call_model, first_tensor, is_norm_module, output_logits
from addnorm.diagnostics.doctor.findings import Finding

__all__ = [
    "Trace",
    "run_example",
    "rms",
    "is_batch_norm",
    "batch_shape",
    "image_input",
    "replace_first_tensor",
    "fed_by_projection",
]


def _detach(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(_detach(v) for v in value)
    if isinstance(value, list):
        return [_detach(v) for v in value]
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    return value


_LIBRARY_DIRS = tuple(str(Path(m.__file__).resolve().parent) for m in (torch, sys.modules["addnorm"]))


def _where(err: BaseException) -> str:
    """' (at FILE:LINE in FUNC)' for the innermost frame of ``err``'s traceback in the user's code (outside torch
    and addnorm), or '' when there is none: where to look, without a traceback."""
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        path = str(Path(frame.filename).resolve()) if not frame.filename.startswith("<") else frame.filename
        if not path.startswith(_LIBRARY_DIRS):
            return f" (at {frame.filename}:{frame.lineno} in {frame.name})"
    return ""


def rms(t: Tensor) -> float:
    t = t.detach().double()
    return float(t.pow(2).mean().sqrt()) if t.numel() else 0.0


def is_batch_norm(m: nn.Module) -> bool:
    name = type(m).__name__
    return isinstance(m, nn.modules.batchnorm._NormBase) or "BatchNorm" in name or "InstanceNorm" in name


def image_input(batch: Any) -> bool:
    """The example batch is an image (a floating (B, C, H, W) tensor, Hugging Face's ``pixel_values``) and carries
    no token ids: the model is a vision encoder."""
    values = (
        list(batch.values())
        if isinstance(batch, dict)
        else list(batch)
        if isinstance(batch, (tuple, list))
        else [batch]
    )
    tensors = [v for v in values if isinstance(v, Tensor)]
    has_image = any(t.is_floating_point() and t.dim() == 4 for t in tensors)
    return has_image and not any(not t.is_floating_point() and t.dim() == 2 for t in tensors)


_VIEWS = ("view", "unsafeview", "reshape", "transpose", "permute", "t", "squeeze", "unsqueeze", "clone", "flatten")
_PROJECTIONS = ("convolution", "addmm", "mm", "bmm", "linear", "matmul")


def fed_by_projection(x: Tensor) -> str | None:
    """ "conv" or "linear" when ``x`` is the output of a convolution or a linear layer, up to reshapes (read from its
    autograd node; None without one): the conv-BN unit of CNNs, whose BatchNorm folds into the projection at
    inference."""
    fn = x.grad_fn
    for _ in range(8):
        if fn is None:
            return None
        op = type(fn).__name__.lower().split("backward")[0]
        if op in _PROJECTIONS:
            return "conv" if op == "convolution" else "linear"
        if op not in _VIEWS or not fn.next_functions:
            return None
        fn = fn.next_functions[0][0]
    return None


def batch_shape(batch: Any) -> tuple[int, ...] | None:
    """Shape of the first tensor of the example batch (token ids (B, T) or features (B, T, C))."""
    if isinstance(batch, dict):
        batch = batch.get("input_ids", next(iter(batch.values()), None)) if batch else None
    t = first_tensor(batch) if not isinstance(batch, Tensor) else batch
    return tuple(t.shape) if t is not None else None


@dataclass(kw_only=True)
class Trace:
    """What the hooks saw during the example forward."""

    order: int = 0  # a counter shared by block ends and norm calls, to tell what ran after the last block
    failed: bool = False  # the forward raised
    block_calls: dict = field(default_factory=dict)  # block index -> (args, kwargs) of its first call
    block_out: dict = field(default_factory=dict)  # block index -> (RMS of its output, output's last dim)
    block_end: dict = field(default_factory=dict)  # block index -> order when it finished
    norm_calls: dict = field(default_factory=dict)  # norm path -> (args, order) of its first call
    norm_last: dict = field(default_factory=dict)  # norm path -> order of its last call (one module may run twice)
    shape_errors: dict = field(default_factory=dict)  # norm path -> message
    after_projection: dict = field(default_factory=dict)  # norm path -> "conv" | "linear" that fed it straight


def run_example(model: nn.Module, batch: Any, blocks: list, findings: list[Finding]) -> Trace:
    """One forward (hooks record block and norm calls) and one backward; failures become findings."""
    tr = Trace()
    handles = []
    names = {id(m): n for n, m in model.named_modules()}

    def block_pre(i):
        def hook(module, args, kwargs):
            if i not in tr.block_calls:
                tr.block_calls[i] = (_detach(args), _detach(kwargs))

        return hook

    def block_post(i):
        def hook(module, args, output):
            tr.order += 1
            tr.block_end.setdefault(i, tr.order)
            h = first_tensor(output)
            if h is not None and h.is_floating_point() and i not in tr.block_out:
                tr.block_out[i] = (rms(h), h.shape[-1] if h.dim() else 0)

        return hook

    def norm_pre(path):
        def hook(module, args):
            tr.order += 1
            if path not in tr.norm_calls:
                tr.norm_calls[path] = (_detach(args), tr.order)
            tr.norm_last[path] = tr.order
            fed = fed_by_projection(args[0]) if args and isinstance(args[0], Tensor) else None
            if fed is not None:
                tr.after_projection[path] = fed
            shape = getattr(module, "normalized_shape", None)
            x = args[0] if args and isinstance(args[0], Tensor) else None
            if shape is not None and x is not None and not is_batch_norm(module):
                shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (int(shape),)
                if tuple(x.shape[x.dim() - len(shape) :]) != shape:
                    tr.shape_errors.setdefault(
                        path, f"normalized_shape {shape} does not match the trailing dims of its input {tuple(x.shape)}"
                    )

        return hook

    for i, (_, b) in enumerate(blocks):
        handles.append(b.register_forward_pre_hook(block_pre(i), with_kwargs=True))
        handles.append(b.register_forward_hook(block_post(i)))
    for m in model.modules():
        if is_norm_module(m):
            handles.append(m.register_forward_pre_hook(norm_pre(names[id(m)] or "<root>")))
    sentinel = NonFiniteSentinel(model)
    try:
        try:
            out = call_model(model, batch)
        except Exception as e:  # noqa: BLE001 - any failure of the user's forward is a finding
            findings.append(
                Finding(
                    code="forward-failed",
                    severity="error",
                    module="<root>",
                    message=f"the example forward raised {type(e).__name__}: {e}{_where(e)}; runtime checks were "
                    "skipped",
                    fix="make FACTORY's example batch run through the model (see the norm-dimension finding, if any)",
                )
            )
            tr.failed = True
            return tr
        if sentinel.first_forward is not None:
            findings.append(
                Finding(
                    code="non-finite",
                    severity="error",
                    module=sentinel.first_forward,
                    message="the example forward produced NaN/Inf; this module's output was the first non-finite one",
                    fix="check this module's init and inputs (log of zero, division by a zero norm, overflow in fp16)",
                )
            )
        y = output_logits(out)
        if y is None:
            y = first_tensor(out)
        if y is None or not y.requires_grad:
            findings.append(
                Finding(
                    code="backward-skipped",
                    severity="info",
                    module="<root>",
                    message="the model's output has no floating-point tensor that requires grad; no backward was run",
                    fix="return logits (or a loss) from forward to let the doctor check gradients",
                )
            )
            return tr
        try:
            y.float().pow(2).mean().backward()
        except Exception as e:  # noqa: BLE001
            findings.append(
                Finding(
                    code="backward-failed",
                    severity="error",
                    module="<root>",
                    message=f"backward of mean(output^2) raised {type(e).__name__}: {e}{_where(e)}",
                    fix="look for in-place updates of tensors autograd saved, or detached parts of the residual stream",
                )
            )
            return tr
        if sentinel.first_backward is not None and sentinel.first_forward is None:
            findings.append(
                Finding(
                    code="non-finite",
                    severity="error",
                    module=sentinel.first_backward,
                    message="backward produced NaN/Inf gradients; this module produced the first non-finite one",
                    fix="look for sqrt/rsqrt/division at zero in this module (a norm with eps=0 on a zero row)",
                )
            )
        return tr
    finally:
        sentinel.detach()
        for h in handles:
            h.remove()


def replace_first_tensor(args: tuple, kwargs: dict, x: Tensor) -> tuple[tuple, dict]:
    for j, a in enumerate(args):
        if isinstance(a, Tensor):
            return (*args[:j], x, *args[j + 1 :]), kwargs
    for k, v in kwargs.items():
        if isinstance(v, Tensor):
            return args, {**kwargs, k: x}
    return args, kwargs
