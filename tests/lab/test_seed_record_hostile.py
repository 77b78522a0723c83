"""``addnorm lab seeds`` and ``addnorm lab doc --seed-record`` as a hostile user drives them: a run of the same code
at a recorded lab seed made with the other --engine, a run given twice, --output on a run's results.json or on the
record the page reads, a truncated record, a record of a newer version, lab seeds written twice ("7" and "007"),
units filed under another lab seed, a run that does not say whether it was --quick, and a page whose own run is not
the one the record holds at its seed. Every case either refuses, naming the file and what was wrong, or says what
it dropped; no recorded run is lost silently. Fabricated results.json files only: no experiment runs."""

from __future__ import annotations

import json

from addnorm.cli import main
from addnorm.lab.pooled import pool_record
from addnorm.lab.seed_record import load_record
from tests.lab.test_lab_seed_record import _run, fake_evidence


def _seeds(*argv) -> int:
    return main(["lab", "seeds", *map(str, argv)])


def test_a_run_of_the_same_code_at_a_recorded_seed_with_the_other_engine_is_refused_unless_replace(tmp_path, capsys):
    record = tmp_path / "lab-seeds.json"
    seq = _run(tmp_path, "seq", 1, {"lr": "reproduced"}, ev={"lr": fake_evidence(1)}, date="2026-12-01T10:00")
    assert _seeds(seq, "--output", record) == 0
    before = record.read_text()
    bat = _run(
        tmp_path,
        "bat",
        1,
        {"lr": "inconclusive"},
        ev={"lr": fake_evidence(1)},
        date="2026-12-02T10:00",
        engine="batched",
    )
    capsys.readouterr()
    assert _seeds(bat, "--output", record, "--add") == 2
    err = capsys.readouterr().err
    for said in ("lr at --seed 1", f"the record {record}", "--engine sequential", "bat/results.json"):
        assert said in err, said
    assert "--engine batched" in err and "--replace" in err
    assert record.read_text() == before  # refused: the recorded run is still there, untouched
    assert _seeds(bat, "--output", record, "--add", "--replace") == 0
    err = capsys.readouterr().err
    assert "note: lr at --seed 1: kept the newer run (inconclusive" in err and "--engine sequential" in err
    assert load_record(record)["experiments"]["lr"]["1"]["engine"] == "batched"


def test_add_to_a_record_that_does_not_exist_is_refused_naming_it(tmp_path, capsys):
    """A mistyped path of an existing record with --add used to start a new record there silently: the user then
    believed the runs added to the record they meant. Refused, naming the file, and nothing is written."""
    s0 = _run(tmp_path, "s0", 0, {"lr": "reproduced"})
    typo = tmp_path / "lab-seed.json"
    capsys.readouterr()
    assert _seeds(s0, "--output", typo, "--add") == 2
    err = capsys.readouterr().err
    assert f"there is no record {typo} to add to" in err and "leave out --add to start a new record" in err
    assert not typo.exists()
    assert _seeds(s0, "--output", typo) == 0 and list(load_record(typo)["experiments"]["lr"]) == ["0"]


def test_two_runs_given_at_one_seed_with_different_engines_are_refused(tmp_path, capsys):
    seq = _run(tmp_path, "seq", 0, {"lr": "reproduced"})
    bat = _run(tmp_path, "bat", 0, {"lr": "reproduced"}, engine="batched", date="2026-12-01T11:00")
    out = tmp_path / "rec.json"
    assert _seeds(seq, bat, "--output", out) == 2
    err = capsys.readouterr().err
    assert "seq/results.json" in err and "bat/results.json" in err and "--replace" in err
    assert not out.exists()


def test_a_run_given_twice_is_refused(tmp_path, capsys):
    s0 = _run(tmp_path, "s0", 0, {"lr": "reproduced"})
    out = tmp_path / "rec.json"
    assert _seeds(s0, s0, "--output", out) == 2
    assert "is given twice" in capsys.readouterr().err
    assert _seeds(s0, s0 / "results.json", "--output", out) == 2  # the directory and its file: one run
    assert "is given twice" in capsys.readouterr().err
    assert not out.exists()


def test_output_on_a_runs_results_json_is_refused_and_the_run_kept(tmp_path, capsys):
    s0 = _run(tmp_path, "s0", 0, {"lr": "reproduced"})
    results = s0 / "results.json"
    before = results.read_text()
    assert _seeds(s0, "--output", results) == 2
    err = capsys.readouterr().err
    assert f"--output {results} is the results.json of the run {s0}" in err
    assert results.read_text() == before


def test_doc_output_on_its_seed_record_is_refused_and_the_record_kept(tmp_path, capsys):
    s0 = _run(tmp_path, "s0", 0, {"lr": "reproduced"})
    record = tmp_path / "lab-seeds.json"
    assert _seeds(s0, "--output", record) == 0
    before = record.read_text()
    capsys.readouterr()
    assert main(["lab", "doc", str(s0), "--seed-record", str(record), "--output", str(record)]) == 2
    assert "--seed-record" in capsys.readouterr().err
    assert record.read_text() == before


def test_a_truncated_record_with_add_is_refused_and_left_as_it_was(tmp_path, capsys):
    s0, s1 = _run(tmp_path, "s0", 0, {"lr": "reproduced"}), _run(tmp_path, "s1", 1, {"lr": "reproduced"})
    record = tmp_path / "lab-seeds.json"
    assert _seeds(s0, "--output", record) == 0
    cut = record.read_text()[:40]
    record.write_text(cut)
    assert _seeds(s1, "--output", record, "--add") == 2
    assert f"{record} is not a readable seed record" in capsys.readouterr().err
    assert record.read_text() == cut  # not overwritten with a record of s1 alone


def test_a_record_of_a_newer_version_says_so(tmp_path, capsys):
    record = tmp_path / "lab-seeds.json"
    record.write_text(json.dumps({"version": 3, "experiments": {}}))
    s0 = _run(tmp_path, "s0", 0, {"lr": "reproduced"})
    assert _seeds(s0, "--output", record, "--add") == 2
    err = capsys.readouterr().err
    assert "version 3, written by a newer addnorm" in err and "upgrade addnorm" in err
    assert json.loads(record.read_text())["version"] == 3


def test_a_lab_seed_written_twice_in_a_record_is_refused(tmp_path):
    # "007" and "7" are one lab seed: pooled as two, its units would count as independent evidence twice
    ev = fake_evidence(7)
    entry = {"verdict": "reproduced", "code": "c", "date": "2026-12-01T10:00", "evidence": ev}
    path = tmp_path / "rec.json"
    path.write_text(json.dumps({"version": 2, "experiments": {"lr": {"7": entry, "007": entry}}}))
    try:
        load_record(path)
    except ValueError as err:
        assert "rec.json: lab seeds must be integers" in str(err) and "'007'" in str(err)
    else:
        raise AssertionError("a record with lab seed 7 written twice was read")


def test_units_filed_under_another_lab_seed_in_a_record_are_refused(tmp_path):
    entry = {"verdict": "reproduced", "code": "c", "date": "2026-12-01T10:00", "evidence": fake_evidence(0)}
    path = tmp_path / "rec.json"
    path.write_text(json.dumps({"version": 2, "experiments": {"lr": {"0": entry, "1": entry}}}))
    try:
        load_record(path)
    except ValueError as err:
        assert "the evidence of lr at lab seed 1 has units of lab seed(s) [0]" in str(err)
    else:
        raise AssertionError("units of lab seed 0 filed under lab seed 1 were read")


def test_a_run_that_does_not_say_whether_it_was_quick_is_refused(tmp_path, capsys):
    d = _run(tmp_path, "noquick", 0, {"lr": "reproduced"})
    doc = json.loads((d / "results.json").read_text())
    del doc["meta"]["quick"]
    (d / "results.json").write_text(json.dumps(doc))
    assert _seeds(d, "--output", tmp_path / "rec.json") == 2
    assert "noquick/results.json: meta.quick must be true or false" in capsys.readouterr().err


def test_a_run_of_other_code_replacing_a_recorded_one_is_reported(tmp_path, capsys):
    record = tmp_path / "lab-seeds.json"
    old = _run(tmp_path, "old", 1, {"lr": "not reproduced"}, code="c0", date="2026-11-30T10:00")
    new = _run(tmp_path, "new", 1, {"lr": "reproduced"}, code="c1", date="2026-12-01T10:00")
    assert _seeds(old, "--output", record) == 0
    capsys.readouterr()
    assert _seeds(new, "--output", record, "--add") == 0
    err = capsys.readouterr().err
    assert "note: lr at --seed 1: kept the newer run (reproduced, code c1" in err
    assert (
        f"dropped the run (not reproduced, code c0, --engine sequential, dated 2026-11-30T10:00) from the record {record}"
        in err
    )


def test_doc_refuses_a_page_whose_run_is_not_the_one_recorded_at_its_seed(tmp_path, capsys):
    record = tmp_path / "lab-seeds.json"
    recorded = _run(tmp_path, "rec", 0, {"lr": "reproduced"}, ev={"lr": fake_evidence(0)}, engine="batched")
    assert _seeds(recorded, "--output", record) == 0
    page_run = _run(tmp_path, "page", 0, {"lr": "reproduced"}, ev={"lr": fake_evidence(0, (0.5, 0.6, 0.71))})
    capsys.readouterr()
    out = tmp_path / "page.md"
    assert main(["lab", "doc", str(page_run), "--seed-record", str(record), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "lr at --seed 0" in err and "--engine batched" in err and "--engine sequential" in err
    assert not out.exists()
    # the run the record holds renders
    assert main(["lab", "doc", str(recorded), "--seed-record", str(record), "--output", str(out)]) == 0


def test_a_page_run_of_older_code_does_not_displace_the_recorded_current_run():
    ev0, ev1 = fake_evidence(0), fake_evidence(1)
    cur = {"verdict": "reproduced", "code": "cur", "date": "2026-12-02T10:00", "evidence": ev0}
    record = {"version": 2, "experiments": {"lr": {"0": cur, "1": dict(cur, evidence=ev1)}}}
    page = {
        "meta": {"seed": 0, "quick": False, "date": "2026-11-01T10:00"},
        "experiments": [{"name": "lr", "kind": "empirical", "verdict": "inconclusive", "code": "old"}],
    }
    p = pool_record(record, {"lr": "cur"}, page)["lr"]
    assert p.basis == "pooled" and p.lab_seeds == ["0", "1"] and p.older == []


def test_a_lab_run_that_differs_from_the_recorded_run_at_its_seed_says_so(tmp_path, capsys, monkeypatch):
    from addnorm.lab import runner
    from tests.lab.lab_fakes import make_registry

    reg = make_registry({}, n=2)
    monkeypatch.setattr(runner, "load_experiments", lambda: reg)
    out, record = tmp_path / "run", tmp_path / "lab-seeds.json"
    assert main(["lab", "--out", str(out), "--seed", "0", "--no-progress", "--device", "cpu"]) == 0
    assert _seeds(out, "--output", record) == 0
    data = json.loads(record.read_text())
    data["experiments"]["fake-0"]["0"]["engine"] = "batched"  # as if recorded from a batched run of this code
    record.write_text(json.dumps(data))
    capsys.readouterr()
    argv = ["lab", "--out", str(out), "--seed", "0", "--no-progress", "--device", "cpu", "--seed-record", str(record)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "warning: fake-0 at --seed 0" in err and "--engine batched" in err and "fake-1 at" not in err
