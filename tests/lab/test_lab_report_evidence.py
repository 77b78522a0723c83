"""What a report says each verdict rests on: a plain run's report judges on this run alone and says so, with each
rule's estimate and 95% interval; `addnorm lab --seed-record FILE` shows the pooled verdicts; results.json carries
the evidence, code identity and pre-registration; `addnorm lab criteria` prints the registry with change logs."""

from __future__ import annotations

import json

import pytest

from addnorm.cli import main
from addnorm.lab import runner
from addnorm.lab.core import Change, Context, Experiment, Result
from addnorm.lab.evidence import Rule, evidence, judge_evidence, units
from addnorm.lab.registry import change_text, code_identity, criteria_json
from addnorm.lab.report import render_html, render_markdown
from addnorm.lab.seeds import model_seeds

GAP = Rule(name="gap", statistic="loss gap", op=">", threshold=0.1)
CTRL = Rule(name="ctrl", statistic="control effect", op=">", threshold=0.5, role="positive")
CHANGE = Change(date="2026-12-02", what="threshold 0.05 -> 0.1", showed="a gap of 0.07", reason="seed spread 0.04")


def _run_fn(ctx: Context) -> Result:
    seeds = model_seeds(ctx.seed, 3)
    gap = [0.3 + ctx.seed / 10 + k / 20 for k in range(3)]
    ev = evidence((GAP, CTRL), {"gap": units(gap, seeds, ctx.seed), "ctrl": units([1.0, 1.2, 1.1], seeds, ctx.seed)})
    verdict, reason, _ = judge_evidence(ev)
    return Result(verdict=verdict, reason=reason, metrics={"per_seed": {"gap": gap}, "seeds": seeds}, evidence=ev)


def _registry() -> dict[str, Experiment]:
    exp = Experiment(
        name="fake-claim",
        claim="a gap exists",
        source="test",
        run=_run_fn,
        criterion="the gap's interval above 0.1",
        rules=(GAP, CTRL),
        fixed="2026-12-02 at 8821e08",
        changes=(CHANGE,),
    )
    return {exp.name: exp}


@pytest.fixture
def fake_lab(monkeypatch):
    reg = _registry()
    monkeypatch.setattr(runner, "load_experiments", lambda: reg)
    return reg


def test_a_plain_run_records_evidence_and_says_every_verdict_rests_on_it_alone(tmp_path, fake_lab):
    out = tmp_path / "s0"
    assert main(["lab", "--out", str(out), "--jobs", "1", "--no-progress"]) == 0
    doc = json.loads((out / "results.json").read_text())
    (rec,) = doc["experiments"]
    assert rec["evidence"]["rules"][0]["name"] == "gap" and rec["code"] == code_identity(fake_lab["fake-claim"])
    assert rec["fixed"] == "2026-12-02 at 8821e08" and rec["changes"][0]["showed"] == "a gap of 0.07"
    md = (out / "report.md").read_text()
    assert "Every verdict here rests on this run alone (lab seed 0)" in md
    assert "This run alone (lab seed 0): its own units" in md
    assert "| gap | claim | mean of loss gap > 0.1 | 0.35 [" in md  # the estimate with its 95% interval
    assert change_text(rec["changes"][0]) in md and "Pre-registered rules (fixed 2026-12-02 at 8821e08)" in md
    page = (out / "index.html").read_text()
    assert "This run alone (lab seed 0)" in page and "Changed on 2026-12-02 after a run showed a gap of 0.07" in page


def test_lab_with_a_seed_record_shows_pooled_verdicts_and_says_so(tmp_path, fake_lab, capsys):
    s1, s0 = tmp_path / "s1", tmp_path / "s0"
    assert main(["lab", "--out", str(s1), "--seed", "1", "--jobs", "1", "--no-progress"]) == 0
    record = tmp_path / "seeds.json"
    assert main(["lab", "seeds", str(s1), "--output", str(record)]) == 0
    argv = ["lab", "--out", str(s0), "--jobs", "1", "--no-progress", "--seed-record", str(record)]
    assert main(argv) == 0
    assert "pooled with" in capsys.readouterr().err
    md = (s0 / "report.md").read_text()
    assert "1 pooled over 2 lab seeds (0, 1) x 3 model seeds each" in md
    assert "Pooled verdict over lab seeds 0, 1 (2 lab seeds x 3 model seeds (units) each)" in md
    assert "| gap | claim | mean of loss gap > 0.1 | 0.4 [" in md  # (0.35 + 0.45) / 2: both lab seeds' units
    assert "| 1 | reproduced | current |" in md  # the per-lab-seed table beside the pooled verdict
    page = (s0 / "index.html").read_text()
    assert "Pooled verdict over lab seeds 0, 1" in page and "verdict at this seed" in page
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    assert main(["lab", "--out", str(tmp_path / "x"), "--seed-record", str(bad)]) == 2
    assert "bad.json is not a seed record" in capsys.readouterr().err


def test_a_record_without_evidence_says_it_has_no_rules_yet():
    rec = {"name": "old", "verdict": "reproduced", "kind": "empirical", "claim": "c", "source": "s"}
    rec.update(criterion="old rule", metrics={}, figures=[], timings={})
    doc = {"meta": {"seed": 2}, "experiments": [rec], "counts": {"reproduced": 1}}
    for text in (render_markdown(doc), render_html(doc, ".")):
        assert "This run alone (lab seed 2)" in text and "no pre-registered rules yet" in text


def test_criteria_lists_every_rule_its_date_and_change_log(fake_lab, capsys):
    assert main(["lab", "criteria"]) == 0
    out = capsys.readouterr().out
    assert "fake-claim  [core, empirical]" in out and "rules, fixed 2026-12-02 at 8821e08:" in out
    assert (
        "claim `gap`: mean of loss gap > 0.1" in out and "positive control `ctrl`: mean of control effect > 0.5" in out
    )
    assert change_text(json.loads(json.dumps(CHANGE.__dict__))) in out
    assert main(["lab", "criteria", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == json.loads(json.dumps(criteria_json(fake_lab)))
    assert data[0]["rules"][1]["role"] == "positive" and data[0]["changes"][0]["date"] == "2026-12-02"


def test_criteria_of_the_real_registry_shows_the_criterion_of_experiments_without_rules(capsys):
    from addnorm.lab.runner import load_experiments

    assert main(["lab", "criteria"]) == 0
    out = capsys.readouterr().out
    for name, exp in load_experiments().items():
        assert f"{name}  [{exp.suite}, {exp.kind}]" in out
        if not exp.rules and exp.criterion:
            assert f"criterion: {exp.criterion}" in out


def test_merge_refuses_two_shards_whose_evidence_differs_for_the_same_key(tmp_path):
    from addnorm.lab.merge import MergeConflictError, merge

    def shard(name, values):
        d = tmp_path / name
        d.mkdir()
        ev = evidence((GAP,), {"gap": units(values, [0, 1], 0)})
        rec = {"name": "fake-claim", "verdict": "reproduced", "reason": "", "metrics": {}, "key": "k1"}
        rec.update(kind="empirical", claim="c", source="s", figures=[], evidence=ev)
        (d / "results.json").write_text(json.dumps({"meta": {"seed": 0, "code": "c"}, "experiments": [rec]}))
        return d

    with pytest.raises(MergeConflictError, match="differs between .* in evidence"):
        merge([shard("a", [0.3, 0.4]), shard("b", [0.3, 0.5])], tmp_path / "out")


def test_list_json_and_a_doc_without_record_say_what_they_rest_on(tmp_path, fake_lab, capsys):
    assert main(["lab", "--list"]) == 0
    assert "rules: 2, fixed 2026-12-02 at 8821e08; changes since: 1 (lab criteria)" in capsys.readouterr().out
    assert main(["lab", "--list", "--json"]) == 0
    (item,) = json.loads(capsys.readouterr().out)
    assert item["rules"][0]["name"] == "gap" and item["fixed"] == "2026-12-02 at 8821e08" and item["changes"]
    out = tmp_path / "s0"
    assert main(["lab", "--out", str(out), "--jobs", "1", "--no-progress"]) == 0
    page = tmp_path / "page.md"
    assert main(["lab", "doc", str(out), "--output", str(page)]) == 0
    text = page.read_text()
    assert "No seed record was given: every verdict rests on this run alone (one lab seed)." in text
    assert "1 judged on the evidence of one lab seed (0)" in text
    assert "Rests on one lab seed (0, 1 lab seed x 3 model seeds (units) each)" in text
