"""The lab runner: a failing experiment does not stop the run, Ctrl-C and a kill resume, writes are atomic, shards
partition the selection; the report files a run writes. The cache, merge and the command line: test_lab_cache.py,
test_lab_merge.py, test_lab_cli.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from addnorm.lab import runner
from addnorm.lab.core import Experiment, Result
from addnorm.lab.report import render_html, terminal_table
from addnorm.lab.runner import RunOptions, atomic_write_text, parse_shard, run, select
from tests.lab.lab_fakes import PNG, make_registry, opts


def test_threads_option_applies_during_the_run_and_is_restored(tmp_path):
    seen = []
    reg = {
        "t": Experiment(
            name="t",
            claim="c",
            source="s",
            run=lambda ctx: seen.append(torch.get_num_threads()) or Result(verdict="reproduced", metrics={}),
        )
    }
    before = torch.get_num_threads()
    s = run(opts(tmp_path, threads=1), reg)
    assert seen == [1] and s.meta["torch_threads"] == 1 and torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads"):
        RunOptions(threads=0)


def test_failing_experiment_is_inconclusive_not_cached_and_the_run_continues(tmp_path):
    calls: dict[str, int] = {}
    reg = make_registry(calls, fail={"fake-1"})
    s = run(opts(tmp_path), reg)
    rec = {r["name"]: r for r in s.records}
    assert rec["fake-1"]["verdict"] == "inconclusive" and "fake-1 broke" in rec["fake-1"]["error"]
    assert s.failed == ["fake-1"] and rec["fake-2"]["verdict"] in ("reproduced", "not reproduced")
    run(opts(tmp_path), reg)
    assert calls["fake-1"] == 2 and calls["fake-0"] == 1  # retried; the others reused


def test_keyboard_interrupt_keeps_finished_results_and_rerun_resumes(tmp_path):
    calls: dict[str, int] = {}
    reg = make_registry(calls)
    stop = {"on": True}
    inner = reg["fake-2"].run

    def interrupted(ctx):
        if stop["on"]:
            raise KeyboardInterrupt
        return inner(ctx)

    reg["fake-2"].run = interrupted
    with pytest.raises(KeyboardInterrupt):
        run(opts(tmp_path), reg)
    stop["on"] = False
    s = run(opts(tmp_path), reg)
    assert sorted(s.reused) == ["fake-0", "fake-1"] and s.ran == ["fake-2", "fake-3"]
    assert calls == {"fake-0": 1, "fake-1": 1, "fake-2": 1, "fake-3": 1}


RESUME_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from addnorm.lab.core import Experiment, Result

    COUNT = Path(os.environ["LAB_COUNT_DIR"])

    def make(name):
        def fn(ctx):
            (COUNT / name).write_text(str(int((COUNT / name).read_text()) + 1 if (COUNT / name).exists() else 1))
            if name == "b" and os.environ.get("LAB_DIE") == "1":
                os._exit(3)  # killed midway: no cleanup, no exception handling
            return Result(verdict="reproduced", metrics={"name": name})
        return fn

    REGISTRY = {n: Experiment(name=n, claim="c", source="s", run=make(n)) for n in ("a", "b", "c")}

    if __name__ == "__main__":
        from addnorm.lab.runner import RunOptions, run
        run(RunOptions(out=Path(sys.argv[1]), progress=False, device="cpu"), REGISTRY)
    """
)


def test_run_killed_by_os_exit_in_a_subprocess_resumes(tmp_path, monkeypatch):
    script = tmp_path / "lab_resume_script.py"
    script.write_text(RESUME_SCRIPT)
    counts, out = tmp_path / "counts", tmp_path / "out"
    counts.mkdir()
    env = dict(os.environ, LAB_COUNT_DIR=str(counts), LAB_DIE="1")
    proc = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert len(list((out / "runs").glob("a-*/result.json"))) == 1
    assert not list((out / "runs").glob("b-*/result.json"))

    import importlib.util

    monkeypatch.setenv("LAB_COUNT_DIR", str(counts))
    monkeypatch.setenv("LAB_DIE", "0")
    spec = importlib.util.spec_from_file_location("lab_resume_script", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    s = run(opts(out), mod.REGISTRY)
    assert s.reused == ["a"] and s.ran == ["b", "c"]
    assert {p.name: p.read_text() for p in counts.iterdir()} == {"a": "1", "b": "2", "c": "1"}


def test_atomic_write_leaves_the_old_file_when_replace_fails(tmp_path, monkeypatch):
    target = tmp_path / "results.json"
    atomic_write_text(target, "old")

    def boom(src, dst):
        raise OSError("disk full")

    import addnorm.io

    monkeypatch.setattr(addnorm.io.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # no temp file left behind


def test_report_files_schema_and_self_contained_html(tmp_path):
    reg = make_registry({}, fail={"fake-3"})
    run(opts(tmp_path, quick=True, seed=2), reg)
    doc = json.loads((tmp_path / "results.json").read_text())
    assert [e["name"] for e in doc["experiments"]] == list(reg)
    for e in doc["experiments"]:
        assert {"name", "claim", "source", "verdict", "metrics", "figures"} <= set(e)
        assert e["verdict"] in ("reproduced", "not reproduced", "inconclusive")
        for f in e["figures"]:
            assert (tmp_path / f).read_bytes() == PNG
    assert doc["meta"]["quick"] is True and doc["meta"]["seed"] == 2 and doc["meta"]["addnorm"]
    assert doc["meta"]["torch"] and doc["meta"]["date"]
    assert sum(doc["counts"].values()) == len(reg)
    page = (tmp_path / "index.html").read_text()
    for name in reg:
        assert f'id="{name}"' in page and f"claim {name[-1]}" in page
    assert page.count("data:image/png;base64,") == 3  # the failed one has none
    assert "http://" not in page and "https://" not in page
    assert "fake-3 broke" in page and "quick" in page
    md = (tmp_path / "report.md").read_text()
    assert all(f"## {name}" in md for name in reg) and "![fig](runs/" in md
    table = terminal_table(doc)
    assert all(name in table for name in reg) and "RuntimeError: fake-3 broke" in table


def test_html_escapes_text(tmp_path):
    doc = {
        "experiments": [
            {
                "name": "x",
                "claim": "<script>alert(1)</script>",
                "source": "s",
                "verdict": "reproduced",
                "metrics": {"a<b": 1.0},
                "figures": [],
            }
        ],
        "meta": {},
        "counts": {},
    }
    page = render_html(doc, tmp_path)
    assert "<script>" not in page and "&lt;script&gt;" in page and "a&lt;b" in page


@pytest.mark.skipif(
    not any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")),
    reason="no headless browser installed",
)
def test_page_renders_in_a_headless_browser(tmp_path):
    reg = make_registry({}, n=2)
    run(opts(tmp_path), reg)
    browser = next(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b))
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", (tmp_path / "index.html").as_uri()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0
    assert all(f'id="{n}"' in proc.stdout for n in reg) and "data:image/png;base64," in proc.stdout


def test_shard_split_is_a_partition_in_order():
    reg = make_registry({}, n=5)
    parts = [select(None, (k, 3), reg) for k in (1, 2, 3)]
    indices = sorted(i for p in parts for i, _ in p)
    assert indices == list(range(5))
    assert [e.name for _, e in parts[0]] == ["fake-0", "fake-3"]
    assert [e.name for _, e in select(["fake-4", "fake-1"], None, reg)] == ["fake-1", "fake-4"]  # registry order
    with pytest.raises(ValueError, match="unknown experiment"):
        select(["nope"], None, reg)
    for bad in ("0/2", "3/2", "a/b", "2", "1/0"):
        with pytest.raises(ValueError, match="shard"):
            parse_shard(bad)


def test_a_cuda_index_beyond_the_devices_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert runner.resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ValueError, match="cuda:3.*1 CUDA device"):
        runner.resolve_device("cuda:3")
