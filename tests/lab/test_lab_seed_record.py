"""``addnorm lab seeds``: the record of each empirical experiment's runs at several lab seeds (verdict, evidence,
code identity, date) built from real results files, its refusals (bad seeds, no code hash, dates in the future,
two disagreeing runs of one code), version 1 records still read, and the line the results page prints for a
verdict that is not pooled."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from addnorm.cli import main
from addnorm.lab.docs import render_results_doc
from addnorm.lab.evidence import Rule, evidence, units
from addnorm.lab.seed_record import RECORD_VERSION, build_record, load_record, seed_line
from addnorm.lab.seeds import model_seeds

RULES = (Rule(name="gap", statistic="loss gap", op=">", threshold=0.0),)


def fake_evidence(seed: int, values=(0.5, 0.6, 0.7), rules=RULES) -> dict:
    us = units(list(values), model_seeds(seed, len(values)), seed)
    return evidence(rules, {r.name: us for r in rules})


def _run(tmp: Path, name: str, seed, verdicts: dict[str, str], *, code="c1", date="2026-12-01T10:00", ev=None, **meta):
    d = tmp / name
    d.mkdir()
    records = [{"name": n, "verdict": v, "kind": "empirical", "summary": f"{n} at {seed}"} for n, v in verdicts.items()]
    for r in records:
        if ev and r["name"] in ev:
            r.update(evidence=ev[r["name"]], code=f"id-{r['name']}")
    records.append({"name": "ln-vs-rms", "verdict": "reproduced", "kind": "demonstration"})
    doc = {"meta": {"seed": seed, "quick": False, "code": code, "date": date, **meta}, "experiments": records}
    if code is None:
        del doc["meta"]["code"]
    (d / "results.json").write_text(json.dumps(doc))
    return d


def test_record_keeps_each_empirical_verdict_evidence_and_code_by_seed_and_leaves_demonstrations_out(tmp_path):
    runs = [
        _run(tmp_path, "s0", 0, {"warmup": "reproduced", "lr": "not reproduced"}),
        _run(tmp_path, "s1", 1, {"warmup": "reproduced", "lr": "not reproduced"}, ev={"warmup": fake_evidence(1)}),
        _run(tmp_path, "s2", 2, {"warmup": "reproduced", "lr": "reproduced"}),
    ]
    rec = build_record(runs)
    assert rec["version"] == RECORD_VERSION == 2
    assert set(rec["experiments"]) == {"warmup", "lr"}  # the demonstration is not a counted verdict
    assert [e["verdict"] for e in rec["experiments"]["lr"].values()] == ["not reproduced"] * 2 + ["reproduced"]
    assert list(rec["experiments"]["lr"]) == ["0", "1", "2"]
    assert rec["experiments"]["warmup"]["1"] == {
        "verdict": "reproduced",
        "code": "id-warmup",  # the experiment's own code identity, not the package's hash
        "engine": "sequential",
        "date": "2026-12-01T10:00",
        "summary": "warmup at 1",
        "evidence": fake_evidence(1),
    }
    # a run that recorded no identity per experiment (older results.json) falls back to the package's hash
    assert rec["experiments"]["warmup"]["0"]["code"] == "c1" and rec["experiments"]["warmup"]["0"]["evidence"] is None


def test_newer_run_replaces_older_code_and_same_code_disagreeing_is_refused(tmp_path):
    old = _run(tmp_path, "old", 1, {"lr": "not reproduced"}, code="c0", date="2026-11-30T10:00")
    new = _run(tmp_path, "new", 1, {"lr": "reproduced"}, code="c1", date="2026-12-01T10:00")
    assert build_record([new, old])["experiments"]["lr"]["1"]["verdict"] == "reproduced"  # by date, not by order
    clash = _run(tmp_path, "clash", 1, {"lr": "not reproduced"}, code="c1", date="2026-12-01T11:00")
    with pytest.raises(ValueError, match=r"lr at --seed 1: .*new.* says 'reproduced' .*clash.* says 'not reproduced'"):
        build_record([new, clash])
    # the same code with the other engine may differ (float rounding): either run is as valid, so the record does
    # not drop one unasked; with replace=True the newer run counts, and the one dropped is reported
    batched = _run(tmp_path, "b", 1, {"lr": "not reproduced"}, code="c1", date="2026-12-01T12:00", engine="batched")
    with pytest.raises(ValueError, match=r"lr at --seed 1: .*new.* --engine sequential .*b/results.json.* --replace"):
        build_record([new, batched])
    dropped: list[str] = []
    assert build_record([new, batched], replace=True, replaced=dropped)["experiments"]["lr"]["1"]["engine"] == "batched"
    assert len(dropped) == 1 and "dropped the run (reproduced, code c1, --engine sequential" in dropped[0]


def test_quick_runs_and_missing_files_are_refused(tmp_path):
    quick = _run(tmp_path, "q", 0, {"lr": "reproduced"}, quick=True)
    with pytest.raises(ValueError, match="--quick run"):
        build_record([quick])
    with pytest.raises(ValueError, match="has no results.json"):
        build_record([tmp_path / "nowhere"])


@pytest.mark.parametrize("seed", ["zero", -5, 2**32, 1.5, True])
def test_a_seed_that_is_not_a_lab_seed_is_refused_naming_the_file(tmp_path, seed):
    d = _run(tmp_path, "bad", seed, {"lr": "reproduced"})
    with pytest.raises(ValueError, match=r"bad/results.json: meta.seed must be an integer in \[0, 2\*\*32\)"):
        build_record([d])


def test_a_run_without_a_code_hash_is_refused(tmp_path):
    # recorded as null, it would make the "same code disagrees" check compare None with None and pass silently
    d = _run(tmp_path, "nocode", 0, {"lr": "reproduced"}, code=None)
    with pytest.raises(ValueError, match=r"nocode/results.json: meta.code .* is missing"):
        build_record([d])


def test_a_run_dated_in_the_future_is_refused_and_a_recorded_future_entry_never_wins(tmp_path):
    future = (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=400)).isoformat()
    ahead = _run(tmp_path, "ahead", 1, {"lr": "not reproduced"}, code="c0", date=future)
    with pytest.raises(ValueError, match=r"ahead/results.json: meta.date .* is in the future"):
        build_record([ahead])
    bad_date = _run(tmp_path, "garbled", 1, {"lr": "reproduced"}, date="yesterday")
    with pytest.raises(ValueError, match=r"garbled/results.json: meta.date must be an ISO date"):
        build_record([bad_date])
    # a record written before the check, with a future-dated entry: a real run at that seed replaces it
    previous = {"version": 1, "experiments": {"lr": {"1": {"verdict": "not reproduced", "code": "c0", "date": future}}}}
    real = _run(tmp_path, "real", 1, {"lr": "reproduced"}, code="c1", date="2026-12-01T10:00")
    assert build_record([real], previous)["experiments"]["lr"]["1"]["verdict"] == "reproduced"


def test_version_1_records_are_read_and_upgraded_their_entries_without_evidence(tmp_path):
    v1 = {"version": 1, "experiments": {"lr": {"0": {"verdict": "reproduced", "code": "old", "date": "2026-11-01"}}}}
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(v1))
    assert load_record(path)["version"] == 1
    s2 = _run(tmp_path, "s2", 2, {"lr": "reproduced"}, ev={"lr": fake_evidence(2)})
    rec = build_record([s2], load_record(path))
    assert rec["version"] == 2 and rec["experiments"]["lr"]["0"]["evidence"] is None
    assert rec["experiments"]["lr"]["2"]["evidence"] == fake_evidence(2)


def test_evidence_of_another_lab_seed_is_refused(tmp_path):
    d = _run(tmp_path, "mixed", 0, {"lr": "reproduced"}, ev={"lr": fake_evidence(1)})
    with pytest.raises(ValueError, match=r"mixed/results.json: experiment 'lr' has units of lab seed\(s\) \[1\]"):
        build_record([d])


def test_seed_line_says_same_flips_and_disagreement_with_the_page():
    rec = {
        "version": 1,
        "experiments": {
            "lr": {
                "0": {"verdict": "not reproduced"},
                "1": {"verdict": "not reproduced"},
                "2": {"verdict": "reproduced"},
            },
            "warmup": {"0": {"verdict": "reproduced"}, "1": {"verdict": "reproduced"}},
        },
    }
    flips = seed_line(rec, {"name": "lr", "verdict": "not reproduced"}, 0)
    assert "flips with `--seed`" in flips and "reproduced at `--seed 2`" in flips and "recorded run" not in flips
    same = seed_line(rec, {"name": "warmup", "verdict": "reproduced"}, 0)
    assert same.startswith("Across seeds: the same verdict") and "flips" not in same
    # the page's own run (seed 0) disagrees with the record at seed 0: its verdict counts, and the line says so
    changed = seed_line(rec, {"name": "warmup", "verdict": "inconclusive"}, 0)
    assert "flips" in changed and "inconclusive at `--seed 0`" in changed and "said reproduced" in changed
    assert seed_line(rec, {"name": "unknown", "verdict": "reproduced"}, 0) is None


def test_results_page_prints_the_line_under_not_pooled_empirical_verdicts_only(tmp_path):
    d = _run(tmp_path, "s0", 0, {"lr": "not reproduced"})
    page_doc = json.loads((d / "results.json").read_text())
    rec = {"version": 1, "experiments": {"lr": {"2": {"verdict": "reproduced"}}, "ln-vs-rms": {"2": {"verdict": "x"}}}}
    page = render_results_doc(page_doc, rec)
    section = page.split("### lr: ", 1)[1].split("###", 1)[0]
    assert "this verdict flips with `--seed`" in section
    assert page.count("Across seeds") == 1  # not under the demonstration
    assert "Across seeds" not in render_results_doc(page_doc)


def test_cli_writes_adds_to_and_reads_the_record(tmp_path, capsys):
    s0 = _run(tmp_path, "s0", 0, {"lr": "not reproduced"})
    s2 = _run(tmp_path, "s2", 2, {"lr": "reproduced"})
    out = tmp_path / "seeds.json"
    assert main(["lab", "seeds", str(s0), "--output", str(out)]) == 0
    assert list(load_record(out)["experiments"]["lr"]) == ["0"]
    assert main(["lab", "seeds", str(s2), "--output", str(out), "--add"]) == 0
    assert list(load_record(out)["experiments"]["lr"]) == ["0", "2"]
    err = capsys.readouterr().err
    assert "flip with --seed: lr" in err and "1 experiments (0 with evidence to pool" in err
    page = tmp_path / "page.md"
    assert main(["lab", "doc", str(s0), "--output", str(page), "--seed-record", str(out)]) == 0
    assert "this verdict flips with `--seed`" in page.read_text()
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": "2"}')
    assert main(["lab", "doc", str(s0), "--seed-record", str(bad)]) == 2
    assert "not a seed record of version 1 or 2" in capsys.readouterr().err
    zero = _run(tmp_path, "zero", "zero", {"lr": "reproduced"})
    assert main(["lab", "seeds", str(zero), "--output", str(tmp_path / "z.json")]) == 2
    assert "zero/results.json: meta.seed must be an integer" in capsys.readouterr().err


def test_the_repository_record_covers_every_empirical_experiment_at_seeds_0_1_2():
    """docs/lab-seeds.json is what lab-results.md's pooled verdicts come from: a new empirical experiment without
    its runs at --seed 1 and 2 fails here, not silently on the page."""
    import addnorm.lab.experiments  # noqa: F401
    from addnorm.lab.core import EXPERIMENTS

    record = load_record(Path(__file__).resolve().parents[2] / "docs" / "lab-seeds.json")
    empirical = {name for name, exp in EXPERIMENTS.items() if exp.kind == "empirical"}
    assert set(record["experiments"]) == empirical
    for name in empirical:
        assert {"0", "1", "2"} <= set(record["experiments"][name]), name


def test_damaged_evidence_is_refused_naming_the_file_and_the_entry(tmp_path):
    broken = fake_evidence(0)
    broken["rules"][0]["op"] = "about"
    d = _run(tmp_path, "broken", 0, {"lr": "reproduced"}, ev={"lr": broken})
    with pytest.raises(
        ValueError, match=r"broken/results.json: the evidence of experiment 'lr' has a rule that is not"
    ):
        build_record([d])
    path = tmp_path / "rec.json"
    entry = {"verdict": "reproduced", "code": "c", "evidence": {"rules": fake_evidence(0)["rules"], "units": {}}}
    path.write_text(json.dumps({"version": 2, "experiments": {"lr": {"0": entry}}}))
    with pytest.raises(
        ValueError, match=r"rec.json: the evidence of lr at lab seed 0 has no list of units for its rule"
    ):
        load_record(path)
