"""Every seed the lab uses, derived in one place from the run's ``--seed`` (the *lab seed*).

A lab seed S owns the model seeds ``S * STRIDE + k`` (k < STRIDE): model initialisations, batch orders and init
draws of different lab seeds never overlap, so pooling the runs of lab seeds 0, 1, 2 pools 9 distinct models, not
5 (the old ``S + k`` shared S+1 and S+2 between neighbouring lab seeds). Lab seed 0 keeps the model seeds 0, 1, 2
it always had, so its recorded numbers stay comparable.

The language a run trains on is the lab seed's own (``language_seed``). Streams derived from one model seed
(a second language for fine-tuning, a generator for a random table, the fine-tuning run's batches) add a fixed
offset per stream (``sub_seed``), so no two streams of one model seed coincide.
"""

from __future__ import annotations

__all__ = ["STRIDE", "model_seeds", "language_seed", "sub_seed", "lab_seed_of"]

# Model seeds per lab seed: far more than any experiment trains (at most a few dozen runs per arm).
STRIDE = 1000
# Offsets of the streams derived from one model seed; primes, so sums of two never meet a third.
STREAMS = {"finetune": 1, "fresh-language": 7919, "table": 104729}


def _check(lab_seed: int) -> int:
    if isinstance(lab_seed, bool) or not isinstance(lab_seed, int) or not 0 <= lab_seed < 2**32:
        raise ValueError(f"the lab seed (--seed) must be an integer in [0, 2**32), got {lab_seed!r}")
    return lab_seed


def model_seeds(lab_seed: int, n: int) -> list[int]:
    """The ``n`` model seeds (inits, batch orders) of lab seed ``lab_seed``: disjoint across lab seeds."""
    _check(lab_seed)
    if not 0 <= n <= STRIDE:
        raise ValueError(f"n (model seeds per lab seed) must be in [0, {STRIDE}], got {n!r}")
    return [lab_seed * STRIDE + k for k in range(n)]


def lab_seed_of(model_seed: int) -> int:
    """The lab seed that owns ``model_seed``."""
    return model_seed // STRIDE


def language_seed(lab_seed: int) -> int:
    """The seed of the synthetic language a run at ``lab_seed`` trains and validates on."""
    return _check(lab_seed)


def sub_seed(model_seed: int, stream: str) -> int:
    """A seed for ``stream`` (one of STREAMS) derived from ``model_seed``."""
    if stream not in STREAMS:
        raise ValueError(f"stream must be one of {sorted(STREAMS)}, got {stream!r}")
    return model_seed + STREAMS[stream]
