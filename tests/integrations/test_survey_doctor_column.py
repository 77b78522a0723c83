"""The survey's doctor column and summary say how many errors, warnings and notes each architecture got: a
released model's recognised design is a note, told apart from an error."""

from __future__ import annotations

from addnorm.integrations.survey import report


def _row(model_type: str, findings: list[tuple[str, str]]) -> dict:
    return {
        "model_type": model_type,
        "status": "ok",
        "role": "decoder",
        "norm": "rmsnorm",
        "placement": "pre",
        "hf_apply": "norms",
        "doctor": [{"code": c, "severity": s, "module": "layers.0"} for c, s in findings],
    }


RESULT = {
    "transformers": "9.9",
    "models": [
        _row("clean", []),
        _row("designed", [("skip-path-design", "info"), ("skip-path-design", "info"), ("channel-norm", "info")]),
        _row("grows", [("residual-growth", "warning"), ("missing-final-norm", "info")]),
        _row("broken", [("residual-not-identity", "error"), ("residual-not-identity", "error")]),
    ],
}


def test_doctor_cell_counts_errors_warnings_and_notes():
    table = report.table_markdown(RESULT)
    assert "| clean |" in table and table.split("| clean |")[1].split("\n")[0].rstrip().endswith("| - | ok |")
    assert "3 notes (channel-norm, skip-path-design x2)" in table
    assert "1 warning (residual-growth); 1 note (missing-final-norm)" in table
    assert "2 errors (residual-not-identity x2)" in table


def test_summary_counts_notes_apart_and_names_the_models_with_errors():
    s = report.summary(RESULT)
    assert s["doctor_findings"] == {"residual-not-identity": 2, "residual-growth": 1}
    assert s["doctor_notes"] == {"skip-path-design": 2, "channel-norm": 1, "missing-final-norm": 1}
    assert s["doctor_errors"] == ["broken"]
    md = report.summary_markdown(RESULT)
    assert "| doctor errors on | broken |" in md and "skip-path-design 2" in md
