"""The lab report's content: empirical claims alone are counted, sanity checks and demonstrations are shown apart;
controls, reasons, per-seed numbers and timings are shown; the run's time reads right after a cached rerun; the
docs page renders from a results document."""

from __future__ import annotations

import copy
import json

import pytest

from addnorm.lab.core import Context, Experiment, Result
from addnorm.lab.docs import MACHINE_NOTE, render_results_doc
from addnorm.lab.formatting import by_kind, per_seed_table, timing_text
from addnorm.lab.report import render_html, render_markdown, results_document, terminal_table
from addnorm.lab.runner import RunOptions, run


def record(name, verdict="reproduced", kind="empirical", **kw):
    base = {
        "name": name,
        "claim": f"claim of {name}",
        "source": "A. Author et al. 2020, Title, arXiv:2002.04745",
        "criterion": f"rule of {name}",
        "kind": kind,
        "precondition": "",
        "verdict": verdict,
        "reason": "",
        "metrics": {},
        "timings": {},
        "figures": [],
        "summary": f"finding of {name}",
        "seconds": 2.0,
        "cached": False,
        "key": "k",
        "index": 0,
    }
    base.update(kw)
    return base


RECORDS = [
    record(
        "depth",
        metrics={
            "per_seed": {"post excess L=48": [1.03, 0.98, 1.1], "pre excess L=48": [0.2, 0.19, 0.21]},
            "seeds": [0, 1, 2],
            "agree": 3,
        },
        precondition="the 6-layer Post-LN run trains (excess < 0.5)",
        timings={"step_ms": 12.5},
    ),
    record(
        "zloss",
        "inconclusive",
        precondition="the run without z-loss shows the instability",
        reason="the control failed: log Z never drifted below -2 without z-loss",
    ),
    record("warm", "not reproduced"),
    record("ln-rms-identity", kind="sanity", summary="RMS of an LN output is 1 by construction"),
    record("gradient-highway", "not reproduced", kind="demonstration"),
    record("old-record", verdict="reproduced", kind=None),  # written before kinds: empirical
]
META = {
    "addnorm": "0.1.0",
    "torch": "2.13.0",
    "python": "3.11",
    "date": "2026-11-30",
    "device": "cpu",
    "seed": 0,
    "quick": False,
    "cpu": "Test CPU 9000",
    "cpu_count": 2,
    "jobs": 2,
    "world_size": 1,
    "seconds": 171.0,
    "computed_seconds": 300.0,
    "cached": 0,
    "platform": "Linux",
    "code": "abc",
}


def doc(records=RECORDS, **meta):
    return results_document(copy.deepcopy(records), dict(META, **meta))


def test_counts_and_headline_cover_empirical_claims_only():
    d = doc()
    assert d["counts"] == {"reproduced": 2, "not reproduced": 1, "inconclusive": 1}
    assert d["counts_by_kind"]["sanity"] == {"reproduced": 1, "not reproduced": 0, "inconclusive": 0}
    assert d["counts_by_kind"]["demonstration"]["not reproduced"] == 1
    table = terminal_table(d)
    assert "Empirical claims: 2 reproduced, 1 not reproduced, 1 inconclusive." in table
    assert "Also 1 sanity check and 1 demonstration, shown apart and not counted." in table
    assert [r["name"] for r in by_kind(d["experiments"])["empirical"]] == ["depth", "zloss", "warm", "old-record"]


def test_terminal_table_groups_kinds_and_has_a_header_for_every_column():
    lines = terminal_table(doc()).splitlines()
    assert lines[0].split() == ["experiment", "verdict", "time", "ran/cached"]
    text = "\n".join(lines)
    empirical, sanity, demo = (
        text.index("[Empirical claims (counted)]"),
        text.index("[Sanity checks (not counted)]"),
        text.index("[Demonstrations (not counted)]"),
    )
    assert empirical < text.index("zloss") < sanity < text.index("ln-rms-identity") < demo < text.index("gradient-h")


@pytest.mark.parametrize("render", ["md", "html"])
def test_sections_show_kind_control_reason_per_seed_numbers_and_timings(tmp_path, render):
    d = doc()
    page = render_markdown(d) if render == "md" else render_html(d, tmp_path)
    for text in (
        "the 6-layer Post-LN run trains (excess &lt; 0.5)"
        if render == "html"
        else "the 6-layer Post-LN run trains (excess < 0.5)",
        "the control failed: log Z never drifted below -2 without z-loss",
        "Sanity checks",
        "Demonstrations",
        "post excess L=48",
        "seed 2",
        "1.1",
        "0.21",
        "step_ms",
        "12.5",
        "sanity, not counted",
    ):
        assert text in page, text
    assert page.index("Empirical claims") < page.index("Sanity checks") < page.index("Demonstrations")
    # the per-seed numbers are a table of their own, not repeated in the metrics table
    assert page.count("post excess L=48") == 1


def test_per_seed_table_and_its_fallbacks():
    header, rows = per_seed_table({"per_seed": {"a": [1.0, 2.5], "b": [3]}, "seeds": [4, 5]})
    assert header == ["", "seed 4", "seed 5"] and rows == [["a", "1", "2.5"], ["b", "3", ""]]
    assert per_seed_table({"per_seed": {"a": [1, 2]}, "seeds": [0]})[0] == ["", "seed 0", "seed 1"]
    for bad in ({}, {"per_seed": 3}, {"per_seed": {"a": 1}}, {"per_seed": {}}, "oops", None):
        assert per_seed_table(bad) is None


def test_cached_rerun_says_cached_and_how_long_the_computation_took():
    assert timing_text({"seconds": 0.0, "computed_seconds": 171.4, "cached": 6, "jobs": 2}, 6) == (
        "all 6 results were cached (computing them took 2 min 51 s, summed over the experiments; this run 0.0 s)"
    )
    assert timing_text({"seconds": 95.0, "computed_seconds": 171.4, "cached": 2, "jobs": 2}, 6).startswith(
        "run took 1 min 35 s (2 of 6 results from the cache"
    )
    assert (
        timing_text({"seconds": 12.0, "cached": 0, "jobs": 4, "world_size": 2}, 6)
        == "run took 12.0 s with --jobs 4 on each of 2 torchrun ranks"
    )


def test_a_real_cached_rerun_reports_cached_not_run_took_zero(tmp_path):
    def slowish(ctx: Context) -> Result:
        return Result(verdict="reproduced", metrics={"v": sum(range(200000))})

    reg = {"s": Experiment(name="s", claim="c", source="s", run=slowish)}
    run(RunOptions(out=tmp_path, progress=False, device="cpu", jobs=1), reg)
    run(RunOptions(out=tmp_path, progress=False, device="cpu", jobs=1), reg)
    d = json.loads((tmp_path / "results.json").read_text())
    assert d["meta"]["cached"] == 1 and d["meta"]["computed_seconds"] == round(d["experiments"][0]["seconds"], 1)
    for text in (terminal_table(d), (tmp_path / "report.md").read_text(), (tmp_path / "index.html").read_text()):
        assert "ll 1 results were cached" in text and "run took" not in text


def test_quick_note_in_every_output(tmp_path):
    d = doc(quick=True)
    for text in (terminal_table(d), render_markdown(d), render_html(d, tmp_path), render_results_doc(d)):
        assert "smoke run for checking the installation, not evidence" in text
    assert "smoke run" not in render_markdown(doc())


def test_docs_page_from_a_results_document():
    text = render_results_doc(doc())
    for needle in (
        "Test CPU 9000, 2 cores",
        "torch 2.13.0",
        "2026-11-30",
        "wall time 2 min 51 s with --jobs 2",
        "Empirical claims: 2 reproduced, 1 not reproduced, 1 inconclusive.",
        MACHINE_NOTE,
        "### depth: reproduced",
        "| post excess L=48 | 1.03 | 0.98 | 1.1 |",
        "Why inconclusive: the control failed",
        "Control (precondition): the run without z-loss",
        "Finding: finding of warm",
        "## Sanity checks",
        "## Demonstrations",
    ):
        assert needle in text, needle
    assert text.index("## Empirical claims") < text.index("### old-record") < text.index("## Sanity checks")
    assert text.index("## Sanity checks") < text.index("### ln-rms-identity") < text.index("## Demonstrations")
    assert "differ in their last digits across machines" in text
    partial = render_results_doc(doc(only=["depth"]))
    assert "Partial run (--only depth)" in partial
    cached = render_results_doc(doc(cached=6))
    assert "every result came from the cache" in cached and "wall time 2 min" not in cached
    assert "--jobs 2" not in cached  # that is the cached rerun's, not the computing run's
