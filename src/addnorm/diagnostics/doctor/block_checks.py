"""The doctor's per-block checks: is the skip path the identity (``residual-not-identity``), which placement
(Pre-Norm, Post-Norm, none) each block has, whether its attention is causal, whether DeepNorm scaling is used."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from addnorm.diagnostics.blocks import first_tensor, is_norm_module
from addnorm.diagnostics.doctor.example_run import Trace, replace_first_tensor, rms
from addnorm.diagnostics.doctor.findings import DoctorConfig, Finding

__all__ = [
    "classify_blocks",
    "block_direction",
    "uses_deepnorm",
    "zeroed_output",
    "placement_of",
    "finite_input",
]


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


def _norm_like(m: nn.Module) -> bool:
    """A norm, or a module named like one that holds its own affine parameters: I-BERT's IntLayerNorm (not a leaf:
    it owns an activation quantizer), MobileBERT's NoNorm (x * w + b where LayerNorm was). Their gains are reset
    to the identity rather than zeroed, or zeroing the branches would zero the skip path that runs through them."""
    if is_norm_module(m):
        return True
    return "norm" in type(m).__name__.lower() and next(m.parameters(recurse=False), None) is not None


def _is_skip_param(module: nn.Module, p: Tensor) -> bool:
    """A vector parameter of a module without a weight matrix (Doge's input_residual, Zaya's residual scaling): it
    can only scale or shift what passes through, so it may sit on the skip path; branches are switched off by
    zeroing their projections (weight matrices and those modules' biases)."""
    return p.dim() <= 1 and not any(q.dim() >= 2 for q in module.parameters(recurse=False))


def zeroed_output(block: nn.Module, args: tuple, kwargs: dict, *, keep_skip_params: bool = False) -> Tensor | None:
    """The output of a copy of ``block`` whose branch parameters are zero and whose norms are reset to identity
    gains; with ``keep_skip_params`` the vector parameters that may scale the skip path keep their values."""
    c = copy.deepcopy(block).eval()
    with torch.no_grad():
        norms = [m for m in c.modules() if _norm_like(m)]
        norm_params = {id(p) for m in norms for p in m.parameters(recurse=False)}
        for m in c.modules():
            for p in m.parameters(recurse=False):
                if id(p) in norm_params or (keep_skip_params and _is_skip_param(m, p)):
                    continue
                p.zero_()  # every sublayer branch now outputs zero (or a constant bias)
        for m in norms:
            _reset_norm_affine(m)
        return first_tensor(c(*args, **kwargs))


def placement_of(out: Tensor, x: Tensor, has_norm: bool, cfg: DoctorConfig) -> str | None:
    """ "pre"/"none" when the zeroed block returned x, "post" when it returned Norm(x) up to a gain, else None."""
    if _rel(out, x) < cfg.identity_rtol:
        return "pre" if has_norm else "none"
    post = min(_fit_rel(out, _standardize(x))[1], _fit_rel(out, _rms_normalize(x))[1])
    return "post" if has_norm and post < cfg.norm_rtol else None


def finite_input(x: Tensor, seed: int) -> Tensor:
    """``x``, or a seeded standard normal of its shape when ``x`` holds NaN/Inf (a model with non-finite weights
    feeds its blocks NaN; the skip-path and direction checks ask about the block's map, not about that data)."""
    if bool(torch.isfinite(x).all()):
        return x
    return torch.randn(x.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).to(x.dtype)


def classify_blocks(blocks, tr: Trace, findings, cfg: DoctorConfig, explain=None) -> list[str | None]:
    """Per block: "pre" (zeroed block is the identity, with norms inside), "none" (identity, no norm),
    "post" (zeroed block is Norm(x)), "design" (a recognised deliberate design, explained by a note), "bad" (an
    error was added) or None (could not be checked). ``explain(name, block, args, kwargs, out, has_norm=, cfg=)``
    returns (note, kind) for a recognised design (:func:`addnorm.diagnostics.doctor.designs.explain`) or None."""
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
        x = finite_input(x, seed=i)
        # The block's own input may already be normalized (Post-Norm blocks after the first), where x and Norm(x)
        # coincide; a stream with a different scale per position and an offset tells them apart.
        g = torch.Generator().manual_seed(i)
        row_scale = torch.empty(*x.shape[:-1], 1).uniform_(0.5, 3.0, generator=g).to(x)
        x = x / max(rms(x), 1e-12) * row_scale + 0.5
        args, kwargs = replace_first_tensor(args, kwargs, x)
        # Norms that ran in this block's forward (a norm that is defined but unused does not make it Pre-Norm).
        # Norm-like modules the hooks do not see count too (I-BERT's IntLayerNorm owns a quantizer, so it is no leaf).
        has_norm = any(p == name or p.startswith(name + ".") for p in tr.norm_calls) or any(
            _norm_like(m) and type(m).__name__.lower() not in ("nonorm", "identitynorm") for m in block.modules()
        )
        try:
            out = zeroed_output(block, args, kwargs)
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
        if out is None or out.shape != x.shape:
            kinds.append(None)
            continue
        kind = placement_of(out, x, has_norm, cfg)
        if kind is not None:
            kinds.append(kind)
            continue
        if not bool(torch.isfinite(out).all()):  # NaN/Inf in what zeroing cannot reach (buffers): nothing to say
            kinds.append(None)
            continue
        design = explain(name, block, args, kwargs, out, has_norm=has_norm, cfg=cfg) if explain else None
        if design is not None:
            note, kind = design
            findings.append(note)
            kinds.append(kind)
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


def block_direction(blocks, tr: Trace) -> str | None:
    """ "causal" when changing a block's input at the last position leaves its output at every earlier position
    unchanged, "bidirectional" when it does not, None when no block lets that be tried (no (B, T, d) input,
    T < 2, the block fails on the changed input, or its output is not finite: NaN weights say nothing about the
    mask). Blocks are tried in order until one answers."""
    for i, (_, block) in enumerate(blocks):
        found = _direction(block, tr.block_calls.get(i), seed=i)
        if found is not None:
            return found
    return None


def _direction(block: nn.Module, call: tuple | None, seed: int) -> str | None:
    if call is None:
        return None
    args, kwargs = call
    x = first_tensor(args) if first_tensor(args) is not None else first_tensor(kwargs)
    if x is None or not x.is_floating_point() or x.dim() != 3 or x.shape[1] < 2:
        return None
    x = finite_input(x, seed).detach().clone().requires_grad_(True)
    args, kwargs = replace_first_tensor(args, kwargs, x)
    if not all(bool(torch.isfinite(p).all()) for p in block.parameters()):
        # NaN weights turn every gradient into NaN; the mask, which is what is asked about, is not in the weights
        block = copy.deepcopy(block)
        with torch.no_grad():
            for p in block.parameters():
                p.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    # The gradient of the earlier positions' outputs with respect to the last position's input: a causal mask makes
    # it exactly zero (masked scores carry exact zeros back), while a bidirectional encoder's is merely small (a
    # layer-scaled branch over a thousand patches: 5e-6 of the whole in Qianfan-OCR's vision encoder). A forward
    # difference cannot tell them apart: float noise moved a causal decoder's outputs by 4e-8.
    try:
        with torch.enable_grad():
            out = first_tensor(block(*args, **kwargs))
            if out is None or out.shape[:2] != x.shape[:2] or not out.requires_grad:
                return None
            probe = torch.randn(out[:, :-1].shape, generator=torch.Generator().manual_seed(seed)).to(out)
            (grad,) = torch.autograd.grad((out[:, :-1] * probe).sum(), x, allow_unused=True)
    except Exception:  # noqa: BLE001 - a block that needs more than its recorded call: say nothing about it
        return None
    if grad is None or not bool(torch.isfinite(grad).all()):
        return None
    whole, last = float(grad.double().norm()), float(grad[:, -1].double().norm())
    if whole == 0.0:
        return None
    return "causal" if last <= 1e-12 * whole else "bidirectional"


def uses_deepnorm(blocks) -> bool:
    for _, block in blocks:
        for m in block.modules():
            placement = str(getattr(m, "placement", "") or getattr(m, "kind", "")).lower()
            alpha = getattr(m, "alpha", None)
            if "deep" in placement or (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and alpha > 1):
                return True
    return False
