"""Deliberate designs whose skip path is not ``x`` (or ``Norm(x)``) once the branches are zeroed, recognised and
explained by a note rather than reported as ``residual-not-identity`` errors.

The skip-path check zeroes every branch parameter of a copy of the block and asks whether it then returns its
input. Released architectures fail it on purpose in a few recognisable ways, each tested here on the zeroed copy
itself, not guessed from names where a measurement can tell:

- hyper-connections (DeepSeek-V4's mHC): the block carries N residual streams, (B, T, N, d), and mixes them with a
  doubly-stochastic matrix; the zeroed block preserves the streams' sum instead of each stream;
- learnable skip gates (Doge's ``input_residual``, Zaya's residual scaling): vector parameters on the skip path,
  initialised to 1; with them kept (branches still zeroed) the block is the identity or a per-channel scale;
- no skip path inside the repeated module, by design: the zeroed module's output does not depend on its input.
  That is a plain convolutional stack (MobileNet-V1, FastSpeech2's variance predictors), a list of branches whose
  residual the parent adds (XLM and FlauBERT keep ``attentions``, ``ffns`` and the norms in parallel lists), or a
  block that hands its residual to another input (Inkling2's block-attention residuals: ``block_states``);
- parameter-free token mixing (FNet's Fourier transform): no weight to zero, so that branch cannot be switched
  off and the check cannot run.

A skip path scaled by a constant, projected by a matrix, or dropped in a block with a norm and a single stream
input (the seeds' bug) is none of these and stays an error.
"""

from __future__ import annotations

from torch import Tensor, nn

from addnorm.diagnostics.blocks import first_tensor
from addnorm.diagnostics.doctor.block_checks import placement_of, zeroed_output
from addnorm.diagnostics.doctor.example_run import replace_first_tensor
from addnorm.diagnostics.doctor.findings import DoctorConfig, Finding

__all__ = ["explain"]

_NONE_NEEDED = "none needed; a deliberate design, not a broken skip path"


def _note(name: str, message: str) -> Finding:
    return Finding(code="skip-path-design", severity="info", module=name, message=message, fix=_NONE_NEEDED)


def _rel(a: Tensor, b: Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _has(block: nn.Module, cls) -> bool:
    return any(isinstance(m, cls) for m in block.modules())


def explain(
    name: str, block: nn.Module, args: tuple, kwargs: dict, out: Tensor, *, has_norm: bool, cfg: DoctorConfig
) -> tuple[Finding, str] | None:
    """(a note, the block's kind for the summary) when the zeroed block's ``out`` is a recognised design, else
    None. ``args``/``kwargs`` are the block's call with the input ``x`` the check used."""
    x = first_tensor(args) if first_tensor(args) is not None else first_tensor(kwargs)
    conv = _has(block, nn.modules.conv._ConvNd)

    if x.dim() == 4 and not conv and 2 <= x.shape[-2] <= 16 and _rel(out.sum(-2), x.sum(-2)) < cfg.identity_rtol:
        return _note(
            name,
            f"the block carries {x.shape[-2]} residual streams (input {tuple(x.shape)}) and, with its branches "
            "zeroed, mixes them while keeping their sum: hyper-connections (DeepSeek-V4's mHC), whose "
            "doubly-stochastic stream mixing replaces the identity skip",
        ), "design"

    try:
        kept = zeroed_output(block, args, kwargs, keep_skip_params=True)
    except Exception:  # noqa: BLE001 - the first zeroed run worked; this one is only an explanation attempt
        kept = None
    if kept is not None and kept.shape == x.shape:
        kind = placement_of(kept, x, has_norm, cfg)
        names = _skip_param_names(block)
        if kind is not None and names:
            return _note(
                name,
                f"the skip path runs through learnable per-channel parameters ({', '.join(names[:4])}): zeroing "
                f"them breaks it, while with them kept and the branches zeroed the block is "
                f"{'Norm(x)' if kind == 'post' else 'x'} (learnable skip gates, as Doge and Zaya use)",
            ), kind

    try:  # does the zeroed block's output depend on its input at all?
        other = zeroed_output(block, *replace_first_tensor(args, kwargs, x * -1.5 + 0.25))
    except Exception:  # noqa: BLE001
        other = None
    if other is not None and other.shape == out.shape and _rel(other, out) < cfg.identity_rtol:
        streams = [
            a
            for a in (*args, *kwargs.values())
            if isinstance(a, Tensor) and a is not x and a.is_floating_point() and a.shape[-1:] == x.shape[-1:]
        ]
        if streams and x.dim() == 3:
            return _note(
                name,
                "the block hands its residual to another input (a tensor of the stream's width, shape "
                f"{tuple(streams[0].shape)}): block-level residuals over stored layer outputs, as Inkling2's "
                "block attention residuals; the skip path of x alone is not the identity by design",
            ), "design"
        if conv or x.dim() == 4:
            return _note(
                name,
                "convolutional layers with no skip path (a plain convolution stack, as MobileNet-V1 or "
                "FastSpeech2's variance predictors): the skip-path check is for residual blocks",
            ), "design"
        if not has_norm:
            return _note(
                name,
                "these repeated modules are branches with no skip path inside: with their weights zeroed they "
                "return a constant, and the parent adds the residual around them (XLM and FlauBERT keep attention, "
                "FFN and norms in parallel lists); the skip path was not checked",
            ), "design"

    mixers = sorted({type(m).__name__ for m in block.modules() if "fourier" in type(m).__name__.lower()})
    if mixers:
        return _note(
            name,
            f"token mixing without weights ({', '.join(mixers)}, as FNet's Fourier transform): zeroing cannot "
            "switch that branch off, so the skip-path check cannot run on this block",
        ), "design"
    return None


def _skip_param_names(block: nn.Module) -> list[str]:
    """The vector parameters that may scale the skip path: the block's own, and those of submodules that hold no
    weight matrix anywhere (a residual-scaling module, not an attention or MLP with a bias)."""
    names = []
    for mname, m in block.named_modules():
        if m is not block and (any(p.dim() >= 2 for p in m.parameters()) or "norm" in type(m).__name__.lower()):
            continue
        names += [f"{mname + '.' if mname else ''}{p}" for p, v in m.named_parameters(recurse=False) if v.dim() <= 1]
    return names
