"""``addnorm lab`` as a hostile user drives it: --json on every exit path, --jobs beyond reason, --threads' message,
a closed stdout pipe, merge's missing-directory message."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from addnorm.lab import runner
from addnorm.lab.runner import RunOptions
from tests.lab.lab_fakes import make_registry


@pytest.fixture
def fake_cli(monkeypatch):
    calls: dict[str, int] = {}
    reg = make_registry(calls, n=3)
    monkeypatch.setattr(runner, "load_experiments", lambda: reg)
    return calls


def main_lab(argv):
    from addnorm.cli import main

    return main(["lab", *argv])


def _one_json_error(out: str, code: int, status: str = "error") -> dict:
    doc = json.loads(out)  # stdout holds exactly one JSON object
    assert doc["exit_code"] == code and doc["status"] == status and doc["error"]
    assert not doc["error"].startswith("error:")
    return doc


@pytest.mark.parametrize(
    ("extra", "word"),
    [
        (["--only", "nope"], "nope"),
        (["--jobs", "0"], "--jobs"),
        (["--shard", "3/2"], "3/2"),
        (["--seed", "-1"], "--seed"),
    ],
)
def test_json_user_errors_print_one_json_object_on_stdout(tmp_path, fake_cli, capsys, extra, word):
    assert main_lab(["--out", str(tmp_path), "--no-progress", "--device", "cpu", "--json", *extra]) == 2
    out, err = capsys.readouterr()
    doc = _one_json_error(out, 2)
    assert word in doc["error"] and word in err and "addnorm lab: error:" in err
    assert fake_cli == {}


def test_json_ctrl_c_prints_an_interrupted_json_object_and_exits_130(tmp_path, monkeypatch, capsys):
    calls: dict[str, int] = {}
    reg = make_registry(calls, n=2)

    def interrupted(ctx):
        raise KeyboardInterrupt

    reg["fake-1"].run = interrupted
    monkeypatch.setattr(runner, "load_experiments", lambda: reg)
    assert main_lab(["--out", str(tmp_path), "--no-progress", "--device", "cpu", "--json"]) == 130
    out, err = capsys.readouterr()
    doc = _one_json_error(out, 130, "interrupted")
    assert "resume" in doc["error"] and "interrupted" in err


def test_without_json_errors_keep_stdout_empty(tmp_path, fake_cli, capsys):
    assert main_lab(["--out", str(tmp_path), "--no-progress", "--device", "cpu", "--only", "nope"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "addnorm lab: error: unknown experiment" in err


def test_merge_json_missing_dir_names_it_once(tmp_path, capsys):
    from addnorm.cli import main

    missing = tmp_path / "nodir"
    assert main(["lab", "merge", str(missing), "--out", str(tmp_path / "m"), "--json"]) == 2
    out, err = capsys.readouterr()
    doc = _one_json_error(out, 2)
    assert str(missing) in doc["error"]
    assert err.count("has no results.json") == 1  # was said twice: describe_os_error's text and then (err) again


def test_jobs_beyond_reason_is_refused_before_any_worker_starts(tmp_path, fake_cli, capsys):
    cores = os.cpu_count() or 1
    limit = runner.JOBS_PER_CORE * cores
    assert main_lab(["--out", str(tmp_path), "--no-progress", "--device", "cpu", "--jobs", "100000"]) == 2
    err = capsys.readouterr().err
    assert "--jobs" in err and "100000" in err and f"at most {limit}" in err
    assert fake_cli == {} and not (tmp_path / "results.json").exists()
    with pytest.raises(ValueError, match="--jobs"):
        RunOptions(jobs=limit + 1)
    RunOptions(jobs=limit)  # the limit itself is allowed


def test_negative_threads_message_names_the_flag_and_the_cli_value(tmp_path, fake_cli, capsys):
    assert main_lab(["--out", str(tmp_path), "--no-progress", "--device", "cpu", "--threads", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--threads" in err and "-1" in err and "0 on the command line" in err


def test_a_closed_stdout_pipe_is_no_traceback():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    code = "import sys; from addnorm.cli import main; sys.exit(main(['lab', '--list']))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=os.getcwd()
    )
    proc.stdout.read(10)
    proc.stdout.close()  # the reader leaves, like `| head -1`
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err


def test_merge_refuses_one_directory_given_twice(tmp_path, fake_cli, capsys):
    from addnorm.cli import main

    assert main_lab(["--out", str(tmp_path / "a"), "--no-progress", "--device", "cpu"]) == 0
    capsys.readouterr()
    again = str(tmp_path / "x" / ".." / "a")  # the same folder by another spelling
    assert main(["lab", "merge", str(tmp_path / "a"), again, "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "given twice" in err and again in err
    assert not (tmp_path / "m" / "results.json").exists()


@pytest.mark.parametrize("name", ["index.html", "report.md", "results.json"])
def test_out_holding_files_no_lab_run_wrote_is_refused_and_they_are_kept(tmp_path, fake_cli, capsys, name):
    from addnorm.cli import main

    site = tmp_path / "site"
    site.mkdir()
    (site / name).write_text("my own page\n")
    for argv in (
        ["lab", "--out", str(site), "--no-progress", "--device", "cpu"],
        ["lab", "merge", str(tmp_path / "a"), "--out", str(site)],
    ):
        if argv[1] == "merge":
            assert main(["lab", "--out", str(tmp_path / "a"), "--no-progress", "--device", "cpu"]) == 0
            capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "--out" in err and name in err and "no `addnorm lab` run wrote" in err
        assert (site / name).read_text() == "my own page\n"
    assert sorted(p.name for p in site.iterdir()) == [name]


def test_a_lab_output_is_reused_and_a_killed_first_run_too(tmp_path, fake_cli, capsys):
    out = tmp_path / "o"
    argv = ["--out", str(out), "--no-progress", "--device", "cpu"]
    assert main_lab(argv) == 0 and main_lab([*argv, "--fresh"]) == 0  # its own report files are replaced
    (out / "results.json").unlink()
    (out / "index.html").write_text("left by a killed run\n")
    assert main_lab(argv) == 0  # runs/ says it is a lab folder
    assert json.loads((out / "results.json").read_text())["experiments"]
