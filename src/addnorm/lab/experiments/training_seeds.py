"""What the two fault experiments of the seeds' advice (:mod:`training_seeds_faults`: localizing a planted
divergence, fp16 statistics) share: their criteria and controls, the registration and the tolerance of a harmed
run. The seeds' other two claims (norm hyperparameters, Post-to-Pre fine-tuning) are in :mod:`seed_advice_claims`.
"""

from __future__ import annotations

from addnorm.lab.experiments.seeds_tasks import FP16_MAX
from addnorm.lab.experiments.training_setup import (
    TRAINED_EXCESS,
    finite,
    registrar,
)

# A difference of excess losses counts (a "harmed") beyond max(0.05 nats, 10% of the baseline's).
TOL_ABS, TOL_REL = 0.05, 0.10
# localize-divergence: the share of faulted runs the first jump must name correctly; the harm a planted fault must
# do (late training loss above the clean run's of the same seed) for there to be a divergence to localize.
LOCALIZE_RATE = 0.8
FAULT_HARM = 0.1

CRITERIA = {
    "localize-divergence": (
        "Per run, addnorm.diagnostics.localize_jump with its defaults (a jump: > 3x the median of that layer's last "
        "8 values, at least 3 seen) over every block's residual-stream RMS, recorded at every step. A faulted run "
        "is localized iff the first jump is in the faulted block and at or after the fault's step. Reproduced iff "
        f"at least {LOCALIZE_RATE:.0%} of the faulted runs (every faulted block at every seed) are localized, and "
        "no jump is flagged in the clean run at a strict majority of the seeds. Chance (1 / layers) and a naive "
        "rule (the block with the largest RMS at the end) are shown, not tested."
    ),
    "fp16-layernorm": (
        "Per seed (paired), three runs differing only in the LayerNorms' statistics: fp16 sums (naive), fp32 "
        "statistics, and the seed's clamp before fp16 statistics. A run is harmed iff its loss goes non-finite, "
        f"it diverges, or its excess loss exceeds the fp32 run's by more than max({TOL_ABS} nats, {TOL_REL:.0%} of "
        "the fp32 run's). Reproduced iff, at a strict majority of the seeds (at least 2), the fp16-statistics run "
        "is harmed and the clamp run is not. The overflow count (steps x norms whose fp16 sum of squares "
        "overflowed) is shown for every arm."
    ),
}
PRECONDITIONS = {
    "localize-divergence": (
        f"The planted fault harms the run: its mean training loss over the last 10% of steps exceeds the clean run's "
        f"of the same seed by > {FAULT_HARM:g} nats, in a strict majority of the faulted runs (else there is no "
        "divergence to localize)."
    ),
    "fp16-layernorm": (
        f"The regime where fp16 statistics can overflow is reached: in the fp32-statistics run a norm input's "
        f"per-token sum of squared deviations exceeds {FP16_MAX:.0f} (the largest fp16 number), and that run trains "
        f"(excess < {TRAINED_EXCESS} nats), each at a strict majority of the seeds."
    ),
}

register = registrar(CRITERIA, PRECONDITIONS, version=1)


def beyond(a: float | None, b: float | None) -> bool | None:
    """a > b + max(TOL_ABS, TOL_REL * |b|) (None when either is not finite)."""
    if not (finite(a) and finite(b)):
        return None
    return a > b + max(TOL_ABS, TOL_REL * abs(b))
