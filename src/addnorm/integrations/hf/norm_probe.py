"""What a norm module computes, found by running it (names lie): LayerNorm or RMSNorm, eps, ``1 + weight``, bias,
and which addnorm module reproduces it bit for bit.

A module is a candidate when it is a leaf whose parameters are one or two vectors of one width (weight, bias) or
none. :func:`probe` runs a float64-free copy of it on random rows and compares with the formulas:

    layernorm   y = (x - mean) / sqrt(var + eps) * w + b
    rmsnorm     y = x / sqrt(mean(x^2) + eps) * w          (w replaced by 1 + w when zero-centred)

eps is the module's own attribute when it has one, else read off its output: rows of +-c have mean 0 and variance
c^2 for both formulas, so with w = 1 the output is c / sqrt(c^2 + eps), and eps = c^2 (1 / y^2 - 1).

The match with an addnorm module is exact, not approximate: fp32 within 1e-6 of the output's scale, and bf16 equal
in all but the rare element where an fp32 rsqrt differs in its last bit. The bf16 run tells the cast orders apart:
Llama rounds the normalized value to bf16 before the weight (``cast_before_weight``), LayerNorm/Gemma round once.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["NormInfo", "probe", "is_candidate", "make_addnorm", "randomize_norms"]

_EPS_ATTRS = ("variance_epsilon", "eps", "epsilon", "layer_norm_eps", "rms_norm_eps")


@dataclass(frozen=True, kw_only=True)
class NormInfo:
    """What a norm module computes. ``addnorm`` names the addnorm module that reproduces it exactly, or None."""

    kind: str  # "layernorm" | "rmsnorm" | the class name when it is neither
    eps: float | None
    zero_centered_weight: bool
    weight: bool
    bias: bool
    width: int | None  # None: a parameter-free norm of whatever last dim it gets
    # "layernorm" | "layernorm-one-plus-weight" | "rmsnorm" | "rmsnorm-cast-before-weight" | "rmsnorm-zero-centered"
    # | "rmsnorm-any-width"
    addnorm: str | None


def _vectors(m: nn.Module) -> dict[str, Tensor] | None:
    params = dict(m.named_parameters(recurse=False))
    if any(p.dim() != 1 for p in params.values()) or len({p.shape for p in params.values()}) > 1:
        return None
    if set(params) - {"weight", "bias"}:
        return None
    return params


def _width(m: nn.Module) -> int | None:
    params = _vectors(m)
    if params:
        return next(iter(params.values())).shape[0]
    shape = getattr(m, "normalized_shape", None)
    if isinstance(shape, (tuple, list, torch.Size)) and len(shape) == 1:
        return int(shape[0])
    if isinstance(shape, int):
        return shape
    return None


# the width a parameter-free module without normalized_shape is probed at (it must normalize any width alike)
_ANY_WIDTH = 48


def is_candidate(m: nn.Module) -> bool:
    """A leaf module with one or two same-width vector parameters (weight, bias), or none (a normalized_shape gives
    its width; without one it is probed at a width of its own choosing and must work at any)."""
    return next(m.children(), None) is None and _vectors(m) is not None


def _attr_eps(m: nn.Module) -> float | None:
    for name in _EPS_ATTRS:
        v = getattr(m, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1:
            return float(v)
    return None


def _run(m: nn.Module, x: Tensor) -> Tensor | None:
    with torch.no_grad():
        y = m(x)
    y = y[0] if isinstance(y, (tuple, list)) else y
    return y if isinstance(y, Tensor) and y.shape == x.shape else None


def _measured_eps(unit: nn.Module, n: int) -> float | None:
    """eps from the output on rows of +-c (mean 0, variance c^2) with the gain reset to 1 (see the docstring)."""
    sign = torch.tensor([1.0, -1.0]).repeat((n + 1) // 2)[:n]
    if n % 2:  # an odd width: mean c/n, not 0; the LayerNorm/RMS estimate is off by O(1/n^2), good enough to round
        sign[-1] = 0.0
    for c in (1e-3, 1.0, 30.0):
        y = _run(unit, (sign * c).reshape(1, n))
        if y is None:
            return None
        ref = y[0, 0].double().item()
        if 0.02 < abs(ref) < 1 - 1e-6:
            var = c * c * (n - (n % 2)) / n
            est = var * (1 / (ref * ref) - 1)
            return float(f"{est:.2g}")
        if abs(ref) >= 1 - 1e-6 and c == 1e-3:
            return 0.0  # eps far below 1e-12: indistinguishable from 0 in fp32
    return None


def _set_gain(unit: nn.Module, zero_centered: bool) -> None:
    with torch.no_grad():
        for name, p in unit.named_parameters(recurse=False):
            p.fill_(0.0 if (name == "bias" or zero_centered) else 1.0)


def _formula(x: Tensor, kind: str, eps: float, w: Tensor | None, b: Tensor | None, zc: bool) -> Tensor:
    x = x.double()
    if kind == "layernorm":
        x = x - x.mean(-1, keepdim=True)
    y = x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    if w is not None:
        y = y * ((1 + w.double()) if zc else w.double())
    if b is not None:
        y = y + b.double()
    return y


def make_addnorm(m: nn.Module, info: NormInfo, device="meta") -> nn.Module:
    """The addnorm module that reproduces ``m`` (per ``info.addnorm``), holding ``m``'s very Parameters."""
    from addnorm.integrations.hf.norms import (
        AnyWidthRMSNorm,
        CastBeforeWeightRMSNorm,
        HFRMSNorm,
        OnePlusWeightLayerNorm,
    )
    from addnorm.nn.norms import LayerNorm

    n, eps = info.width, info.eps
    if info.addnorm == "rmsnorm-any-width":
        return AnyWidthRMSNorm(eps=eps, device=device)
    if info.addnorm == "layernorm":
        new = LayerNorm(n, eps=eps, elementwise_affine=info.weight, bias=info.bias, device=device)
    elif info.addnorm == "layernorm-one-plus-weight":
        new = OnePlusWeightLayerNorm(n, eps=eps, elementwise_affine=info.weight, bias=info.bias, device=device)
    elif info.addnorm == "rmsnorm-cast-before-weight":
        new = CastBeforeWeightRMSNorm(n, eps=eps, device=device)
    elif info.addnorm in ("rmsnorm", "rmsnorm-zero-centered"):
        new = HFRMSNorm(
            n,
            eps=eps,
            elementwise_affine=info.weight,
            device=device,
            zero_centered_weight=info.addnorm == "rmsnorm-zero-centered",
        )
    else:
        raise ValueError(f"no addnorm module reproduces {type(m).__name__}")
    for name in ("weight", "bias"):
        if hasattr(new, name) or hasattr(m, name):
            setattr(new, name, getattr(m, name, None))
    return new


def _exact(m: nn.Module, info: NormInfo, x: Tensor) -> bool:
    """Whether the addnorm module of ``info`` matches ``m`` (fp32 within 1e-6, bf16 equal but for rare last-bit
    differences of an fp32 rsqrt)."""
    try:
        new = make_addnorm(m, info, device="cpu")
        for dtype in (torch.float32, torch.bfloat16):
            a, b = copy.deepcopy(m).to(dtype), copy.deepcopy(new).to(dtype)
            xd = x.to(dtype)
            ya, yb = _run(a, xd), _run(b, xd)
            if ya is None or yb is None or ya.dtype != yb.dtype:
                return False
            scale = ya.abs().max().item()
            if dtype == torch.float32 and (ya - yb).abs().max().item() > 1e-6 * scale:
                return False
            if dtype == torch.bfloat16 and (
                (ya != yb).float().mean().item() > 0.01 or (ya - yb).abs().max().item() > 2**-7 * scale
            ):
                return False
        return True
    except Exception:  # noqa: BLE001 - a module that does not run like a norm is not reproduced
        return False


_CACHE: dict[tuple, NormInfo | None] = {}


def probe(m: nn.Module) -> NormInfo | None:
    """What ``m`` computes (see the module docstring), or None if it is not a per-row norm over its last dim."""
    if not is_candidate(m):
        return None
    params = _vectors(m)
    n = _width(m)  # None: no parameter and no normalized_shape, a norm of any width (nanochat's RMSNorm)
    # instances of one class may compute different things (ConvNeXt's LayerNorm: data_format channels_last or
    # channels_first), so the key holds the instance's plain attributes, not only its class
    plain = tuple(sorted((k, v) for k, v in vars(m).items() if isinstance(v, (bool, int, float, str, tuple))))
    key = (type(m), n, tuple(sorted(params)), plain, params.get("weight", torch.empty(0)).dtype)
    if key in _CACHE:
        return _CACHE[key]
    info = None
    try:
        info = _probe(m, params, n) if n is not None else _probe_any_width(m)
    except Exception:  # noqa: BLE001 - the module is not a norm we can run alone
        info = None
    _CACHE[key] = info
    return info


def _probe(m: nn.Module, params: dict, n: int) -> NormInfo | None:
    # probed on CPU whatever the model's device (a copy of one vector or two): the probe's inputs are CPU tensors,
    # and a model already on a GPU (the usual case for hf.apply) must be recognized all the same
    unit = copy.deepcopy(m).float().eval().to("cpu")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, n, generator=g) * 2 + 0.5  # an offset tells mean subtraction apart
    # random gains (HF initialises them to 1 or 0, which would hide where and how the weight is applied)
    with torch.no_grad():
        for name, p in unit.named_parameters(recurse=False):
            p.copy_(0.3 * torch.randn(p.shape, generator=g) + (0.0 if name == "bias" else 1.0))
    y = _run(unit, x)
    if y is None:
        return None
    w, b = params.get("weight") is not None, params.get("bias") is not None
    wt = unit.weight.detach() if w else None
    bt = unit.bias.detach() if b else None
    for zc in (False, True) if w else (False,):
        gain = copy.deepcopy(unit)
        _set_gain(gain, zc)
        eps = _attr_eps(m)
        if eps is None:
            eps = _measured_eps(gain, n)
        if eps is None:
            continue
        for kind in ("layernorm", "rmsnorm"):
            ref = _formula(x, kind, eps, wt, bt, zc)
            if (y.double() - ref).abs().max().item() <= 1e-4 * ref.abs().max().item():
                draft = NormInfo(kind=kind, eps=eps, zero_centered_weight=zc, weight=w, bias=b, width=n, addnorm=None)
                return _with_addnorm(unit, draft, x)
    return None


def _probe_any_width(m: nn.Module) -> NormInfo | None:
    """A parameter-free module with no width of its own: probed at two widths, it must compute the same norm at
    both (an RMSNorm over whatever last dim it gets); ``width`` None and only the any-width RMSNorm reproduces it."""
    found = [_probe(m, {}, n) for n in (_ANY_WIDTH, _ANY_WIDTH + 7)]
    if None in found:
        return None
    infos = {NormInfo(**{**i.__dict__, "width": None, "addnorm": None}) for i in found}
    if len(infos) != 1:
        return None
    info = infos.pop()
    if info.kind != "rmsnorm":
        return info  # (a weightless LayerNorm of any width: none of addnorm's modules is width-free but this one)
    x = torch.randn(3, 5, _ANY_WIDTH + 3, generator=torch.Generator().manual_seed(1)) * 2 + 0.5
    candidate = NormInfo(**{**info.__dict__, "addnorm": "rmsnorm-any-width"})
    return candidate if _exact(copy.deepcopy(m).float().eval().to("cpu"), candidate, x) else info


def _with_addnorm(unit: nn.Module, info: NormInfo, x: Tensor) -> NormInfo:
    """``info`` with the addnorm module that matches ``unit`` (the fp32 copy with random gains) exactly, if any."""
    if info.kind == "layernorm":
        options = ["layernorm"] if not info.zero_centered_weight else ["layernorm-one-plus-weight"]
    elif info.zero_centered_weight:
        options = [] if info.bias else ["rmsnorm-zero-centered"]
    else:
        options = [] if info.bias else (["rmsnorm-cast-before-weight", "rmsnorm"] if info.weight else ["rmsnorm"])
    for option in options:
        candidate = NormInfo(**{**info.__dict__, "addnorm": option})
        if _exact(unit, candidate, x):
            return candidate
    return info


def randomize_norms(model: nn.Module, seed: int = 1) -> None:
    """Random gains and biases, in place, for every module :func:`probe` recognises (gains around 1, or around 0
    where the norm scales by 1 + weight). Models start with gains of 1 and biases of 0, which hide a weight applied
    in the wrong place or order: checks that compare a patched model with the original randomise them first."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            info = probe(m) if is_candidate(m) else None
            if info is None:
                continue
            for name, p in m.named_parameters(recurse=False):
                centre = 0.0 if (name == "bias" or info.zero_centered_weight) else 1.0
                p.copy_(centre + 0.3 * torch.randn(p.shape, generator=g).to(p.device, p.dtype))
