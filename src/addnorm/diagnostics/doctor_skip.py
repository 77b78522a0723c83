"""The doctor's per-block checks: is the skip path the identity (``residual-not-identity``), which placement
(Pre-Norm, Post-Norm, none) each block has, whether its attention is causal, whether DeepNorm scaling is used."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from addnorm.diagnostics.blocks import first_tensor, is_norm_module
from addnorm.diagnostics.doctor_findings import DoctorConfig, Finding
from addnorm.diagnostics.doctor_walk import Trace, replace_first_tensor, rms

__all__ = ["classify_blocks", "block_direction", "uses_deepnorm"]


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


def classify_blocks(blocks, tr: Trace, findings, cfg: DoctorConfig) -> list[str | None]:
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
        x = x / max(rms(x), 1e-12) * row_scale + 0.5
        args, kwargs = replace_first_tensor(args, kwargs, x)
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
                f"{rms(out) / max(rms(x), 1e-30):.3g}, distance from x {_rel(out, x):.3g})"
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


def block_direction(block: nn.Module, call: tuple | None) -> str | None:
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
    bumped[:, -1] += 3.0 * max(rms(x), 1e-3)
    try:
        with torch.no_grad():
            before = first_tensor(block(*args, **kwargs))
            b_args, b_kwargs = replace_first_tensor(args, kwargs, bumped)
            after = first_tensor(block(*b_args, **b_kwargs))
    except Exception:  # noqa: BLE001 - a block that needs more than its recorded call: say nothing about it
        return None
    if before is None or after is None or before.shape != after.shape or before.shape[:2] != x.shape[:2]:
        return None
    return "causal" if _rel(after[:, :-1], before[:, :-1]) < 1e-6 else "bidirectional"


def uses_deepnorm(blocks) -> bool:
    for _, block in blocks:
        for m in block.modules():
            placement = str(getattr(m, "placement", "") or getattr(m, "kind", "")).lower()
            alpha = getattr(m, "alpha", None)
            if "deep" in placement or (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and alpha > 1):
                return True
    return False
