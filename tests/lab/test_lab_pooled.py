"""Pooled verdicts: every recorded run of the current code pooled into one verdict with the rules' intervals and a
per-lab-seed table; runs of older code listed, never pooled; runs without evidence counted as a labelled majority;
the headline says what each count rests on. And the path the coordinator runs at the end, on fake runs: `addnorm
lab seeds` over three lab seeds' results, then `addnorm lab doc --seed-record` writing the page."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from addnorm.cli import main
from addnorm.lab.evidence import Rule, evidence, judge_evidence, units
from addnorm.lab.pooled import basis_text, pool_record, pooled_headline
from addnorm.lab.seeds import model_seeds

CLAIM = Rule(name="gap", statistic="excess gap", op=">", threshold=0.1)
CONTROL = Rule(name="post_fails", statistic="Post-LN excess without warmup", op=">", threshold=0.5, role="positive")
RULES = (CLAIM, CONTROL)


def ev(lab_seed: int, gap, control=(1.0, 1.1, 1.2), rules=RULES) -> dict:
    seeds = model_seeds(lab_seed, len(gap))
    unit_map = {"gap": units(list(gap), seeds, lab_seed), "post_fails": units(list(control), seeds, lab_seed)}
    return evidence(rules, {r.name: unit_map[r.name] for r in rules})


def entry(lab_seed, gap, code="cur", verdict=None, **kw):
    e = ev(lab_seed, gap, **kw) if gap is not None else None
    v = verdict or (judge_evidence(e)[0] if e else "reproduced")
    return {"verdict": v, "code": code, "date": "2026-12-02T10:00:00+00:00", "evidence": e}


def test_every_run_of_the_current_code_is_pooled_older_code_is_listed_not_pooled():
    by_seed = {
        "0": entry(0, [0.2, 0.3, 0.25]),
        "1": dict(entry(1, [0.3, 0.2, 0.35]), engine="batched"),
        "2": entry(2, [0.15, 0.3, 0.2]),
        "3": entry(3, [-5.0, -6.0, -5.5], code="old"),  # older code: listed, not pooled
    }
    p = pool_record({"version": 2, "experiments": {"warmup": by_seed}}, {"warmup": "cur"})["warmup"]
    assert p.basis == "pooled" and p.lab_seeds == ["0", "1", "2"] and p.older == ["3"]
    assert p.units_per_seed == [3, 3, 3]
    claim = p.judgements[0]
    assert claim.n == 9 and claim.estimate == pytest.approx(sum([0.2, 0.3, 0.25, 0.3, 0.2, 0.35, 0.15, 0.3, 0.2]) / 9)
    assert claim.low < claim.estimate < claim.high and p.verdict == "reproduced"
    assert [row[0] for row in p.rows] == ["0", "1", "2", "3"] and p.rows[3][2] == "older (old)"
    assert p.rows[1][2] == "current, engine batched"  # pooled alike, and named
    assert p.rows[0][4].startswith("0.25 (0.2, 0.3, 0.25)")  # the per-lab-seed mean and its units
    text = basis_text(p)
    assert "Pooled verdict over lab seeds 0, 1, 2 (3 lab seeds x 3 model seeds (units) each)" in text
    assert "older code at lab seed(s) 3 are listed, not pooled" in text


def test_a_control_not_met_in_the_pool_makes_it_inconclusive_and_a_clear_failure_not_reproduced():
    weak = {s: entry(int(s), [0.3, 0.2, 0.4], control=(0.1, 0.0, 0.2)) for s in "012"}
    p = pool_record({"version": 2, "experiments": {"w": weak}}, {"w": "cur"})["w"]
    assert p.verdict == "inconclusive" and "positive control not shown" in p.reason
    failing = {s: entry(int(s), [-0.3, -0.2, -0.4]) for s in "012"}
    assert pool_record({"version": 2, "experiments": {"w": failing}}, {"w": "cur"})["w"].verdict == "not reproduced"


def test_runs_without_evidence_count_as_a_labelled_majority_and_a_tie_is_inconclusive():
    maj = {"0": entry(0, None, verdict="reproduced"), "1": entry(1, None, verdict="reproduced")}
    maj["2"] = entry(2, None, verdict="not reproduced")
    p = pool_record({"version": 1, "experiments": {"d": maj}}, {"d": "cur"})["d"]
    assert (p.basis, p.verdict, p.judgements) == ("majority", "reproduced", [])
    assert basis_text(p).startswith("Not pooled")
    tie = {"0": entry(0, None, verdict="reproduced"), "1": entry(1, None, verdict="not reproduced")}
    assert pool_record({"version": 1, "experiments": {"d": tie}}, {"d": "cur"})["d"].verdict == "inconclusive"


def test_no_run_of_the_current_code_falls_back_to_this_run_and_says_so():
    page = {"meta": {"seed": 0}, "experiments": [{"name": "d", "verdict": "not reproduced", "kind": "empirical"}]}
    record = {"version": 1, "experiments": {"d": {"1": entry(1, None, code="old", verdict="reproduced")}}}
    p = pool_record(record, {"d": "cur"}, page)["d"]
    assert (p.basis, p.verdict) == ("run", "not reproduced")
    assert "from this run alone" in pooled_headline({"d": p})
    nowhere = pool_record(record, {"d": "cur"})["d"]  # neither the record nor a page has the current code's run
    assert nowhere.verdict == "inconclusive" and "no run of the current code" in nowhere.reason


def test_the_pages_run_is_the_newest_word_at_its_lab_seed_unless_it_is_quick():
    mine = {
        "name": "w",
        "verdict": "reproduced",
        "kind": "empirical",
        "code": "cur",
        "evidence": ev(0, [1.0, 1.1, 1.2]),
    }
    page = {"meta": {"seed": 0, "date": "2026-12-02T11:00:00+00:00"}, "experiments": [mine]}
    record = {"version": 2, "experiments": {"w": {"0": entry(0, [9.0, 9.0, 9.0]), "1": entry(1, [1.0, 1.0, 1.0])}}}
    p = pool_record(record, {"w": "cur"}, page)["w"]
    assert p.judgements[0].estimate == pytest.approx((1.0 + 1.1 + 1.2 + 3.0) / 6)
    quick = {"meta": {"seed": 0, "quick": True}, "experiments": [mine]}
    assert pool_record(record, {"w": "cur"}, quick)["w"].judgements[0].estimate == pytest.approx((27.0 + 3.0) / 6)


def test_headline_counts_pooled_verdicts_and_says_what_they_rest_on():
    record = {
        "version": 2,
        "experiments": {
            "a": {s: entry(int(s), [0.3, 0.2, 0.4]) for s in "012"},
            "b": {s: entry(int(s), [-0.3, -0.2, -0.4]) for s in "012"},
            "c": {"0": entry(0, None, verdict="inconclusive")},
        },
    }
    head = pooled_headline(pool_record(record, {"a": "cur", "b": "cur", "c": "cur"}))
    assert head.startswith("Empirical claims: 1 reproduced, 1 not reproduced, 1 inconclusive.")
    assert "2 pooled over 3 lab seeds (0, 1, 2) x 3 model seeds each" in head and "1 not pooled" in head


# ------------------------------------------------------------------- the coordinator's path, end to end on fakes
def _fake_run(tmp: Path, lab_seed: int, codes: dict[str, str], gap) -> Path:
    d = tmp / f"s{lab_seed}"
    d.mkdir()
    changes = [{"date": "2026-12-02", "what": "the claim became a rule", "showed": "2 of 3 seeds", "reason": "pooling"}]
    warmup = {
        "name": "warmup",
        "kind": "empirical",
        "claim": "Post-LN needs warmup",
        "source": "Xiong et al. 2020",
        "criterion": "the gap's interval above 0.1",
        "code": codes["warmup"],
        "rules": [r for r in ev(lab_seed, gap)["rules"]],
        "fixed": "2026-12-02 at 8821e08",
        "changes": changes,
        "evidence": ev(lab_seed, gap),
    }
    warmup["verdict"] = judge_evidence(warmup["evidence"])[0]
    depth = {"name": "depth-sweep", "kind": "empirical", "verdict": "reproduced", "code": codes["depth-sweep"]}
    depth.update(claim="c", source="s", criterion="Post-LN degrades at 24 layers")
    sanity = {"name": "ln-rms-identity", "kind": "sanity", "verdict": "reproduced", "claim": "c", "source": "s"}
    meta = {
        "seed": lab_seed,
        "quick": False,
        "code": "pkg",
        "date": "2026-12-02T10:00:00+00:00",
        "engine": "sequential",
    }
    (d / "results.json").write_text(json.dumps({"meta": meta, "experiments": [warmup, depth, sanity]}))
    return d


def test_lab_seeds_then_lab_doc_write_the_pooled_page_end_to_end(tmp_path, capsys, monkeypatch):
    from addnorm.lab.cli import current_codes

    codes = current_codes()
    gaps = {0: [0.3, 0.25, 0.4], 1: [0.35, 0.3, 0.2], 2: [0.3, 0.45, 0.3]}
    runs = [str(_fake_run(tmp_path, s, codes, g)) for s, g in gaps.items()]
    record, page = tmp_path / "lab-seeds.json", tmp_path / "lab-results.md"
    assert main(["lab", "seeds", *runs, "--output", str(record)]) == 0
    assert main(["lab", "doc", runs[0], "--seed-record", str(record), "--output", str(page)]) == 0
    text = page.read_text()
    n_empirical = sum(1 for _ in codes)  # the record's other experiments are not on it: only these two count
    assert n_empirical >= 2
    assert "Empirical claims: 2 reproduced, 0 not reproduced, 0 inconclusive." in text
    assert "1 pooled over 3 lab seeds (0, 1, 2) x 3 model seeds each" in text and "1 not pooled" in text
    warmup = text.split("### warmup: reproduced", 1)[1].split("\n### ", 1)[0]
    assert "Pooled verdict over lab seeds 0, 1, 2" in warmup
    assert "| gap | claim | mean of excess gap > 0.1 | 0.3" in warmup  # the pooled mean with its interval
    assert "| lab seed | verdict at this seed |" in warmup and "| 2 | reproduced | current |" in warmup
    assert "| post_fails | positive | mean of Post-LN excess without warmup > 0.5 | 1.1 [" in warmup
    assert "| 9 | met |" in warmup and "| 9 | reproduced |" in warmup  # a control is met, a claim reproduced
    assert "Pre-registered rules (fixed 2026-12-02 at 8821e08):" in warmup
    assert "Changed on 2026-12-02 after a run showed 2 of 3 seeds: the claim became a rule (why: pooling)" in warmup
    depth = text.split("### depth-sweep: reproduced", 1)[1].split("\n### ", 1)[0]
    assert "Not pooled" in depth and "Criterion (no pre-registered rules yet; its text)" in depth
    assert "## Sanity checks" in text and "## What the seeds say" in text
    assert "warning" not in capsys.readouterr().err
    # an edit to the code of warmup: the record's runs become older code, listed and no longer pooled, and the
    # command says so
    import addnorm.lab.cli as lab_cli

    monkeypatch.setattr(lab_cli, "current_codes", lambda: dict(codes, warmup="edited"))
    assert main(["lab", "doc", runs[0], "--seed-record", str(record), "--output", str(page)]) == 0
    assert "warning: no recorded run of the current code for warmup" in capsys.readouterr().err
    assert "Runs of older code at lab seed(s) 0, 1, 2 are listed, not pooled." in page.read_text()


def test_runs_of_one_code_judged_by_different_rules_are_not_pooled_and_the_page_says_why():
    other = (Rule(name="gap", statistic="loss gap", op=">", threshold=0.2), CONTROL)
    by_seed = {"0": entry(0, [0.3, 0.3, 0.4]), "1": entry(1, [0.3, 0.3, 0.4], rules=other)}
    p = pool_record({"version": 2, "experiments": {"w": by_seed}}, {"w": "cur"})["w"]
    assert p.verdict == "inconclusive" and "cannot be pooled" in p.reason and "different rules" in p.reason
    assert "Pooled verdict over lab seeds 0, 1 (2 lab seeds)" in basis_text(
        p
    )  # the text renders, naming what was tried
    assert "1 pooled over 2 lab seeds (0, 1)." in pooled_headline({"w": p})
