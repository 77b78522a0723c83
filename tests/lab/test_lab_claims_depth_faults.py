"""rezero, mix-ln-training, layernorm-scaling, branch-scaling, localize-divergence and fp16-layernorm as evidence:
their pre-registered rules judge synthetic per-seed numbers; each positive control refuses a planted null (an arm
with no effect, a regime without the phenomenon) with *inconclusive*, and each claim rule can come out *not
reproduced*; their measurement helpers; one tiny run of each through ctx.map with JSON tasks and evidence."""

from __future__ import annotations

import json
import math

import pytest

from addnorm.lab.core import EXPERIMENTS, Context, serial_map
from addnorm.lab.evidence import Rule, judge_evidence
from addnorm.lab.experiments import branch_scaling as B
from addnorm.lab.experiments import divergence as V
from addnorm.lab.experiments import fp16_stats as P
from addnorm.lab.experiments import layernorm_scaling as L
from addnorm.lab.experiments import mix_ln as M
from addnorm.lab.experiments import rezero as R
from addnorm.lab.experiments import training_setup as C
from addnorm.lab.experiments.rules_common import judge_values

SEEDS = [0, 1, 2]
NAMES = {
    "rezero": R,
    "mix-ln-training": M,
    "layernorm-scaling": L,
    "branch-scaling": B,
    "localize-divergence": V,
    "fp16-layernorm": P,
}


def test_registered_with_rules_a_positive_control_the_date_fixed_and_the_changes():
    import addnorm.lab.experiments  # noqa: F401

    for name, mod in NAMES.items():
        exp = EXPERIMENTS[name]
        assert exp.kind == "empirical" and exp.claim and exp.source and exp.criterion and exp.precondition, name
        assert exp.rules == mod.RULES and all(isinstance(r, Rule) for r in exp.rules), name
        roles = {r.role for r in exp.rules}
        assert "claim" in roles and "positive" in roles, name
        assert exp.fixed == "2026-12-02 at 8821e08" and exp.changes, name
        assert any(c.date == "2026-12-02" for c in exp.changes), name
        assert exp.config["default"]["seeds"] >= 3, name
    assert EXPERIMENTS["rezero"].suite == EXPERIMENTS["mix-ln-training"].suite == "core"
    assert {EXPERIMENTS[n].suite for n in list(NAMES)[2:]} == {"extended"}


def _verdict(judgement) -> str:
    return judgement[1]


# ---- rezero -----------------------------------------------------------------------------------------------------
def test_steps_to_target_uses_a_running_mean_and_stops_at_a_missing_loss():
    assert R.steps_to_target([3.0, 2.0, 1.0, 1.0], 1.5, window=2) == 3  # (2 + 1) / 2 <= 1.5 at the 3rd step
    assert R.steps_to_target([3.0, 1.0, 1.0], 1.0, window=1) == 2
    assert R.steps_to_target([3.0, None, 0.5, 0.5], 1.0, window=1) is None  # diverged before reaching it
    assert R.steps_to_target([3.0, 3.0], 1.0) is None
    with pytest.raises(ValueError, match="window"):
        R.steps_to_target([1.0], 1.0, window=0)


def _curve(start, end, reach_at, steps=150):
    """A training-loss curve falling linearly from ``start`` to ``end`` at step ``reach_at``, flat after."""
    return [start + (end - start) * min(t, reach_at) / reach_at for t in range(steps)]


REZERO_OK = dict(
    ex_none=[3.0, 1.2, 0.8],
    div_none=[True, False, False],
    ex_rezero=[0.2, 0.25, 0.3],
    curve_rezero=[_curve(3.5, 1.2, 40), _curve(3.5, 1.3, 50), _curve(3.5, 1.25, 45)],
    curve_pre=[_curve(3.5, 1.5, 100), _curve(3.5, 1.6, 120), _curve(3.5, 1.5, 90)],
    budget=150,
)


def _rezero(**kw):
    values, shown = R.rezero_values(**{**REZERO_OK, **kw})
    return (*judge_values(R.RULES, values, SEEDS, 0), shown)


def test_rezero_reproduced_on_a_clear_effect():
    ev, verdict, reason, shown = _rezero()
    assert verdict == "reproduced" and reason == ""
    assert shown["target"] == pytest.approx([1.5, 1.6, 1.5])
    ratios = [u["value"] for u in ev["units"]["ReZero is faster"]]
    assert all(0.2 < r < 0.6 for r in ratios) and shown["Pre-LN steps"][0] > 100


def test_rezero_planted_null_x_plus_f_trains_here_is_inconclusive():
    # the regime has no failure of x + F(x) for ReZero to fix: the control refuses it, whatever ReZero does
    _, verdict, reason, _ = _rezero(ex_none=[0.2, 0.3, 0.25], div_none=[False] * 3)
    assert verdict == "inconclusive" and "x + F(x) fails" in reason
    stuck = [_curve(3.5, 3.2, 50)] * 3  # Pre-LN does not learn: its final loss is no target
    _, verdict, reason, _ = _rezero(curve_pre=stuck)
    assert verdict == "inconclusive" and "Pre-LN learns" in reason


def test_rezero_claims_can_fail():
    same = REZERO_OK["curve_pre"]  # ReZero exactly as fast as Pre-LN: the ratio is 1, not below
    assert _rezero(curve_rezero=same)[1] == "not reproduced"
    never = [_curve(3.5, 2.5, 40)] * 3  # never reaches Pre-LN's level: counted at the run's length
    assert _rezero(curve_rezero=never)[1] == "not reproduced"
    assert _rezero(ex_rezero=[0.9, 1.0, 1.1])[1] == "not reproduced"  # ReZero does not train either
    assert R.final_level([1.0] * 5 + [2.0] * 10) == 2.0 and R.final_level([1.0, None] * 10) is None


# ---- mix-ln-training --------------------------------------------------------------------------------------------
def test_deep_share_is_the_deepest_quarter_over_the_median_layer():
    assert M.deep_share([2.0] * 8) == 1.0
    assert M.deep_share([4.0, 4.0, 2.0, 2.0, 2.0, 2.0, 1.0, 1.0]) == 0.5  # Post-LN layers do not move the median
    assert M.deep_share([1.0, 3.0]) == pytest.approx(1.5)
    assert M.deep_share([1.0, None]) is None and M.deep_share([0.0, 0.0]) is None and M.deep_share([1.0]) is None


MIX_OK = dict(share_pre=[0.5, 0.6, 0.55], share_mix=[0.9, 1.0, 0.8], ex_pre=[0.3, 0.35, 0.4], ex_mix=[0.2, 0.3, 0.3])


def _mix(**kw):
    return judge_values(M.RULES, M.mix_values(**{**MIX_OK, **kw}), SEEDS, 0)


def test_mix_ln_reproduced_on_a_clear_effect():
    assert _verdict(_mix()) == "reproduced"


def test_mix_ln_planted_null_no_deep_deficit_or_untrained_pre_ln_is_inconclusive():
    _, verdict, reason = _mix(share_pre=[1.0, 1.1, 0.95], share_mix=[1.5] * 3)  # Pre-LN's profile is flat
    assert verdict == "inconclusive" and "deep share is small" in reason
    _, verdict, reason = _mix(ex_pre=[0.8, 0.7, 0.3])
    assert verdict == "inconclusive" and "Pre-LN trains" in reason


def test_mix_ln_claims_can_fail():
    assert _verdict(_mix(share_mix=[0.5, 0.6, 0.55])) == "not reproduced"  # Mix-LN's deep layers get no more
    assert _verdict(_mix(ex_mix=[0.5, 0.6, 0.7])) == "not reproduced"  # Mix-LN's loss is higher


# ---- layernorm-scaling ------------------------------------------------------------------------------------------
def test_contributions_halves_and_stream_growth():
    assert L.contributions({"full": 1.0, "skipped": [1.5, 1.25, 1.0, 1.125]}) == [0.5, 0.25, 0.0, 0.125]
    assert L.contributions({"full": float("nan"), "skipped": [1.0]}) == []
    # block 1 (next to the embeddings) is left out: halves of blocks 2..L
    assert L.halves([3.0, 0.5, 0.25, 0.0, 0.125]) == (0.375, 0.0625)
    assert L.halves([3.0, 1.0, 2.0, 3.0]) == (1.0, 3.0)  # odd count: the middle block is in neither half
    assert L.halves([3.0, 0.1, None]) == (None, None) and L.halves([3.0, 0.1]) == (None, None)
    assert L.stream_growth({"rms_init": [1.0, 2.0], "rms_final": [3.0, 10.0]}) == 5.0
    assert L.stream_growth({"rms_init": [1.0, 0.0], "rms_final": [3.0, 10.0]}) is None and L.stream_growth(None) is None


LNS_OK = dict(
    contrib_pre=[[2.0, 0.3, 0.3, 0.3, 0.1, 0.1, 0.1, 0.1]] * 3,
    contrib_lns=[[2.0, 0.3, 0.3, 0.3, 0.05, 0.05, 0.05, 0.05]] * 3,
    growth_pre=[4.0, 5.0, 6.0],
    ex_pre=[0.2, 0.25, 0.3],
    ex_lns=[0.1, 0.15, 0.2],
    ex_shallow=[0.6, 0.7, 0.65],
)


def _lns(**kw):
    unit_map, shown = L.lns_units(**{**LNS_OK, **kw}, seeds=SEEDS, lab_seed=0)
    return (*L.lns_judgement(unit_map), shown)


def test_layernorm_scaling_reproduced_and_the_construction_bound_statistic_only_shown():
    ev, verdict, reason, shown = _lns()
    assert verdict == "reproduced"  # LNS lowers C_deep here (as 1/sqrt(l) pushes it to), which is not counted
    assert shown["C_deep(LNS) - C_deep(Pre-LN), shown"] == pytest.approx([-0.05] * 3)
    assert "C_deep(LNS) - C_deep(Pre-LN), shown" not in ev["units"]


def test_layernorm_scaling_planted_null_a_task_that_needs_no_depth_is_inconclusive():
    _, verdict, reason, _ = _lns(ex_shallow=[0.15, 0.2, 0.3])  # 2 layers do as well as 8: today's task
    assert verdict == "inconclusive" and "depth helps" in reason
    _, verdict, reason, _ = _lns(growth_pre=[1.1, 1.3, 0.9])  # no stream growth for LNS to counteract
    assert verdict == "inconclusive" and "stream grew" in reason
    _, verdict, reason, _ = _lns(contrib_pre=[[2.0, 0.01, 0.01, 0.01, 0.0, 0.0, 0.0, 0.0]] * 3)
    assert verdict == "inconclusive" and "skips resolve" in reason


def test_layernorm_scaling_claims_can_fail():
    flat = [[2.0, 0.1, 0.1, 0.1, 0.3, 0.3, 0.3, 0.3]] * 3  # Pre-LN's deep blocks contribute more
    assert _lns(contrib_pre=flat)[1] == "not reproduced"
    assert _lns(ex_lns=[0.4, 0.45, 0.5])[1] == "not reproduced"  # LNS ends worse


# ---- branch-scaling ---------------------------------------------------------------------------------------------
def _branch(div_un, div_sc):
    return judge_values(B.RULES, B.branch_values(div_un, div_sc), SEEDS, 0)


def test_branch_scaling_verdicts_and_planted_null():
    assert _verdict(_branch([True] * 3, [False] * 3)) == "reproduced"
    _, verdict, reason = _branch([False] * 3, [False] * 3)  # nothing diverges unscaled: no instability to fix
    assert verdict == "inconclusive" and "unscaled x + F(x) diverges" in reason
    assert _verdict(_branch([True] * 3, [True] * 3)) == "not reproduced"
    assert _verdict(_branch([True] * 3, [True, False, False])) == "inconclusive"  # 2 of 3: the interval straddles


def test_branch_sanity_is_the_init_identity_and_not_a_rule():
    assert B.branch_sanity([50.0, 80.0], [1.1, 1.2])["holds"] is True
    assert B.branch_sanity([50.0, 80.0], [1.1, 3.0])["holds_by_seed"] == [True, False]
    assert all("S at init" not in r.statistic and "swell" not in r.name for r in B.RULES)


def test_early_loss_counts_steps_after_a_divergence_at_the_first_loss():
    assert B.early_loss([4.0, 2.0, 2.0, 2.0], 4) == 3.0
    assert B.early_loss([4.0, 5.0, 1.0, 1.0], 4) == 4.0  # min(loss, loss_0)
    assert B.early_loss([4.0, None], 8) == 4.0  # stopped at step 1 of 8: the first half counted at 4
    assert B.early_loss([None, 1.0], 4) is None


def test_stream_probe_and_swelling():
    kw = dict(model={"n_layers": 3, "placement": "none"}, train={"steps": 2, "lr": 1e-3, "seed": 0}, lang_seed=0)
    unscaled = C.train_task(**kw, probe="addnorm.lab.experiments.branch_scaling:stream_probe")["probe"]
    kw["model"]["residual_init_scaling"] = True
    scaled = C.train_task(**kw, probe="addnorm.lab.experiments.branch_scaling:stream_probe")["probe"]
    assert len(unscaled["block_rms"]) == 3 and unscaled["embed_rms"] == pytest.approx(scaled["embed_rms"])
    assert B.swelling(unscaled) > B.swelling(scaled) > 0  # the scaled branches add less to the stream
    assert B.swelling({"embed_rms": 0.5, "block_rms": [1.0, 2.0]}) == 4.0
    assert B.swelling({"embed_rms": 0.0, "block_rms": [1.0]}) is None and B.swelling(None) is None


# ---- localize-divergence ----------------------------------------------------------------------------------------
def test_running_mean_harm_step_and_blowup_step():
    assert V.running_mean([1.0, 3.0, 5.0], window=2) == [1.0, 2.0, 4.0]
    assert V.running_mean([1.0, None, 1.0], window=1) == [1.0, None, None]
    clean = [1.0] * 30
    hurt = [1.0] * 15 + [2.5] * 15  # running mean of 10 passes clean + 0.1 at the first bad step
    assert V.harm_step(hurt, clean, 10) == 15 and V.harm_step(clean, clean, 10) is None
    assert V.harm_step([1.0] * 12 + [None], clean, 10) == 12  # stopped: harmed there
    assert V.blowup_step([3.0] * 20 + [9.0] * 20) is not None and V.blowup_step([3.0, 2.0, 1.0] * 5) is None
    assert V.blowup_step([2.0, float("nan")]) == 1


def _fault_run(rms_jump_block=None, jump_at=None, harm_at=None, steps=40, blocks=3, loss=1.0):
    rms, losses = [], []
    for t in range(steps):
        row = [1.0 + b for b in range(blocks)]
        if jump_at is not None and t >= jump_at:
            row = [v * (10.0 if b >= rms_jump_block else 1.0) for b, v in enumerate(row)]
        rms.append(row)
        losses.append(loss + (1.0 if harm_at is not None and t >= harm_at else 0.0))
    return {"rms": rms, "losses": losses}


def _outcome(fault_jump=22, harm=24, natural_jump=20, natural_blow=22, clean_jump=None):
    clean = _fault_run(rms_jump_block=0, jump_at=clean_jump)
    faults = {(1, 100.0): _fault_run(1, fault_jump, harm), (1, 30.0): _fault_run()}  # x30: harmless, unflagged
    natural = {**_fault_run(0, natural_jump), "losses": [3.0] * natural_blow + [9.0] * (40 - natural_blow)}
    return V.seed_outcome(clean, faults, natural, fault_step=20)


def _localize(outcomes):
    return judge_values(V.RULES, V.localize_values(outcomes), SEEDS, 0)


def test_localize_reproduced_when_flagged_named_in_time_and_quiet():
    o = _outcome()
    assert [r["flagged"] for r in o["faults"]] == [True, False] and o["faults"][0]["named_in_time"] is True
    assert _verdict(_localize([o] * 3)) == "reproduced"


def test_localize_planted_null_a_harmless_fault_or_no_natural_blowup_is_inconclusive():
    harmless = _outcome(fault_jump=22, harm=None)  # the x100 fault moved the norm but not the loss
    _, verdict, reason = _localize([harmless] * 3)
    assert verdict == "inconclusive" and "largest faults harm" in reason
    calm = _outcome(natural_blow=40)  # the natural run never blows up
    _, verdict, reason = _localize([calm] * 3)
    assert verdict == "inconclusive" and "natural run blows up" in reason


def test_localize_claims_can_fail():
    assert _verdict(_localize([_outcome(fault_jump=None)] * 3)) == "not reproduced"  # harmful fault missed
    late = _outcome(fault_jump=35, harm=24)  # flagged, the right block, but after the loss showed the harm
    assert late["faults"][0]["flagged"] and not late["faults"][0]["named_in_time"]
    assert _verdict(_localize([late] * 3)) == "not reproduced"
    assert _verdict(_localize([_outcome(clean_jump=25)] * 3)) == "not reproduced"  # false alarms
    assert _verdict(_localize([_outcome(natural_jump=None)] * 3)) == "not reproduced"  # natural one missed
    # a flag long before the blow-up is one a run raises without diverging, not a warning of it
    assert _verdict(_localize([_outcome(natural_jump=14, natural_blow=30)] * 3)) == "not reproduced"
    # nor is one in the first steps, where every run's norms move fast: the detector starts at step BURN_IN
    early = _outcome(natural_jump=4, natural_blow=12)
    assert early["natural_jump_step"] is None and _verdict(_localize([early] * 3)) == "not reproduced"


def test_fault_task_trains_the_placement_it_is_given():
    from addnorm.lab.experiments.seeds_tasks import fault_task

    kw = dict(layers=2, lr=1e-3, steps=3, warmup=1, fault_layer=None, fault_step=0, fault_mult=1.0, seed=0, lang_seed=0)
    pre, plain = fault_task(**kw), fault_task(**kw, placement="none")
    assert len(plain["rms"]) == 3 and all(len(r) == 2 for r in plain["rms"]) and plain["steps_done"] == 3
    assert plain["losses"] != pre["losses"]  # another model: no norm in x + F(x)
    with pytest.raises(ValueError, match="placement"):
        fault_task(**kw, placement="sideways")


def test_first_jump_and_late_loss():
    rms = [[1.0, 2.0, 3.0]] * 6 + [[1.0, 9.0, 10.0]]
    j = V.first_jump(rms)
    assert (j.layer, j.step) == (1, 6)
    assert V.first_jump([[1.0, 2.0]] * 10) is None
    assert V.first_jump(rms, start=6) is None  # the jump is the first value it sees: no history to jump from
    late = [[1.0, 2.0]] * 12 + [[5.0, 9.0]]
    assert V.first_jump(late, start=8).step == 12 and V.first_jump(late, start=8).layer == 0
    assert V.late_loss([5.0] * 9 + [1.0] * 1) == 1.0 and V.late_loss([1.0, None]) is None


# ---- fp16-layernorm ---------------------------------------------------------------------------------------------
def _fp16_seed(broke16=True, sumsq=1e5, ex32=0.2):
    fp16 = {"diverged": broke16, "final_loss": None if broke16 else 1.0, "excess": 0.3}
    return {"fp16": fp16, "fp32": {"diverged": False, "final_loss": 1.0, "excess": ex32, "max_sumsq": sumsq}}


def _fp16(runs):
    return P.fp16_judgement(P.fp16_units(runs, SEEDS, 0))


def test_fp16_verdicts_and_planted_null():
    assert _verdict(_fp16([_fp16_seed()] * 3)) == "reproduced"
    assert _verdict(_fp16([_fp16_seed(broke16=False)] * 3)) == "not reproduced"  # overflowed, trained on
    _, verdict, reason = _fp16([_fp16_seed(sumsq=3e4)] * 3)  # the stream never got large enough to overflow
    assert verdict == "inconclusive" and "overflow regime reached" in reason
    _, verdict, reason = _fp16([_fp16_seed(ex32=0.9)] * 3)
    assert verdict == "inconclusive" and "fp32 statistics train" in reason
    with pytest.raises(ValueError, match="fp16 and fp32"):
        P.fp16_units([{"fp16": {}}], [0], 0)


def test_the_clamp_is_not_an_arm_any_more():
    assert P.STATS == ("fp16", "fp32") and all("clamp" not in r.statistic for r in P.RULES)


# ---- a tiny run of each, through ctx.map ------------------------------------------------------------------------
TINY = {
    "rezero": {"layers": 2, "steps": 12},
    "mix-ln-training": {"layers": 4, "steps": 6},
    "layernorm-scaling": {"layers": 3, "steps": 4},
    "branch-scaling": {"layers": 2, "steps": 4},
    "localize-divergence": {"layers": 2, "steps": 12, "fault_step": 6},
    "fp16-layernorm": {"layers": 1, "steps": 4},
}


@pytest.mark.parametrize("name", list(NAMES))
def test_a_tiny_run_returns_json_evidence_judged_by_its_rules(name, tmp_path):
    import addnorm.lab.experiments  # noqa: F401

    def mapper(fn, tasks):
        assert "<locals>" not in fn.__qualname__
        json.dumps(tasks)
        out = serial_map(fn, tasks)
        json.dumps(out)
        return out

    exp = EXPERIMENTS[name]
    config = {**exp.config, "quick": {**exp.config["quick"], **TINY[name], "seeds": 2}}
    if name == "localize-divergence":
        config["fault_mults"] = [100.0]
    res = exp.run(Context(quick=True, seed=3, figure_dir=tmp_path, config=config, mapper=mapper))
    assert res.metrics["seeds"] == [3000, 3001] and res.summary and res.metrics["criterion"] == exp.criterion
    assert all(len(v) == 2 for v in res.metrics["per_seed"].values())
    json.dumps(res.metrics)
    json.loads(json.dumps(res.evidence))
    verdict, reason, _ = judge_evidence(res.evidence)
    assert res.verdict == verdict and res.reason.startswith(reason)  # (layernorm-scaling adds what was tried)
    assert [r["name"] for r in res.evidence["rules"]] == [r.name for r in NAMES[name].RULES]
    for us in res.evidence["units"].values():
        assert [u["seed"] for u in us] == [3000, 3001] and {u["lab_seed"] for u in us} == {3}
        assert all(u["value"] is None or math.isfinite(u["value"]) for u in us)
    assert all((tmp_path / f).is_file() for f in res.figures)
