"""The residual placements: where a sublayer's norm stands relative to its residual add. Each is defined here once,
by its parts, and its forward is written once, in :func:`residual_forward`, for :class:`addnorm.nn.Residual` and
for the batched trainer (:mod:`addnorm.train.stacked`, which runs the same forward on stacked members).

For a sublayer F (dropout applies to the branch just before the residual add, i.e. to F's output, after Norm_out
for sandwich):

    "post"          Norm(x + F(x))                      original Transformer, BERT (one fused add+norm)
    "pre"           x + F(Norm(x))                      GPT-2 onwards
    "deepnorm"      Norm(alpha * x + F(x))              DeepNet (Wang et al. 2022); alpha > 1 from the depth
    "sandwich"      x + Norm_out(F(Norm_in(x)))         Sandwich-LN / Peri-LN
    "none"          x + F(x)                            no norm at all
    "rezero"        x + a * F(x), a a learned scalar    ReZero (Bachlechner et al. 2020): a = 0 at init, no norm
    "branch-output" x + Norm(F(x))                      the norm on the branch's output only (OLMo 2's "reordered")
    "post-noskip"   Norm(F(x))                          lab only: no residual path
    "pre-noskip"    F(Norm(x))                          lab only: no residual path

Mix-LN (Post-LN in the first layers, Pre-LN after) is a property of the stack, not a placement: see
:meth:`addnorm.nn.TransformerConfig.layer_placement`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

__all__ = ["PLACEMENTS", "Placement", "branch_forward", "residual_forward"]


@dataclass(frozen=True)
class Placement:
    """What a placement is made of. Everything else (which norms a Residual holds, which placements fuse with their
    neighbours, which want a final norm) follows from these."""

    name: str
    norm_in: bool = False  # F reads Norm(x)
    norm_out: bool = False  # a norm on F's output, before the add
    gate: bool = False  # a learned scalar on F's output, 0 at init
    skip: bool = True  # the stream x is added back
    scaled_skip: bool = False  # alpha * x is added back instead of x
    norm_after: bool = False  # a norm after the add (or on F's output, without a skip)

    @property
    def norm(self) -> bool:
        """Whether it holds the placement's main norm (``Residual.norm``: Norm_in, or the norm after the add)."""
        return self.norm_in or self.norm_after

    @property
    def ends_with_add(self) -> bool:
        """The output is ``x + branch`` with nothing after the add: the add can fuse with the next norm."""
        return self.skip and not self.norm_after

    @property
    def starts_with_norm(self) -> bool:
        """The branch reads ``Norm(x)`` and the output is ``x + branch``: that norm can fuse with a preceding add."""
        return self.norm_in and self.ends_with_add

    @property
    def wants_final_norm(self) -> bool:
        """A stack of it leaves the stream unnormalized although it has norms: it wants a final norm by default."""
        return (self.norm_in or self.norm_out) and not self.norm_after

    @classmethod
    def named(cls, name: str) -> Placement:
        """The placement called ``name`` (one of :data:`PLACEMENTS`); a ValueError naming the choices otherwise."""
        if name not in _TABLE:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}; got {name!r}")
        return _TABLE[name]


_TABLE: dict[str, Placement] = {
    p.name: p
    for p in (
        Placement("post", norm_after=True),
        Placement("pre", norm_in=True),
        Placement("deepnorm", scaled_skip=True, norm_after=True),
        Placement("sandwich", norm_in=True, norm_out=True),
        Placement("none"),
        Placement("post-noskip", skip=False, norm_after=True),
        Placement("pre-noskip", norm_in=True, skip=False),
        Placement("rezero", gate=True),
        Placement("branch-output", norm_out=True),
    )
}

PLACEMENTS: tuple[str, ...] = tuple(_TABLE)


def branch_forward(
    p: Placement, f: Callable[[Tensor], Tensor], h: Tensor, norm_out: Callable[[Tensor], Tensor] | None, gate
) -> Tensor:
    """What placement ``p`` adds to the stream, from the branch input ``h``: ``f(h)``, then ``norm_out`` (sandwich,
    branch-output), then times the learned scalar ``gate`` (rezero). Dropout, if any, is the caller's, after this."""
    y = f(h)
    if p.norm_out:
        y = norm_out(y)
    if p.gate:
        y = gate * y
    return y


def residual_forward(
    p: Placement,
    x: Tensor,
    branch: Callable[[Tensor], Tensor],
    norm: Callable[[Tensor], Tensor],
    add_norm: Callable[[Tensor, Tensor], Tensor],
    alpha: float | None = None,
    add_branch: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> Tensor:
    """One residual step of placement ``p`` on the stream ``x``, given its pieces as the caller holds them:

    branch(h)        what is added to the stream (:func:`branch_forward`, and dropout)
    norm(h)          the placement's norm (Norm_in for sandwich)
    add_norm(y, r)   norm(y + r): one fused add+norm call where the norm can make one
    alpha            deepnorm's scale on the skip path
    add_branch(x, h) x + branch(h) as the caller computes it, for the placements that end with the add (sandwich
                     and branch-output make ``x + Norm_out(F(h))`` one norm-then-add call); None: ``x + branch(h)``
    """
    h = norm(x) if p.norm_in else x
    if add_branch is not None and p.ends_with_add:
        return add_branch(x, h)
    y = branch(h)
    if not p.skip:
        return norm(y) if p.norm_after else y
    r = alpha * x if p.scaled_skip else x
    return add_norm(y, r) if p.norm_after else r + y
