"""The pre-registered two-stage seed design (addnorm.lab.stages, issue 35): the second stage runs when the first
leaves a planted rule undecided and not otherwise, runs once whatever it shows, reuses the first stage's tasks,
its units pool with other lab seeds' runs, and results.json and the report say which stage was taken and why."""

from __future__ import annotations

import dataclasses
import json

import pytest

from addnorm.lab.core import EXPERIMENTS, Context, Experiment, Result
from addnorm.lab.evidence import Rule, evidence, undecided, units
from addnorm.lab.experiments.training_batch import plan
from addnorm.lab.pooled import pool_record
from addnorm.lab.report import load_results
from addnorm.lab.runner import run
from addnorm.lab.seed_record import build_record
from addnorm.lab.stages import Memo, check_second_stage, run_stages, second_stage_reasons
from tests.lab import lab_fakes
from tests.lab.lab_fakes import make_staged, opts

# Model seed k's planted value: the first three straddle 0.5 (mean 0.63, interval [0.2, 0.9]), the next three are high.
UNDECIDED = [0.2, 0.9, 0.8, 0.9, 0.95, 0.85]
DECIDED = [0.9, 0.95, 1.0, 0.0, 0.0, 0.0]  # the first three clear 0.5; the rest must never be run
STILL_UNDECIDED = [0.2, 0.9, 0.8, 0.1, 0.9, 0.5]


def _run(tmp_path, exp: Experiment, seed: int = 0, **kw):
    return run(opts(tmp_path / f"out{seed}", seed=seed, jobs=1, **kw), registry={exp.name: exp})


def _record(tmp_path, seed: int = 0) -> dict:
    return load_results(tmp_path / f"out{seed}")["experiments"][0]


def test_an_undecided_rule_takes_the_second_stage_once_and_the_evidence_pools_both(tmp_path):
    calls: list[int] = []
    lab_fakes.TASK_CALLS.clear()
    summary = _run(tmp_path, make_staged(UNDECIDED, calls))
    assert calls == [0, 3]  # the first stage, then the second with 3 more seeds
    assert lab_fakes.TASK_CALLS == [0, 1, 2, 3, 4, 5]  # the first stage's tasks were not run again
    r = summary.records[0]
    assert r["metrics"]["seeds"] == [0, 1, 2, 3, 4, 5]
    assert [u["seed"] for u in r["evidence"]["units"]["x"]] == [0, 1, 2, 3, 4, 5]
    st = r["stages"]
    assert st["taken"] and st["declared"] == {"first": 3, "second": 3}
    assert st["first_stage"] == {"verdict": "inconclusive", "seeds": [0, 1, 2]}
    assert st["second_stage_seeds"] == [3, 4, 5]
    assert st["why"] == ["x (claim): 0.633 [0.2, 0.9] over 3 units straddles > 0.5"]
    assert r["figures"] == [f"runs/{r['figures'][0].split('/')[1]}/fig6.png"]  # the first stage's figure is gone
    assert not any(p.name == "fig3.png" for p in (tmp_path / "out0" / "runs").rglob("*.png"))


def test_a_decided_first_stage_runs_once_and_says_so(tmp_path):
    calls: list[int] = []
    lab_fakes.TASK_CALLS.clear()
    summary = _run(tmp_path, make_staged(DECIDED, calls))
    assert calls == [0] and lab_fakes.TASK_CALLS == [0, 1, 2]
    r = summary.records[0]
    assert r["verdict"] == "reproduced" and len(r["evidence"]["units"]["x"]) == 3
    assert r["stages"]["taken"] is False and r["stages"]["why"] == [] and r["stages"]["second_stage_seeds"] == []


def test_the_second_stage_is_never_repeated_whatever_it_shows(tmp_path):
    calls: list[int] = []
    summary = _run(tmp_path, make_staged(STILL_UNDECIDED, calls))
    assert calls == [0, 3]
    r = summary.records[0]
    assert r["verdict"] == "inconclusive" and len(r["evidence"]["units"]["x"]) == 6
    assert second_stage_reasons(r["evidence"])  # still undecided after both stages: no third


def test_an_undecided_control_takes_the_second_stage_too(tmp_path):
    calls: list[int] = []
    summary = _run(tmp_path, make_staged(UNDECIDED, calls, role="positive"))
    assert calls == [0, 3] and summary.records[0]["stages"]["why"][0].startswith("x (positive): ")


def test_without_a_declared_second_stage_an_undecided_rule_runs_once_and_records_no_stages(tmp_path):
    calls: list[int] = []
    summary = _run(tmp_path, make_staged(UNDECIDED, calls, second_stage=0))
    assert calls == [0] and "stages" not in summary.records[0]
    assert "stages" not in _record(tmp_path)


def test_fresh_and_cached_runs_take_the_same_stages_and_the_tasks_run_once_per_stage(tmp_path):
    calls: list[int] = []
    exp = make_staged(UNDECIDED, calls)
    first = _run(tmp_path, exp).records[0]
    lab_fakes.TASK_CALLS.clear()
    again = _run(tmp_path, exp, fresh=True).records[0]  # --fresh: the memo, not the task cache, spares stage 1
    assert lab_fakes.TASK_CALLS == [0, 1, 2, 3, 4, 5]
    assert again["evidence"] == first["evidence"] and again["stages"] == first["stages"]
    cached = _run(tmp_path, exp).records[0]
    assert cached["cached"] and cached["stages"] == first["stages"] and calls == [0, 3, 0, 3]


def test_an_experiment_that_ignores_ctx_model_seeds_is_an_error_not_a_silent_second_stage(tmp_path):
    summary = _run(tmp_path, make_staged(UNDECIDED, [], own_seeds=False))
    r = summary.records[0]
    assert r["verdict"] == "inconclusive" and "ctx.model_seeds" in r["error"]


def test_check_second_stage_refuses_changed_first_stage_units_and_other_rules():
    rules = (Rule(name="x", statistic="v", op=">", threshold=0.5),)
    first = evidence(rules, {"x": units([0.2, 0.9, 0.8], [0, 1, 2], 0)})
    second = evidence(rules, {"x": units([0.2, 0.9, 0.8, 0.7], [0, 1, 2, 3], 0)})
    assert check_second_stage(first, second, 1) == [3]
    changed = evidence(rules, {"x": units([0.3, 0.9, 0.8, 0.7], [0, 1, 2, 3], 0)})
    with pytest.raises(ValueError, match="changed the first stage's units"):
        check_second_stage(first, changed, 1)
    with pytest.raises(ValueError, match="new model seeds"):
        check_second_stage(first, second, 2)
    other = evidence((dataclasses.replace(rules[0], threshold=0.6),), {"x": second["units"]["x"]})
    with pytest.raises(ValueError, match="other rules"):
        check_second_stage(first, other, 1)
    with pytest.raises(ValueError, match="no evidence"):
        check_second_stage(first, None, 1)


def test_an_experiment_with_a_second_stage_must_return_evidence(tmp_path):
    exp = Experiment(name="bare", claim="c", source="s", run=lambda ctx: Result(verdict="reproduced", metrics={}))
    with pytest.raises(ValueError, match="no evidence"):
        run_stages(dataclasses.replace(exp, second_stage=2), Context(), exp.run)


def test_units_of_a_two_stage_lab_seed_pool_with_a_one_stage_lab_seed(tmp_path):
    exp = make_staged([0.2, 0.9, 0.8, 0.9, 0.95, 0.85] + [0.0] * 994, [])
    # lab seed 1's model seeds are 1000 + k: values[k] again, but plant a decided first stage there
    exp1 = make_staged([0.9, 0.95, 1.0] + [0.0] * 997, [])
    _run(tmp_path, exp, seed=0)
    _run(tmp_path, dataclasses.replace(exp1, name=exp.name, config=exp.config), seed=1)
    for s in (0, 1):  # the seed record needs an empirical run of full sizes
        assert load_results(tmp_path / f"out{s}")["experiments"][0]["kind"] == "empirical"
    rec = build_record([tmp_path / "out0", tmp_path / "out1"])
    by_seed = rec["experiments"]["staged"]
    assert [len(by_seed[s]["evidence"]["units"]["x"]) for s in ("0", "1")] == [6, 3]
    pooled = pool_record(rec, page=load_results(tmp_path / "out0"))["staged"]
    assert pooled.basis == "pooled" and pooled.units_per_seed == [6, 3]
    assert pooled.judgements[0].n == 9


def test_results_json_and_the_report_say_which_stage_ran_and_why(tmp_path):
    _run(tmp_path, make_staged(UNDECIDED, []), seed=0)
    doc = json.loads((tmp_path / "out0" / "results.json").read_text())
    st = doc["experiments"][0]["stages"]
    assert st["taken"] and "x (claim)" in st["why"][0]
    md = (tmp_path / "out0" / "report.md").read_text()
    assert "Second stage taken at this run (model seeds 3, 4, 5)" in md and "x (claim): " in md
    assert "rests on both stages (6 model seeds)" in md
    assert "Second stage taken at this run" in (tmp_path / "out0" / "index.html").read_text()
    _run(tmp_path, make_staged(DECIDED, []), seed=1)
    assert "Second stage not needed at this run" in (tmp_path / "out1" / "report.md").read_text()


def test_undecided_lists_straddling_rules_of_every_role_and_not_rules_short_of_units():
    rules = (
        Rule(name="c", statistic="v", op=">", threshold=0.5, role="positive"),
        Rule(name="a", statistic="v", op=">", threshold=0.5),
        Rule(name="b", statistic="v", op="<", threshold=0.5),
        Rule(name="few", statistic="v", op=">", threshold=0.5),
    )
    ev = evidence(
        rules,
        {
            "c": units([0.2, 0.9, 0.8], [0, 1, 2], 0),
            "a": units([0.9, 0.95, 1.0], [0, 1, 2], 0),
            "b": units([0.2, 0.9, 0.8], [0, 1, 2], 0),
            "few": units([0.2, None, None], [0, 1, 2], 0),  # too few finite units: more seeds of the same kind won't do
        },
    )
    assert [r.name for r, _ in undecided(ev)] == ["c", "b"]


def test_memo_serves_seen_tasks_as_copies_and_maps_only_the_new_ones():
    seen: list[list[dict]] = []

    def mapper(fn, tasks):
        seen.append(list(tasks))
        return [fn(**t) for t in tasks]

    memo = Memo(mapper)
    first = memo(lab_fakes.echo_task, [{"seed": 0, "value": 0.5}, {"seed": 1, "value": float("nan")}])
    first[0]["value"] = 99.0  # the caller changes what it got: the memo keeps its own copy
    again = memo(
        lab_fakes.echo_task, [{"seed": 1, "value": float("nan")}, {"seed": 0, "value": 0.5}, {"seed": 2, "value": 1.0}]
    )
    assert seen[1] == [{"seed": 2, "value": 1.0}] and memo.served == 2
    assert again[1] == {"value": 0.5} and again[0]["value"] != again[0]["value"] and again[2] == {"value": 1.0}


def test_context_model_seeds_adds_the_second_stage_after_the_first():
    ctx = Context(seed=2)
    assert ctx.model_seeds(3) == [2000, 2001, 2002] and ctx.second_stage_seeds == set()
    ctx2 = dataclasses.replace(ctx, extra_seeds=3)
    assert ctx2.model_seeds(3) == [2000, 2001, 2002, 2003, 2004, 2005]
    assert ctx2.second_stage_seeds == {2003, 2004, 2005}
    with pytest.raises(ValueError, match="extra_seeds"):
        Context(extra_seeds=-1)
    for bad in (-1, True, 1.5, 1000):
        with pytest.raises(ValueError, match="second_stage"):
            Experiment(name="e", claim="c", source="s", run=lambda ctx: None, second_stage=bad)


def test_the_batched_plan_groups_the_second_stage_apart_so_the_first_stage_groups_stay_the_same():
    def task(seed, lr=1e-3):
        return {"model": {"n_layers": 1}, "train": {"steps": 2, "lr": lr, "seed": seed}, "lang_seed": 0}

    first = [task(s) for s in (0, 1, 2)]
    second = [task(s) for s in (3, 4, 5)]
    assert plan(first) == [[0, 1, 2]]
    assert plan(first + second) == [[0, 1, 2, 3, 4, 5]]  # without the stage: one group, other tasks than before
    assert plan(first + second, apart=frozenset({3, 4, 5})) == [[0, 1, 2], [3, 4, 5]]


def test_localize_divergence_declares_a_second_stage_and_takes_its_seeds_from_the_context(tmp_path):
    """A tiny run of the real experiment, first stage then second (1 more seed): the second keeps every first-stage
    unit and reuses its runs."""
    import addnorm.lab.experiments  # noqa: F401
    from addnorm.lab.core import serial_map

    exp = EXPERIMENTS["localize-divergence"]
    assert exp.second_stage == 3
    assert any("second stage" in c.what for c in exp.changes)
    config = {**exp.config, "fault_mults": [100.0], "natural": {**exp.config["natural"], "layers": 2}}
    config["quick"] = {**config["quick"], "layers": 2, "steps": 12, "fault_step": 6, "seeds": 2}
    memo = Memo(serial_map)
    ctx = Context(quick=True, seed=3, figure_dir=tmp_path, config=config, mapper=memo)
    first = exp.run(ctx)
    second = exp.run(dataclasses.replace(ctx, extra_seeds=1))
    assert check_second_stage(first.evidence, second.evidence, 1) == [3002]
    assert memo.served == len(memo.results) - 3  # the 3 runs of seed 3002 (clean, fault, natural) are new
    assert second.metrics["seeds"] == [3000, 3001, 3002]


def test_criteria_and_list_show_the_declared_second_stage():
    from addnorm.lab.registry import criteria_json, criteria_text

    staged, plain = make_staged(UNDECIDED, []), make_staged(UNDECIDED, [], second_stage=0, name="plain")
    reg = {staged.name: staged, plain.name: plain}
    assert [i["second_stage"] for i in criteria_json(reg)] == [3, 0]
    text = criteria_text(reg)
    assert text.count("second stage: 3 more model seeds") == 1
