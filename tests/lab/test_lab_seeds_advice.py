"""The "What the seeds say" section: every statement names real experiments, verdicts come from the run."""

from addnorm.lab.core import EXPERIMENTS
from addnorm.lab.docs import render_results_doc
from addnorm.lab.report import render_markdown
from addnorm.lab.seeds_advice import ADVICE, seeds_section


def test_every_experiment_named_by_the_seeds_section_exists():
    import addnorm.lab.experiments  # noqa: F401

    for _, _, names, _ in ADVICE:
        for name in names:
            assert name in EXPERIMENTS, name


def test_verdicts_come_from_the_run_and_missing_ones_say_so(monkeypatch):
    from addnorm.lab import seeds_advice

    # a statement no experiment tests yet says so (once every statement has one, ADVICE alone cannot show it)
    monkeypatch.setattr(seeds_advice, "ADVICE", [*ADVICE, ("004, nowhere", "an untested statement", (), "none")])
    lines = seeds_section([{"name": "warmup", "verdict": "not reproduced"}])
    text = "\n".join(lines)
    assert "warmup: not reproduced" in text  # the run's verdict, whatever it is
    assert "depth-sweep: not in this run" in text
    assert "no experiment yet" in text  # statements without an experiment say so
    assert len([ln for ln in lines if ln.startswith("| 0")]) == len(ADVICE) + 1


def test_the_section_is_in_the_results_page_and_the_report():
    record = {"name": "warmup", "verdict": "reproduced", "kind": "empirical", "claim": "c", "source": "s"}
    record.update(criterion="k", precondition="p", metrics={}, figures=[], summary="", reason="", timings={})
    doc = {"meta": {"seed": 0}, "experiments": [record]}
    for text in (render_results_doc(doc), render_markdown(doc)):
        assert "## What the seeds say" in text and "warmup: reproduced" in text
