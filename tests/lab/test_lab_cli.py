"""``addnorm lab`` on the command line: flags, errors as messages (never tracebacks), Ctrl-C, one run per --out,
--jobs, --quick and ``addnorm lab doc``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from addnorm.lab import outdir, runner
from addnorm.lab.core import Context, Experiment, Result
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


def test_cli_run_json_shard_and_merge(tmp_path, fake_cli, capsys):
    from addnorm.cli import main

    assert main(["lab", "--out", str(tmp_path / "w"), "--no-progress", "--device", "cpu", "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert [e["name"] for e in doc["experiments"]] == ["fake-0", "fake-1", "fake-2"]
    assert "fake-0" in err and "reproduced" in err  # the verdict table goes to stderr with --json
    for k in (1, 2):
        assert (
            main(["lab", "--shard", f"{k}/2", "--out", str(tmp_path / f"s{k}"), "--no-progress", "--device", "cpu"])
            == 0
        )
    capsys.readouterr()
    assert main(["lab", "merge", str(tmp_path / "s1"), str(tmp_path / "s2"), "--out", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert "fake-2" in out and "index.html" in out
    merged = json.loads((tmp_path / "m" / "results.json").read_text())
    assert [e["metrics"] for e in merged["experiments"]] == [e["metrics"] for e in doc["experiments"]]
    assert fake_cli == {"fake-0": 2, "fake-1": 2, "fake-2": 2}  # once whole, once in its shard


def test_cli_only_and_errors(tmp_path, fake_cli, capsys):
    from addnorm.cli import main

    assert main(["lab", "--only", "fake-1", "--out", str(tmp_path), "--no-progress", "--device", "cpu"]) == 0
    assert fake_cli == {"fake-1": 1}
    assert "fake-1" in capsys.readouterr().out
    assert main(["lab", "--only", "nope", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "unknown experiment" in capsys.readouterr().err
    assert main(["lab", "--shard", "3/2", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "shard" in capsys.readouterr().err
    assert main(["lab", "merge", str(tmp_path / "none"), "--out", str(tmp_path / "m")]) == 2
    for seed in ("-5", str(2**64)):  # numpy refuses negative seeds, torch overflows: fail before running anything
        assert main(["lab", "--seed", seed, "--out", str(tmp_path), "--no-progress", "--device", "cpu"]) == 2
        assert "--seed" in capsys.readouterr().err
    assert main(["lab", "--device", "bogus", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "device" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["lab", "--device", "cuda", "--out", str(tmp_path), "--no-progress"]) == 2
        assert "cuda" in capsys.readouterr().err
    assert fake_cli == {"fake-1": 1}  # bad arguments ran nothing


def test_cli_list_names_every_registered_experiment(capsys):
    from addnorm.cli import main
    from addnorm.lab.core import EXPERIMENTS

    assert main(["lab", "--list"]) == 0
    out = capsys.readouterr().out
    mine = [
        "residual-gradient-flow",
        "xiong-init-gradients",
        "deepnet-update-size",
        "admin-output-change",
        "ln-vs-rms",
        "half-precision-stats",
        "batchnorm-vs-layernorm",
        "residual-stream-growth",
    ]
    for name in set(mine) | set(EXPERIMENTS):
        assert name in out
        assert EXPERIMENTS[name].claim[:30] in out


def test_cli_help_explains_every_flag(capsys):
    from addnorm.cli import main

    with pytest.raises(SystemExit):
        main(["lab", "--help"])
    text = capsys.readouterr().out
    for flag in (
        "--list",
        "--only",
        "--quick",
        "--out",
        "--seed",
        "--device",
        "--fresh",
        "--json",
        "--shard",
        "--threads",
        "--jobs",
        "torchrun",
        "addnorm-report-quick",
        "doc",
    ):
        assert flag in text
    with pytest.raises(SystemExit):
        main(["lab", "merge", "--help"])
    assert "--out" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["lab", "doc", "--help"])
    assert "--output" in capsys.readouterr().out


def test_cli_out_that_is_a_file_is_an_error_naming_out(tmp_path, fake_cli, capsys):
    from addnorm.cli import main

    a_file = tmp_path / "report.txt"
    a_file.write_text("not a directory")
    assert main(["lab", "--out", str(a_file), "--no-progress", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "not a directory" in err and "Traceback" not in err
    assert main(["lab", "--out", str(a_file / "sub"), "--no-progress", "--device", "cpu"]) == 2
    assert "--out" in capsys.readouterr().err
    assert fake_cli == {}  # nothing ran
    assert main(["lab", "--out", str(tmp_path / "ok"), "--no-progress", "--device", "cpu"]) == 0
    capsys.readouterr()
    assert main(["lab", "merge", str(tmp_path / "ok"), "--out", str(a_file)]) == 2
    assert "--out" in capsys.readouterr().err


def test_cli_ctrl_c_exits_130_with_a_resume_hint_and_the_rerun_resumes(tmp_path, monkeypatch, capsys):
    from addnorm.cli import main

    calls: dict[str, int] = {}
    reg = make_registry(calls, n=3)
    inner = reg["fake-1"].run

    def interrupted_once(ctx):
        if "stopped" not in calls:
            calls["stopped"] = 1
            raise KeyboardInterrupt  # what Ctrl-C raises in the main thread
        return inner(ctx)

    reg["fake-1"].run = interrupted_once
    monkeypatch.setattr(runner, "load_experiments", lambda: reg)
    argv = ["lab", "--out", str(tmp_path), "--no-progress", "--device", "cpu"]
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "again to resume" in err and str(tmp_path / "runs") in err
    assert main(argv) == 0
    assert calls == {"fake-0": 1, "stopped": 1, "fake-1": 1, "fake-2": 1}  # fake-0 came from the cache


@pytest.mark.slow
def test_sigterm_like_timeout_sends_it_stops_cleanly_exits_143_and_the_rerun_resumes(tmp_path):
    """A real SIGTERM to the lab's whole process group (what `timeout` and schedulers send), workers included."""
    import signal

    out = tmp_path / "out"
    src = str(Path(runner.__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "addnorm", "lab", "--quick", "--only", "warmup", "--jobs", "2", "--device", "cpu"]
    cmd += ["--no-progress", "--out", str(out)]

    def default_signals() -> None:  # a test run started in the background may have inherited them ignored
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    proc = subprocess.Popen(
        cmd,
        env=env,
        start_new_session=True,  # its own process group, as `timeout` makes one: the signal reaches the workers too
        preexec_fn=default_signals,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    tasks = out / "runs" / "tasks"
    try:
        deadline = time.monotonic() + 240
        while len(list(tasks.glob("*.json"))) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert len(list(tasks.glob("*.json"))) >= 2, proc.communicate(timeout=60)
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err
    assert "interrupted (SIGTERM)" in err and "again to resume" in err and str(out / "runs") in err, err
    assert "leaked" not in err and "Traceback" not in err, err
    deadline = time.monotonic() + 60  # the workers were stopped: nothing is left in the group
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("processes of the interrupted run are still alive")
    kept = sorted(tasks.glob("*.json"))
    assert len(kept) >= 2 and not (out / "results.json").exists()
    # Mark one finished task: the rerun shows the mark only if it reused that task instead of training it again.
    record = json.loads(kept[0].read_text())
    record["result"]["excess"] = 123.0
    kept[0].write_text(json.dumps(record))
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    (exp,) = json.loads((out / "results.json").read_text())["experiments"]
    assert [v for values in exp["metrics"]["per_seed"].values() for v in values].count(123.0) == 1


def test_sigterm_raises_terminated_once_and_the_handler_is_restored():
    import signal

    from addnorm.interrupt import Terminated, sigterm_interrupts

    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with sigterm_interrupts():
            with pytest.raises(Terminated) as caught:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(10)  # the handler raises long before this ends
            assert caught.value.signum == signal.SIGTERM and isinstance(caught.value, KeyboardInterrupt)
            os.kill(os.getpid(), signal.SIGTERM)  # a second one while the run cleans up: ignored
            time.sleep(0.2)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a caller's own disposition is left alone
        with sigterm_interrupts():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_results_are_strict_json_with_non_finite_values_kept_as_strings(tmp_path, capsys, monkeypatch):
    """An fp16 overflow (inf) is a result: stored as "inf", because Infinity/NaN literals are not JSON (jq rejects
    them) and `addnorm lab --json` output must parse anywhere."""
    from addnorm.cli import main

    def overflow(ctx: Context) -> Result:
        return Result(
            verdict="reproduced",
            summary="inf",
            metrics={"var": float("inf"), "pair": [float("nan"), 1.5], "t": torch.tensor([-math.inf])},
        )

    reg = {"overflow": Experiment(name="overflow", claim="c", source="s", run=overflow)}
    monkeypatch.setattr(runner, "load_experiments", lambda: reg)

    def no_constants(name):
        raise AssertionError(f"non-standard JSON literal {name}")

    for attempt in range(2):  # computed, then from the cache
        assert main(["lab", "--out", str(tmp_path), "--no-progress", "--device", "cpu", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out, parse_constant=no_constants)
        json.loads((tmp_path / "results.json").read_text(), parse_constant=no_constants)
        assert doc["experiments"][0]["metrics"] == {"var": "inf", "pair": ["nan", 1.5], "t": ["-inf"]}
        assert doc["experiments"][0]["cached"] is bool(attempt)
    assert '<td class="v">inf</td>' in (tmp_path / "index.html").read_text()


def test_cli_disk_full_is_an_error_message(tmp_path, fake_cli, capsys, monkeypatch):
    import errno

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    import addnorm.io

    monkeypatch.setattr(addnorm.io, "atomic_write_text", full)
    monkeypatch.setattr(addnorm.io, "atomic_write", lambda path, write, binary: full(path, ""))
    assert main_lab(["--out", str(tmp_path), "--no-progress", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "cannot write the results" in err and "No space left" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------------ one run per --out
def test_a_second_run_on_a_locked_out_is_refused_with_a_message(tmp_path, fake_cli, capsys):
    from addnorm.cli import main

    with outdir.out_lock(tmp_path):  # what a run in progress holds
        assert main_lab(["--out", str(tmp_path), "--no-progress", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert "in use by another `addnorm lab` run" in err and f"pid {os.getpid()}" in err
        assert "Traceback" not in err
        assert main(["lab", "merge", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert fake_cli == {}
    # a lock file left by a killed run does not block: flock locks die with their process
    assert (tmp_path / ".lock").exists()
    assert main_lab(["--out", str(tmp_path), "--no-progress", "--device", "cpu"]) == 0


SLOW_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from addnorm.lab.core import Experiment, Result

    def slow(ctx):
        Path(sys.argv[2]).write_text("started")
        time.sleep(float(sys.argv[3]))
        ctx.figure_path("f.png").write_bytes(b"png")
        return Result(verdict="reproduced", metrics={"v": 1}, figures=["f.png"])

    if __name__ == "__main__":
        from addnorm.lab.runner import RunOptions, run
        reg = {"slow": Experiment(name="slow", claim="c", source="s", run=slow)}
        run(RunOptions(out=Path(sys.argv[1]), progress=False, device="cpu", jobs=1), reg)
    """
)


def test_two_concurrent_runs_on_one_out_the_second_is_refused_and_the_first_completes(tmp_path, fake_cli, capsys):
    script, started, out = tmp_path / "slow_lab.py", tmp_path / "started", tmp_path / "out"
    script.write_text(SLOW_SCRIPT)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(Path(runner.__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    )
    first = subprocess.Popen(
        [sys.executable, str(script), str(out), str(started), "4"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
            time.sleep(0.05)
        assert main_lab(["--out", str(out), "--no-progress", "--device", "cpu"]) == 2
        assert "in use by another `addnorm lab` run" in capsys.readouterr().err
    finally:
        _, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr
    doc = json.loads((out / "results.json").read_text())
    assert [e["name"] for e in doc["experiments"]] == ["slow"]
    assert all((out / f).is_file() for e in doc["experiments"] for f in e["figures"])
    assert fake_cli == {}


# ---------------------------------------------------------------------------------------- --jobs, --quick, doc
def test_cli_jobs_flag_is_validated_and_recorded(tmp_path, fake_cli, capsys):
    assert main_lab(["--out", str(tmp_path), "--no-progress", "--device", "cpu", "--jobs", "0"]) == 2
    assert "--jobs" in capsys.readouterr().err and fake_cli == {}
    assert main_lab(["--out", str(tmp_path), "--no-progress", "--device", "cpu", "--jobs", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["meta"]["jobs"] == 1
    with pytest.raises(ValueError, match="jobs"):
        RunOptions(jobs=0)


def test_cli_quick_writes_to_its_own_folder_and_says_it_is_a_smoke_run(tmp_path, fake_cli, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main_lab(["--quick", "--no-progress", "--device", "cpu", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "addnorm-report-quick" / "results.json").is_file()
    assert not (tmp_path / "addnorm-report").exists()
    assert "smoke run" in out and "not evidence" in out
    for name in ("index.html", "report.md"):
        assert (
            "smoke run for checking the installation, not evidence"
            in (tmp_path / "addnorm-report-quick" / name).read_text()
        )
    assert main_lab(["--no-progress", "--device", "cpu", "--jobs", "1"]) == 0
    assert (tmp_path / "addnorm-report" / "results.json").is_file()
    assert "smoke run" not in capsys.readouterr().out
    assert "smoke run" not in (tmp_path / "addnorm-report" / "report.md").read_text()
    assert main_lab(["--quick", "--out", "mine", "--no-progress", "--device", "cpu", "--jobs", "1"]) == 0
    assert (tmp_path / "mine" / "results.json").is_file()


def test_cli_doc_renders_a_run_and_names_what_is_missing(tmp_path, fake_cli, capsys):
    from addnorm.cli import main

    assert main_lab(["--out", str(tmp_path / "r"), "--no-progress", "--device", "cpu", "--jobs", "1"]) == 0
    capsys.readouterr()
    assert main(["lab", "doc", str(tmp_path / "r")]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# Stability lab results") and "fake-2" in text and "--jobs 1" in text
    target = tmp_path / "docs" / "lab-results.md"
    assert main(["lab", "doc", str(tmp_path / "r"), "--output", str(target)]) == 0
    assert target.read_text() == text and oct(target.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    assert main(["lab", "doc", str(tmp_path / "none")]) == 2
    assert "has no results.json" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "results.json").write_text("[]")
    assert main(["lab", "doc", str(tmp_path / "bad")]) == 2
    assert "not an `addnorm lab` results file" in capsys.readouterr().err
    assert main(["lab", "doc", str(tmp_path / "r"), "--output", str(tmp_path)]) == 2
    assert "--output" in capsys.readouterr().err


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ------------------------------------------------------------------------- hostile flags and paths (issue 30)
def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_an_empty_out_is_refused_and_nothing_is_written_in_the_current_folder(tmp_path, fake_cli, capsys, monkeypatch):
    from addnorm.cli import main

    assert main_lab(["--out", str(tmp_path / "r"), "--no-progress", "--device", "cpu", "--jobs", "1"]) == 0
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "index.html").write_text("mine")
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    for argv in (
        ["lab", "--out", "", "--no-progress", "--device", "cpu"],
        ["lab", "merge", str(tmp_path / "r"), "--out", ""],
        ["lab", "doc", str(tmp_path / "r"), "--output", ""],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert ("--out is empty" in err or "--output is empty" in err) and "Traceback" not in err, err
    assert _snapshot(cwd) == {"index.html": b"mine"}
    with pytest.raises(ValueError, match="--out is empty"):
        RunOptions(out="")


def test_a_shard_that_selects_nothing_is_refused_and_keeps_the_results(tmp_path, fake_cli, capsys):
    out = tmp_path / "r"
    assert main_lab(["--out", str(out), "--no-progress", "--device", "cpu", "--jobs", "1"]) == 0
    before = _snapshot(out)
    capsys.readouterr()
    assert main_lab(["--only", "fake-1", "--shard", "2/2", "--out", str(out), "--no-progress", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--shard 2/2" in err and "selects no experiment" in err
    assert _snapshot(out) == before and fake_cli == {"fake-0": 1, "fake-1": 1, "fake-2": 1}


@pytest.mark.parametrize("device", ["meta", "mps", "xla"])
def test_devices_the_lab_cannot_run_on_are_refused_before_anything_runs(tmp_path, fake_cli, capsys, device):
    assert main_lab(["--out", str(tmp_path), "--no-progress", "--device", device]) == 2
    err = capsys.readouterr().err
    assert "--device" in err and repr(device) in err
    assert fake_cli == {} and not (tmp_path / "results.json").exists()


def test_threads_beyond_the_cores_are_refused_with_a_clear_message(tmp_path, fake_cli, capsys):
    cores = os.cpu_count() or 1
    for extra in ([], ["--jobs", "2"]):
        assert (
            main_lab(["--out", str(tmp_path), "--no-progress", "--device", "cpu", "--threads", "100000", *extra]) == 2
        )
        err = capsys.readouterr().err
        assert "--threads" in err and f"{cores} CPU core" in err and "cannot write" not in err
    assert fake_cli == {}
    assert main_lab(["--out", str(tmp_path), "--no-progress", "--device", "cpu", "--threads", str(cores)]) == 0
    with pytest.raises(ValueError, match="threads"):
        RunOptions(threads=cores + 1)


def test_doc_on_results_without_meta_says_what_is_missing(tmp_path, fake_cli, capsys):
    from addnorm.cli import main

    out = tmp_path / "r"
    assert main_lab(["--out", str(out), "--no-progress", "--device", "cpu", "--jobs", "1"]) == 0
    doc = json.loads((out / "results.json").read_text())
    del doc["meta"]
    (out / "results.json").write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["lab", "doc", str(out)]) == 0
    text = capsys.readouterr().out
    assert "None" not in text and "not recorded" in text


def test_doc_output_keeps_the_files_mode_and_a_symlink(tmp_path, fake_cli, capsys):
    from addnorm.cli import main

    out = tmp_path / "r"
    assert main_lab(["--out", str(out), "--no-progress", "--device", "cpu", "--jobs", "1"]) == 0
    target = tmp_path / "site" / "lab.md"
    target.parent.mkdir()
    target.write_text("old")
    target.chmod(0o600)
    link = tmp_path / "lab.md"
    link.symlink_to(target)
    assert main(["lab", "doc", str(out), "--output", str(link)]) == 0
    assert link.is_symlink() and target.read_text().startswith("# Stability lab results")
    assert target.stat().st_mode & 0o777 == 0o600


def test_list_json_prints_json(capsys):
    assert main_lab(["--list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed and {"name", "claim", "source", "kind"} <= set(listed[0])
    assert [e["name"] for e in listed] == list(runner.load_experiments())
