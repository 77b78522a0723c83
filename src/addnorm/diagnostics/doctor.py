"""``addnorm doctor``: find Add & Norm mistakes in a model, statically and with one forward/backward.

The "three checks" of a broken Transformer (is the skip path an identity, is the norm over the right axis, does
the layout suit the depth and schedule) plus a few numerics checks, on any ``nn.Module``:

==========================  ========  =====================================================================
code                        severity  what is checked
==========================  ========  =====================================================================
``norm-dimension``          error     a norm whose normalized_shape does not match its input; a norm that
                                      normalizes over the sequence or batch axis (its input's last dim is the
                                      sequence length, or changing one position's features changes the output
                                      at other positions); BatchNorm/InstanceNorm in a sequence model
``residual-not-identity``   error     with every weight of a block's sublayers set to zero (norm gains reset
                                      to 1, biases to 0), the block must map x to x (Pre-Norm) or to Norm(x)
                                      (Post-Norm); anything else means the skip path is scaled or projected
``missing-final-norm``      error     a Pre-Norm stack with no norm between the last block and the output
``post-norm-deep``          warning   Post-Norm with 12 or more blocks (Xiong et al. 2020: needs warmup;
                                      Wang et al. 2022: DeepNorm) and no DeepNorm scaling found
``low-precision-stats``     warning   a norm whose mean/variance reduction runs in fp16/bf16 when fed half
                                      precision (error when it already does so on its input in this model)
``residual-growth``         warning   at init, RMS(stream after the last block) / RMS(after the first)
                                      above 2 * sqrt((1 + 3L/2) / (3/2)): twice the ratio of the Pre-LN
                                      bounds of Xiong et al.'s Lemma 2 (upper at layer L, lower at layer 1);
                                      healthy Pre-Norm grows like sqrt(l), a bad init geometrically
``forward-failed`` etc.     error     the example forward or backward raised, or produced NaN/Inf
==========================  ========  =====================================================================

The command ``addnorm doctor`` (loading a user's file or a Hugging Face config) is in
:mod:`addnorm.diagnostics.doctor_cli`.
"""

from __future__ import annotations

import copy
import math
import sys
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from addnorm.diagnostics.anomaly import NonFiniteSentinel
from addnorm.diagnostics.monitor import call_model, find_blocks, first_tensor, is_norm_module, output_logits

__all__ = ["Finding", "DoctorConfig", "diagnose", "SEVERITIES"]

SEVERITIES = ("error", "warning", "info")
_HALF = (torch.float16, torch.bfloat16)


@dataclass(kw_only=True)
class Finding:
    """One problem (or note) about the model: ``code``, ``severity`` ("error"|"warning"|"info"), the module path,
    what was seen, and how to fix it."""

    code: str
    severity: str
    module: str
    message: str
    fix: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(kw_only=True)
class DoctorConfig:
    """Thresholds of the checks (each one stated in the module docstring)."""

    post_norm_depth: int = 12  # Post-Norm blocks from which a deep-Post-Norm warning is given
    growth_factor: float = 2.0  # residual-growth fires above growth_factor * sqrt((1 + 1.5 L) / 1.5)
    identity_rtol: float = 1e-3  # zeroed block vs x (a scaled/projected skip is off by far more)
    norm_rtol: float = 5e-2  # zeroed Post-Norm block vs Norm(x) up to a gain (eps shifts it by ~1%)
    coupling_rtol: float = 1e-4  # output change at untouched positions, relative to the output's scale


# ---- helpers ------------------------------------------------------------------------------------------------------
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


def _rms(t: Tensor) -> float:
    t = t.detach().double()
    return float(t.pow(2).mean().sqrt()) if t.numel() else 0.0


def _rel(a: Tensor, b: Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _fit_rel(out: Tensor, ref: Tensor) -> tuple[float, float]:
    """Best scalar c with out ~ c * ref, and the relative residual ||out - c ref|| / ||out||."""
    out, ref = out.double().reshape(-1), ref.double().reshape(-1)
    denom, size = float(ref @ ref), float(out.norm())
    if denom == 0 or size == 0:  # a zero output fits nothing (a zeroed skip path must not pass as Norm(x))
        return 0.0, 1.0
    c = float(out @ ref) / denom
    return c, float((out - c * ref).norm()) / size


def _standardize(x: Tensor) -> Tensor:
    x = x.double()
    return (x - x.mean(-1, keepdim=True)) / x.var(-1, unbiased=False, keepdim=True).add(1e-12).sqrt()


def _rms_normalize(x: Tensor) -> Tensor:
    x = x.double()
    return x / x.pow(2).mean(-1, keepdim=True).add(1e-12).sqrt()


def _reset_norm_affine(m: nn.Module) -> None:
    """Norm gain to identity: reset_parameters() where it exists (it knows zero-centred gains), else 1 and 0."""
    if hasattr(m, "reset_parameters"):
        m.reset_parameters()
        return
    for name, p in m.named_parameters(recurse=False):
        p.fill_(0.0 if "bias" in name else 1.0)


def _is_batch_norm(m: nn.Module) -> bool:
    name = type(m).__name__
    return isinstance(m, nn.modules.batchnorm._NormBase) or "BatchNorm" in name or "InstanceNorm" in name


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


def _batch_shape(batch: Any) -> tuple[int, ...] | None:
    """Shape of the first tensor of the example batch (token ids (B, T) or features (B, T, C))."""
    if isinstance(batch, dict):
        batch = batch.get("input_ids", next(iter(batch.values()), None)) if batch else None
    t = first_tensor(batch) if not isinstance(batch, Tensor) else batch
    return tuple(t.shape) if t is not None else None


# ---- the checks ---------------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class _Trace:
    """What the hooks saw during the example forward."""

    order: int = 0  # a counter shared by block ends and norm calls, to tell what ran after the last block
    failed: bool = False  # the forward raised
    block_calls: dict = field(default_factory=dict)  # block index -> (args, kwargs) of its first call
    block_out: dict = field(default_factory=dict)  # block index -> (RMS of its output, output's last dim)
    block_end: dict = field(default_factory=dict)  # block index -> order when it finished
    norm_calls: dict = field(default_factory=dict)  # norm path -> (args, order) of its first call
    norm_last: dict = field(default_factory=dict)  # norm path -> order of its last call (one module may run twice)
    shape_errors: dict = field(default_factory=dict)  # norm path -> message


def _run(model: nn.Module, batch: Any, blocks: list, findings: list[Finding]) -> _Trace:
    """One forward (hooks record block and norm calls) and one backward; failures become findings."""
    tr = _Trace()
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
                tr.block_out[i] = (_rms(h), h.shape[-1] if h.dim() else 0)

        return hook

    def norm_pre(path):
        def hook(module, args):
            tr.order += 1
            if path not in tr.norm_calls:
                tr.norm_calls[path] = (_detach(args), tr.order)
            tr.norm_last[path] = tr.order
            shape = getattr(module, "normalized_shape", None)
            x = args[0] if args and isinstance(args[0], Tensor) else None
            if shape is not None and x is not None and not _is_batch_norm(module):
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


def _check_norms(model, tr: _Trace, batch_shape, d_model, findings, cfg: DoctorConfig) -> None:
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
        if path in tr.shape_errors:
            findings.append(
                Finding(
                    code="norm-dimension", severity="error", module=path, message=tr.shape_errors[path], fix=norm_fix
                )
            )
        elif _is_batch_norm(m) and x.dim() != 4:  # BatchNorm2d on (N, C, H, W): a CNN's norm, not a sequence's
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


def _classify_blocks(blocks, tr: _Trace, findings, cfg: DoctorConfig) -> list[str | None]:
    """Per block: "pre" (zeroed block is the identity, with norms inside), "none" (identity, no norm),
    "post" (zeroed block is Norm(x)), "bad" (a finding was added) or None (could not be checked)."""
    kinds: list[str | None] = []
    for i, (name, block) in enumerate(blocks):
        call = tr.block_calls.get(i)
        if call is None:
            kinds.append(None)
            continue
        args, kwargs = call
        x = first_tensor(args) if first_tensor(args) is not None else first_tensor(kwargs)
        if x is None or not x.is_floating_point() or x.dim() < 2:
            kinds.append(None)
            continue
        # The block's own input may already be normalized (Post-Norm blocks after the first), where x and Norm(x)
        # coincide; a stream with a different scale per position and an offset tells them apart.
        g = torch.Generator().manual_seed(i)
        row_scale = torch.empty(*x.shape[:-1], 1).uniform_(0.5, 3.0, generator=g).to(x)
        x = x / max(_rms(x), 1e-12) * row_scale + 0.5
        args, kwargs = _replace_first_tensor(args, kwargs, x)
        # Norms that ran in this block's forward (a norm that is defined but unused does not make it Pre-Norm).
        has_norm = any(p == name or p.startswith(name + ".") for p in tr.norm_calls)
        try:
            c = copy.deepcopy(block).eval()
            with torch.no_grad():
                norms = [m for m in c.modules() if is_norm_module(m)]
                norm_params = {id(p) for m in norms for p in m.parameters()}
                for p in c.parameters():
                    if id(p) not in norm_params:
                        p.zero_()  # every sublayer branch now outputs zero (or a constant bias)
                for m in norms:
                    _reset_norm_affine(m)
                out = first_tensor(c(*args, **kwargs))
        except Exception as e:  # noqa: BLE001
            findings.append(
                Finding(
                    code="residual-check-skipped",
                    severity="info",
                    module=name,
                    message=f"could not re-run a zeroed copy of this block ({type(e).__name__}: {e})",
                    fix="none needed; the skip-path check did not run for this block",
                )
            )
            kinds.append(None)
            continue
        if out is None or x is None or out.shape != x.shape:
            kinds.append(None)
            continue
        if _rel(out, x) < cfg.identity_rtol:
            kinds.append("pre" if has_norm else "none")
            continue
        post = min(_fit_rel(out, _standardize(x))[1], _fit_rel(out, _rms_normalize(x))[1])
        if has_norm and post < cfg.norm_rtol:
            kinds.append("post")
            continue
        scale, resid = _fit_rel(out, x)
        if resid < 1e-2:
            what = f"multiplies the skip path by {scale:.4g}"
        else:
            what = (
                f"applies a non-identity map to the skip path (output RMS / input RMS = "
                f"{_rms(out) / max(_rms(x), 1e-30):.3g}, distance from x {_rel(out, x):.3g})"
            )
        findings.append(
            Finding(
                code="residual-not-identity",
                severity="error",
                module=name,
                message=f"with its sublayers' weights set to zero the block should return x (Pre-Norm) or Norm(x) "
                f"(Post-Norm), but it {what}: gradients no longer pass through unchanged",
                fix="write the residual as x = x + sublayer(norm(x)) (Pre-Norm) or x = norm(x + sublayer(x)); "
                "move projections and scales into the sublayer branch",
            )
        )
        kinds.append("bad")
    return kinds


def _direction(block: nn.Module, call: tuple | None) -> str | None:
    """ "causal" when changing the block's input at the last position leaves its output at every earlier position
    unchanged, "bidirectional" when it does not, None when that cannot be tried (no (B, T, d) input, T < 2, the
    block fails on the changed input)."""
    if call is None:
        return None
    args, kwargs = call
    x = first_tensor(args) if first_tensor(args) is not None else first_tensor(kwargs)
    if x is None or not x.is_floating_point() or x.dim() != 3 or x.shape[1] < 2:
        return None
    bumped = x.clone()
    bumped[:, -1] += 3.0 * max(_rms(x), 1e-3)
    try:
        with torch.no_grad():
            before = first_tensor(block(*args, **kwargs))
            b_args, b_kwargs = _replace_first_tensor(args, kwargs, bumped)
            after = first_tensor(block(*b_args, **b_kwargs))
    except Exception:  # noqa: BLE001 - a block that needs more than its recorded call: say nothing about it
        return None
    if before is None or after is None or before.shape != after.shape or before.shape[:2] != x.shape[:2]:
        return None
    return "causal" if _rel(after[:, :-1], before[:, :-1]) < 1e-6 else "bidirectional"


def _replace_first_tensor(args: tuple, kwargs: dict, x: Tensor) -> tuple[tuple, dict]:
    for j, a in enumerate(args):
        if isinstance(a, Tensor):
            return (*args[:j], x, *args[j + 1 :]), kwargs
    for k, v in kwargs.items():
        if isinstance(v, Tensor):
            return args, {**kwargs, k: x}
    return args, kwargs


def _uses_deepnorm(blocks) -> bool:
    for _, block in blocks:
        for m in block.modules():
            placement = str(getattr(m, "placement", "") or getattr(m, "kind", "")).lower()
            alpha = getattr(m, "alpha", None)
            if "deep" in placement or (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and alpha > 1):
                return True
    return False


def diagnose(
    model: nn.Module, example_batch: Any, *, blocks: Any = None, config: DoctorConfig | None = None
) -> list[Finding]:
    """Run every check on ``model`` with ``example_batch`` (tensor, tuple or dict of inputs); returns the findings,
    errors first. The model is deep-copied first, so its state (grads, BatchNorm statistics) is left untouched."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    cfg = config or DoctorConfig()
    try:
        model = copy.deepcopy(model)
    except Exception:  # noqa: BLE001 - some models hold un-copyable handles; then work on the original
        pass
    model.eval()
    findings: list[Finding] = []
    try:
        found = find_blocks(model, blocks)
    except ValueError as e:
        found = []
        findings.append(
            Finding(
                code="no-blocks",
                severity="info",
                module="<root>",
                message=str(e),
                fix="pass blocks= to diagnose() to enable the per-block checks",
            )
        )
    tr = _run(model, example_batch, found, findings)
    if tr.failed:  # only what the hooks saw before the failure can be reported
        for path, msg in tr.shape_errors.items():
            findings.append(
                Finding(
                    code="norm-dimension",
                    severity="error",
                    module=path,
                    message=msg,
                    fix="give the norm normalized_shape=(d_model,), the feature dim of its input",
                )
            )
        return _sorted(findings)
    outs = [tr.block_out[i] for i in sorted(tr.block_out)]
    d_model = max({d for _, d in outs}, key=[d for _, d in outs].count) if outs else None
    _check_norms(model, tr, _batch_shape(example_batch), d_model, findings, cfg)
    if not found or not tr.block_calls:
        return _sorted(findings)

    container = found[0][0].rpartition(".")[0] or "<root>"
    kinds = _classify_blocks(found, tr, findings, cfg)
    n_post, n_pre = kinds.count("post"), kinds.count("pre")
    L = len(found)

    if n_post >= cfg.post_norm_depth and not _uses_deepnorm(found):
        findings.append(
            Finding(
                code="post-norm-deep",
                severity="warning",
                module=container,
                message=f"{n_post} Post-Norm blocks: at this depth Post-Norm's gradients at init grow with the layer "
                "index, and Adam without warmup often diverges or stalls (Xiong et al. 2020)",
                fix="use a learning-rate warmup, switch to Pre-Norm (with a final norm), or use DeepNorm "
                "(x = LN(alpha x + f(x)), alpha = (2N)^(1/4), branch init scaled by beta = (8N)^(-1/4))",
            )
        )

    if n_pre > L // 2:
        last_end = tr.block_end.get(len(found) - 1)
        block_ids = {id(m) for _, b in found for m in b.modules()}
        modules = dict(model.named_modules())
        # a norm module may run before the blocks and again after them (NanoChat's self.norm): its last call counts
        after = [
            p
            for p, order in tr.norm_last.items()
            if last_end is not None
            and order > last_end
            and id(modules.get("" if p == "<root>" else p)) not in block_ids
        ]
        if last_end is not None and not after:
            findings.append(
                Finding(
                    code="missing-final-norm",
                    severity="error",
                    module=container,
                    message="Pre-Norm blocks but no norm runs after the last block: the head reads the raw residual "
                    "stream, whose scale grows with depth",
                    fix="apply a final LayerNorm/RMSNorm to the output of the last block, before the head",
                )
            )

    if n_post <= L // 2 and L >= 2 and 0 in tr.block_out and (L - 1) in tr.block_out:
        first, last = tr.block_out[0][0], tr.block_out[L - 1][0]
        limit = cfg.growth_factor * math.sqrt((1 + 1.5 * L) / 1.5)
        if first > 0 and last / first > limit:
            per_layer = ", ".join(f"{tr.block_out[i][0]:.3g}" for i in sorted(tr.block_out))
            findings.append(
                Finding(
                    code="residual-growth",
                    severity="warning",
                    module=container,
                    message=f"at init the residual stream's RMS grows {last / first:.3g}x from the first block's "
                    f"output to the last one's ({first:.3g} -> {last:.3g}; limit {limit:.3g} = "
                    f"{cfg.growth_factor:g} * sqrt((1 + 3L/2) / (3/2)), L={L}); per block: {per_layer}",
                    fix="normalize each branch's input (Pre-Norm) and scale the init of each branch's output "
                    "projection down with depth (std 0.02/sqrt(2L) as GPT-2, or a 1/sqrt(2L) branch scale)",
                )
            )

    label = {"pre": "Pre-Norm", "post": "Post-Norm", "none": "no norm", "bad": "non-identity skip", None: "not checked"}
    counts = {k: kinds.count(k) for k in label if kinds.count(k)}
    if len(counts) == 1:
        placement = label[next(iter(counts))]
    else:
        placement = "mixed (" + ", ".join(f"{n} {label[k]}" for k, n in counts.items()) + ")"
    direction = _direction(found[0][1], tr.block_calls.get(0))
    name = type(found[0][1]).__name__
    # a class name that contradicts what the block does (addnorm's EncoderLayer with causal=True is a decoder-only
    # block) is left out rather than repeated
    misleading = ("encoder" in name.lower() and direction == "causal") or (
        "decoder" in name.lower() and direction == "bidirectional"
    )
    what = f"{L} blocks" if misleading else f"{L} blocks of {name}"
    attention = {"causal": ", causal (decoder-only)", "bidirectional": ", bidirectional (encoder)"}.get(direction, "")
    findings.append(
        Finding(
            code="summary",
            severity="info",
            module=container,
            message=f"{what} at '{container}'{attention}, placement {placement}, d_model {d_model}",
            fix="none needed",
        )
    )
    return _sorted(findings)


def _sorted(findings: list[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: SEVERITIES.index(f.severity))
