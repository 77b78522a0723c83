"""The verdict rule of addnorm.lab.evidence: intervals that clear a threshold decide, straddling ones do not,
controls that are not clearly met give inconclusive, pooling keeps lab seeds apart; and the seed derivation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from addnorm.lab import evidence as ev
from addnorm.lab import seeds


def _u(values, lab=0, scales=None):
    return ev.units(values, list(range(lab * 1000, lab * 1000 + len(values))), lab, scales)


GT = ev.Rule(name="gap", statistic="gap", op=">", threshold=0.05)


def test_clear_effect_is_reproduced_and_its_absence_is_not():
    assert ev.judge(GT, _u([0.3, 0.4, 0.5, 0.35])).verdict == "reproduced"
    assert ev.judge(GT, _u([-0.1, 0.0, -0.05, 0.01])).verdict == "not reproduced"


def test_an_interval_straddling_the_threshold_is_inconclusive():
    j = ev.judge(GT, _u([-0.4, 0.6, 0.0, 0.5, -0.3]))
    assert j.verdict == "inconclusive" and j.low < 0.05 < j.high


def test_less_than_rule_mirrors_greater_than():
    lt = ev.Rule(name="r", statistic="ratio", op="<", threshold=1.0)
    assert ev.judge(lt, _u([0.2, 0.3, 0.25])).verdict == "reproduced"
    assert ev.judge(lt, _u([2.0, 3.0, 2.5])).verdict == "not reproduced"


def test_interval_is_deterministic_and_contains_the_mean():
    u = _u([0.1, 0.7, 0.3, 0.9, 0.2])
    a, b = ev.judge(GT, u), ev.judge(GT, u)
    assert (a.low, a.high) == (b.low, b.high)
    assert a.low <= a.estimate <= a.high
    assert math.isclose(a.estimate, 0.44)


def test_missing_units_make_it_inconclusive():
    j = ev.judge(GT, _u([0.5, None, float("nan")]))
    assert j.verdict == "inconclusive" and "1 of 3" in j.reason


def test_parity_with_an_absolute_margin():
    par = ev.Rule(name="d", statistic="difference", op="within", threshold=0.05)
    assert ev.judge(par, _u([0.01, -0.01, 0.0, 0.02])).verdict == "reproduced"
    assert ev.judge(par, _u([0.3, 0.4, 0.35])).verdict == "not reproduced"


def test_relative_margin_follows_the_spread_of_the_scale():
    par = ev.Rule(name="d", statistic="difference", op="within", threshold=1.0, relative=True)
    diffs = [0.02, 0.03, 0.025, 0.03]
    wide = ev.judge(par, _u(diffs, scales=[0.1, 0.3, 0.5, 0.2]))  # spread ~0.17: the differences are inside it
    narrow = ev.judge(par, _u(diffs, scales=[0.100, 0.101, 0.102, 0.100]))  # spread ~0.001: outside
    assert wide.verdict == "reproduced" and narrow.verdict == "not reproduced"
    assert narrow.margin < 0.002 < wide.margin


def test_a_control_not_clearly_met_gives_inconclusive_never_not_reproduced():
    ctrl = ev.Rule(name="post fails", statistic="excess", op=">", threshold=0.5, role="positive")
    rules = [ctrl, GT]
    absent = ev.evidence(rules, {"post fails": _u([0.1, 0.2, 0.1]), "gap": _u([-0.1, 0.0, -0.05])})
    verdict, reason, _ = ev.judge_evidence(absent)
    assert verdict == "inconclusive" and "positive control" in reason
    present = ev.evidence(rules, {"post fails": _u([1.0, 1.1, 0.9]), "gap": _u([-0.1, 0.0, -0.05])})
    assert ev.judge_evidence(present)[0] == "not reproduced"


def test_negative_control_must_be_rejected_by_the_margin():
    par = ev.Rule(name="arm", statistic="d", op="within", threshold=0.05)
    worse = ev.Rule(name="worse", statistic="d(worse)", op="outside", threshold=0.05, role="negative")
    ok = ev.evidence([worse, par], {"worse": _u([0.3, 0.4, 0.35]), "arm": _u([0.0, 0.01, -0.01])})
    assert ev.judge_evidence(ok)[0] == "reproduced"
    # a margin so wide that the known-worse arm also passes proves nothing
    blind = ev.evidence([worse, par], {"worse": _u([0.01, 0.02, 0.0]), "arm": _u([0.0, 0.01, -0.01])})
    assert ev.judge_evidence(blind)[0] == "inconclusive"


def test_all_claim_rules_must_hold():
    other = ev.Rule(name="pre", statistic="gap pre", op="<", threshold=0.05)
    e = ev.evidence([GT, other], {"gap": _u([0.3, 0.4, 0.5]), "pre": _u([0.3, 0.2, 0.4])})
    verdict, reason, judged = ev.judge_evidence(e)
    assert verdict == "not reproduced" and "gap pre" in reason and len(judged) == 2


def test_pooling_concatenates_lab_seeds_and_refuses_duplicates():
    a = ev.evidence([GT], {"gap": _u([0.3, -0.2, 0.1], lab=0)})
    b = ev.evidence([GT], {"gap": _u([0.2, 0.3, 0.25], lab=1)})
    pooled = ev.pool_evidence([a, b])
    assert len(pooled["units"]["gap"]) == 6
    assert ev.judge(GT, pooled["units"]["gap"]).per_lab_seed.keys() == {"0", "1"}
    with pytest.raises(ValueError, match="two runs"):
        ev.pool_evidence([a, a])
    changed = ev.evidence([ev.Rule(name="gap", statistic="gap", op=">", threshold=0.1)], {"gap": b["units"]["gap"]})
    with pytest.raises(ValueError, match="different rules"):
        ev.pool_evidence([a, changed])


def test_pooling_can_settle_what_one_run_cannot():
    # each run alone straddles the threshold; nine units together clear it
    runs = [
        ev.evidence([GT], {"gap": _u(v, lab=k)})
        for k, v in enumerate([[0.3, 0.0, 0.2], [0.25, 0.05, 0.3], [0.2, 0.1, 0.3]])
    ]
    assert ev.judge_evidence(runs[0])[0] == "inconclusive"
    assert ev.judge_evidence(ev.pool_evidence(runs))[0] == "reproduced"


def test_bad_rules_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="op"):
        ev.Rule(name="x", statistic="s", op=">=", threshold=0)
    with pytest.raises(ValueError, match="margin"):
        ev.Rule(name="x", statistic="s", op="within", threshold=0)
    with pytest.raises(ValueError, match="relative"):
        ev.Rule(name="x", statistic="s", op=">", threshold=0, relative=True)
    with pytest.raises(ValueError, match="no units"):
        ev.evidence([GT], {})


def test_model_seeds_are_disjoint_across_lab_seeds_and_keep_seed_zero():
    assert seeds.model_seeds(0, 3) == [0, 1, 2]
    sets = [set(seeds.model_seeds(s, 6)) for s in range(5)]
    assert all(not (sets[i] & sets[j]) for i in range(5) for j in range(i + 1, 5))
    assert all(seeds.lab_seed_of(m) == 3 for m in seeds.model_seeds(3, 6))
    with pytest.raises(ValueError, match="--seed"):
        seeds.model_seeds(-5, 3)
    with pytest.raises(ValueError, match="stream"):
        seeds.sub_seed(0, "nope")
    assert len({seeds.sub_seed(5, s) for s in seeds.STREAMS}) == len(seeds.STREAMS)


def test_pooled_interval_carries_the_spread_between_lab_seeds():
    """Lab seeds that disagree (each tight within itself) widen the pooled interval: resampling units only within
    each lab seed would give about +-0.003 around 0 here and call 'mean > -0.05' reproduced."""
    from addnorm.lab.evidence import bootstrap_interval

    values, strata = [], []
    for lab_seed, centre in enumerate((-0.2, 0.0, 0.2)):
        values += [centre - 0.005, centre, centre + 0.005]
        strata += [lab_seed] * 3
    low, high = bootstrap_interval(values, strata)
    assert low < -0.1 and high > 0.1
    rule = ev.Rule(name="r", role="claim", statistic="s", op=">", threshold=-0.05)
    unit_list = [{"lab_seed": s, "seed": i, "value": v} for i, (v, s) in enumerate(zip(values, strata))]
    assert ev.judge(rule, unit_list).verdict == "inconclusive"


def test_one_lab_seed_is_the_plain_bootstrap_of_its_units():
    from addnorm.lab.evidence import BOOTSTRAP, _generator, bootstrap_interval

    values = [0.3, 0.1, 0.4, 0.15, 0.9]
    rng = _generator(np.asarray(values), np.zeros(5, dtype=int))
    means = np.asarray(values)[rng.integers(0, 5, size=(BOOTSTRAP, 5))].mean(axis=1)
    assert bootstrap_interval(values, [0] * 5) == (float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975)))
