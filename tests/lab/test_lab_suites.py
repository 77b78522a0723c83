"""Suites: ``addnorm lab`` runs the core suite, ``--suite all`` every experiment, ``--only`` picks from both; the
suite is on each Experiment, in --list, in results.json (records and meta) and in the report."""

from __future__ import annotations

import dataclasses
import json

import pytest

from addnorm.lab.core import EXPERIMENTS, Experiment
from addnorm.lab.runner import RunOptions, load_experiments, run, select
from tests.lab.lab_fakes import make_registry, opts


def _with_extended(n: int = 4, extended=("fake-1", "fake-3")) -> dict[str, Experiment]:
    reg = make_registry({}, n=n)
    return {k: dataclasses.replace(e, suite="extended") if k in extended else e for k, e in reg.items()}


def test_core_is_the_default_and_all_adds_the_extended_ones_in_registry_order():
    reg = _with_extended()
    assert [e.name for _, e in select(None, None, reg)] == ["fake-0", "fake-2"]
    assert [e.name for _, e in select(None, None, reg, "all")] == ["fake-0", "fake-1", "fake-2", "fake-3"]
    # --only reaches an extended experiment whatever the suite
    assert [e.name for _, e in select(["fake-3", "fake-0"], None, reg)] == ["fake-0", "fake-3"]
    # shards partition the suite's selection
    parts = [[e.name for _, e in select(None, (k, 2), reg, "all")] for k in (1, 2)]
    assert parts == [["fake-0", "fake-2"], ["fake-1", "fake-3"]]


def test_bad_suites_are_refused_with_the_argument_named():
    with pytest.raises(ValueError, match=r"suite \(--suite\) must be one of core, all, got 'extended'"):
        select(None, None, make_registry({}), "extended")
    with pytest.raises(ValueError, match="suite"):
        RunOptions(suite="everything")
    with pytest.raises(ValueError, match="suite must be one of"):
        Experiment(name="x", claim="c", source="s", run=lambda ctx: None, suite="all")


def test_results_json_records_the_suite_of_the_run_and_of_each_experiment(tmp_path):
    reg = _with_extended()
    run(opts(tmp_path, suite="all"), reg)
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["meta"]["suite"] == "all"
    assert {r["name"]: r["suite"] for r in doc["experiments"]} == {
        "fake-0": "core",
        "fake-1": "extended",
        "fake-2": "core",
        "fake-3": "extended",
    }
    assert "suite all" in (tmp_path / "report.md").read_text()
    run(opts(tmp_path), reg)  # cached records: the default run reports the core ones only
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["meta"]["suite"] == "core" and [r["name"] for r in doc["experiments"]] == ["fake-0", "fake-2"]


def test_cli_suite_flag_and_list_show_suites(capsys, monkeypatch):
    from addnorm.cli import main

    assert main(["lab", "--list"]) == 0
    out = capsys.readouterr().out
    for name, exp in EXPERIMENTS.items():
        assert f"{name}" in out and f"[{exp.suite}, {exp.kind}]" in out
    assert main(["lab", "--list", "--json"]) == 0
    listed = {e["name"]: e["suite"] for e in json.loads(capsys.readouterr().out)}
    assert listed == {n: e.suite for n, e in EXPERIMENTS.items()}
    with pytest.raises(SystemExit):
        main(["lab", "--suite", "extended"])
    assert "invalid choice" in capsys.readouterr().err
    seen = {}

    def fake_run(options):
        seen["suite"] = options.suite
        raise ValueError("stop here")

    monkeypatch.setattr("addnorm.lab.runner.run", fake_run)
    assert main(["lab", "--suite", "all", "--out", "unused"]) == 2
    assert seen == {"suite": "all"}


def test_the_registry_keeps_todays_core_suite():
    """The default run is the 18 experiments of the 2026-12-01 timing (7 min 55 s); new ones go to "extended"."""
    registry = load_experiments()
    core = [n for n, e in registry.items() if e.suite == "core"]
    assert len(core) == 18 and "ln-vs-rms" in core and "mix-ln-training" in core
