"""What the ReZero and Mix-LN experiments (:mod:`training_residuals`) share with the norm-choice experiments: their
criteria and controls, the registration, and the old fixed parity tolerance they still use. Peri-LN and DyT, once
here, are in :mod:`peri_ln` and :mod:`dyt`.
"""

from __future__ import annotations

from addnorm.lab.experiments.training_setup import (
    TRAINED_EXCESS,
    finite,
    registrar,
)

# "At least as well" / "parity": the same tolerance as ln-vs-rms-training (max of 0.05 nats and 10% of the baseline).
PARITY_ABS, PARITY_REL = 0.05, 0.10
# Mix-LN: Pre-LN's per-layer gradient profile counts as non-uniform (the positive control) above this coefficient
# of variation across layers (a profile whose layers differ by about +-20% around their mean).
NONUNIFORM = 0.2

CRITERIA = {
    "rezero": (
        f"Per seed: the unnormalized residual stack x + F(x) fails (excess >= {TRAINED_EXCESS} nats or diverged) while "
        f"ReZero trains (excess < {TRAINED_EXCESS} nats), and ReZero converges faster than Pre-LN: its mean training "
        "loss over the first half of the run is lower than Pre-LN's (paired by seed). Reproduced iff both hold at a "
        "strict majority of the seeds (at least 2)."
    ),
    "mix-ln-training": (
        "Per seed, u(p) = the coefficient of variation (std / mean) across layers of each layer's gradient norm, "
        "averaged over the training steps the monitor recorded (step 0 left out): 0 for a perfectly uniform profile. "
        "Reproduced iff, at a strict majority of the seeds (at least 2), u(Mix-LN) < u(Pre-LN) and excess(Mix-LN) <= "
        f"excess(Pre-LN) + max({PARITY_ABS} nats, {PARITY_REL:.0%} of Pre-LN's), paired by seed."
    ),
}
PRECONDITIONS = {
    "rezero": (
        f"Pre-LN trains (excess < {TRAINED_EXCESS} nats) at a strict majority of the seeds: otherwise the LR or the "
        "depth is too hard for any placement and no comparison with it says anything."
    ),
    "mix-ln-training": (
        f"Pre-LN trains (excess < {TRAINED_EXCESS} nats) and its gradient profile is not uniform (u > {NONUNIFORM:g}), "
        "each at a strict majority of the seeds: otherwise there is nothing for Mix-LN to make more uniform."
    ),
}


register = registrar(CRITERIA, PRECONDITIONS, version=1)


def parity(a: float | None, baseline: float | None) -> bool | None:
    """|a - baseline| within the parity tolerance (None when either is not finite)."""
    if not (finite(a) and finite(baseline)):
        return None
    return abs(a - baseline) < max(PARITY_ABS, PARITY_REL * abs(baseline))
