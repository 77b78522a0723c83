"""The doctor's per-norm checks: ``norm-dimension`` (a norm over the wrong axis) and ``low-precision-stats``."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from addnorm.diagnostics.blocks import first_tensor
from addnorm.diagnostics.doctor.example_run import Trace, is_batch_norm
from addnorm.diagnostics.doctor.findings import DoctorConfig, Finding

__all__ = ["check_norms"]

_HALF = (torch.float16, torch.bfloat16)


def _trusted_norm(m: nn.Module) -> bool:
    """torch's and addnorm's norm layers compute statistics in fp32 whatever the input dtype."""
    trusted = [nn.LayerNorm, nn.GroupNorm] + ([nn.RMSNorm] if hasattr(nn, "RMSNorm") else [])
    try:
        from addnorm.nn.norms import LayerNorm as ALayerNorm
        from addnorm.nn.norms import RMSNorm as ARMSNorm

        trusted += [ALayerNorm, ARMSNorm]
    except ImportError:  # pragma: no cover
        pass
    return any(type(m).forward is cls.forward for cls in trusted)


_REDUCTIONS = frozenset(
    {"mean", "var", "var_mean", "std", "std_mean", "sum", "norm", "vector_norm", "linalg_vector_norm", "nanmean"}
)


def _half_reductions(fn) -> list[str]:
    """Run fn() and list the reductions (mean, var, sum, norm) that returned fp16/bf16 tensors."""
    from torch.overrides import TorchFunctionMode

    hits: list[str] = []

    class _Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = getattr(func, "__name__", "")
            outs = out if isinstance(out, tuple) else (out,)
            if name in _REDUCTIONS and any(isinstance(o, Tensor) and o.dtype in _HALF for o in outs):
                hits.append(name)
            return out

    with _Spy():
        fn()
    return hits


def _feature_sizes(model: nn.Module) -> set[int]:
    """Sizes that are feature dims: both dims of every 2-D weight (Linear, HF Conv1D, Embedding) and norm widths."""
    sizes: set[int] = set()
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(w, Tensor) and w.dim() == 2:
            sizes.update(w.shape)
    return sizes


def _channel_axis_norm(m: nn.Module) -> bool:
    return isinstance(m, (nn.GroupNorm, nn.LocalResponseNorm))


def _channels_first(m: nn.Module, x: Tensor) -> bool:
    """A norm whose normalized_shape is the channel dim of a (B, C, L) or (B, C, H, W) input."""
    shape = getattr(m, "normalized_shape", None)
    if shape is None or x.dim() not in (3, 4):
        return False
    shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (int(shape),)
    return shape == (x.shape[1],)


def _per_position(m: nn.Module, args: tuple, cfg: DoctorConfig, axis: int) -> bool:
    """Changing every feature (along ``axis``) of one position changes the norm's output at that position only."""
    try:
        c = copy.deepcopy(m).eval().float()
        x = args[0].float()
        with torch.no_grad():
            y0 = first_tensor(c(x))
            x2 = x.clone()
            idx = [0] * x.dim()
            idx[axis] = slice(None)
            x2[tuple(idx)] = x2[tuple(idx)] * 3.0 + 1.0
            y1 = first_tensor(c(x2))
    except Exception:  # noqa: BLE001 - a norm that cannot be re-run alone is not vouched for
        return False
    if y0 is None or y1 is None or y0.shape != x.shape:
        return False
    diff = (y1 - y0).abs()
    diff[tuple(idx)] = 0
    return float(diff.max()) <= cfg.coupling_rtol * max(float(y0.abs().max()), 1e-6)


def check_norms(model, tr: Trace, batch_shape, d_model, findings, cfg: DoctorConfig, *, image: bool = False) -> None:
    """The per-norm checks on what the example run recorded; ``image``: the model reads images (a vision model)."""
    modules = dict(model.named_modules())
    features = _feature_sizes(model) | ({d_model} if d_model else set())
    seq_len = batch_shape[1] if batch_shape and len(batch_shape) >= 2 else None
    batch_size = batch_shape[0] if batch_shape else None
    norm_fix = (
        "normalize each position over its features: LayerNorm(d_model)/RMSNorm(d_model) on a (..., d_model) input"
    )
    for path, (args, _) in tr.norm_calls.items():
        m = modules.get("" if path == "<root>" else path)
        x = args[0] if args and isinstance(args[0], Tensor) else None
        if m is None or x is None or not x.is_floating_point():
            continue
        flagged = True
        channels_first = _channels_first(m, x)
        if path in tr.shape_errors and channels_first and _per_position(m, args, cfg, axis=1):
            findings.append(
                Finding(
                    code="channel-norm",
                    severity="info",
                    module=path,
                    message=f"normalizes the channel axis of a convolutional module's (B, C, ...) input "
                    f"{tuple(x.shape)}, each position on its own (checked): a channels-first LayerNorm, as ConvNeXt, "
                    "SAM's neck and SqueezeBERT use, the right axis for that layout",
                    fix="none needed",
                )
            )
        elif path in tr.shape_errors:
            findings.append(
                Finding(
                    code="norm-dimension", severity="error", module=path, message=tr.shape_errors[path], fix=norm_fix
                )
            )
        # after a convolution anywhere; after a linear layer only in a vision model (LeViT's Linear + BatchNorm, a
        # 1x1 convolution over patches): in a token model that is BatchNorm on a projected stream, the seeds' bug
        elif (
            is_batch_norm(m)
            and x.dim() != 4
            and (tr.after_projection.get(path) == "conv" or (image and tr.after_projection.get(path) == "linear"))
        ):
            findings.append(
                Finding(
                    code="channel-norm",
                    severity="info",
                    module=path,
                    message=f"{type(m).__name__} straight after a convolution or linear projection: the conv-BN unit "
                    "of convolutional modules (LeViT, Conformer's convolution module, FastSpeech2's postnet): "
                    "statistics per channel over batch and positions by design, folded into the projection at "
                    "inference",
                    fix="none needed; mind padding in the batch statistics when training on padded sequences",
                )
            )
        elif is_batch_norm(m) and x.dim() != 4:  # BatchNorm2d on (N, C, H, W): a CNN's norm, not a sequence's
            findings.append(
                Finding(
                    code="norm-dimension",
                    severity="error",
                    module=path,
                    message=f"{type(m).__name__} in a sequence model: its statistics run over the batch (and "
                    f"sequence) axis, so outputs depend on other samples and on padding, and differ between "
                    f"training and inference (input {tuple(x.shape)})",
                    fix="use LayerNorm or RMSNorm over the feature dim",
                )
            )
        elif is_batch_norm(m) or _channel_axis_norm(m):
            flagged = False  # these normalize dim 1 (channels), never the last dim: the axis test below is not theirs
        elif x.dim() >= 2 and x.shape[-1] not in features and x.shape[-1] in (seq_len, batch_size):
            axis = "sequence" if x.shape[-1] == seq_len else "batch"
            findings.append(
                Finding(
                    code="norm-dimension",
                    severity="error",
                    module=path,
                    message=f"normalizes over the last dim of its input {tuple(x.shape)}, which has the {axis} "
                    f"length {x.shape[-1]}, not a feature size (d_model={d_model}): a transpose is missing or extra",
                    fix=norm_fix,
                )
            )
        else:
            flagged = False
        if not flagged and x.dim() >= 2 and x.numel() > x.shape[-1]:
            coupled = _couples_positions(m, args, cfg)
            if coupled:
                shape = getattr(m, "normalized_shape", None)
                what = f" (normalized_shape {tuple(shape)})" if shape is not None else ""
                findings.append(
                    Finding(
                        code="norm-dimension",
                        severity="error",
                        module=path,
                        message=f"changing one position's features changed the norm's output at other positions"
                        f"{what}, input {tuple(x.shape)}: statistics are shared across the sequence or batch axis",
                        fix=norm_fix,
                    )
                )
        if not _trusted_norm(m):
            low = _low_precision(m, args)
            if low:
                sev, ops = low
                findings.append(
                    Finding(
                        code="low-precision-stats",
                        severity=sev,
                        module=path,
                        message=f"{type(m).__name__} computes its statistics in half precision "
                        f"({', '.join(sorted(set(ops)))} return fp16/bf16)"
                        + (" on its input in this model" if sev == "error" else " when fed fp16/bf16 input")
                        + ": squares overflow fp16 above |x| = 256 and the statistics keep only 3-4 significant digits",
                        fix="upcast before the statistics (x.float()), normalize, then cast back; "
                        "or use torch.nn.RMSNorm/LayerNorm or addnorm.nn norms",
                    )
                )


def _couples_positions(m: nn.Module, args: tuple, cfg: DoctorConfig) -> bool:
    """Perturb the features of one position; a per-position norm leaves every other position's output as it was."""
    try:
        c = copy.deepcopy(m).eval().float()
        x = args[0].float()
        rest = tuple(a.float() if isinstance(a, Tensor) and a.is_floating_point() else a for a in args[1:])
        with torch.no_grad():
            y0 = first_tensor(c(x, *rest))
            x2 = x.clone()
            idx = (0,) * (x.dim() - 1)
            x2[idx] = x2[idx] * 3.0 + 1.0
            y1 = first_tensor(c(x2, *rest))
    except Exception:  # noqa: BLE001 - a norm that cannot be re-run alone is not checked this way
        return False
    if y0 is None or y1 is None or y0.shape != x.shape:
        return False
    diff = (y1 - y0).abs()
    diff[idx] = 0
    return float(diff.max()) > cfg.coupling_rtol * max(float(y0.abs().max()), 1e-6)


def _low_precision(m: nn.Module, args: tuple) -> tuple[str, list[str]] | None:
    """("error", ops) if the norm's reductions return fp16/bf16 on its real input, ("warning", ops) if they would on
    bf16 input, else None."""
    try:
        c = copy.deepcopy(m).eval()
        with torch.no_grad():
            hits = _half_reductions(lambda: c(*args))
            if hits:
                return "error", hits  # it does so right now, in the dtype the model runs in
            c16 = c.to(torch.bfloat16)
            a16 = tuple(a.to(torch.bfloat16) if isinstance(a, Tensor) and a.is_floating_point() else a for a in args)
            hits = _half_reductions(lambda: c16(*a16))
            if hits:
                return "warning", hits
    except Exception:  # noqa: BLE001 - a norm that does not run in bf16 here is not checked
        return None
    return None
