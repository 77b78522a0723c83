"""``addnorm survey`` against hostile paths and saved surveys (issue 30): every refusal comes before the survey runs,
names the flag, exits 2 and writes nothing."""

from __future__ import annotations

import json
import math

import pytest

from addnorm.cli import main
from addnorm.integrations.survey import report
from tests.integrations.test_survey import _rows_result

pytest.importorskip("transformers")

README = (
    "<!-- survey:hf-fused -->\nkeep\n<!-- /survey:hf-fused -->\n"
    "<!-- survey:summary -->\nkeep\n<!-- /survey:summary -->\n"
)


@pytest.fixture
def ran(monkeypatch):
    """Fail the test if the (slow) survey starts: every case here must be refused before it."""
    from addnorm.integrations import survey

    def boom(*a, **k):
        raise AssertionError("the survey ran")

    monkeypatch.setattr(survey, "survey", boom)


def _snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_docs_ending_in_json_would_write_the_page_and_the_rows_to_one_file(tmp_path, capsys, ran):
    assert main(["survey", "--only", "llama", "--docs", str(tmp_path / "x.json"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--docs" in err and "same file" in err
    assert list(tmp_path.iterdir()) == []


def test_outputs_that_collide_are_refused(tmp_path, capsys, ran):
    (tmp_path / "README.md").write_text(README)
    cases = [  # (--readme needs the whole survey: no --only; every case is refused before it would run)
        ["--only", "llama", "--docs", str(tmp_path / "out" / "survey.md"), "--out", str(tmp_path / "out")],
        ["--docs", str(tmp_path / "README.md"), "--readme", str(tmp_path / "README.md")],
    ]
    for argv in cases:
        assert main(["survey", *argv, "--no-progress"]) == 2
        assert "same file" in capsys.readouterr().err
    assert _snapshot(tmp_path) == {"README.md": README.encode()}


@pytest.mark.parametrize("flag", ["--out", "--docs", "--readme"])
def test_an_empty_path_is_refused(flag, tmp_path, capsys, monkeypatch, ran):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "index.html").write_text("mine")
    only = [] if flag == "--readme" else ["--only", "llama"]
    assert main(["survey", *only, flag, "", "--no-progress"]) == 2
    assert f"{flag} is empty" in capsys.readouterr().err
    assert _snapshot(tmp_path) == {"index.html": b"mine"}


def test_a_folder_for_a_file_and_a_file_for_a_folder(tmp_path, capsys, ran):
    (tmp_path / "a_file").write_text("keep")
    (tmp_path / "a_dir").mkdir()
    cases = [
        (["--only", "llama", "--docs", str(tmp_path / "a_dir")], "--docs"),
        (["--readme", str(tmp_path / "a_dir")], "--readme"),
        (["--only", "llama", "--out", str(tmp_path / "a_file")], "--out"),
    ]
    for argv, flag in cases:
        assert main(["survey", *argv, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert flag in err and ("is a directory, not a file" in err or "is a file, not a directory" in err)
        assert "Traceback" not in err
    assert _snapshot(tmp_path) == {"a_file": b"keep"}


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e12", "1e-9", "0.5"])
def test_time_limits_that_mean_nothing_are_refused(value, capsys, ran):
    assert main(["survey", "--only", "llama", f"--time-limit={value}", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--time-limit" in err and "Traceback" not in err


def test_the_time_limit_helper_refuses_nan_and_caps_huge_values():
    from addnorm import _limits

    with pytest.raises(ValueError, match="nan"):
        with _limits.time_limit(math.nan, lambda: None):
            pass
    with _limits.time_limit(1e12, lambda: None):  # OverflowError in setitimer before
        pass


def _broken_surveys():
    good = _rows_result()
    one_row = dict(good, models=good["models"][:1])
    return {
        "no rows": dict(good, models=[]),
        "a row without a model type": dict(
            good, models=[dict(good["models"][0], model_type=None), *good["models"][1:]]
        ),
        "a numeric version": dict(good, transformers=5),
        "an unknown status": dict(good, models=[dict(good["models"][0], status="maybe"), *good["models"][1:]]),
        "a model type twice": dict(good, models=[*good["models"], good["models"][0]]),
        "a partial survey (--only)": dict(one_row, only=["a"]),
    }


@pytest.mark.parametrize("case", list(_broken_surveys()))
def test_from_a_broken_or_partial_survey_leaves_the_readme_alone(case, tmp_path, capsys, ran):
    saved = tmp_path / "survey.json"
    saved.write_text(json.dumps(_broken_surveys()[case]))
    readme = tmp_path / "README.md"
    readme.write_text(README)
    assert main(["survey", "--from", str(saved), "--readme", str(readme), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--from" in err and str(saved) in err
    assert readme.read_text() == README


def test_from_a_survey_missing_installed_architectures_is_partial(tmp_path, capsys, ran):
    import transformers

    rows = [dict(r, model_type=t) for r, t in zip(_rows_result()["models"], ("llama", "gpt2", "bert", "t5"))]
    partial = dict(_rows_result(), transformers=transformers.__version__, models=rows)  # 4 installed types
    saved = tmp_path / "survey.json"
    saved.write_text(report.dumps(partial))
    readme = tmp_path / "README.md"
    readme.write_text(README)
    assert main(["survey", "--from", str(saved), "--readme", str(readme), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--from" in err and "covers 4 of the" in err and "--readme" in err
    assert readme.read_text() == README


def test_only_with_readme_is_refused(tmp_path, capsys, ran):
    readme = tmp_path / "README.md"
    readme.write_text(README)
    assert main(["survey", "--only", "llama", "--readme", str(readme), "--no-progress"]) == 2
    assert "--readme" in capsys.readouterr().err and readme.read_text() == README


def test_a_full_disk_while_writing_is_a_message(tmp_path, capsys, monkeypatch, ran):
    import errno

    import addnorm.io

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    saved = tmp_path / "survey.json"
    saved.write_text(report.dumps(_rows_result()))
    monkeypatch.setattr(addnorm.io, "atomic_write_text", full)
    assert main(["survey", "--from", str(saved), "--docs", str(tmp_path / "s.md"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no space left on the device" in err and "Traceback" not in err


@pytest.mark.parametrize("where", ["config_class", "config_defaults", "model_build"])
def test_a_timeout_while_building_is_reported_as_a_timeout(monkeypatch, where):
    """The time limit's exception passes the build steps' `except Exception` (it was reported as "config class not
    importable: _Timeout" when it fired during the config import)."""
    import transformers
    from transformers.models.auto import configuration_auto

    from addnorm.integrations import survey, tiny

    def expire(*args, **kwargs):
        raise tiny.SurveyTimeout("over the survey's limit of 1 CPU seconds per architecture")

    if where == "config_class":

        class Mapping(dict):
            __getitem__ = expire

        monkeypatch.setattr(configuration_auto, "CONFIG_MAPPING", Mapping())
    elif where == "config_defaults":
        monkeypatch.setattr(tiny, "config_class", lambda model_type: expire)
    else:
        monkeypatch.setattr(transformers.AutoModel, "from_config", expire)
    row = survey.survey_one("llama", doctor=False, time_limit=None)
    assert row["status"] == "skipped"
    assert row["reason"] == "build: over the survey's limit of 1 CPU seconds per architecture"
